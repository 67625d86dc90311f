"""Engine ablation on CPU: one request stream, measured four ways, each adding one technique.

    naive             one request at a time, no KV cache: every token re-runs the whole sequence
    + KV cache        one request at a time (max_num_seqs=1), paged KV cache, no prefix caching
    + cont. batching  max_num_seqs=32, no prefix caching
    + prefix caching  the same, prefix caching on

Requests share a few long system prompts (a product FAQ, a style guide, a story) and each asks
its own short question; outputs are greedy with ignore_eos, so every configuration generates the
same number of tokens. Run from the repository root:

    HF_HUB_OFFLINE=1 python benchmarks/ablation.py --out ablation.json

It also times a large tensor copy: a batch-1 decode step reads every weight once, so
weight bytes / memory bandwidth is a floor on its time that no engine trick below batching beats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import ScheduledSeq
from worker.engine.sequence import Sequence

SYSTEM_PROMPTS = [
    # A product FAQ
    "You are the support assistant for Brightloom, a smart desk lamp. Answer only from this FAQ; if the "
    "answer is not here, say so and suggest contacting support@brightloom.example. "
    "Q: How do I pair the lamp? A: Hold the touch strip for five seconds until the ring blinks blue, then "
    "open the Brightloom app and tap Add Device. Pairing needs 2.4 GHz Wi-Fi; 5 GHz networks are not "
    "supported. Q: What do the ring colors mean? A: Blue blinking means pairing mode, solid green means "
    "connected, amber means a firmware update is running, and red means the lamp lost its network. "
    "Q: How long is the warranty? A: Two years from purchase for the lamp and one year for the power "
    "adapter. Keep your receipt; the serial number is under the base. Q: Can I set schedules? A: Yes. In "
    "the app, open Routines to set wake-up light, focus sessions of 25 or 50 minutes, and a wind-down "
    "mode that lowers color temperature to 2700 K after sunset. Q: How much power does it use? A: At most "
    "9 watts at full brightness and under half a watt on standby. Q: How do I reset it? A: Unplug it, hold "
    "the touch strip, plug it back in and keep holding for ten seconds until the ring flashes white "
    "three times. A reset erases schedules and Wi-Fi settings but not the firmware. Q: Does it work with "
    "voice assistants? A: Yes, with the major voice assistants through their smart-home skills; link your "
    "Brightloom account in the assistant's app. Keep answers short, friendly and in plain language.",
    # A style guide
    "You are an editor for the Northfield Gazette. Apply this house style guide to everything you write "
    "or review. Headlines use sentence case, never end with a period, and stay under twelve words. Write "
    "numbers one to nine as words and 10 and above as figures, except for ages, percentages and money, "
    "which are always figures: a 7-year-old, 5 percent, $3. Spell out percent in running text; use the % "
    "sign only in tables. Dates are written as March 4, 2024, without ordinal suffixes; days of the week "
    "are used only for events within the coming seven days. Use the serial comma. Prefer active voice and "
    "short sentences; a paragraph in a news story has at most three sentences. Attribute quotes with said, "
    "placed after the name: 'The bridge will reopen in May,' Mayor Lin said. Do not use courtesy titles "
    "such as Mr. or Ms.; use full name on first reference and surname afterwards. Avoid jargon, clichés "
    "and exclamation marks. Abbreviations are spelled out on first use with the short form in "
    "parentheses, except for widely known ones such as NASA and FBI. Corrections are published on page "
    "two and state plainly what was wrong and what is right. When unsure, choose the simpler word and "
    "explain your edits in one sentence each.",
    # A story
    "You are a storyteller for children aged eight to ten. Continue or discuss only this story, keep its "
    "tone warm and a little funny, and never add anything frightening. The story so far: On the edge of "
    "the village of Millbrook stood a windmill that had not turned in forty years. Its only resident was "
    "Pip, a mouse who collected buttons and kept a careful list of every one of them in a notebook made "
    "from a matchbox. One autumn morning a gust of wind shook the sails, and to everyone's surprise they "
    "began to creak and turn. Flour dust from long ago rose in clouds, and Pip sneezed so hard that her "
    "spectacles flew into the grain chute. Following them down, she found a tunnel nobody had seen, lined "
    "with old lanterns and drawings of the stars. At the end of it sat a tortoise named Orla, who said she "
    "had been the miller's friend and had waited all these years for the sails to move again, because "
    "that was the signal that the village needed help. The river had been drying up all summer, and the "
    "miller had once built a secret sluice gate that could bring water back to the fields. Orla knew where "
    "the gate was but was far too slow to reach it before the first frost, and Pip was far too small to "
    "turn its iron wheel alone. Together they set off, with the button notebook, a ball of string, and a "
    "map drawn on the back of a seed packet.",
]

QUESTIONS = [
    ["My lamp's ring is amber, what is happening?", "Can I use it on a 5 GHz network?",
     "How long is the adapter covered?", "How do I set a focus session?", "Where is the serial number?",
     "What does a reset erase?", "How much power does it draw on standby?", "Can I control it by voice?"],
    ["Fix this headline: 'Council Approves New Park!'", "How should I write 8 percent in a story?",
     "Is 'Mr. Smith said' correct on second reference?", "How do I write the date 2024-03-04?",
     "When may I use the % sign?", "Should 'seven apples' be '7 apples'?",
     "How long may a news paragraph be?", "How do I introduce the abbreviation for World Health Organization?"],
    ["What happens when Pip and Orla reach the river?", "Why did the sails start turning?",
     "Describe the tunnel under the windmill.", "What does Pip keep in her notebook?",
     "How will they turn the iron wheel?", "Who was the miller?", "What is drawn on the seed packet map?",
     "Write the next paragraph of the story."],
]

DEFAULT_MAX_NUM_SEQS = 32


@dataclass
class Request:
    rid: str
    system: int  # which shared system prompt
    prompt_ids: list[int]
    arrival: float  # seconds after the stream starts


@dataclass
class Record:
    """One request's measured life; times are time.monotonic()."""

    arrival: float
    num_prompt: int
    first: float | None = None
    finish: float | None = None
    num_cached: int = 0
    tokens: list[int] = field(default_factory=list)


