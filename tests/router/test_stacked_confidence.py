"""The stacked confidence (router/stacked_confidence.py): one logistic model over the prompt's
words and the draft's own measures separates what neither does alone, survives a save and load,
scores a draft as its features say, and refuses a bad file naming the field."""

from __future__ import annotations

import json
import math
import random

import pytest

from kvcascade.calibration_report import auroc
from protos import kvcascade_pb2 as pb
from router.prompt_router import PromptRouter
from router.stacked_confidence import (FEATURES, StackedConfidenceError, StackedModel, cross_fit, features,
                                       own_scores)

CITIES = ["France", "Peru", "Japan", "Kenya", "Chile", "Spain", "Egypt", "Nepal", "Italy", "Cuba"]


def draft(logprobs: list[float]) -> list[pb.TokenLogprob]:
    """Tokens with these logprobs, each with one alternative holding the rest of the mass."""
    return [pb.TokenLogprob(logprob=lp, top=[pb.TopLogprob(logprob=lp),
                                              pb.TopLogprob(logprob=math.log(max(1e-9, 1 - math.exp(lp))))])
            for lp in logprobs]


def labelled(rng: random.Random, n: int):
    """Capitals: right exactly when the draft is sure. Products: always wrong, and just as sure:
    the prompt tells the products apart, the draft tells the capitals apart, neither both."""
    prompts, drafts, right = [], [], []
    for i in range(n):
        sure = rng.random() < 0.5
        lps = [rng.uniform(-0.05, 0) if sure else rng.uniform(-2.5, -0.8) for _ in range(rng.randint(1, 3))]
        if i % 2:
            prompts.append(f"What is the capital of {rng.choice(CITIES)}? One word.")
            right.append(sure)
        else:
            prompts.append(f"What is {rng.randrange(100, 999)} times {rng.randrange(10, 99)}? The number only.")
            right.append(False)
        drafts.append(draft(lps))
    return prompts, drafts, right


def rows_of(drafts) -> list[dict[str, float]]:
    return [features(own_scores(d, 20), len(d)) for d in drafts]


def test_it_separates_what_neither_the_prompt_nor_the_draft_does_alone() -> None:
    prompts, drafts, right = labelled(random.Random(0), 120)
    scores, model = cross_fit(prompts, rows_of(drafts), right)
    assert auroc(scores, right) > 0.95  # cross-fitted: scored by models that never saw the draft
    # On new tasks: the stacked model against the prompt router and the draft's measures alone.
    router = PromptRouter.train(prompts, right)
    prompts, drafts, right = labelled(random.Random(10), 120)
    rows = rows_of(drafts)
    stacked = [model.score(p, r) for p, r in zip(prompts, rows)]
    own, routed = [r["sum_logprob"] for r in rows], [router.score(p) for p in prompts]
    alone = max(auroc(own, right), auroc(routed, right))
    assert auroc(stacked, right) > 0.95 and auroc(stacked, right) > alone + 0.05, (auroc(stacked, right), alone)
    # New drafts, scored by the fold models' average: a sure capital high, a sure product low.
    capital, product = "What is the capital of Peru? One word.", "What is 512 times 77? The number only."
    sure = draft([-0.01, -0.02])
    assert model.measure(capital).score(sure) > 0.7 > 0.2 > model.measure(product).score(sure)
    assert model.measure(capital).score(draft([-1.5, -2.0])) < 0.2
    assert model.trained_on == 120 and model.names == FEATURES


def test_the_measure_scores_a_draft_as_its_features_say_and_survives_a_save(tmp_path) -> None:
    prompts, drafts, right = labelled(random.Random(1), 60)
    model = StackedModel.train(prompts, rows_of(drafts), right)
    model.save(tmp_path / "s.json")
    again = StackedModel.load(tmp_path / "s.json")
    for p, d in zip(prompts[:10], drafts[:10]):
        want = model.score(p, features(own_scores(d, 20), len(d)))
        assert model.measure(p).score(d) == want
        assert again.measure(p).score(d) == pytest.approx(want, abs=1e-5)
    # A prompt given as token ids has no words: no prompt term.
    assert model.measure(None).prompt_logit == 0.0 and model.measure(prompts[0]).prompt_logit != 0.0


def test_one_kind_of_label_gives_the_base_rate() -> None:
    prompts, drafts, _ = labelled(random.Random(2), 10)
    model = StackedModel.train(prompts, rows_of(drafts), [True] * 10)
    assert model.measure(prompts[0]).score(drafts[0]) == pytest.approx(0.999, abs=1e-3)


def good() -> dict:
    prompts, drafts, right = labelled(random.Random(3), 20)
    return StackedModel.train(prompts, rows_of(drafts), right).to_json()


@pytest.mark.parametrize("change, message", [
    ({"format": "other"}, "not a stacked confidence file"),
    ({"features": ["sum_logprob", "vibes"]}, "features: must be a list of distinct names"),
    ({"features": ["sum_logprob", "sum_logprob"]}, "features: must be a list of distinct names"),
    ({"weights": [1.0, 2.0]}, "weights: must be 5 numbers"),
    ({"weights": [1.0, 2.0, "x", 4, 5]}, "weights: must be 5 numbers"),
    ({"bias": None}, "bias: must be a number"),
    ({"top_logprobs": 0}, "top_logprobs: must be an integer >= 1"),
    ({"prompt": {"format": "kvcascade-prompt-router/1", "dim": 3}}, "prompt: dim:"),
])
def test_a_bad_file_is_refused_naming_the_field(tmp_path, change: dict, message: str) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({**good(), **change}))
    with pytest.raises(StackedConfidenceError) as err:
        StackedModel.load(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)


def test_an_unreadable_file_is_refused_naming_it(tmp_path) -> None:
    (tmp_path / "s.json").write_text("{not json")
    with pytest.raises(StackedConfidenceError, match="s.json: not JSON"):
        StackedModel.load(tmp_path / "s.json")
    with pytest.raises(StackedConfidenceError, match="cannot read"):
        StackedModel.load(tmp_path / "missing.json")
