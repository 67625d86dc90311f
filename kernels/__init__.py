"""Triton kernels for the GPU engine, each beside a plain torch reference of the same signature.

A leaf library: it knows nothing of models or the engine. It imports without Triton or a GPU
(``HAS_TRITON`` says whether the kernels can run); the references run anywhere. On CPU the
kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set before importing this).
"""

from kernels._triton import HAS_TRITON
from kernels.activation import silu_and_mul
from kernels.kv_store import store_kv
from kernels.matmul import tiled_matmul
from kernels.paged_attention import default_num_splits, paged_decode_attention, paged_prefill_attention
from kernels.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    rms_norm_ref,
    rotary_embedding_ref,
    rotary_store_kv_ref,
    silu_and_mul_ref,
    store_kv_ref,
)
from kernels.rmsnorm import rms_norm
from kernels.rotary import rotary_embedding, rotary_store_kv
from kernels.skinny import skinny_matmul

__all__ = [
    "HAS_TRITON",
    "default_num_splits",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
    "rotary_store_kv",
    "rotary_store_kv_ref",
    "skinny_matmul",
    "silu_and_mul",
    "silu_and_mul_ref",
    "store_kv",
    "store_kv_ref",
    "tiled_matmul",
]
