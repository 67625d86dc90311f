"""Synthetic prompt text from a seeded random generator: plain English words (about one token
each for the usual tokenizers), so prompt lengths are predictable without a tokenizer, plus
templates for the easy and hard prompts of a cascade mix."""

from __future__ import annotations

import random
from collections.abc import Callable

WORDS = """
the of and to in is was that for on with as by at from this be are have it not or an which
you one had were all we can there their has been more when will would who so no if out some
time about into than them only other new could these two may first then do any like my now over
such our man me even most made after also did many before must through back years where much
your way well down should because each just those people how too little state good very make
world still own see men work long get here between both life being under never day same another
know while last might great old year off come since against go came right used take three
house river water light garden window table paper letter music city road field market summer
winter morning evening forest mountain ocean island bridge village station library kitchen
teacher doctor farmer painter student friend family history science number question answer
story reason system problem program company country mother father child school power money
""".split()

COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "Kenya", "Norway", "Peru", "India", "Spain",
             "Italy", "Chile", "Poland", "Greece", "Mexico", "Vietnam"]
TOPICS = ["photosynthesis", "public-key cryptography", "the water cycle", "inflation", "plate tectonics",
          "how vaccines train the immune system", "garbage collection in a programming language",
          "the causes of the First World War", "how a compiler turns source code into machine code",
          "supply and demand", "how hash tables handle collisions", "the greenhouse effect"]
TASKS = ["parses a CSV file and sums one column", "finds the longest palindromic substring",
         "merges overlapping intervals", "checks whether a binary tree is balanced",
         "implements an LRU cache", "computes the edit distance of two strings"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sentences(rng: random.Random, n_words: int) -> str:
    """About ``n_words`` words as sentences of 8 to 16 words."""
    out, left = [], n_words
    while left > 0:
        k = min(left, rng.randint(8, 16))
        s = words(rng, k)
        out.append(s[0].upper() + s[1:] + ".")
        left -= k
    return " ".join(out)


# Questions with a short, unambiguous answer, and prompts that need reasoning and a long answer.
_EASY: tuple[Callable[[random.Random], str], ...] = (
    lambda r: f"What is {r.randint(2, 99)} plus {r.randint(2, 99)}? Answer with the number only.",
    lambda r: f"What is the capital of {r.choice(COUNTRIES)}? Answer in one word.",
    lambda r: f"Spell the word '{r.choice(WORDS)}' backwards.",
    lambda r: f"Is {r.randint(2, 999)} an even number? Answer yes or no.",
)
_HARD: tuple[Callable[[random.Random], str], ...] = (
    lambda r: f"Explain {r.choice(TOPICS)} step by step to a university student, with an example.",
    lambda r: f"Write a Python function that {r.choice(TASKS)}, then explain its time and memory complexity.",
    lambda r: "Compare {} and {}: what do they have in common, how do they differ, and why does it matter?".format(
        *r.sample(TOPICS, 2)),
)


def easy_prompt(rng: random.Random) -> str:
    return rng.choice(_EASY)(rng)


def hard_prompt(rng: random.Random) -> str:
    return rng.choice(_HARD)(rng)
