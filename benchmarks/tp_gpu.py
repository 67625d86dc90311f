"""Tensor parallelism on GPUs: TP=N against TP=1 on a Llama-3.1-8B-shaped model with random weights.

    python benchmarks/tp_gpu.py --part greedy --tp 1 --out g1.json   # fp32: greedy tokens
    python benchmarks/tp_gpu.py --part greedy --tp 2 --out g2.json
    python benchmarks/tp_gpu.py --compare g1.json g2.json            # equal token for token?
    python benchmarks/tp_gpu.py --part speed --tp 1 --out s1.json    # bf16, CUDA graphs: ms per
    python benchmarks/tp_gpu.py --part speed --tp 2 --out s2.json    #   output token at batch 1, 64
    python benchmarks/tp_gpu.py --part greedy --tp 2 --dump-after 120  # a run that hangs: stacks every 120 s

Ranks start as `kvcascade worker --tp N` starts them (worker/distributed/ranks.LocalRanks: this
process is rank 0, the others its children; the Ray actors run the same run_rank), so the GPU
machine needs no Ray. Random weights come from one seed per full tensor, so every TP size builds
the same model. Greedy equality is checked in fp32: in bf16 a split all-reduce rounds differently
from one matmul and random weights leave near-ties between top logits. Floor per decode step: each
rank reads its share of the weights (plus the live KV, small here) at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "dummy:llama-3.1-8b"


def start_engine(tp: int, dtype: str, max_num_seqs: int):
    from worker.distributed.ranks import LocalRanks
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine

    config = EngineConfig(model=MODEL, device="cuda", dtype=dtype, tensor_parallel_size=tp, max_model_len=2048,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=4096, gpu_memory_utilization=0.85)
    ranks = None
    if tp > 1:
        ranks = LocalRanks(config)
        _rank_groups.append(ranks)
        config = ranks.start()
    return LLMEngine(config), ranks


def stop(engine, ranks) -> None:
    engine.close()
    if ranks is not None:
        ranks.stop()


def greedy(tp: int) -> dict:
    from worker.engine.sampling_params import SamplingParams

    engine, ranks = start_engine(tp, "float32", 16)
    rng = random.Random(0)
    prompts = [[rng.randrange(128000) for _ in range(rng.randint(40, 400))] for _ in range(8)]
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    # Once more after the first pass: prefix-cache hits and a different batch composition.
    again = engine.generate(prompts[:4], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    elapsed = time.perf_counter() - t0
    stop(engine, ranks)
    return {"tp": tp, "tokens": out, "again": again, "seconds": elapsed}


def decode_ms(engine, batch: int, prompt_len: int = 512, new: int = 128) -> float:
    from worker.engine.sampling_params import SamplingParams

    rng = random.Random(batch)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(128000) for _ in range(prompt_len)], params)
    while any(s.num_output_tokens == 0 for s in engine.requests.values()):  # prefills (and their first token)
        engine.step()
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) / steps * 1e3


def copy_bandwidth() -> float:
    import torch

    a = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 2 * 10 / (time.perf_counter() - t0)


def speed(tp: int) -> dict:
    bw = copy_bandwidth()
    engine, ranks = start_engine(tp, "bfloat16", 64)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())  # rank 0's share
    for b in (1, 64):
        decode_ms(engine, b, new=8)  # warm-up
    result = {"tp": tp, "copy_bw_TBps": bw / 1e12, "rank0_weight_GB": weight_bytes / 1e9,
              "floor_ms": weight_bytes / bw * 1e3, "ms_per_token": {b: decode_ms(engine, b) for b in (1, 64)}}
    stop(engine, ranks)
    return result


_rank_groups: list = []  # the LocalRanks started, for dump_stacks_every


def dump_stacks_every(seconds: float) -> None:
    """Rank 0's stacks (faulthandler) and, by SIGUSR1, its child ranks' (worker/distributed/ranks.py)."""
    faulthandler.dump_traceback_later(seconds, repeat=True)

    def children() -> None:
        while True:
            time.sleep(seconds)
            for ranks in _rank_groups:
                for proc in ranks.procs:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGUSR1)

    threading.Thread(target=children, daemon=True).start()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["greedy", "speed"])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2, metavar="JSON")
    parser.add_argument("--dump-after", type=float, default=0, metavar="S",
                        help="after S seconds (and every S after), print every rank's Python stacks: for a run that hangs")
    args = parser.parse_args()
    # Rank 0's progress (shard loaded, engine ready) beside the other ranks' lines.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s rank0 %(name)s: %(message)s")
    if args.dump_after:
        dump_stacks_every(args.dump_after)
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        same = [x == y for x, y in zip(a["tokens"] + a["again"], b["tokens"] + b["again"])]
        print(f"TP={a['tp']} vs TP={b['tp']}: {sum(same)}/{len(same)} sequences equal token for token")
        return 0 if all(same) else 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = greedy(args.tp) if args.part == "greedy" else speed(args.tp)
    text = json.dumps(result, indent=1)
    print(text if args.part == "speed" else json.dumps({k: v for k, v in result.items() if k != "tokens"})[:2000])
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
