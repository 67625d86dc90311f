"""The engine's configuration: one typed source of defaults, checked on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from protos.block_hash import DEFAULT_BLOCK_SIZE

# --kv-cache-dtype's names, torch-free (the router process checks configs without torch);
# kernels.kv_quant.KV_CACHE_DTYPES maps the quantized ones to storage dtypes
KV_CACHE_DTYPE_NAMES = ("auto", "int8", "fp8")
# --quantization's names (weight-only; worker/models/quantization.py): none (dense floats), auto
# (a quantized checkpoint as it ships: GGUF Q4_0/Q4_1/Q4_K as int4, Q5_0/Q8_0/Q6_K as int8), int8, int4
QUANTIZATION_NAMES = ("none", "auto", "int8", "int4")


def _one_of(name: str, value: str, names: tuple[str, ...]) -> None:
    """Refuse ``value`` of field ``name`` unless it is one of ``names``, naming them all."""
    if value not in names:
        *first, last = names
        raise ValueError(f"{name} must be {', '.join(first)} or {last}, got {value!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative``: ``ngram`` or ``ngram:MIN-MAX`` (prompt lookup over n-grams of MIN to MAX
    tokens, default 1-4), or ``draft:MODEL`` (a smaller model with the same tokenizer), with
    ``num_tokens`` drafted per step (speculative.py)."""

    method: str  # ngram | draft
    num_tokens: int
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None

    @staticmethod
    def parse(spec: str, num_tokens: int) -> SpeculativeConfig:
        if not 1 <= num_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {num_tokens}")
        if spec.startswith("draft:") and len(spec) > len("draft:"):
            return SpeculativeConfig("draft", num_tokens, draft_model=spec.removeprefix("draft:"))
        m = re.fullmatch(r"ngram(?::(\d+)-(\d+))?", spec)
        if m is None:
            raise ValueError(f"speculative must be ngram, ngram:MIN-MAX or draft:MODEL, got {spec!r}")
        lo, hi = (int(m.group(1)), int(m.group(2))) if m.group(1) else (1, 4)
        if not 1 <= lo <= hi:
            raise ValueError(f"speculative ngram sizes must satisfy 1 <= MIN <= MAX, got {spec!r}")
        return SpeculativeConfig("ngram", num_tokens, lo, hi)


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"  # built-in name, .gguf file, safetensors folder, or dummy:PRESET
    # A tokenizer folder, tokenizer.json or .gguf to use instead of the model's own (contracts/tokenizers.py).
    tokenizer: str | None = None
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    # The KV pool's storage: auto (the model's dtype), int8 or fp8 (e4m3), the last two with a scale
    # per token and KV head (kernels/kv_quant.py): about half a bf16 pool's bytes per token.
    kv_cache_dtype: str = "auto"
    # Weights stored and multiplied packed (W8A16 / W4A16): none, auto, int8 or int4 (QUANTIZATION_NAMES).
    # auto (the default, as vLLM serves a GGUF, GPTQ or AWQ checkpoint): a quantized checkpoint
    # packed as it ships, a float one as floats; none dequantizes. int8/int4 quantize a float
    # checkpoint at load (a scale per group of input columns) and repack a quantized one; the LM
    # head is int8 whenever anything is packed.
    quantization: str = "auto"
    quantization_group_size: int = 128  # columns per scale (halved until it divides a layer's inputs)
    attention_backend: str = "auto"  # auto: triton on CUDA, torch elsewhere
    cuda_graphs: bool = True  # decode steps replay captured graphs (CUDA only)
    # Graphs for batches 1, 2, 4, every 8 to 64, then every cuda_graph_step up to max_num_seqs.
    # 8 (as vLLM): above ~128 rows the GEMMs pay for padded rows (docs/BENCHMARKS.md).
    cuda_graph_step: int = 8
    # Launch decode step N+1 before reading step N's tokens, so the host's scheduling and
    # bookkeeping overlap the device (llm_engine.py: "the lookahead"). None: on for CUDA.
    async_scheduling: bool | None = None
    # After start-up, freeze what exists (model, pool, graphs) out of Python's cyclic collector,
    # whose full passes would otherwise walk it all and stall the step loop. None: on for CUDA.
    freeze_gc: bool | None = None
    # CUDA: the share of GPU memory the engine may use; the KV pool gets what the weights and a
    # warm-up forward at the full token budget leave of it (kv_cache_bytes is then ignored).
    gpu_memory_utilization: float = 0.9
    block_size: int = DEFAULT_BLOCK_SIZE
    # The KV pool's size in bytes; the pool is allocated once at start.
    kv_cache_bytes: int = 256 * 2**20
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes when set (tests, benchmarks)
    # Tokens one step may process: decodes plus chunks of prefills (chunked prefill).
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64  # running sequences at once
    max_model_len: int | None = None  # prompt + output; None: the model's context length
    max_queued_requests: int = 256  # waiting + running; past it a request is refused (overload)
    enable_prefix_caching: bool = True
    # Ranks (GPUs, or CPU processes) one model is split over; each holds its share of the weights
    # and of the KV pool, so kv_cache_bytes is per rank.
    tensor_parallel_size: int = 1
    seed: int = 0  # dummy weights
    # Defaults for the sampling fields a request leaves unset: auto (the model's generation_config),
    # vllm (the engine's own) or a folder with a generation_config.json (generation_config.py).
    generation_config: str = "auto"
    # Speculative decoding (speculative.py): None (off), ngram or ngram:MIN-MAX; a drafter proposes
    # num_speculative_tokens tokens per decode step and one target forward verifies them.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    # Draft only while at most this many requests run (None: always). Verification costs rows:
    # nearly free on a GPU up to ~100 rows, but a CPU's GEMMs turn compute-bound at ~4 rows.
    speculative_max_batch: int | None = None
    # The draft model's weights (None: as the target's `quantization`): a packed draft costs a
    # fraction of a dense one per token while the output stays the target's (draft:MODEL only).
    speculative_draft_quantization: str | None = None

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        return None if self.speculative is None else SpeculativeConfig.parse(self.speculative,
                                                                                self.num_speculative_tokens)

    def __post_init__(self) -> None:
        positive = ("block_size", "kv_cache_bytes", "max_num_batched_tokens", "max_num_seqs", "max_queued_requests",
                    "tensor_parallel_size", "cuda_graph_step")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _one_of("dtype", self.dtype, ("float32", "bfloat16", "float16"))
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPE_NAMES)
        _one_of("quantization", self.quantization, QUANTIZATION_NAMES)
        if self.quantization_group_size not in (16, 32, 64, 128, 256):
            raise ValueError(f"quantization_group_size must be 16, 32, 64, 128 or 256, got "
                             f"{self.quantization_group_size}")
        if (self.generation_config not in ("auto", "vllm")
                and not Path(self.generation_config, "generation_config.json").is_file()):
            raise ValueError(f"generation_config must be auto, vllm or a folder with a generation_config.json, got "
                             f"{self.generation_config!r}")
        if self.speculative is not None:
            SpeculativeConfig.parse(self.speculative, self.num_speculative_tokens)
        if self.speculative_max_batch is not None and self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if self.speculative_draft_quantization is not None:
            _one_of("speculative_draft_quantization", self.speculative_draft_quantization, QUANTIZATION_NAMES)
            spec = self.speculative_config
            if spec is None or spec.method != "draft":
                raise ValueError("speculative_draft_quantization needs speculative draft:MODEL")
        if self.async_scheduling is None:
            # The lookahead launches a step before the one before is read; a drafter needs every
            # token known, so speculation runs each step plainly.
            self.async_scheduling = self.device.startswith("cuda") and self.speculative is None
        if self.freeze_gc is None:
            self.freeze_gc = self.device.startswith("cuda")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device.startswith("cuda") else "torch"