def build_workload(engine: LLMEngine, n: int, rate: float | None, seed: int) -> list[Request]:
    """``n`` (system prompt, question) pairs in a seeded order, arriving offline or as Poisson at ``rate``."""
    rng = random.Random(seed)
    pairs = [(s, q) for s in range(len(SYSTEM_PROMPTS)) for q in range(len(QUESTIONS[s]))]
    rng.shuffle(pairs)
    requests, t = [], 0.0
    for i in range(n):
        s, q = pairs[i % len(pairs)]
        question = QUESTIONS[s][q] + ("" if i < len(pairs) else f" (asked again, #{i // len(pairs)})")
        ids = engine.tokenize(messages=[{"role": "system", "content": SYSTEM_PROMPTS[s]},
                                        {"role": "user", "content": question}])
        if rate:
            t += rng.expovariate(rate)
        requests.append(Request(f"req-{i}", s, ids, t))
    return requests


def ideal_hit_rate(workload: list[Request], block_size: int) -> float:
    """The prefix-cache hit rate if every earlier prompt were cached whole before the next arrives.

    Per request: its longest common prefix with any earlier prompt, in whole blocks, held one
    token short of the prompt like the engine's lookup.
    """
    hits, seen = 0, []
    for r in sorted(workload, key=lambda r: r.arrival):
        common = max((len(os.path.commonprefix([r.prompt_ids, p])) for p in seen), default=0)
        hits += min(common, len(r.prompt_ids) - 1) // block_size * block_size
        seen.append(r.prompt_ids)
    return hits / sum(len(r.prompt_ids) for r in workload)


def run_engine(engine: LLMEngine, workload: list[Request], params: SamplingParams) -> tuple[dict[str, Record], float]:
    """Feed the stream to the engine as requests arrive; per-request records and the makespan."""
    pending = deque(sorted(workload, key=lambda r: r.arrival))
    records: dict[str, Record] = {}
    start = time.monotonic()
    while pending or engine.has_unfinished():
        now = time.monotonic()
        while pending and start + pending[0].arrival <= now:
            r = pending.popleft()
            engine.add_request(r.prompt_ids, params, request_id=r.rid, arrival_time=start + r.arrival)
            records[r.rid] = Record(start + r.arrival, len(r.prompt_ids))
        if not engine.has_unfinished():
            time.sleep(max(0.0, start + pending[0].arrival - time.monotonic()))
            continue
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            rec = records[out.request_id]
            if out.new_token_ids and rec.first is None:
                rec.first = now
            rec.tokens += out.new_token_ids
            if out.finished:
                if out.error:
                    raise RuntimeError(f"{out.request_id} failed: {out.error}")
                rec.finish = now
                rec.num_cached = out.usage.cached_tokens
    return records, max(r.finish for r in records.values()) - start


