"""The model's recommended sampling, as defaults for the fields a request leaves unset (vLLM's
``--generation-config``).

    auto     the model's own: generation_config.json in a safetensors folder (or in the
             --tokenizer folder, for a GGUF or dummy model), or a GGUF's general.sampling.* keys
    vllm     none: the engine's defaults (temperature 1, top_p 1, no top-k, max_tokens 16)
    FOLDER   the generation_config.json in that folder

Only what the engine implements is taken (temperature, top_p, top_k, max_new_tokens as
max_tokens); the rest (repetition_penalty, min_p, ...) is named in the log as left out, so a user
knows the answers can differ from the model card's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from worker.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_new_tokens": "max_tokens"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k"}
# What generation_config.json holds beyond sampling (token ids, flags): not worth a warning.
_NOT_SAMPLING = {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "do_sample",
                 "transformers_version", "_from_model_config", "use_cache", "return_dict_in_generate"}


def sampling_defaults(setting: str, model_path: Path | None, model_kind: str, tokenizer: str | None) -> dict[str, Any]:
    """The SamplingParams defaults ``setting`` gives for this model ({} for none)."""
    if setting == "vllm":
        return {}
    if setting != "auto":
        return _from_json(Path(setting) / "generation_config.json")
    if model_kind == "gguf" and model_path is not None and (found := _from_gguf(model_path)):
        return found
    for folder in (model_path if model_kind == "safetensors" else None, tokenizer and Path(tokenizer)):
        if folder and (folder / "generation_config.json").is_file():
            return _from_json(folder / "generation_config.json")
    return {}


def _from_json(path: Path) -> dict[str, Any]:
    raw = json.loads(path.read_text())
    defaults = {field: raw[key] for key, field in _FIELDS.items() if raw.get(key) is not None}
    ignored = sorted(k for k in raw if k not in _FIELDS and k not in _NOT_SAMPLING)
    return _checked(defaults, str(path), ignored)


def _from_gguf(path: Path) -> dict[str, Any]:
    from worker.models.loader import gguf_reader

    fields = gguf_reader(path).fields
    defaults = {}
    for key, name in _GGUF_KEYS.items():
        if key in fields:
            defaults[name] = fields[key].contents()
    return _checked(defaults, str(path), []) if defaults else {}


def _checked(defaults: dict[str, Any], origin: str, ignored: list[str]) -> dict[str, Any]:
    if "top_k" in defaults and defaults["top_k"] < 0:  # transformers' and vLLM's "off"
        defaults["top_k"] = 0
    try:
        SamplingParams(**defaults).validate()
    except ValueError as err:
        raise ValueError(f"the sampling defaults of {origin} are not valid: {err}") from None
    if defaults:
        log.info("sampling defaults from %s: %s%s", origin, defaults,
                 f" (not applied, the engine lacks them: {', '.join(ignored)})" if ignored else "")
    return defaults
