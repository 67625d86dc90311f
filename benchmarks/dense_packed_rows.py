"""Packed bf16 CPU projections (worker/models/dense_packed.py): does a row come out with the same
bits alone as among others, and what does a lone row cost as one call and as the first of two?

    python benchmarks/dense_packed_rows.py [--seeds 5] [--rows 16] [--out rows.json]

Per SmolLM2-135M and Qwen2.5-1.5B projection shape (random bf16 weights, ``--seeds`` of them):
for 1..``--rows`` rows, whether each row of one call equals that row computed alone, with the
one-row kernel (``one_row_as_two`` off) and as the module runs it on this CPU; then the median time
of a one-row call and of a two-row call (the weight L3- or DRAM-resident as its size makes it).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from worker.models.dense_packed import PackedDenseWeight, packable

SHAPES = {"smollm2 q/o": (576, 576), "smollm2 gate/up": (1536, 576), "smollm2 down": (576, 1536),
          "smollm2 head": (49152, 576), "qwen1.5b gate_up": (8960, 1536), "qwen1.5b down": (1536, 8960)}


def rows_alone_agree(packed: PackedDenseWeight, x: torch.Tensor) -> list[bool]:
    """For each row count m: every row of one m-row call equals that row computed alone."""
    alone = torch.cat([packed.matmul(x[i:i + 1]) for i in range(x.shape[0])])
    return [torch.equal(packed.matmul(x[:m]), alone[:m]) for m in range(1, x.shape[0] + 1)]


def median_ms(fn, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not packable(torch.zeros(1, 1, dtype=torch.bfloat16)):
        raise SystemExit("no oneDNN bf16 on this CPU: nothing is packed")
    result = {"cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
              "amx": torch.cpu._is_amx_tile_supported(), "threads": torch.get_num_threads(), "shapes": {}}
    print(f"{result['capability']}, AMX {result['amx']}, {result['threads']} threads")
    for name, shape in SHAPES.items():
        disagree = {"one-row kernel": 0, "as run": 0}
        for seed in range(args.seeds):
            gen = torch.Generator().manual_seed(seed)
            packed = PackedDenseWeight((torch.randn(shape, generator=gen) * shape[1] ** -0.5).bfloat16())
            x = torch.randn(args.rows, shape[1], generator=gen).bfloat16()
            as_run = packed.one_row_as_two
            for mode, flag in (("one-row kernel", False), ("as run", as_run)):
                packed.one_row_as_two = flag
                disagree[mode] += rows_alone_agree(packed, x).count(False)
            packed.one_row_as_two = False
            one = median_ms(lambda: packed.matmul(x[:1]))
            two = median_ms(lambda: packed.matmul(x[:2]))
        result["shapes"][name] = dict(shape=shape, one_row_as_two=as_run, row_counts_disagreeing=disagree,
                                      one_row_ms=round(one, 3), two_rows_ms=round(two, 3))
        print(f"{name:18s} {str(shape):13s} row counts (of {args.seeds} x {args.rows}) where a row is not its "
              f"lone self: one-row kernel {disagree['one-row kernel']:3d}, as run {disagree['as run']:3d} "
              f"(one_row_as_two {as_run}); 1 row {one:.3f} ms, 2 rows {two:.3f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
