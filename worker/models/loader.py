"""A model's shape and weights: from a GGUF file, a safetensors folder, or random (dummy) weights.
Which file a ``--model`` name means is the catalog's (contracts/models.py); numpy and torch are
imported only where weights are read."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from contracts.models import DUMMY_PREFIX, PRESETS, ModelSource, cache_dir, resolve_model  # noqa: F401 (worker's names)
from worker.models.config import ModelConfig

if TYPE_CHECKING:
    import torch


def load_config(src: ModelSource) -> ModelConfig:
    if src.kind == "dummy":
        return ModelConfig(**PRESETS[src.preset])
    if src.kind == "safetensors":
        return ModelConfig.from_hf(json.loads((src.path / "config.json").read_text()))
    return _gguf_config(src.path)


def iter_weights(src: ModelSource, packed: bool = False) -> Iterator[tuple[str, "torch.Tensor"]]:
    """HF-named float32 tensors, one at a time (never the whole checkpoint in a second copy).
    ``packed``: a GGUF's quantized tensors come as kernels.wquant.QuantizedWeight where they
    repack exactly (worker/models/gguf_quant.py), not dequantized."""
    if src.kind == "safetensors":
        yield from _safetensors_weights(src.path, packed)
    elif src.kind == "gguf":
        yield from _gguf_weights(src.path, packed)
    else:
        raise ValueError("dummy models have no weights to read")


def hf_weight_names(cfg: ModelConfig) -> Iterator[str]:
    """The Hugging Face tensor names of a Llama-family model of this shape."""
    yield "model.embed_tokens.weight"
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        yield from (f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj"):
            yield f"{p}.self_attn.{proj}.weight"
            if cfg.qkv_bias:
                yield f"{p}.self_attn.{proj}.bias"
        yield from (f"{p}.self_attn.o_proj.weight", f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight",
                    f"{p}.mlp.down_proj.weight")
    yield "model.norm.weight"
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight"


def iter_dummy_weights(cfg: ModelConfig, seed: int, device: str = "cpu", dtype=None
                       ) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Random full tensors with sane scales, each from its own seed (seed, name): every tensor is
    the same whatever the tensor parallel size, so TP=2 can be checked against TP=1 on them.
    What a step costs does not depend on the values."""
    import zlib

    import torch

    h, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    i, d, v = cfg.intermediate_size, cfg.hidden_size, cfg.vocab_size
    shapes = {"embed_tokens": (v, d), "lm_head": (v, d), "q_proj": (h, d), "k_proj": (kv, d), "v_proj": (kv, d),
              "o_proj": (d, h), "gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}
    gen = torch.Generator(device=device)
    for name in hf_weight_names(cfg):
        piece, kind = name.split(".")[-2:]
        if piece.endswith("norm"):
            yield name, torch.ones(d, device=device, dtype=dtype)
            continue
        shape = shapes[piece] if kind == "weight" else shapes[piece][:1]
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        std = 0.02 if kind == "weight" else 0.0
        yield name, (torch.randn(shape, generator=gen, device=device) * std).to(dtype or torch.float32)


def _safetensors_weights(path: Path, packed: bool) -> Iterator[tuple[str, "torch.Tensor"]]:
    """A folder's tensors by HF name; a GPTQ/AWQ projection's qweight, qzeros, scales (and g_idx)
    come as one ``P.weight`` (worker/models/gptq.py): packed, or dequantized unless ``packed``."""
    from safetensors import safe_open

    from worker.models.gptq import quantization_method

    quant = quantization_method(json.loads((path / "config.json").read_text()))
    with contextlib.ExitStack() as stack:  # each file opened once; a projection's parts may span files
        where = {}
        for file in sorted(path.glob("*.safetensors")):
            f = stack.enter_context(safe_open(str(file), framework="pt"))
            where.update((name, f) for name in f.keys())
        yield from _combined(where, quant, packed)


def _combined(where: dict, quant: tuple[str, int] | None, packed: bool) -> Iterator[tuple[str, "torch.Tensor"]]:
    """``where``: tensor name -> its open file. A quantized projection's parts combined into one weight."""
    from kernels.wquant import QuantizedWeight
    from worker.models.gptq import to_quantized

    def get(name: str):
        return where[name].get_tensor(name)

    parts = (".qzeros", ".scales", ".g_idx")
    for name in where:
        if quant is not None and name.endswith(parts) and name.rsplit(".", 1)[0] + ".qweight" in where:
            continue  # read with its qweight
        if quant is not None and name.endswith(".qweight"):
            prefix = name.removesuffix(".qweight")
            g_idx = get(prefix + ".g_idx") if prefix + ".g_idx" in where else None
            w = to_quantized(quant[0], get(name), get(prefix + ".qzeros"), get(prefix + ".scales"), g_idx)
            if isinstance(w, QuantizedWeight) and not packed:
                w = w.dequantize()
            yield prefix + ".weight", w
        else:
            yield name, get(name)


def checkpoint_quantization(src: ModelSource) -> tuple[str, int] | None:
    """A safetensors folder's 4-bit GPTQ / AWQ (method, group size), else None."""
    if src.kind != "safetensors":
        return None
    from worker.models.gptq import quantization_method

    return quantization_method(json.loads((src.path / "config.json").read_text()))


# --- GGUF -------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")


def gguf_reader(path: Path):
    """The ``gguf`` package's reader of ``path``, its metadata arrays read whole.

    gguf's own reader makes a numpy view of every element of every array: a Qwen2.5 GGUF's
    tokenizer (151,936 tokens and 151,387 merges) becomes 1.4M views, 10-16 s a parse on a 2-core
    CPU (measured), and loading a model parsed its file five times (config, quantization plan,
    weights, sampling defaults). Here an array of numbers is one view (``contents()`` gives its
    list, as before) and an array of strings is stepped over, its count kept (``array_len``): the
    tokenizer is transformers' to read (contracts/tokenizers.py). Tensors are gguf's own."""
    return _arrays_whole_reader_class()(str(path))


def array_len(field) -> int:
    """How many items a metadata array field holds (the length gguf stores before them)."""
    return int(field.parts[4][0])  # key length, key, value type, item type, item count


@functools.cache
def _arrays_whole_reader_class():  # built at first use: gguf and numpy are imported then
    import struct

    import gguf
    import numpy as np

    arr, text = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

    class ArraysWholeReader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            if gguf.GGUFValueType(raw_type) != arr or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            count = self._get(orig_offs + 4, np.uint64)
            itype, n, offs = gguf.GGUFValueType(raw_itype[0]), int(count[0]), orig_offs + 12
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                items = self._get(offs, nptype, n)
                return 12 + int(items.nbytes), [raw_itype, count, items], [2], [arr, itype]
            if itype != text:  # nested arrays: gguf's way
                return super()._get_field_parts(orig_offs, raw_type)
            view = memoryview(self.data)
            for _ in range(n):  # each string: a little-endian uint64 length, then its bytes
                offs += 8 + struct.unpack_from("<Q", view, offs)[0]
            return offs - orig_offs, [raw_itype, count], [], [arr, itype]

    return ArraysWholeReader


def _gguf_fields(reader) -> dict[str, object]:
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"
        ):
            continue
        try:
            out[key] = f.contents()
        except Exception:  # odd field types we do not need
            continue
    return out


