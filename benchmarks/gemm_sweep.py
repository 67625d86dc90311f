"""kernels/matmul.py's tiled GEMM against cuBLAS at decode batches of 64-256 rows, on a CUDA GPU.

For each batch size M and each Llama-3.1-8B projection (bf16, random weights), times
``F.linear`` (cuBLAS) and every ``kernels.matmul.CANDIDATES`` config, each call inside a captured
CUDA graph (as the engine runs them) replayed ``--replays`` times between two CUDA events. A
graph cycles through enough copies of the weight (``ROTATE_BYTES``) that each call reads its
weight from HBM, not from the 50 MB L2: in a model's step the next layer's weight is cold too.
Each config's output is checked against F.linear in fp32; a config that fails to compile or
launch is reported and skipped. Prints one line per (M, projection, config), then the best
config per (M, projection) against cuBLAS. Run from the repository root:

    python benchmarks/gemm_sweep.py [--rows 64 128 192 256] [--shapes qkv o_proj] [--out gemm_sweep.json]

The weight-read floor is weight bytes / ~3 TB/s (this project's measured H100 copy rate).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels._triton import triton  # noqa: E402
from kernels.matmul import CANDIDATES, tiled_matmul  # noqa: E402
from kernels.wq_gluon_tune import graph_us  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # N, K
DTYPE = torch.bfloat16
ROTATE_BYTES = 200e6  # weight copies per graph: 4x the H100's L2
MAX_ERR = 2e-2  # max |out - ref| / max |ref|; bf16 output rounding alone is ~4e-3
PEAK_TBPS = 3.0

Timer = Callable[[list[Callable[[], object]], int], float]


def graph_time_us(calls: list[Callable[[], object]], replays: int) -> float:
    """Microseconds per call: ``calls`` captured once into a CUDA graph, replayed ``replays`` times
    (kernels/wq_gluon_tune.graph_us, one timing)."""
    return graph_us(calls, samples=1, replays=replays)


def wall_time_us(calls: list[Callable[[], object]], replays: int) -> float:
    """A stand-in for graph_time_us off the GPU (the interpreter), to exercise the sweep's code."""
    t0 = time.perf_counter()
    for _ in range(replays):
        for call in calls:
            call()
    return (time.perf_counter() - t0) * 1e6 / (replays * len(calls))


def config_label(cfg: tuple) -> str:
    bm, bn, bk, split_k, warps, stages = cfg
    return f"{bm}x{bn}x{bk} split{split_k} w{warps} s{stages}"


def measure(label: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor],
            ref: torch.Tensor, timer: Timer, replays: int) -> dict:
    """One row: ``fn(weight)`` checked on weights[0] against ``ref``, then timed over all weights."""
    m, k = x.shape
    n = weights[0].shape[0]
    row = dict(m=m, n=n, k=k, config=label)
    try:
        err = ((fn(weights[0]).float() - ref).abs().max() / ref.abs().max()).item()
        us = timer([functools.partial(fn, w) for w in weights], replays)
    except Exception as e:  # a config the compiler or the launch refuses
        return dict(row, error=f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}")
    weight_bytes = weights[0].numel() * weights[0].element_size()
    return dict(row, us=us, tbps=weight_bytes / us / 1e6, tflops=2 * m * n * k / us / 1e6, err=err,
                ok=math.isfinite(err) and err <= MAX_ERR)


def bench_case(m: int, n: int, k: int, configs: list[tuple], device: torch.device, timer: Timer = graph_time_us,
               replays: int = 50, rotate_bytes: float = ROTATE_BYTES, dtype: torch.dtype = DTYPE) -> list[dict]:
    """cuBLAS, then each config, on x [m, k] and fresh random weights [n, k]."""
    copies = max(1, math.ceil(rotate_bytes / (n * k * torch.finfo(dtype).bits / 8)))
    x = torch.randn(m, k, device=device).to(dtype)
    weights = [(torch.randn(n, k, device=device) * k**-0.5).to(dtype) for _ in range(copies)]
    ref = F.linear(x.float(), weights[0].float())
    rows = [measure("cublas", lambda w: F.linear(x, w), x, weights, ref, timer, replays)]
    for cfg in configs:
        bm, bn, bk, split_k, warps, stages = cfg
        fn = functools.partial(tiled_matmul, x, block_m=bm, block_n=bn, block_k=bk, split_k=split_k,
                               num_warps=warps, num_stages=stages)
        rows.append(measure(config_label(cfg), lambda w, fn=fn: fn(w), x, weights, ref, timer, replays))
    return rows


def format_row(shape: str, row: dict) -> str:
    head = f"M={row['m']:4d} {shape:8s} {row['config']:26s}"
    if "error" in row:
        return f"{head} FAILED {row['error']}"
    flag = "" if row["ok"] else f"  BAD (err > {MAX_ERR})"
    return (f"{head} {row['us']:8.2f} us {row['tbps']:5.2f} TB/s {row['tflops']:6.1f} TFLOP/s "
            f"err={row['err']:.1e}{flag}")


def summary(rows: list[dict]) -> list[str]:
    """Per (M, projection): the best correct Triton config against cuBLAS."""
    lines = [f"{'M':>4} {'shape':8} {'floor us':>8} {'cublas us':>9} {'best triton':26} {'us':>8} {'triton/cublas':>13}"]
    for (m, shape) in dict.fromkeys((r["m"], r["shape"]) for r in rows):
        case = [r for r in rows if (r["m"], r["shape"]) == (m, shape) and "us" in r]
        cublas = next((r for r in case if r["config"] == "cublas"), None)
        triton = [r for r in case if r["config"] != "cublas" and r["ok"]]
        if cublas is None or not triton:
            lines.append(f"{m:4d} {shape:8} (no cuBLAS or no correct Triton config)")
            continue
        best = min(triton, key=lambda r: r["us"])
        floor = cublas["n"] * cublas["k"] * 2 / PEAK_TBPS / 1e6
        lines.append(f"{m:4d} {shape:8} {floor:8.2f} {cublas['us']:9.2f} {best['config']:26} {best['us']:8.2f} "
                     f"{best['us'] / cublas['us']:13.2f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 192, 256])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", type=Path, help="write every row as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gemm_sweep.py needs a CUDA GPU: it times cuBLAS and the Triton GEMM there", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    device = torch.device("cuda")
    rows = []
    for m in args.rows:
        for shape in args.shapes:
            n, k = SHAPES[shape]
            for row in bench_case(m, n, k, CANDIDATES, device, replays=args.replays):
                row["shape"] = shape
                rows.append(row)
                print(format_row(shape, row), flush=True)
            torch.cuda.empty_cache()
    print("\n".join(["", *summary(rows)]))
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    triton=triton.__version__, replays=args.replays,
                    rotate_bytes=ROTATE_BYTES, date=datetime.datetime.now().isoformat(timespec="seconds"))
        args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
