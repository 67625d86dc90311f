"""How one model is split over ``tp`` ranks: pure arithmetic, no torch.

Attention is split by KV head, each rank taking whole GQA groups (a KV head with the query heads
that read it), so attention never crosses ranks. When heads do not divide evenly the first ranks
take one more (SmolLM2's 3 KV heads over 2 ranks: 2 and 1), which vLLM refuses; the only cost is
an unbalanced step. With fewer KV heads than ranks, each KV head is replicated on
``tp // num_kv_heads`` ranks that split its query heads. MLP columns split the same way;
the vocabulary splits into equal padded slices so logits gather in one collective.

    llama-3.1-8b, tp=2:  rank 0: q heads 0-15, kv heads 0-3;  rank 1: q 16-31, kv 4-7
    smollm2-135m, tp=2:  rank 0: q heads 0-5,  kv heads 0-1;  rank 1: q 6-8,   kv 2
    qwen2.5-0.5b, tp=4:  (14 q, 2 kv) rank r: kv head r // 2, q heads 7*(r//2) + (0-3 | 4-6)
"""

from __future__ import annotations

from dataclasses import dataclass


def split_evenly(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of part ``index`` of ``n`` items in ``parts`` contiguous parts; the first
    ``n % parts`` parts hold one more."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts}")
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, base + (index < extra)


@dataclass(frozen=True)
class HeadShard:
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    """The query and KV heads rank ``rank`` of ``tp`` holds."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        kv_start, kv_count = split_evenly(num_kv_heads, tp, rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if tp % num_kv_heads:
        raise ValueError(f"tensor parallel size {tp} must divide evenly over the {num_kv_heads} KV heads "
                         f"(a multiple of {num_kv_heads}) when it exceeds them")
    per_kv = tp // num_kv_heads
    if per_kv > group:
        raise ValueError(f"tensor parallel size {tp} exceeds the {num_heads} query heads")
    kv = rank // per_kv
    q_start, q_count = split_evenly(group, per_kv, rank % per_kv)
    return HeadShard(kv * group + q_start, q_count, kv, 1)


def vocab_shard(vocab_size: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(start, count, padded): rank ``rank`` holds rows [start, start + count) of the vocabulary in a
    slice of ``padded`` rows (the same on every rank; the tail of the last slice is padding)."""
    padded = -(-vocab_size // tp)
    start = min(rank * padded, vocab_size)
    return start, min(padded, vocab_size - start), padded


def check_tp(num_heads: int, num_kv_heads: int, intermediate_size: int, tp: int) -> None:
    """Raise ValueError, naming the reason, when a model cannot be split ``tp`` ways."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    for rank in range(tp):
        head_shard(num_heads, num_kv_heads, tp, rank)
    if intermediate_size < tp:
        raise ValueError(f"tensor parallel size {tp} exceeds the MLP width {intermediate_size}")
