"""The prompt router (router/prompt_router.py): it learns which prompts a tier gets wrong from
their words and the size of their numbers, scores what it never saw near the base rate, survives
a save and load, refuses a bad file by name, and its cross-fitted scores are not memorised."""

from __future__ import annotations

import json
import random

import pytest

from router.prompt_router import DIM, PromptRouter, PromptRouterError, cross_fit, tokens


def test_numbers_become_their_digit_count() -> None:
    assert tokens("What is 347 times 29?") == ["what", "is", "<3>", "times", "<2>", "?"]


def labelled(rng: random.Random, n: int) -> tuple[list[str], list[bool]]:
    """Capitals right; products right with one-digit factors, wrong with three-digit ones."""
    texts, right = [], []
    cities = ["France", "Peru", "Japan", "Kenya", "Chile", "Spain", "Egypt", "Nepal"]
    for i in range(n):
        kind = i % 3
        if kind == 0:
            texts.append(f"What is the capital of {rng.choice(cities)}? One word.")
            right.append(True)
        else:
            digits = 1 if kind == 1 else 3
            a, b = (rng.randrange(10 ** (digits - 1), 10 ** digits) for _ in range(2))
            texts.append(f"What is {a} times {b}? Reply with the number only.")
            right.append(digits == 1)
    return texts, right


def test_it_learns_the_kinds_and_sizes_a_tier_gets_wrong() -> None:
    texts, right = labelled(random.Random(0), 60)
    router = PromptRouter.train(texts, right)
    assert router.score("What is the capital of Italy? One word.") > 0.8
    assert router.score("What is 7 times 8? Reply with the number only.") > 0.7
    assert router.score("What is 512 times 877? Reply with the number only.") < 0.2
    # Words it never saw: near the base rate (2/3 right), not a confident guess either way.
    assert abs(router.score("Translate bonjour into Swedish") - 2 / 3) < 0.15


def test_save_and_load_give_the_same_scores(tmp_path) -> None:
    texts, right = labelled(random.Random(1), 30)
    router = PromptRouter.train(texts, right)
    path = tmp_path / "small.router.json"
    router.save(path)
    again = PromptRouter.load(path)
    assert again.trained_on == 30
    for text in texts[:10]:
        assert again.score(text) == pytest.approx(router.score(text), abs=1e-5)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not JSON"),
    (json.dumps({"format": "other"}), "not a prompt router file"),
    (json.dumps({"format": "kvcascade-prompt-router/1", "dim": 7, "bias": 0}), "dim:"),
    (json.dumps({"format": "kvcascade-prompt-router/1", "dim": DIM, "bias": 0, "weights": {"x": 1}}), "bad weights"),
])
def test_a_bad_file_is_refused_naming_it(tmp_path, content: str, message: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(PromptRouterError) as err:
        PromptRouter.load(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)
    with pytest.raises(PromptRouterError, match="cannot read"):
        PromptRouter.load(tmp_path / "missing.json")


def test_cross_fitted_scores_are_not_memorised() -> None:
    # Unique words per prompt and coin-flip labels: a router scoring its own training prompts
    # separates them perfectly; scored by routers that never saw them, it cannot.
    rng = random.Random(2)
    word = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8))  # noqa: E731
    texts = [f"{word()} {word()} {word()}" for _ in range(60)]
    right = [rng.random() < 0.5 for _ in texts]
    rate = sum(right) / len(right)
    trained = PromptRouter.train(texts, right, steps=800)
    assert all((trained.score(t) > rate) == r for t, r in zip(texts, right))
    fitted, _ = cross_fit(texts, right)
    agree = sum((s > rate) == r for s, r in zip(fitted, right)) / len(texts)
    assert agree < 0.75


def test_a_long_prompt_is_read_to_its_first_words_only() -> None:
    """The router scores on the router's event loop: a 100k-word prompt costs what 256 words do."""
    from router.prompt_router import MAX_TOKENS

    texts, right = labelled(random.Random(3), 30)
    router = PromptRouter.train(texts, right)
    head = " ".join(["What is 512 times 877?"] * (MAX_TOKENS // 6 + 1))
    assert router.score(head + " capital of France" * 50_000) == router.score(head)
