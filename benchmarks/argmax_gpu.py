"""The greedy argmax on a CUDA device: kernels/argmax.py against torch's, right and how fast.

    python benchmarks/argmax_gpu.py [--vocab 128256] [--rows 1 8 64 256] [--out argmax.json]

Checks the kernel's index against ``torch.argmax`` on fresh random logits (bf16, fp16, fp32),
on coarse ones with many ties, with NaN and infinities, and replayed from a CUDA graph (its
per-row key and ticket must be left at rest by each launch); then times both (CUDA graph of 20
calls, median over replays, logits rotated over 8 buffers so that not all come from one L2 line set).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.argmax import argmax_rows  # noqa: E402


def check(rows: int, vocab: int, device: torch.device) -> int:
    """Cases checked; raises on the first index that differs from torch's."""
    n = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for trial in range(20):
            x = torch.randn(rows, vocab, device=device).to(dtype) * 4
            if trial % 4 == 1:  # coarse values: many ties
                x = x.round()
            elif trial % 4 == 2:  # the max duplicated in other chunks
                top = x.max(dim=-1, keepdim=True).values
                cols = torch.randint(0, vocab, (rows, 5), device=device)
                x.scatter_(1, cols, top.expand(rows, 5))
            elif trial % 4 == 3:
                x[:, torch.randint(0, vocab, (3,))] = float("inf")
                x[rows // 2, torch.randint(0, vocab, (2,))] = float("nan")
            got, want = argmax_rows(x), x.argmax(dim=-1)
            if not torch.equal(got, want):
                bad = (got != want).nonzero()[:5].flatten().tolist()
                raise AssertionError(f"{dtype} rows {rows} trial {trial}: rows {bad} got {got[bad].tolist()} "
                                     f"want {want[bad].tolist()}")
            n += 1
    # Inside a graph: each replay's launch must find the state the previous one left.
    x = torch.randn(rows, vocab, device=device, dtype=torch.bfloat16)
    argmax_rows(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(x)
    for _ in range(10):
        x.copy_(torch.randn_like(x, dtype=torch.float32).round())
        graph.replay()
        assert torch.equal(out, x.argmax(dim=-1)), "graph replay"
        n += 1
    return n


def time_us(fn, rows: int, vocab: int, device: torch.device, calls: int = 20, reps: int = 200) -> float:
    bufs = [torch.randn(rows, vocab, device=device, dtype=torch.bfloat16) for _ in range(8)]
    for buf in bufs:
        fn(buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(bufs[i % len(bufs)])
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 256])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "vocab": args.vocab, "rows": {}}
    for rows in args.rows:
        cases = check(rows, args.vocab, device)
        torch_us = time_us(lambda x: x.argmax(dim=-1), rows, args.vocab, device)
        kernel_us = time_us(argmax_rows, rows, args.vocab, device)
        res["rows"][rows] = {"checked": cases, "torch_us": torch_us, "kernel_us": kernel_us}
        print(f"rows {rows:4d}: {cases} cases equal to torch; torch {torch_us:7.2f} us, kernel {kernel_us:7.2f} us",
              flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
