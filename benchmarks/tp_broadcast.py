"""What sending one step's inputs from rank 0 to a follower costs (tensor parallelism's step
broadcast): torch's ``broadcast_object_list`` (what the ranks used: a broadcast of the pickled
length, then one of the bytes) against ``TPGroup.broadcast_object`` (the length and the first
bytes in one fixed-size broadcast, any rest in a second), at several first-chunk sizes.

    python benchmarks/tp_broadcast.py [--batches 1 64 256] [--context 1024] [--chunks 4096 16384 65536]
        [--iters 300] [--out FILE]

Two processes on loopback gloo, as a worker's ranks meet. Per step shape (decode steps of
``batch`` sequences at ``context`` tokens, block size 16; and a prefill step of 8k tokens), the
median of ``iters`` round trips: rank 0 sends the step, the follower unpickles it and answers
with one int64; the round trip of a 1-int answer alone is subtracted.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.distributed import group as tp_group  # noqa: E402
from worker.engine.model_runner import StepInputs  # noqa: E402

BLOCK = 16


def decode_step(batch: int, context: int) -> StepInputs:
    blocks = -(-context // BLOCK)
    tables = [[(s * blocks + b) % 50000 for b in range(blocks)] for s in range(batch)]
    return StepInputs(input_ids=[1000 + s for s in range(batch)], positions=[context - 1] * batch,
                      slots=[t[-1] * BLOCK + (context - 1) % BLOCK for t in tables],
                      query_start=list(range(batch + 1)), context_lens=[context] * batch, block_tables=tables,
                      num_decodes=batch, sample_rows=list(range(batch)))


def prefill_step(tokens: int) -> StepInputs:
    return StepInputs(input_ids=list(range(tokens)), positions=list(range(tokens)), slots=list(range(tokens)),
                      query_start=[0, tokens], context_lens=[tokens], block_tables=[list(range(tokens // BLOCK))],
                      num_decodes=0, sample_rows=[tokens - 1])


def worker(rank: int, port: int, shapes: dict, chunks: list[int], iters: int, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cpu_group = dist.new_group(backend="gloo")
    tp = tp_group.TPGroup(rank, 2, dist.group.WORLD, cpu_group)
    ack = torch.zeros(1, dtype=torch.int64)

    def torch_object_list(step):
        box = [step]
        dist.broadcast_object_list(box, src=0, group=cpu_group)
        return box[0]

    methods = [("broadcast_object_list", None, torch_object_list)] + [
        (f"one chunk of {c}", c, tp.broadcast_object) for c in chunks]
    rtt: dict[str, dict[str, float]] = {}
    for method, chunk, send in methods:
        if chunk is not None:
            tp_group.FIRST_CHUNK = chunk
        for name, step in [("ack alone", None)] + list(shapes.items()):
            times = []
            for i in range(iters + 20):
                t0 = time.perf_counter()
                if step is not None:
                    got = send(step if rank == 0 else None)
                    assert len(got.context_lens) == len(step.context_lens)
                dist.broadcast(ack, 1, group=cpu_group)
                if i >= 20:
                    times.append(time.perf_counter() - t0)
            rtt.setdefault(name, {})[method] = statistics.median(times)
    if rank == 0:
        base = rtt.pop("ack alone")
        rows = {name: {"bytes_pickled": len(pickle.dumps(shapes[name], protocol=pickle.HIGHEST_PROTOCOL)),
                       **{m: (t - base[m]) * 1e6 for m, t in r.items()}} for name, r in rtt.items()}
        rows["ack round trip"] = {m: t * 1e6 for m, t in base.items()}
        Path(out).write_text(json.dumps(rows, indent=1))
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--chunks", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default="/tmp/tp_broadcast.json")
    args = ap.parse_args()
    shapes = {f"decode {b} x {args.context}": decode_step(b, args.context) for b in args.batches}
    shapes[f"prefill {args.prefill}"] = prefill_step(args.prefill)
    from contracts.ports import free_port

    mp.spawn(worker, args=(free_port(), shapes, args.chunks, args.iters, args.out), nprocs=2)
    rows = json.loads(Path(args.out).read_text())
    methods = list(rows["ack round trip"])
    print(f"{'µs per step (round trip - ack)':32s}{'pickled bytes':>14s}" + "".join(f"{m:>24s}" for m in methods))
    for name, r in rows.items():
        print(f"{name:32s}{r.get('bytes_pickled', ''):>14}" + "".join(f"{r[m]:24.0f}" for m in methods))


if __name__ == "__main__":
    main()