def run_naive(engine: LLMEngine, workload: list[Request], params: SamplingParams) -> tuple[dict[str, Record], float]:
    """One request at a time, each token from a fresh prefill over prompt + output so far.

    It goes through the same model runner as the engine (same kernels, same sampler), but with a
    throwaway sequence whose computed-token count is reset to 0 before every forward, so nothing
    computed for earlier tokens is ever reused: full recompute, O(length) work per token.
    """
    records: dict[str, Record] = {}
    start = time.monotonic()
    for r in sorted(workload, key=lambda r: r.arrival):
        time.sleep(max(0.0, start + r.arrival - time.monotonic()))
        rec = records[r.rid] = Record(start + r.arrival, len(r.prompt_ids))
        seq = Sequence(r.rid, list(r.prompt_ids), params)
        seq.block_table = list(range(engine.block_manager.blocks_needed(len(r.prompt_ids) + params.max_tokens)))
        for _ in range(params.max_tokens):
            seq.num_computed_tokens = 0
            [(token, _)], _ = engine.runner.run([ScheduledSeq(seq, seq.num_tokens)])
            seq.token_ids.append(token)
            rec.tokens.append(token)
            if rec.first is None:
                rec.first = time.monotonic()
        rec.finish = time.monotonic()
    return records, max(r.finish for r in records.values()) - start


