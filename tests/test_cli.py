"""The ``kvcascade`` command's engine flags land on EngineConfig, and bad values are refused by name
before anything loads."""

from __future__ import annotations

import pytest

from kvcascade.cli import build_parser, engine_config, main
from worker.engine.config import EngineConfig


def test_speculative_flags_map_onto_engine_config():
    args = build_parser().parse_args(["worker", "--speculative", "ngram:2-5", "--num-speculative-tokens", "6"])
    config = engine_config(args)
    assert (config.speculative, config.num_speculative_tokens) == ("ngram:2-5", 6)
    assert (config.speculative_config.ngram_min, config.speculative_config.ngram_max) == (2, 5)


def test_left_out_speculative_flags_keep_the_engine_defaults():
    config = engine_config(build_parser().parse_args(["serve"]))
    assert (config.speculative, config.num_speculative_tokens) == (EngineConfig.speculative,
                                                                   EngineConfig.num_speculative_tokens)


@pytest.mark.parametrize("flags, message", [
    (["--speculative", "medusa"], "speculative must be ngram, ngram:MIN-MAX or draft:MODEL, got 'medusa'"),
    (["--speculative", "ngram", "--num-speculative-tokens", "17"], "num_speculative_tokens must be in [1, 16]"),
    (["--num-speculative-tokens", "four"], "--num-speculative-tokens: invalid int value"),
])  # fmt: skip
def test_bad_speculative_flags_are_refused_before_loading(capsys, flags, message):
    with pytest.raises(SystemExit) as exit:
        main(["worker", *flags])
    assert exit.value.code == 2 and message in capsys.readouterr().err
