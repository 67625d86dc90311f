"""The Triton kernels on a CUDA device at Llama-3.1-8B shapes: right, and how near the floor.

Each kernel is first checked against its torch reference (kernels/reference.py) on the same
inputs, then timed with CUDA events: warm-up, then the median of many runs, with L2 flushed
before each run so that small working sets are not served from cache. Memory-bound kernels are
scored by achieved bandwidth over the bytes they must move (for decode attention: the live K/V
read once, plus q and out) as a fraction of ``--peak-gbps``; prefill attention, which is
compute-bound, also by TFLOP/s against ``--peak-tflops``. Run from the repository root:

    python benchmarks/kernels_gpu.py --out kernels_gpu.json
    python benchmarks/kernels_gpu.py --sweep-splits   # also time decode at fixed split counts
    python benchmarks/kernels_gpu.py --sweep-decode   # decode tile / warps / stages, on the engine's cases
    python benchmarks/kernels_gpu.py --sweep-prefill  # prefill tiles / warps / stages, on the engine's cases
    python benchmarks/kernels_gpu.py --sweep-order    # decode launched in batch order vs longest first, batch 32-256

Shapes: H=32, KVH=8, D=128, block size 16, bf16, hidden 4096, intermediate 14336; decode at
batch 1 / 64 / 256 with contexts of 512, 4096 and mixed 512-4096; prefill of 4 x 512 new tokens,
fresh and after cached prefixes. Peaks default to this project's measured H100 figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels as K  # noqa: E402
from kernels import paged_attention  # noqa: E402
from kernels.paged_attention import default_num_splits  # noqa: E402

H, KVH, D, BLOCK_SIZE = 32, 8, 128, 16
HIDDEN, INTER, MAX_POS = 4096, 14336, 8192
DTYPE = torch.bfloat16
ELEM = 2  # bytes per bf16
SCALE = D**-0.5


@dataclass
class Result:
    kernel: str
    case: str
    ms: float
    bytes: int
    gbps: float
    bw_frac: float
    max_err: float
    ok: bool
    tflops: float | None = None
    flops_frac: float | None = None
    note: str = ""


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = torch.device("cuda")
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=self.device)
        self.results: list[Result] = []

    def time_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(self.args.warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.args.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.args.reps)]
        for start, end in zip(starts, ends):
            self.flush.zero_()  # evict L2 (50 MB on an H100) so every run reads from HBM
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))

    def record(self, kernel, case, fn, nbytes, err, tol, flops=None, note=""):
        ms = self.time_ms(fn)
        gbps = nbytes / ms / 1e6
        res = Result(
            kernel, case, round(ms, 4), nbytes, round(gbps, 1), round(gbps / self.args.peak_gbps, 3),
            float(err), bool(err <= tol), note=note,
        )
        if flops is not None:
            res.tflops = round(flops / ms / 1e9, 1)
            res.flops_frac = round(res.tflops / self.args.peak_tflops, 3)
        self.results.append(res)
        print(_row(res), flush=True)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst error relative to the reference's scale: max |got - want| / max(1, max |want|)."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1.0)).item()


def _pool(context_lens: list[int], device: torch.device):
    """K/V pool holding the given contexts in shuffled blocks, and the block tables."""
    needed = [-(-c // BLOCK_SIZE) for c in context_lens]
    num_blocks = sum(needed) + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KVH, D, dtype=DTYPE, device=device)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(context_lens), max(needed), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(needed):
        tables[i, :n] = order[start : start + n]
        start += n
    return k_cache, v_cache, tables


def bench_decode(b: Bench) -> None:
    for batch in (1, 64, 256):
        rng = random.Random(batch)
        for label, lens in (
            ("ctx 512", [512] * batch),
            ("ctx 4096", [4096] * batch),
            ("ctx mixed 512-4096", [rng.randint(512, 4096) for _ in range(batch)]),
        ):
            k_cache, v_cache, tables = _pool(lens, b.device)
            ctx = torch.tensor(lens, dtype=torch.int32, device=b.device)
            q = torch.randn(batch, H, D, dtype=DTYPE, device=b.device)
            want = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, SCALE)
            nbytes = sum(lens) * KVH * D * 2 * ELEM + 2 * batch * H * D * ELEM
            auto = default_num_splits(batch, KVH, tables.shape[1] * BLOCK_SIZE, b.device)
            splits = [None] + ([s for s in (1, 2, 4, 8, 16, 32) if s != auto] if b.args.sweep_splits else [])
            for s in splits:
                got = K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE, num_splits=s)
                b.record(
                    "decode_attention", f"B={batch} {label}",
                    lambda s=s: K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE, num_splits=s),
                    nbytes, _err(got, want), 2e-2, note=f"splits={auto if s is None else s}{' (auto)' if s is None else ''}",
                )
            del k_cache, v_cache, tables, want
            torch.cuda.empty_cache()


def sweep_decode_config(b: Bench) -> None:
    """Decode attention's tile (context tokens per step), warps and pipeline stages, on the cases
    the engine benchmark runs: batch 1 at context 600 (graph split count), and batches of 64 and
    256 with contexts spread as in the offline workload (prompt + output, 200-2048)."""
    rng = random.Random(1)
    cases = [("B=1 ctx 600", [600], 33), ("B=64 ctx 200-2048", [rng.randint(200, 2048) for _ in range(64)], None),
             ("B=256 ctx 200-2048", [rng.randint(200, 2048) for _ in range(256)], None)]
    chosen = (paged_attention.DECODE_BLOCK_N, paged_attention.DECODE_NUM_WARPS, paged_attention.DECODE_NUM_STAGES)
    threshold, paged_attention.WIDE_MIN_PROGRAMS_PER_SM = paged_attention.WIDE_MIN_PROGRAMS_PER_SM, 0  # always the swept one
    for label, lens, splits in cases:
        k_cache, v_cache, tables = _pool(lens, b.device)
        ctx = torch.tensor(lens, dtype=torch.int32, device=b.device)
        q = torch.randn(len(lens), H, D, dtype=DTYPE, device=b.device)
        want = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, SCALE)
        nbytes = sum(lens) * KVH * D * 2 * ELEM + 2 * len(lens) * H * D * ELEM
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    paged_attention.DECODE_BLOCK_N = block_n
                    paged_attention.DECODE_NUM_WARPS = warps
                    paged_attention.DECODE_NUM_STAGES = stages
                    fn = lambda: K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE, num_splits=splits)  # noqa: E731
                    try:
                        got = fn()
                    except Exception as exc:  # out of shared memory: not a config this chip can run
                        print(f"decode {label} block_n={block_n} warps={warps} stages={stages}: {type(exc).__name__}")
                        continue
                    b.record("decode_config", label, fn, nbytes, _err(got, want), 2e-2,
                             note=f"block_n={block_n} warps={warps} stages={stages}")
        del k_cache, v_cache, tables, want
        torch.cuda.empty_cache()
    paged_attention.DECODE_BLOCK_N, paged_attention.DECODE_NUM_WARPS, paged_attention.DECODE_NUM_STAGES = chosen
    paged_attention.WIDE_MIN_PROGRAMS_PER_SM = threshold
    _sweep_summary(b, "decode_config", [c[0] for c in cases], "block_n={} warps={} stages={}".format(*chosen),
                   lambda r: f"{100 * r.bw_frac:.1f}%")


def sweep_decode_order(b: Bench) -> None:
    """Decode attention at the large batches of (b), sequences launched in batch order or longest
    first, with the wide tile and a narrower one, on contexts spread as in the workload's first
    steps (prompts 100-1024) and later ones, and one uniform context."""
    rng = random.Random(2)
    cases = [("B=256 ctx 100-1024", [rng.randint(100, 1024) for _ in range(256)]),
             ("B=256 ctx 400-1300", [rng.randint(400, 1300) for _ in range(256)]),
             ("B=256 ctx 900", [900] * 256),
             ("B=160 ctx 600-2000", [rng.randint(600, 2000) for _ in range(160)]),
             ("B=96 ctx 800-2048", [rng.randint(800, 2048) for _ in range(96)]),
             ("B=32 ctx 900-2048", [rng.randint(900, 2048) for _ in range(32)])]
    for label, lens in cases:
        k_cache, v_cache, tables = _pool(lens, b.device)
        ctx = torch.tensor(lens, dtype=torch.int32, device=b.device)
        longest_first = torch.argsort(ctx, descending=True).to(torch.int32)
        q = torch.randn(len(lens), H, D, dtype=DTYPE, device=b.device)
        want = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, SCALE)
        nbytes = sum(lens) * KVH * D * 2 * ELEM + 2 * len(lens) * H * D * ELEM
        for order in (None, longest_first):
            fn = lambda o=order: K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE, order=o)  # noqa: E731
            b.record("decode_order", label, fn, nbytes, _err(fn(), want), 2e-2,
                     note=f"order={'longest' if order is not None else 'batch'}")
        del k_cache, v_cache, tables, want
        torch.cuda.empty_cache()
    _sweep_summary(b, "decode_order", [c[0] for c in cases], "order=batch", lambda r: f"{100 * r.bw_frac:.1f}%")


def _sweep_summary(b: Bench, kernel: str, labels: list[str], current: str, score: Callable[[Result], str]) -> None:
    """Per swept case: the three fastest configs, and the current one."""
    for label in labels:
        rows = sorted((r for r in b.results if r.kernel == kernel and r.case == label), key=lambda r: r.ms)
        mine = next((r for r in rows if r.note == current), None)
        print(f"{label}: best " + "; ".join(f"{r.note} {r.ms:.4f} ms {score(r)}" for r in rows[:3])
              + (f" | current {current} {mine.ms:.4f} ms {score(mine)}" if mine else ""))


def bench_prefill(b: Bench) -> None:
    q_len = 512
    for label, prefixes in (("4x512 fresh", [0, 0, 0, 0]), ("4x512 after prefixes 0/512/1536/3584", [0, 512, 1536, 3584])):
        lens = [p + q_len for p in prefixes]
        k_cache, v_cache, tables = _pool(lens, b.device)
        ctx = torch.tensor(lens, dtype=torch.int32, device=b.device)
        query_start = torch.arange(0, 4 * q_len + 1, q_len, dtype=torch.int32, device=b.device)
        q = torch.randn(4 * q_len, H, D, dtype=DTYPE, device=b.device)
        want = K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, query_start, ctx, SCALE)
        got = K.paged_prefill_attention(q, k_cache, v_cache, tables, query_start, ctx, SCALE)
        nbytes = sum(lens) * KVH * D * 2 * ELEM + 2 * q.numel() * ELEM
        # QK^T and PV: 2 flops per multiply-add each, over the keys each query sees (causal).
        flops = 4 * H * D * sum(q_len * p + q_len * (q_len + 1) // 2 for p in prefixes)
        b.record(
            "prefill_attention", label,
            lambda: K.paged_prefill_attention(q, k_cache, v_cache, tables, query_start, ctx, SCALE),
            nbytes, _err(got, want), 2e-2, flops=flops,
        )
        del k_cache, v_cache, tables, want
        torch.cuda.empty_cache()


def sweep_prefill_config(b: Bench) -> None:
    """Prefill attention's Q tile rows, K/V tile, warps and stages, on a step of the offline
    workload's admission phase (8,192 new tokens: whole prompts of 100-1024 tokens, the last one
    chunked) and on 4 x 512 new tokens after cached prefixes (chunked prefill, prefix hits)."""
    rng = random.Random(2)
    fresh: list[int] = []
    while sum(fresh) < 8192:
        fresh.append(min(rng.randint(100, 1024), 8192 - sum(fresh)))
    cases = [("8192 new, prompts 100-1024", [0] * len(fresh), fresh),
             ("4x512 after prefixes 0/512/1536/3584", [0, 512, 1536, 3584], [512] * 4)]
    chosen = (paged_attention.PREFILL_BLOCK_M, paged_attention.PREFILL_BLOCK_N, paged_attention.PREFILL_NUM_WARPS,
              paged_attention.PREFILL_NUM_STAGES)
    for label, prefixes, q_lens in cases:
        lens = [p + n for p, n in zip(prefixes, q_lens)]
        k_cache, v_cache, tables = _pool(lens, b.device)
        ctx = torch.tensor(lens, dtype=torch.int32, device=b.device)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        query_start = torch.tensor(starts, dtype=torch.int32, device=b.device)
        q = torch.randn(starts[-1], H, D, dtype=DTYPE, device=b.device)
        want = K.paged_prefill_attention_ref(q, k_cache, v_cache, tables, query_start, ctx, SCALE)
        nbytes = sum(lens) * KVH * D * 2 * ELEM + 2 * q.numel() * ELEM
        flops = 4 * H * D * sum(n * p + n * (n + 1) // 2 for p, n in zip(prefixes, q_lens))
        for block_m in (64, 128, 256):
            for block_n in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        (paged_attention.PREFILL_BLOCK_M, paged_attention.PREFILL_BLOCK_N,
                         paged_attention.PREFILL_NUM_WARPS, paged_attention.PREFILL_NUM_STAGES) = block_m, block_n, warps, stages
                        note = f"block_m={block_m} block_n={block_n} warps={warps} stages={stages}"
                        fn = lambda: K.paged_prefill_attention(q, k_cache, v_cache, tables, query_start, ctx, SCALE)  # noqa: E731
                        try:
                            got = fn()
                        except Exception as exc:  # out of shared memory or registers
                            print(f"prefill {label} {note}: {type(exc).__name__}")
                            continue
                        b.record("prefill_config", label, fn, nbytes, _err(got, want), 2e-2, flops=flops, note=note)
        del k_cache, v_cache, tables, want
        torch.cuda.empty_cache()
    (paged_attention.PREFILL_BLOCK_M, paged_attention.PREFILL_BLOCK_N, paged_attention.PREFILL_NUM_WARPS,
     paged_attention.PREFILL_NUM_STAGES) = chosen
    _sweep_summary(b, "prefill_config", [c[0] for c in cases],
                   "block_m={} block_n={} warps={} stages={}".format(*chosen), lambda r: f"{r.tflops:.0f} TFLOP/s")


def bench_store_kv(b: Bench) -> None:
    for tokens in (256, 2048):
        num_blocks = 4 * tokens // BLOCK_SIZE
        k_cache = torch.zeros(num_blocks, BLOCK_SIZE, KVH, D, dtype=DTYPE, device=b.device)
        v_cache = torch.zeros_like(k_cache)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        k = torch.randn(tokens, KVH, D, dtype=DTYPE, device=b.device)
        v = torch.randn_like(k)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=b.device)[:tokens]
        slots[::7] = -1  # padding
        K.store_kv(k, v, k_cache, v_cache, slots)
        K.store_kv_ref(k, v, k_ref, v_ref, slots)
        err = max(_err(k_cache, k_ref), _err(v_cache, v_ref))
        nbytes = 2 * 2 * tokens * KVH * D * ELEM + tokens * 8  # k and v, read and written; slots
        b.record("store_kv", f"T={tokens}", lambda: K.store_kv(k, v, k_cache, v_cache, slots), nbytes, err, 0.0)


def bench_skinny_matmul(b: Bench) -> None:
    """The decode projections at 1, 8 and 16 rows: the Triton skinny matmul (tuned per shape at
    its first call) against cuBLAS (F.linear), each scored by the weight bytes it must read."""
    shapes = {"qkv": (H * D + 2 * KVH * D, HIDDEN), "o": (HIDDEN, H * D), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER), "lm_head": (128256, HIDDEN)}
    for rows in (1, 8, 16):
        for name, (n, k) in shapes.items():
            x = torch.randn(rows, k, dtype=DTYPE, device=b.device)
            w = torch.randn(n, k, dtype=DTYPE, device=b.device) / k**0.5
            want = torch.nn.functional.linear(x.float(), w.float())
            nbytes = (n * k + rows * (n + k)) * ELEM
            got = K.skinny_matmul(x, w)
            b.record("skinny_matmul", f"M={rows} {name} {n}x{k}", lambda: K.skinny_matmul(x, w), nbytes,
                     _err(got, want), 2e-2)
            got = torch.nn.functional.linear(x, w)
            b.record("cublas_linear", f"M={rows} {name} {n}x{k}", lambda: torch.nn.functional.linear(x, w), nbytes,
                     _err(got, want), 2e-2)
            del w
    from kernels import skinny

    tuner = skinny._tuned
    if tuner is not None:
        for key, cfg in tuner.cache.items():
            print(f"skinny_matmul tuned {key}: {cfg}")


def bench_rotary_store_kv(b: Bench) -> None:
    cos, sin = _rope_tables(b.device)
    for tokens in (1, 256):
        num_blocks = 4 * max(tokens, 16) // BLOCK_SIZE
        positions = torch.randint(0, MAX_POS, (tokens,), device=b.device)
        qkv = torch.randn(tokens, (H + 2 * KVH) * D, dtype=DTYPE, device=b.device)
        k_cache = torch.zeros(num_blocks, BLOCK_SIZE, KVH, D, dtype=DTYPE, device=b.device)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=b.device)[:tokens]

        def views(buf):
            return (buf[:, : H * D].view(tokens, H, D), buf[:, H * D : (H + KVH) * D].view(tokens, KVH, D),
                    buf[:, (H + KVH) * D :].view(tokens, KVH, D))

        ref_buf, k_ref, v_ref = qkv.clone(), k_cache.clone(), v_cache.clone()
        K.rotary_store_kv_ref(positions, *views(ref_buf), cos, sin, k_ref, v_ref, slots)
        got_buf = qkv.clone()
        K.rotary_store_kv(positions, *views(got_buf), cos, sin, k_cache, v_cache, slots)
        err = max(_err(got_buf, ref_buf), _err(k_cache, k_ref), _err(v_cache, v_ref))
        # q, k read and written in place; k, v written to the pool; v read; cos, sin rows
        nbytes = tokens * (2 * (H + KVH) * D + 3 * KVH * D) * ELEM + 2 * tokens * D * 4
        b.record("rotary+store_kv", f"T={tokens}",
                 lambda: K.rotary_store_kv(positions, *views(qkv), cos, sin, k_cache, v_cache, slots), nbytes, err, 2e-2)


def bench_decode_rope_store(b: Bench) -> None:
    """A decode graph's attention per layer: rotary + KV store, then decode attention (two
    launches), against the decode kernel doing all three (``rope_store=``), on the same inputs."""
    cos, sin = _rope_tables(b.device)
    rng = random.Random(3)
    for label, lens in (("B=1 ctx 600", [600]), ("B=64 ctx 200-2048", [rng.randint(200, 2048) for _ in range(64)]),
                        ("B=256 ctx 100-1024", [rng.randint(100, 1024) for _ in range(256)])):
        batch = len(lens)
        k_cache, v_cache, tables = _pool(lens, b.device)
        ctx = torch.tensor(lens, dtype=torch.int32, device=b.device)
        order = torch.argsort(ctx, descending=True).to(torch.int32)
        positions = (ctx - 1).long()
        slots = (tables.long().gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + positions % BLOCK_SIZE)
        qkv = torch.randn(batch, (H + 2 * KVH) * D, dtype=DTYPE, device=b.device)
        q, k, v = (qkv[:, : H * D].view(batch, H, D), qkv[:, H * D : (H + KVH) * D].view(batch, KVH, D),
                   qkv[:, (H + KVH) * D :].view(batch, KVH, D))
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        rope = (positions, k, v, cos, sin, slots)
        want = K.paged_decode_attention_ref(q, k_ref, v_ref, tables, ctx, SCALE, rope_store=rope)
        got = K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE, order=order, rope_store=rope)
        err = max(_err(got, want), _err(k_cache, k_ref), _err(v_cache, v_ref))
        nbytes = sum(lens) * KVH * D * 2 * ELEM + 2 * batch * H * D * ELEM
        b.record("decode+rope+store", label,
                 lambda: K.paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE, order=order, rope_store=rope),
                 nbytes, err, 2e-2, note="fused: one launch")
        buf = qkv.clone()  # the two-launch path rotates its q and k in place: the check gets fresh ones
        q2, k2, v2 = (buf[:, : H * D].view(batch, H, D), buf[:, H * D : (H + KVH) * D].view(batch, KVH, D),
                      buf[:, (H + KVH) * D :].view(batch, KVH, D))

        def two_launches():  # timed as it comes: rotating again each run moves the same bytes
            K.rotary_store_kv(positions, q2, k2, v2, cos, sin, k_cache, v_cache, slots)
            return K.paged_decode_attention(q2, k_cache, v_cache, tables, ctx, SCALE, order=order)

        b.record("decode+rope+store", label, two_launches, nbytes, _err(two_launches(), want), 2e-2,
                 note="rotary_store_kv + decode: two launches")
        del k_cache, v_cache, tables, k_ref, v_ref
        torch.cuda.empty_cache()


def bench_rms_norm(b: Bench) -> None:
    for tokens in (1, 256, 4096):
        x = torch.randn(tokens, HIDDEN, dtype=DTYPE, device=b.device)
        residual = torch.randn_like(x)
        weight = (1 + 0.1 * torch.randn(HIDDEN, device=b.device)).to(DTYPE)
        got, got_res = K.rms_norm(x, weight, 1e-5, residual)
        want, want_res = K.rms_norm_ref(x, weight, 1e-5, residual)
        err = max(_err(got, want), _err(got_res, want_res))
        nbytes = 4 * tokens * HIDDEN * ELEM + HIDDEN * ELEM  # x, residual in; out, residual out
        b.record("rms_norm+residual", f"T={tokens}", lambda: K.rms_norm(x, weight, 1e-5, residual), nbytes, err, 2e-2)


def _rope_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=device).float() / D))
    freqs = torch.arange(MAX_POS, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def bench_rotary(b: Bench) -> None:
    cos, sin = _rope_tables(b.device)
    for tokens in (256, 4096):
        positions = torch.randint(0, MAX_POS, (tokens,), device=b.device)
        q = torch.randn(tokens, H, D, dtype=DTYPE, device=b.device)
        k = torch.randn(tokens, KVH, D, dtype=DTYPE, device=b.device)
        want_q, want_k = K.rotary_embedding_ref(positions, q, k, cos, sin)
        got_q, got_k = K.rotary_embedding(positions, q.clone(), k.clone(), cos, sin)
        err = max(_err(got_q, want_q), _err(got_k, want_k))
        nbytes = 2 * tokens * (H + KVH) * D * ELEM + 2 * tokens * D * 4  # q, k in place; cos, sin rows
        b.record("rotary", f"T={tokens}", lambda: K.rotary_embedding(positions, q, k, cos, sin), nbytes, err, 2e-2)


def bench_silu_and_mul(b: Bench) -> None:
    for tokens in (1, 256, 4096):
        x = torch.randn(tokens, 2 * INTER, dtype=DTYPE, device=b.device)
        err = _err(K.silu_and_mul(x), K.silu_and_mul_ref(x))
        nbytes = tokens * 3 * INTER * ELEM  # [T, 2I] in, [T, I] out
        b.record("silu_and_mul", f"T={tokens}", lambda: K.silu_and_mul(x), nbytes, err, 2e-2)


def _row(r: Result) -> str:
    flops = f"{r.tflops:7.1f} {100 * r.flops_frac:5.1f}%" if r.tflops is not None else " " * 14
    return (
        f"{r.kernel:<18} {r.case:<38} {r.ms:9.4f} {r.gbps:8.1f} {100 * r.bw_frac:5.1f}% {flops} "
        f"{r.max_err:9.2e} {'ok' if r.ok else 'FAIL':<4} {r.note}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-gbps", type=float, default=2960.0, help="memory bandwidth to score against")
    parser.add_argument("--peak-tflops", type=float, default=760.0, help="bf16 matmul rate to score prefill against")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--sweep-splits", action="store_true", help="also time decode at fixed split counts")
    parser.add_argument("--sweep-decode", action="store_true", help="only sweep decode tile / warps / stages")
    parser.add_argument("--sweep-order", action="store_true", help="only decode attention launched in batch order vs longest first")
    parser.add_argument("--sweep-prefill", action="store_true", help="only sweep prefill tiles / warps / stages")
    parser.add_argument("--only-decode", action="store_true", help="only decode attention (with --sweep-splits: every split count)")
    parser.add_argument("--only-skinny", action="store_true", help="only the skinny matmul against cuBLAS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not K.HAS_TRITON:
        sys.exit("needs a CUDA device and Triton")
    torch.manual_seed(args.seed)

    b = Bench(args)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  peak {args.peak_gbps} GB/s, {args.peak_tflops} TFLOP/s")
    print(f"{'kernel':<18} {'case':<38} {'ms':>9} {'GB/s':>8} {'%bw':>6} {'TFLOP/s':>7} {'%mm':>6} {'err':>9} ok")
    parts = (bench_skinny_matmul, bench_decode, bench_decode_rope_store, bench_prefill, bench_store_kv, bench_rotary_store_kv, bench_rms_norm, bench_rotary,
             bench_silu_and_mul)
    if args.sweep_decode:
        parts = (sweep_decode_config,)
    elif args.sweep_order:
        parts = (sweep_decode_order,)
    elif args.sweep_prefill:
        parts = (sweep_prefill_config,)
    elif args.only_skinny:
        parts = (bench_skinny_matmul,)
    elif args.only_decode:
        parts = (bench_decode, bench_decode_rope_store)
    for part in parts:
        part(b)

    failed = [r for r in b.results if not r.ok]
    print(f"{len(b.results) - len(failed)}/{len(b.results)} cases match their reference")
    if args.out:
        report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "python": platform.python_version(),
            "command": " ".join(sys.argv),
            "peak_gbps": args.peak_gbps,
            "peak_tflops": args.peak_tflops,
            "shapes": {"H": H, "KVH": KVH, "D": D, "block_size": BLOCK_SIZE, "hidden": HIDDEN, "inter": INTER, "dtype": "bf16"},
            "results": [asdict(r) for r in b.results],
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
