"""N-gram drafting policies replayed offline over recorded greedy answers: what a drafter change
would buy, in seconds instead of a benchmark run per idea.

Greedy speculation is exact: the answer is the plain run's whatever is drafted, so a drafter's
effect is fixed by the answer alone. `--record` runs the target plainly over the workloads of
benchmarks/data/speculative_workloads.jsonl (prompt and answer token ids), then times the real
engine's steps by how many rows they carry (an n-gram run at k = 8 without back-off); `--replay`
walks each answer as the engine would (propose from prompt + answer so far, accept the longest
matching prefix, one token more) and prices every step with the recorded time for its rows.

    python benchmarks/spec_replay.py --record docs/results/spec_traces_qwen1.5b_cpu.json [--max-tokens 192]
        [--dtype bfloat16] [--quantization auto] [--traces EARLIER.json]   # --traces: its answers, new step times
    python benchmarks/spec_replay.py --replay docs/results/spec_traces_qwen1.5b_cpu.json

Replayed speed-up = the answer's tokens at the one-row step time / the sum of the replayed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA = REPO / "benchmarks" / "data" / "speculative_workloads.jsonl"


def ngram(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """The engine's own n-gram proposal (worker/engine/speculative.NgramDrafter) for these tokens."""
    from worker.engine.speculative import NgramDrafter

    return NgramDrafter(min_n, max_n).propose(SimpleNamespace(token_ids=tokens), k)


def adaptive_k(rate: float, k_max: int, cost: dict[int, float]) -> int:
    """The k of most expected tokens per second at a per-draft acceptance ``rate``: a step of k
    drafts emits 1 + rate + .. + rate^k tokens (each accepted only if those before were) and
    costs cost[k + 1]."""
    return max(range(k_max + 1), key=lambda k: sum(rate ** j for j in range(k + 1)) / cost[k + 1])


def replay(prompt: list[int], answer: list[int], cost: dict[int, float], k: int, backoff: int,
           min_n: int = 1, max_n: int = 4, oracle: bool = False, adaptive: bool = False) -> dict:
    """One answer's steps under a policy: ``backoff`` fully rejected drafts in a row before sitting
    out 1, 2, 4 .. 16 steps (0: never), as llm_engine._accept does; ``oracle``: the drafter knows
    the answer (the bound for k); ``adaptive``: up to k drafts, as many as ``adaptive_k`` picks
    for the answer's acceptance so far (a running mean of accepted / drafted, starting at 0.5 and
    drifting back to it while nothing is drafted)."""
    i, seconds, steps, drafted, accepted, skip, misses = 1, 0.0, 0, 0, 0, 0, 0
    rate = 0.5
    while i < len(answer):
        room = len(answer) - i - 1
        draft = []
        want = adaptive_k(rate, k, cost) if adaptive else k
        if skip:
            skip -= 1
        elif min(want, room) > 0:
            draft = (answer[i:i + min(want, room)] if oracle
                     else ngram(prompt + answer[:i], min(want, room), min_n, max_n))
        n = 0
        while n < len(draft) and draft[n] == answer[i + n]:
            n += 1
        seconds += cost[1 + len(draft)]
        steps += 1
        if draft:
            drafted, accepted = drafted + len(draft), accepted + n
            rate = 0.8 * rate + 0.2 * (n / len(draft))
            misses = misses + 1 if n == 0 else 0
            if backoff and misses >= backoff:
                skip = min(2 ** (misses - backoff), 16)
        elif adaptive and want == 0:  # no draft, no news: drift back toward the prior, to try again
            rate = 0.9 * rate + 0.1 * 0.5
        i += n + 1
    return {"tokens": len(answer) - 1, "seconds": seconds, "steps": steps, "drafted": drafted, "accepted": accepted}


