"""The greedy token: the argmax of each row of the logits, in one launch.

torch's argmax of one 128k-vocabulary row runs as one reduction kernel of ~37 µs on an H100 (a
batch-1 decode step's profile, docs/BENCHMARKS.md). Here the row is cut into chunks, a program a
(row, chunk), and the chunks' winners meet through a 64-bit ``atomic_max`` on a key that orders
as (value, -index): the float's order-preserving bits above the inverted index, so the largest
value wins and among equal values the lowest index, as torch picks. NaN counts as the largest
value (torch returns a NaN's index) and -0.0 as +0.0 (equal values, lowest index wins).

    key = [ ordered bits of float32(x) : 32 | 0xFFFFFFFF - index : 32 ]   (signed int64 max)

Each row's key and ticket live in a persistent buffer (``_state``) that the kernel leaves as it
found it: the last program of a row to take a ticket reads the key, writes the index and resets
both, so a call needs no clearing launch and fits inside a CUDA graph. One stream at a time: two
argmaxes running at once on one device would share the buffer.
"""

from __future__ import annotations

import os

import torch

from kernels._triton import cdiv, check_launchable, jit, next_power_of_2, pdl_launch, tl, wait_for_producer

# Elements of a row a program reduces (16 a thread at 4 warps: two 16-byte loads of bf16); a
# 128,256-token vocabulary is 63 programs a row. Module-level so tests can shrink it.
ARGMAX_BLOCK = 2048
# KVCASCADE_TRITON_ARGMAX=0: the sampler keeps torch's argmax (the A/B).
TRITON_ARGMAX = os.environ.get("KVCASCADE_TRITON_ARGMAX", "1") != "0"

_KEY_EMPTY = -(2**63)  # below every element's key (the lowest ordered bits of a float are -inf's, 0x807FFFFF)


@jit
def _argmax_kernel(x_ptr, out_ptr, key_ptr, ticket_ptr, stride_x, n_cols,
                   BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_producer(USE_PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # -0.0 as +0.0
    # Signed-int order of the floats: negative floats' magnitude bits flipped.
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ordered = tl.where(x != x, 0x7FFFFFFF, ordered)  # NaN above +inf
    ordered = tl.where(mask, ordered, -2147483648)  # past the row: below every element
    key = (ordered.to(tl.int64) << 32) | ((~offs).to(tl.int64) & 0xFFFFFFFF)
    tl.atomic_max(key_ptr + row, tl.max(key, 0))
    # acq_rel: the ticket is taken after this program's key is in; the last taker sees all of them.
    if tl.atomic_add(ticket_ptr + row, 1) == NUM_CHUNKS - 1:
        best = tl.atomic_xchg(key_ptr + row, tl.full([], -2147483648, tl.int32).to(tl.int64) << 32)
        tl.atomic_xchg(ticket_ptr + row, 0)
        tl.store(out_ptr + row, ~best & 0xFFFFFFFF)


# Per device: (keys, tickets), each row's slot at rest (_KEY_EMPTY, 0). Outgrown buffers stay
# referenced: a CUDA graph captured with one keeps its address.
_STATES: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def _state(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    held = _STATES.setdefault(device, [])
    if held and held[-1][0].numel() >= rows:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("argmax_rows: its buffer must be sized before a CUDA graph capture (run it once first)")
    cap = max(256, next_power_of_2(rows))
    held.append((torch.full((cap,), _KEY_EMPTY, dtype=torch.int64, device=device),
                 torch.zeros(cap, dtype=torch.int32, device=device)))
    return held[-1]


def fits(logits: torch.Tensor) -> bool:
    """``argmax_rows`` takes these logits: [N, V] fp32, fp16 or bf16, rows of unit stride, 0 < V < 2^31."""
    return (logits.dim() == 2 and logits.stride(1) == 1 and 0 < logits.shape[1] < 2**31
            and logits.dtype in (torch.float32, torch.float16, torch.bfloat16))


def argmax_rows(logits: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of logits that ``fit``, int64 [N]: the same index as torch, ties
    to the lowest index and NaN first."""
    check_launchable(logits)
    assert fits(logits), (logits.shape, logits.stride(), logits.dtype)
    rows, n_cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        keys, tickets = _state(rows, logits.device)
        block = block or min(ARGMAX_BLOCK, next_power_of_2(n_cols))
        chunks = cdiv(n_cols, block)
        _argmax_kernel[(rows, chunks)](logits, out, keys, tickets, logits.stride(0), n_cols,
                                       BLOCK=block, NUM_CHUNKS=chunks, num_warps=4, **pdl_launch(logits.device))
    return out