def summarize(name: str, records: dict[str, Record], makespan: float, engine: LLMEngine | None) -> dict:
    recs = list(records.values())
    ttft = np.array([r.first - r.arrival for r in recs])
    tpot = np.array([(r.finish - r.first) / (len(r.tokens) - 1) for r in recs if len(r.tokens) > 1])
    e2e = np.array([r.finish - r.arrival for r in recs])
    out_tokens = sum(len(r.tokens) for r in recs)
    prompt_tokens = sum(r.num_prompt for r in recs)
    cached = sum(r.num_cached for r in recs)
    return {
        "config": name,
        "requests": len(recs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "makespan_s": makespan,
        "output_tok_per_s": out_tokens / makespan,
        "requests_per_s": len(recs) / makespan,
        "ttft_s": {f"p{p}": float(np.percentile(ttft, p)) for p in (50, 90, 99)},
        "tpot_ms": {f"p{p}": float(np.percentile(tpot, p)) * 1e3 for p in (50, 90)},
        "e2e_s": {"p50": float(np.percentile(e2e, 50))},
        "prefix_hit_rate": cached / prompt_tokens,
        "preemptions": engine.scheduler.num_preemptions if engine else 0,
        "engine_prefix_hit_rate": engine.stats().prefix_hit_rate if engine else 0.0,
    }


def copy_bandwidth_gbs(mib: int = 256, repeats: int = 7) -> float:
    """Best-of-N large tensor copy, counting bytes read plus bytes written (the STREAM convention)."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def linear_pass_ms(model: torch.nn.Module, repeats: int = 7) -> float:
    """Best time of one token through every Linear layer alone (lm_head included, which reads the
    tied embedding): the weight stream of a batch-1 decode step without attention or the engine."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, m.in_features, dtype=m.weight.dtype) for m in linears]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for m, x in zip(linears, inputs):
                m(x)
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def machine() -> dict:
    model_name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model_name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpus": len(os.sched_getaffinity(0)), "cpu_model": model_name, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "loadavg_at_end": os.getloadavg()}


def print_table(rows: list[dict]) -> None:
    head = ("config", "reqs", "out tok/s", "req/s", "TTFT p50 s", "p90", "p99", "TPOT p50 ms", "p90",
            "E2E p50 s", "prefix hit", "cores busy")
    lines = [head] + [
        (r["config"], str(r["requests"]), f"{r['output_tok_per_s']:.1f}", f"{r['requests_per_s']:.3f}",
         f"{r['ttft_s']['p50']:.2f}", f"{r['ttft_s']['p90']:.2f}", f"{r['ttft_s']['p99']:.2f}",
         f"{r['tpot_ms']['p50']:.0f}", f"{r['tpot_ms']['p90']:.0f}", f"{r['e2e_s']['p50']:.2f}",
         f"{r['prefix_hit_rate']:.1%}", f"{r.get('cpu_cores_busy', 0):.2f}")
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]

    def fmt(line: tuple[str, ...]) -> str:  # a Markdown table row: first column left, numbers right
        cells = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
        return "| " + " | ".join(cells) + " |"

    print(fmt(head))
    print("|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|")
    for line in lines[1:]:
        print(fmt(line))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--naive-requests", type=int, default=6, help="the naive run takes the first N of the stream")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals in req/s (default: all at t=0)")
    ap.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantization", default="none",
                    help="weights: none (the GGUF dequantized, as recorded) or auto (packed, the serving default)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    t = time.monotonic()
    base = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization, enable_prefix_caching=False))
    print(f"model loaded in {time.monotonic() - t:.1f}s", file=sys.stderr)
    bw_start = copy_bandwidth_gbs()
    workload = build_workload(base, args.requests, args.rate, args.seed)
    bs = base.block_manager
    # Enough blocks for the whole stream at once: preemption is not what this ablation measures.
    num_blocks = sum(bs.blocks_needed(len(r.prompt_ids) + args.max_tokens) for r in workload) + 4

    def engine(**overrides) -> LLMEngine:
        return LLMEngine(EngineConfig(model=args.model, quantization=args.quantization, num_kv_blocks=num_blocks,
                                      **overrides),
                         tokenizer=base.tokenizer, model=base.model)

    # Warm up every kernel path outside any measurement (the first prefill costs seconds more than
    # the next): full and chunked prefills, a prefill over a cached prefix, batched decodes.
    warm = [r.prompt_ids for r in workload[:3]]
    engine(enable_prefix_caching=True).generate(warm + warm[:1], SamplingParams(max_tokens=4, temperature=0,
                                                                                ignore_eos=True))

    naive_load = workload[: args.naive_requests]
    configs = [
        (f"naive (first {len(naive_load)})", None, naive_load),
        ("+ KV cache (batch 1)", dict(max_num_seqs=1, enable_prefix_caching=False), workload),
        (f"+ continuous batching ({args.max_num_seqs})",
         dict(max_num_seqs=args.max_num_seqs, enable_prefix_caching=False), workload),
        ("+ prefix caching", dict(max_num_seqs=args.max_num_seqs, enable_prefix_caching=True), workload),
    ]
    rows, tokens = [], {}
    for name, overrides, load in configs:
        t, cpu = time.monotonic(), time.process_time()
        if overrides is None:
            eng = engine(max_num_seqs=1, enable_prefix_caching=False)
            records, makespan = run_naive(eng, load, params)
            eng = None
        else:
            eng = engine(**overrides)
            records, makespan = run_engine(eng, load, params)
            eng.check_integrity()
        rows.append(summarize(name, records, makespan, eng))
        # Cores this process kept busy: well under torch's thread count means another job took the CPU
        # (or the run waited on arrivals), and the timings are not clean.
        rows[-1]["cpu_cores_busy"] = (time.process_time() - cpu) / (time.monotonic() - t)
        tokens[name] = {rid: r.tokens for rid, r in records.items()}
        print(f"{name}: {time.monotonic() - t:.1f}s, {rows[-1]['cpu_cores_busy']:.2f} cores busy", file=sys.stderr)

    # The baseline must compute the same thing: greedy tokens equal to the KV-cache run's.
    names = [c[0] for c in configs]
    first = workload[0].rid
    assert tokens[names[0]][first] == tokens[names[1]][first], "naive and KV-cache greedy tokens differ"
    same = {n: sum(tokens[n][rid] == tokens[names[1]][rid] for rid in tokens[n]) for n in names}

    n_params = sum(p.numel() for p in base.model.parameters())  # tied embeddings counted once
    weight_bytes = sum(p.numel() * p.element_size() for p in base.model.parameters())
    # Best of both ends of the run: on a shared host it moves with the neighbours, and a floor wants the best case.
    bw_end = copy_bandwidth_gbs()
    bw = max(bw_start, bw_end)
    floor_ms = weight_bytes / (bw * 1e9) * 1e3
    linears_ms = linear_pass_ms(base.model)
    kv_tpot = rows[1]["tpot_ms"]["p50"]

    print_table(rows)
    ideal = ideal_hit_rate(workload, bs.block_size)
    print(f"\nprefix hit rate if every earlier prompt were cached on arrival: {ideal:.1%}")
    print("tokens identical to the KV-cache run: " + ", ".join(f"{n}: {same[n]}/{len(tokens[n])}" for n in names))
    print(f"weights: {n_params / 1e6:.1f}M params, {weight_bytes / 1e6:.0f} MB fp32; copy bandwidth "
          f"{bw_start:.1f} GB/s at start, {bw_end:.1f} at end (read+write); batch-1 decode floor {floor_ms:.1f} "
          f"ms/token; the Linear layers alone at batch 1 {linears_ms:.1f} ms; KV-cache TPOT p50 {kv_tpot:.1f} ms "
          f"= {kv_tpot / floor_ms:.1f}x the floor")
    if args.out:
        result = {
            "args": vars(args), "machine": machine(), "results": rows, "tokens_identical_to_kv_cache_run": same,
            "model_params": n_params, "weight_bytes": weight_bytes,
            "copy_bandwidth_gbs": {"start": bw_start, "end": bw_end},
            "decode_floor_ms_per_token": floor_ms, "ideal_prefix_hit_rate": ideal,
            "linear_layers_batch1_ms": linears_ms,
            "workload": [{"rid": r.rid, "system": r.system, "arrival": r.arrival, "prompt_tokens": len(r.prompt_ids)}
                         for r in workload],
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