def record(args) -> None:
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams
    import worker.engine.llm_engine as llm_engine

    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_bytes=1 << 30, max_num_seqs=1, dtype=args.dtype,
                                    quantization=args.quantization, speculative="ngram", num_speculative_tokens=8))
    # --traces: an earlier record's answers (greedy answers move little with the weights' form;
    # the replay then prices them with this configuration's step times)
    if args.traces:
        traces = json.loads(Path(args.traces).read_text())["traces"]
    else:
        traces = []
        for row in rows:
            prompt = engine.tokenize(messages=[{"role": "user", "content": row["prompt"]}])
            engine.block_manager.reset_prefix_cache()
            answer = engine.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                                              speculative=False))[0]
            traces.append({"workload": row["workload"], "prompt": prompt, "answer": answer})
            print(f"{row['workload']}: {len(prompt)} prompt tokens, {len(answer)} answer tokens", flush=True)
    # Step times by rows: an n-gram run at k = 8 that never backs off, on the code prompts.
    backoff = llm_engine.SPEC_MISSES_BEFORE_BACKOFF
    llm_engine.SPEC_MISSES_BEFORE_BACKOFF = 10**9
    by_rows: dict[int, list[float]] = defaultdict(list)
    schedule = engine.scheduler.schedule
    last = {}

    def recording(*a, **kw):
        batch, overflow = schedule(*a, **kw)
        last["rows"] = sum(it.num_new_tokens for it in batch)
        return batch, overflow

    engine.scheduler.schedule = recording
    try:
        for tr in [t for t in traces if t["workload"] == "code"][: args.cost_prompts]:
            engine.add_request(tr["prompt"], SamplingParams(max_tokens=args.max_tokens, temperature=0))
            steps = 0
            while engine.has_unfinished():
                t0 = time.perf_counter()
                engine.step()
                steps += 1
                if steps > 2:  # past the prefill
                    by_rows[last["rows"]].append(time.perf_counter() - t0)
    finally:
        llm_engine.SPEC_MISSES_BEFORE_BACKOFF = backoff
        engine.scheduler.schedule = schedule
    cost = {r: statistics.median(v) for r, v in sorted(by_rows.items()) if r <= 9}
    for r, v in cost.items():
        print(f"{r} rows: {v * 1e3:.1f} ms (median of {len(by_rows[r])})", flush=True)
    Path(args.record).write_text(json.dumps({"model": args.model, "quantization": args.quantization,
                                             "dtype": args.dtype, "cost_s": cost, "traces": traces}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", metavar="OUT")
    ap.add_argument("--replay", metavar="FILE")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--traces", metavar="FILE", help="with --record: time steps only, over this record's answers")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--cost-prompts", type=int, default=3)
    args = ap.parse_args()
    if args.record:
        record(args)
        return
    data = json.loads(Path(args.replay).read_text())
    cost = {int(r): s for r, s in data["cost_s"].items()}
    missing = [r for r in range(1, 10) if r not in cost]  # rows no step happened to carry: interpolate
    for r in missing:
        below, above = max(x for x in cost if x < r), min((x for x in cost if x > r), default=None)
        cost[r] = cost[below] if above is None else cost[below] + (cost[above] - cost[below]) * (r - below) / (above - below)
    print("step time by rows:", ", ".join(f"{r}: {cost[r] * 1e3:.0f} ms" for r in sorted(cost)))
    policies = [("k=2, back-off after 3 (today)", dict(k=2, backoff=3)), ("k=2, no back-off", dict(k=2, backoff=0)),
                ("k=2, back-off after 6", dict(k=2, backoff=6)), ("k=1, no back-off", dict(k=1, backoff=0)),
                ("k=3, no back-off", dict(k=3, backoff=0)), ("k=4, no back-off", dict(k=4, backoff=0)),
                ("k=6, no back-off", dict(k=6, backoff=0)), ("k=8, no back-off", dict(k=8, backoff=0)),
                ("k=2, n 1-8, no back-off", dict(k=2, backoff=0, max_n=8)),
                ("k=2, n 2-4, no back-off", dict(k=2, backoff=0, min_n=2)),
                ("k<=8 adaptive, no back-off", dict(k=8, backoff=0, adaptive=True)),
                ("k<=8 adaptive, back-off after 3", dict(k=8, backoff=3, adaptive=True)),
                ("k=2, a drafter that knows", dict(k=2, backoff=0, oracle=True)),
                ("k=8, a drafter that knows", dict(k=8, backoff=0, oracle=True))]
    for workload in sorted({t["workload"] for t in data["traces"]}):
        traces = [t for t in data["traces"] if t["workload"] == workload]
        for name, kw in policies:
            parts = [replay(t["prompt"], t["answer"], cost, **kw) for t in traces]
            tokens, seconds = sum(p["tokens"] for p in parts), sum(p["seconds"] for p in parts)
            drafted, accepted = sum(p["drafted"] for p in parts), sum(p["accepted"] for p in parts)
            print(f"{workload:5s} {name:30s} x{tokens * cost[1] / seconds:.2f}  steps {sum(p['steps'] for p in parts):4d}"
                  f"  acceptance {accepted / max(drafted, 1):.2f}")


if __name__ == "__main__":
    main()
