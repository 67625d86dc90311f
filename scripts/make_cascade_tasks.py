"""Write deploy/cascade_tasks.jsonl: labelled short-answer tasks for calibrating the cascade (see loadtest.tasks).

Deterministic (random.Random(0), no network, no models), so the shipped file can be checked against a fresh run.
Every answer is computed here or taken from a small table of well-known, unambiguous facts; the kinds range from easy
(two-digit sums, capitals) to ones small models often miss (floor division of negatives, letters in "strawberry",
9.11 against 9.9). Each task is checked before it is written: its reference replies must score as correct.

    .venv/bin/python scripts/make_cascade_tasks.py [--out PATH] [--n-per-kind N]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loadtest.tasks import Task, score

OUT = Path(__file__).resolve().parents[1] / "deploy" / "cascade_tasks.jsonl"
NUMBER_ONLY = "Reply with the number only."

# Country -> accepted spellings of its capital (the first is the usual English one).
CAPITALS = {
    "France": ["Paris"], "Germany": ["Berlin"], "Italy": ["Rome"], "Spain": ["Madrid"], "Portugal": ["Lisbon"],
    "the United Kingdom": ["London"], "Ireland": ["Dublin"], "Norway": ["Oslo"], "Sweden": ["Stockholm"],
    "Finland": ["Helsinki"], "Denmark": ["Copenhagen"], "Poland": ["Warsaw"], "Austria": ["Vienna"],
    "Switzerland": ["Bern", "Berne"], "Belgium": ["Brussels"], "Greece": ["Athens"], "Hungary": ["Budapest"],
    "the Czech Republic": ["Prague"], "Russia": ["Moscow"], "Ukraine": ["Kyiv", "Kiev"], "Turkey": ["Ankara"],
    "Egypt": ["Cairo"], "Kenya": ["Nairobi"], "Nigeria": ["Abuja"], "Japan": ["Tokyo"], "China": ["Beijing", "Peking"],
    "South Korea": ["Seoul"], "India": ["New Delhi"], "Thailand": ["Bangkok"], "Vietnam": ["Hanoi", "Ha Noi"],
    "the Philippines": ["Manila"], "Australia": ["Canberra"], "New Zealand": ["Wellington"], "Canada": ["Ottawa"],
    "the United States": ["Washington, D.C.", "Washington D.C.", "Washington DC", "Washington"],
    "Mexico": ["Mexico City"], "Brazil": ["Brasília", "Brasilia"], "Argentina": ["Buenos Aires"], "Peru": ["Lima"],
    "Colombia": ["Bogotá", "Bogota"], "Cuba": ["Havana"], "Iceland": ["Reykjavík", "Reykjavik"],
    "Iran": ["Tehran", "Teheran"], "Iraq": ["Baghdad"], "Saudi Arabia": ["Riyadh"], "Pakistan": ["Islamabad"],
    "Morocco": ["Rabat"],
}  # fmt: skip

ELEMENTS = {
    "hydrogen": "H", "helium": "He", "lithium": "Li", "beryllium": "Be", "boron": "B", "carbon": "C", "nitrogen": "N",
    "oxygen": "O", "fluorine": "F", "neon": "Ne", "sodium": "Na", "magnesium": "Mg", "aluminum": "Al", "silicon": "Si",
    "phosphorus": "P", "sulfur": "S", "chlorine": "Cl", "argon": "Ar", "potassium": "K", "calcium": "Ca",
    "titanium": "Ti", "chromium": "Cr", "manganese": "Mn", "iron": "Fe", "cobalt": "Co", "nickel": "Ni", "copper": "Cu",
    "zinc": "Zn", "arsenic": "As", "bromine": "Br", "krypton": "Kr", "silver": "Ag", "tin": "Sn", "iodine": "I",
    "xenon": "Xe", "barium": "Ba", "tungsten": "W", "platinum": "Pt", "gold": "Au", "mercury": "Hg", "lead": "Pb",
    "radon": "Rn", "uranium": "U",
}  # fmt: skip

# Word -> its antonym, only where the opposite is a single clear word ("hard" -> easy or soft is left out).
ANTONYMS = {
    "hot": "cold", "cold": "hot", "wet": "dry", "dry": "wet", "heavy": "light", "fast": "slow", "slow": "fast",
    "full": "empty", "empty": "full", "young": "old", "strong": "weak", "weak": "strong", "rich": "poor",
    "poor": "rich", "early": "late", "late": "early", "thick": "thin", "deep": "shallow", "shallow": "deep",
    "cheap": "expensive", "expensive": "cheap", "wide": "narrow", "narrow": "wide", "clean": "dirty",
    "dirty": "clean", "asleep": "awake", "awake": "asleep", "alive": "dead", "dead": "alive", "true": "false",
    "false": "true", "possible": "impossible", "visible": "invisible", "first": "last", "north": "south",
    "south": "north", "east": "west", "west": "east", "maximum": "minimum", "minimum": "maximum",
    "positive": "negative", "negative": "positive", "inner": "outer", "outer": "inner", "major": "minor",
    "minor": "major", "ancient": "modern", "tall": "short", "long": "short", "high": "low", "low": "high",
    "smooth": "rough", "rough": "smooth",
}  # fmt: skip

# Question (completing "How many ...?") -> its count.
FACTS = {
    "days are in January": 31, "days are in February in a non-leap year": 28, "days are in February in a leap year": 29,
    "days are in March": 31, "days are in April": 30, "days are in May": 31, "days are in June": 30,
    "days are in July": 31, "days are in August": 31, "days are in September": 30, "days are in October": 31,
    "days are in November": 30, "days are in December": 31, "days are in a week": 7, "months are in a year": 12,
    "full weeks are in a year": 52, "days are in a non-leap year": 365, "days are in a leap year": 366,
    "hours are in a day": 24, "minutes are in an hour": 60, "seconds are in a minute": 60,
    "seconds are in an hour": 3600, "minutes are in a day": 1440, "hours are in a week": 168,
    "days are in a fortnight": 14, "years are in a decade": 10, "years are in a century": 100,
    "years are in a millennium": 1000, "sides does a triangle have": 3, "sides does a pentagon have": 5,
    "sides does a hexagon have": 6, "sides does an octagon have": 8, "sides does a decagon have": 10,
    "degrees are in a right angle": 90, "degrees are in a full circle": 360,
    "degrees do the interior angles of a triangle add up to": 180, "legs does a spider have": 8,
    "legs does an insect have": 6, "cards are in a standard deck without jokers": 52, "bits are in a byte": 8,
    "items are in a dozen": 12, "items are in a gross": 144, "keys does a standard piano have": 88,
    "strings does a standard guitar have": 6, "planets are in the Solar System": 8,
    "pieces does each player have at the start of a chess game": 16,
}  # fmt: skip

# (from unit, to unit, factor): "How many <to> are in <n> <from>?"
CONVERSIONS = [
    ("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("centimeters", "millimeters", 10),
    ("kilograms", "grams", 1000), ("liters", "milliliters", 1000), ("hours", "minutes", 60),
    ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7), ("feet", "inches", 12),
    ("yards", "feet", 3), ("dozen", "eggs", 12),
]  # fmt: skip

WORDS = [
    "apple", "banana", "cherry", "orange", "grape", "lemon", "mango", "melon", "peach", "strawberry", "blueberry",
    "pineapple", "coconut", "avocado", "tomato", "potato", "carrot", "onion", "garlic", "pepper", "elephant",
    "giraffe", "kangaroo", "penguin", "dolphin", "octopus", "butterfly", "squirrel", "rabbit", "turtle", "monkey",
    "zebra", "tiger", "horse", "chicken", "window", "kitchen", "garden", "bottle", "pencil", "notebook", "computer",
    "keyboard", "mountain", "river", "ocean", "island", "forest", "desert", "bicycle", "airplane", "umbrella",
    "library", "hospital", "mississippi", "bookkeeper", "committee", "balloon", "coffee", "address", "assessment",
]  # fmt: skip
SHORT_WORDS = [w for w in WORDS if len(w) <= 7]
LETTER_POSITIONS = {"first": 0, "second": 1, "third": 2, "last": -1}
# What a generated Python expression may call.
PY_BUILTINS = {"len": len, "sum": sum, "range": range, "max": max, "min": min, "abs": abs}


@dataclass(frozen=True)
class Draft:
    """A task before it has an id; ``correct`` holds replies that must score as correct (for a regex, the spellings
    it is meant to accept, since the pattern is not itself a reply)."""

    prompt: str
    answer: str
    scorer: str
    correct: tuple[str, ...]


def numeric(prompt: str, value: int | str) -> Draft:
    return Draft(f"{prompt} {NUMBER_ONLY}", str(value), "numeric", (str(value),))


def one_of(prompt: str, spellings: list[str]) -> Draft:
    """A regex accepting exactly these spellings (any case), and nothing around them."""
    pattern = "^(?:" + "|".join(re.escape(s.removesuffix(".")) for s in spellings) + ")$"
    return Draft(prompt, pattern, "regex", tuple(spellings))


def add(rng: random.Random) -> Draft:
    digits = rng.choice([2, 3])
    a, b = (rng.randint(10 ** (digits - 1), 10**digits - 1) for _ in range(2))
    return numeric(f"What is {a} + {b}?", a + b)


def mul(rng: random.Random) -> Draft:
    a, b = rng.randint(2, 9), rng.randint(11, 99)
    return numeric(f"What is {a} times {b}?", a * b)


def sequence(rng: random.Random) -> Draft:
    start, step, length = rng.randint(-20, 100), rng.choice([-1, 1]) * rng.randint(2, 25), rng.randint(4, 5)
    terms = [start + i * step for i in range(length + 1)]
    shown = ", ".join(map(str, terms[:-1]))
    return numeric(f"What is the next number in the sequence {shown}?", terms[-1])


def convert(rng: random.Random) -> Draft:
    source, target, factor = rng.choice(CONVERSIONS)
    n = rng.randint(2, 99)
    return numeric(f"How many {target} are in {n} {source}?", n * factor)


def larger(rng: random.Random) -> Draft:
    """Close integers, negatives, and decimals with different lengths (9.11 against 9.9), the classic trap."""
    style = rng.choice(["close", "negative", "decimal"])
    if style == "close":
        a = rng.randint(1000, 9999)
        digits = list(str(a))
        i = rng.randrange(1, 3)
        digits[i], digits[i + 1] = digits[i + 1], digits[i]
        pair = (str(a), "".join(digits))
    elif style == "negative":
        a, b = rng.sample(range(-99, 0), 2)
        pair = (str(a), str(b))
    else:
        whole = rng.randint(1, 20)
        pair = (f"{whole}.{rng.randint(1, 9)}", f"{whole}.{rng.choice([n for n in range(11, 100) if n % 10])}")
        pair = pair if rng.random() < 0.5 else pair[::-1]
    if float(pair[0]) == float(pair[1]):  # a swap of equal digits, or 5.3 against 5.30
        return larger(rng)
    return numeric(f"Which is larger, {pair[0]} or {pair[1]}?", max(pair, key=float))


def letter_count(rng: random.Random) -> Draft:
    word = rng.choice(WORDS)
    if rng.random() < 0.4:
        return numeric(f"How many letters are in the word '{word}'?", len(word))
    letter = rng.choice("abcdefghijklmnopqrstuvwxyz" if rng.random() < 0.2 else word)
    return numeric(f"How many times does the letter '{letter}' appear in the word '{word}'?", word.count(letter))


def letter_at(rng: random.Random) -> Draft:
    word, position = rng.choice(WORDS), rng.choice(list(LETTER_POSITIONS))
    letter = word[LETTER_POSITIONS[position]]
    prompt = f"What is the {position} letter of the word '{word}'? Reply with the letter only."
    return Draft(prompt, letter, "exact", (letter,))


def python_expression(rng: random.Random) -> str:
    """A one-line expression over ints and strings: slicing, len, sum(range()), floor division, string methods."""
    w, v = rng.sample(SHORT_WORDS, 2)
    a, b, k = rng.randint(10, 99), rng.randint(2, 9), rng.randint(2, 4)
    i = rng.randrange(len(w) - 1)
    j = rng.randint(i + 1, len(w))
    c = rng.choice(w)
    return rng.choice([
        f'len("{w}")', f'"{w}"[::-1]', f'"{w}".upper()', f'"{w}"[{i}:{j}]', f'"{w}"[-{k}]', f'"{w}"[{i}]',
        f'"{w}".replace("{c}", "{c.upper()}")', f'"{w}".count("{c}")', f'"{w}".find("{c}")', f'sum(range({a}))',
        f"{a} // {b}", f"{a} % {b}", f"-{a} // {b}", f"-{a} % {b}", f"{b} ** {k}", f'"{w}" + "{v}"',
        f'"{c}" * {b}', f'"-".join("{w[:4]}")', f"len(range({b}, {a}, {k}))", f"max({a}, {b} * 9) - min({a}, {b})",
        f'len("{w}" * {k})', f'"{w}"[{i}:] + "{v}"[:{k}]', f"abs({b} - {a}) * {k}",
    ])  # fmt: skip


def python(rng: random.Random) -> Draft:
    """An int is scored as a number; a string with a case-sensitive regex, since "ABC" for "abc" is wrong here."""
    expr = python_expression(rng)
    value = eval(expr, {"__builtins__": PY_BUILTINS}, {})  # our own expression, with only PY_BUILTINS to call
    prompt = f"What does the Python expression `{expr}` evaluate to? Reply with the value only, without quotes."
    if isinstance(value, int):
        return Draft(prompt, str(value), "numeric", (str(value),))
    return Draft(prompt, f"^(?-i:{re.escape(value)})$", "regex", (value, f"'{value}'"))


def capitals(rng: random.Random, n: int) -> list[Draft]:
    countries = rng.sample(sorted(CAPITALS), min(n, len(CAPITALS)))
    return [one_of(f"What is the capital of {c}? Reply with the city name only.", CAPITALS[c]) for c in countries]


def elements(rng: random.Random, n: int) -> list[Draft]:
    names = rng.sample(sorted(ELEMENTS), min(n, len(ELEMENTS)))
    return [Draft(f"What is the chemical symbol for {name}? Reply with the symbol only.", ELEMENTS[name], "exact",
                  (ELEMENTS[name],)) for name in names]


def antonyms(rng: random.Random, n: int) -> list[Draft]:
    words = rng.sample(sorted(ANTONYMS), min(n, len(ANTONYMS)))
    return [Draft(f"What is the opposite of '{w}'? Reply with one word only.", ANTONYMS[w], "contains",
                  (ANTONYMS[w], f"The opposite of {w} is {ANTONYMS[w]}.")) for w in words]


def facts(rng: random.Random, n: int) -> list[Draft]:
    questions = rng.sample(sorted(FACTS), min(n, len(FACTS)))
    return [numeric(f"How many {q}?", FACTS[q]) for q in questions]


def drawn(make: Callable[[random.Random], Draft]) -> Callable[[random.Random, int], list[Draft]]:
    """A kind of up to n tasks with distinct prompts from a random maker (fewer if it runs out of new prompts)."""

    def kind(rng: random.Random, n: int) -> list[Draft]:
        drafts: dict[str, Draft] = {}
        for _ in range(50 * n):
            if len(drafts) == n:
                break
            draft = make(rng)
            drafts.setdefault(draft.prompt, draft)
        return list(drafts.values())

    return kind


KINDS: dict[str, Callable[[random.Random, int], list[Draft]]] = {
    "add": drawn(add), "mul": drawn(mul), "sequence": drawn(sequence), "convert": drawn(convert),
    "larger": drawn(larger), "letter_count": drawn(letter_count), "letter_at": drawn(letter_at),
    "python": drawn(python), "capital": capitals, "element": elements, "antonym": antonyms, "fact": facts,
}  # fmt: skip


def generate(n_per_kind: int) -> list[Task]:
    """Up to n_per_kind tasks of each kind, in a seeded shuffled order so kinds interleave."""
    rng = random.Random(0)
    tasks = []
    for kind, make in KINDS.items():
        for i, draft in enumerate(make(rng, n_per_kind), 1):
            task = Task(f"{kind}-{i:03d}", draft.prompt, draft.answer, draft.scorer, kind)
            if wrong := [reply for reply in draft.correct if not score(task, reply)]:
                raise ValueError(f"{task.id}: reference replies {wrong} score as wrong")
            tasks.append(task)
    if len({t.prompt for t in tasks}) != len(tasks):
        raise ValueError("two tasks share a prompt")
    rng.shuffle(tasks)
    return tasks


def write(tasks: list[Task], out: Path) -> None:
    lines = ["# Generated by scripts/make_cascade_tasks.py; edit that script, not this file."]
    lines += [json.dumps({"id": t.id, "kind": t.kind, "prompt": t.prompt, "answer": t.answer, "scorer": t.scorer},
                         ensure_ascii=False) for t in tasks]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write (default: {OUT})")
    parser.add_argument("--n-per-kind", type=int, default=34, help="tasks per kind, at most (default: 34)")
    args = parser.parse_args(argv)
    tasks = generate(args.n_per_kind)
    write(tasks, args.out)
    counts = {kind: sum(t.kind == kind for t in tasks) for kind in KINDS}
    print(f"wrote {len(tasks)} tasks to {args.out}: " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
