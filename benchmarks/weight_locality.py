"""Does the order of a packed weight's bytes in memory cap how fast a 1-row projection can read it?

The Gluon kernels (kernels/wq_gluon.py) read a tile of BLOCK_N rows x 128 columns per TMA copy:
for int8 that is 128 contiguous bytes a row (the next 128 sit in the same row, 4 KB on), for int4
64. The bf16 skinny kernel reads 512-1024 bytes a row per tile. ncu put DRAM throughput at 51%
(int4), 68% (int8) and ~97% (bf16) of the copy rate on gate_up at one row. This probe streams the
same bytes with no arithmetic, one program per 64 rows as the kernels' grid has it, in two orders:

- ``row-major``: tile (p, t) is rows 64 p.. of columns t W.. (W bytes a row), as the weight lies now;
- ``tile-major``: the same tiles stored one after another, each 64 W contiguous bytes.

    python benchmarks/weight_locality.py [--n 28672] [--k-bytes 4096] [--out results.json]
    python benchmarks/weight_locality.py --grid-sweep [--k-bytes 8192]   # 16-128 rows a program, K split 1-4
    python benchmarks/weight_locality.py --graph-sizes                   # each 8B projection's int8 bytes

The first two print GB/s from triton.testing.do_bench (its L2 flush between runs; its time includes
the launch, so only their comparisons count: gate_up's 117 MB reads at ~0.77 of the copy rate in
every order there); ``--graph-sizes`` times the stream as quant_gpu.py --parts decode times the
kernels (CUDA graphs over copies that miss the L2), the ceiling a 1-row projection kernel could
reach (docs/BENCHMARKS.md, 2026-11-28: 28.7 µs for gate_up's int8 bytes, 4.09 TB/s).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from kernels.wq_gluon_tune import graph_us  # noqa: E402 (the kernels' own timing: back to back from a CUDA graph)


@triton.jit
def _stream_tma(desc, out_ptr, T, ROWS: tl.constexpr, COLS: tl.constexpr, TILE_MAJOR: tl.constexpr,
                STAGES: tl.constexpr, SPLIT: tl.constexpr = 1):
    p = tl.program_id(0)
    part = T // SPLIT
    acc = tl.zeros([ROWS, COLS], tl.int32)
    for t in tl.range(tl.program_id(1) * part, (tl.program_id(1) + 1) * part, num_stages=STAGES):
        if TILE_MAJOR:
            blk = desc.load([(p * T + t) * ROWS, 0])
        else:
            blk = desc.load([p * ROWS, t * COLS])
        acc ^= blk
    tl.store(out_ptr + p * SPLIT + tl.program_id(1), tl.sum(acc))


@triton.jit
def _stream_ptr(w_ptr, out_ptr, T, stride, ROWS: tl.constexpr, COLS: tl.constexpr, TILE_MAJOR: tl.constexpr,
                STAGES: tl.constexpr):
    p = tl.program_id(0)
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, COLS)[None, :]
    acc = tl.zeros([ROWS, COLS], tl.int32)
    for t in tl.range(T, num_stages=STAGES):
        if TILE_MAJOR:
            offs = ((p * T + t) * ROWS + r).to(tl.int64) * COLS + c
        else:
            offs = (p * ROWS + r).to(tl.int64) * stride + t * COLS + c
        acc ^= tl.load(w_ptr + offs)
    tl.store(out_ptr + p, tl.sum(acc))


def graph_sizes() -> list[dict]:
    """The plain stream (row-major TMA, 64 rows a program, 128-byte runs, 4 stages, K split 1, 2 or 4:
    the best) of each Llama-3.1-8B projection's int8 bytes (and gate_up's bf16 bytes), in CUDA
    graphs over copies that together pass 400 MB (the L2 holds ~50)."""
    rows = []
    for name, n, k_bytes in (("o int8", 4096, 4096), ("qkv int8", 6144, 4096), ("down int8", 4096, 14336),
                             ("gate_up int8", 28672, 4096), ("gate_up bf16", 28672, 8192)):
        words = k_bytes // 4
        nbytes = n * k_bytes
        copies = max(2, -(-400_000_000 // nbytes))
        ws = [torch.randint(-2**31, 2**31 - 1, (n, words), dtype=torch.int32, device="cuda") for _ in range(copies)]
        cols, r = 32, 64
        descs = [TensorDescriptor.from_tensor(w, [r, cols]) for w in ws]
        out = torch.empty(n * 4, dtype=torch.int32, device="cuda")
        best = None
        for split in (1, 2, 4):
            g = (n // r, split)
            us = graph_us([lambda i=i: _stream_tma[g](descs[i], out, words // cols, ROWS=r, COLS=cols,
                                                      TILE_MAJOR=False, STAGES=4, SPLIT=split, num_warps=4)
                           for i in range(copies)])
            print(f"{name:13s} {nbytes / 1e6:6.1f} MB split {split}: {us:6.1f} us {nbytes / us / 1e3:6.0f} GB/s")
            if best is None or us < best["us"]:
                best = {"projection": name, "bytes": nbytes, "split": split, "us": us, "gbs": nbytes / us / 1e3}
        rows.append(best)
        del ws, descs
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=28672, help="rows (gate_up of Llama-3.1-8B)")
    ap.add_argument("--k-bytes", type=int, default=4096, help="bytes a row (int8 K 4096)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--graph-sizes", action="store_true",
                    help="instead: the stream in CUDA graphs over weight copies that miss the L2 (as a decode step "
                    "meets them, as quant_gpu.py --parts decode times the kernels) for the 8B shape's projections")
    ap.add_argument("--grid-sweep", action="store_true",
                    help="instead: row-major TMA at 16-128 rows a program and K split 1-4 (128 and 512 B runs)")
    args = ap.parse_args()
    torch.manual_seed(0)
    words = args.k_bytes // 4
    w = torch.randint(-2**31, 2**31 - 1, (args.n, words), dtype=torch.int32, device="cuda")
    nbytes = w.numel() * 4
    grid = (args.n // args.rows,)
    out = torch.empty(grid[0], dtype=torch.int32, device="cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    results = {"gpu": torch.cuda.get_device_name(), "n": args.n, "k_bytes": args.k_bytes, "bytes": nbytes, "runs": []}
    dst = torch.empty_like(w)
    ms = triton.testing.do_bench(lambda: dst.copy_(w), warmup=25, rep=200, return_mode="median")
    copy = 2 * nbytes / ms / 1e6
    results["copy_gbs"] = copy
    print(f"{torch.cuda.get_device_name()}: {nbytes / 1e6:.1f} MB, torch copy {copy:.0f} GB/s (read + write)")
    if args.graph_sizes:
        results["graph"] = graph_sizes()
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
        return 0
    if args.grid_sweep:
        out = torch.empty(args.n * 4, dtype=torch.int32, device="cuda")
        for run_bytes in (128, 512):
            cols = run_bytes // 4
            t = words // cols
            for rows in (16, 32, 64, 128):
                desc = TensorDescriptor.from_tensor(w, [rows, cols])
                for split in (1, 2, 4):
                    g = (args.n // rows, split)
                    fn = lambda: _stream_tma[g](desc, out, t, ROWS=rows, COLS=cols, TILE_MAJOR=False,  # noqa: E731
                                                STAGES=4, SPLIT=split, num_warps=4)
                    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                    gbs = nbytes / ms / 1e6
                    results["runs"].append({"run_bytes": run_bytes, "rows": rows, "split": split, "programs": g[0] * split,
                                            "us": ms * 1e3, "gbs": gbs, "of_copy": gbs / copy})
                    print(f"{run_bytes:4d} B, {rows:3d} rows, split {split}: {g[0] * split:5d} programs "
                          f"{ms * 1e3:7.1f} us {gbs:6.0f} GB/s ({gbs / copy:.2f} of the copy rate)")
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
        return 0
    for run_bytes in (64, 128, 256, 512):
        cols = run_bytes // 4
        t = words // cols
        # tile-major: the same tiles, tile (p, t) at rows (p T + t) 64.. of a [n T, cols] view
        for major in (False, True):
            src = w if not major else w.view(grid[0], args.rows, t, cols).permute(0, 2, 1, 3).contiguous()
            flat = src.view(-1, cols) if major else src
            for kind in ("tma", "ptr"):
                for stages in (3, 4, 6):
                    if kind == "tma":
                        desc = TensorDescriptor.from_tensor(flat, [args.rows, cols])
                        fn = lambda: _stream_tma[grid](desc, out, t, ROWS=args.rows, COLS=cols,  # noqa: E731
                                                       TILE_MAJOR=major, STAGES=stages, num_warps=4)
                    else:
                        fn = lambda: _stream_ptr[grid](flat, out, t, flat.stride(0), ROWS=args.rows,  # noqa: E731
                                                       COLS=cols, TILE_MAJOR=major, STAGES=stages, num_warps=4)
                    try:
                        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                    except Exception as exc:  # noqa: BLE001 (a probe: report and go on)
                        print(f"{run_bytes} B {'tile' if major else 'row'}-major {kind} stages {stages}: {exc!r}"[:200])
                        continue
                    gbs = nbytes / ms / 1e6
                    row = {"run_bytes": run_bytes, "order": "tile-major" if major else "row-major", "load": kind,
                           "stages": stages, "us": ms * 1e3, "gbs": gbs, "of_copy": gbs / copy}
                    results["runs"].append(row)
                    print(f"{run_bytes:4d} B a row a tile, {row['order']:10s} {kind} stages {stages}: "
                          f"{ms * 1e3:7.1f} us {gbs:6.0f} GB/s ({gbs / copy:.2f} of the copy rate)")
            del src, flat
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
