"""Paged attention through the Triton kernels (kernels/): the GPU path behind the same interface.

Per step, ``prepare`` builds the device tensors once (block tables, context lengths, query
offsets) from pinned host memory with asynchronous copies. In a step of decodes only, each layer
is one launch: the decode kernel rotates q and k, stores the new K/V and attends. Otherwise a
layer rotates q/k and stores its new K/V (one fused kernel), then runs the decode kernel over
the decode rows and the varlen prefill kernel over the rest. For CUDA graphs the model runner
fills ``meta.extra`` from static buffers itself and sets ``decode_num_splits`` per captured
batch size, so nothing here reads the device or allocates data-dependent shapes.
"""

from __future__ import annotations

import torch

from worker.models.attention import AttentionBackend, AttentionMetadata
from worker.models.transfer import to_device


def pad_block_tables(tables: list[list[int]], width: int | None = None) -> list[list[int]]:
    width = width or max((len(t) for t in tables), default=1) or 1
    return [t + [0] * (width - len(t)) for t in tables]


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        nd = meta.num_decodes
        n = len(meta.context_lens)
        tables = to_device(pad_block_tables(meta.block_tables), device)
        ctx = to_device(meta.context_lens, device)
        meta.extra["decode_block_tables"] = tables[:nd]
        meta.extra["decode_context_lens"] = ctx[:nd]
        meta.extra["decode_num_splits"] = None  # let the kernel choose
        # The decode kernel starts the longest sequences first, so the short ones fill its tail.
        lens = meta.context_lens[:nd]
        meta.extra["decode_order"] = to_device(sorted(range(nd), key=lambda i: -lens[i]), device) if nd else None
        if nd < n:
            qs = meta.query_start
            meta.extra["prefill_block_tables"] = tables[nd:]
            meta.extra["prefill_context_lens"] = ctx[nd:]
            meta.extra["prefill_query_start"] = to_device([q - qs[nd] for q in qs[nd:]], device)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, rope=None, kv_scales=None, next_quantized=False):
        from kernels import paged_decode_attention, paged_prefill_attention, rotary_store_kv, store_kv

        nd = meta.num_decodes
        extra = meta.extra

        def decode(rows: torch.Tensor, **kw) -> torch.Tensor:
            return paged_decode_attention(rows, k_cache, v_cache, extra["decode_block_tables"],
                                          extra["decode_context_lens"], scale, extra["decode_num_splits"],
                                          order=extra["decode_order"], kv_scales=kv_scales, **kw)

        decodes_only = "prefill_query_start" not in extra  # (the CUDA-graph case)
        # One launch, unless rows of one sequence share the step (speculative verification as
        # decode rows): a row reads the K/V its neighbours store, so all are stored first.
        if decodes_only and rope is not None and not extra.get("decode_store_first"):
            positions, rotary = rope
            return decode(q, rope_store=(positions, k, v, rotary.cos, rotary.sin, meta.slot_mapping),
                          next_quantized=next_quantized)
        if rope is None:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales=kv_scales)
        else:  # rotate q and k and store k and v: one launch
            positions, rotary = rope
            rotary_store_kv(positions, q, k, v, rotary.cos, rotary.sin, k_cache, v_cache, meta.slot_mapping,
                            kv_scales=kv_scales)
        if decodes_only:
            return decode(q, next_quantized=next_quantized)
        out = torch.empty_like(q)  # both kernels write their rows of it in place
        if nd:
            decode(q[:nd], out=out[:nd])
        paged_prefill_attention(q[nd:], k_cache, v_cache, extra["prefill_block_tables"],
                                extra["prefill_query_start"], extra["prefill_context_lens"], scale, out=out[nd:],
                                kv_scales=kv_scales)
        return out
