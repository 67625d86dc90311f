"""The model's recommended sampling as defaults for what a request leaves unset (--generation-config),
read from the files users have, and applied by the worker's gRPC server field by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contracts.models import resolve_model
from protos import kvcascade_pb2 as pb
from worker.engine.config import EngineConfig
from worker.engine.generation_config import sampling_defaults

from .test_server import PROMPT, _generate, _serve


def folder_with(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_folders_generation_config_gives_what_the_engine_implements(tmp_path, caplog) -> None:
    folder = folder_with(tmp_path, {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                                    "max_new_tokens": 512, "eos_token_id": [1, 2], "do_sample": True})
    with caplog.at_level("INFO"):
        defaults = sampling_defaults(str(folder), None, "dummy", None)
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 512}
    assert "not applied, the engine lacks them: repetition_penalty" in caplog.text
    assert sampling_defaults("vllm", None, "safetensors", str(folder)) == {}
    assert sampling_defaults("auto", None, "dummy", str(folder)) == defaults  # the --tokenizer folder's
    assert sampling_defaults("auto", folder, "safetensors", None) == defaults  # the model folder's
    # The bundled GGUF has no general.sampling.* keys: the engine's own defaults.
    gguf = resolve_model("smollm2-135m")
    assert sampling_defaults("auto", gguf.path, gguf.kind, None) == {}


def test_top_k_off_and_bad_values(tmp_path) -> None:
    assert sampling_defaults(str(folder_with(tmp_path, {"top_k": -1})), None, "dummy", None) == {"top_k": 0}
    with pytest.raises(ValueError, match="generation_config.json are not valid: temperature"):
        sampling_defaults(str(folder_with(tmp_path, {"temperature": -1})), None, "dummy", None)
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder"):
        EngineConfig(generation_config=str(tmp_path / "nowhere"))


def test_the_worker_applies_them_to_unset_fields_only(smollm2, tmp_path) -> None:
    """Defaults greedy with 3 tokens: a request setting nothing gets exactly that; one setting a
    field keeps its own value (an explicit top_k 0 included)."""
    folder = folder_with(tmp_path, {"temperature": 0.0, "max_new_tokens": 3, "top_k": 5})
    config = EngineConfig(model="smollm2-135m", generation_config=str(folder))
    for served in _serve(config, reuse=smollm2):
        plain = _generate(served, text=PROMPT, sampling=pb.SamplingParams(ignore_eos=True))
        assert sum(len(m.token_ids) for m in plain) == 3 and plain[-1].finish_reason == "length"
        greedy = _generate(served, text=PROMPT, sampling=pb.SamplingParams(max_tokens=3, temperature=0,
                                                                            ignore_eos=True))
        assert [t for m in plain for t in m.token_ids] == [t for m in greedy for t in m.token_ids]
        longer = _generate(served, text=PROMPT, sampling=pb.SamplingParams(max_tokens=7, ignore_eos=True))
        assert sum(len(m.token_ids) for m in longer) == 7
        # Sampled with top_k 0 set explicitly: the default top_k 5 must not apply. Over 8 seeds at
        # temperature 5 some first token falls outside the 5 likeliest.
        firsts = set()
        for seed in range(8):
            out = _generate(served, text=PROMPT, sampling=pb.SamplingParams(max_tokens=1, temperature=5.0, top_k=0,
                                                                            seed=seed, logprobs=5))
            top5 = {t.token_id for t in out[0].logprobs[0].top}
            firsts.add(out[0].token_ids[0] in top5)
        assert False in firsts