def _gguf_config(path: Path, reader=None) -> ModelConfig:
    reader = reader or gguf_reader(path)
    meta = _gguf_fields(reader)
    arch = meta["general.architecture"]
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (only {_SUPPORTED_ARCHS})")
    names = {t.name for t in reader.tensors}
    vocab = meta.get(f"{arch}.vocab_size") or array_len(reader.fields["tokenizer.ggml.tokens"])
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=int(heads),
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        qkv_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        architecture=arch,
    )


def gguf_formats(path: Path) -> dict[str, tuple[int, int] | None]:
    """HF weight name -> (bits, group) its GGUF type repacks into exactly, or None (float, or a
    type that is not repacked): what ``--quantization auto`` serves (quantization.checkpoint_plan)."""
    from worker.models.gguf_quant import REPACKED

    reader = gguf_reader(path)
    names = ((_gguf_to_hf_name(t.name), t.tensor_type.name) for t in reader.tensors)
    return {name: REPACKED.get(kind) for name, kind in names if name is not None}


def _gguf_weights(path: Path, packed: bool = False) -> Iterator[tuple[str, "torch.Tensor"]]:
    import numpy as np
    import torch
    from gguf.quants import dequantize

    from kernels.wquant import QuantizedWeight
    from worker.models.gguf_quant import REPACKED, repack

    reader = gguf_reader(path)
    cfg = _gguf_config(path, reader)
    for t in reader.tensors:
        name = _gguf_to_hf_name(t.name)
        if name is None:
            continue
        # GGUF stores dims fastest-first; numpy wants them slowest-first.
        shape = [int(d) for d in reversed(t.shape)]
        if packed and t.tensor_type.name in REPACKED and len(shape) == 2:
            w = repack(t.data, t.tensor_type.name, *shape)
        else:
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type).reshape(shape), dtype=np.float32))
        if cfg.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            # llama.cpp's converter interleaves the rotary halves of Q and K for Llama; undo it so the
            # rotate-half rotary embedding applies (Qwen2 GGUFs are stored unpermuted). A row
            # permutation: a packed weight's rows (and their scales) move the same way.
            n_head = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            if isinstance(w, QuantizedWeight):
                w = QuantizedWeight(*(None if x is None else _unpermute_rotary(x, n_head).contiguous()
                                      for x in (w.qweight, w.scales, w.biases)), w.bits, w.group_size)
            else:
                w = _unpermute_rotary(w, n_head).contiguous()
        yield name, w


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")  # blk.N.attn_q.weight
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if name == "rope_freqs.weight":
        return None  # Llama 3 rope factors: recomputed from the config's rope scaling
    raise KeyError(f"unexpected GGUF tensor {name!r}")


def _unpermute_rotary(w, n_head: int):
    """Rows of ``w`` (numpy or torch) from llama.cpp's interleaved rotary order to rotate-half's."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
