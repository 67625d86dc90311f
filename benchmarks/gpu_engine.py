"""The engine on one GPU with a Llama-3.1-8B-shaped model (random bf16 weights), against the
memory-bandwidth floor and against Hugging Face transformers on the same machine and workload.

    python benchmarks/gpu_engine.py --part ours --out ours.json   # (a), (b), (c) for kvcascade
    python benchmarks/gpu_engine.py --part hf --out hf.json       # (a), (b) for transformers

(a) batch 1, prompt 512, 128 new tokens: time per output token (CUDA graphs, and eager as the
    baseline of the same run); floor = weight bytes / measured copy bandwidth.
(b) offline throughput: 256 requests, prompt and output lengths uniform in [100, 1024], EOS
    ignored, seed 0: output tok/s, and the floor computed from the same workload: every decode
    step reads the weights and every live KV byte at the measured bandwidth (all requests
    running at once, the best case), prefill at the measured matmul rate.
(c) TTFT of a 2,000-token prompt whose first 1,900 tokens are cached, against uncached.
The two parts run as separate processes so each has the GPU's memory to itself.
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRESET = "llama-3.1-8b"


def measure_ceilings(device) -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate, on random data."""
    n = 2 * 2**30 // 2  # 2 GiB of bf16
    a = torch.randn(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    bw = 2 * a.numel() * 2 / sorted(times)[len(times) // 2]
    del a, b
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        x @ y
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start.record()
        x @ y
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    flops = 2 * m**3 / sorted(times)[len(times) // 2]
    del x, y
    torch.cuda.empty_cache()
    return {"copy_bandwidth_Bps": bw, "bf16_matmul_flops": flops}


def shape_numbers():
    from worker.models.config import PRESETS, ModelConfig

    cfg = ModelConfig(**PRESETS[PRESET])
    h, i, L, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    kv = cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    params = L * per_layer + 2 * v * h + h
    kv_bytes_per_token = 2 * L * kv * 2
    return cfg, params, kv_bytes_per_token


def workload_b(seed: int = 0, n: int = 256):
    rng = random.Random(seed)
    return [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(n)]


def floor_b(work, params, kv_per_token, ceilings) -> float:
    """Seconds: all requests decode together; step t reads the weights and the KV of live ones."""
    bw, flops = ceilings["copy_bandwidth_Bps"], ceilings["bf16_matmul_flops"]
    weight_bytes = 2 * params
    t = sum(2 * params * p for p, _ in work) / flops  # prefill: 2 FLOP per parameter per token
    for step in range(max(o for _, o in work)):
        live = [(p, o) for p, o in work if o > step]
        t += (weight_bytes + sum((p + step) * kv_per_token for p, _ in live)) / bw
    return t


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


# --- kvcascade -------------------------------------------------------------------------------------


def run_ours(args) -> dict:
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams

    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    cfg, params, kv_per_token = shape_numbers()
    res = {"ceilings": ceilings, "params": params}
    common = dict(model=f"dummy:{PRESET}", device="cuda", dtype="bfloat16", max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.budget, max_num_seqs=256, gpu_memory_utilization=0.9,
                  freeze_gc=not args.no_gc_freeze, **({} if args.graph_step is None else {"cuda_graph_step": args.graph_step}))
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(**common))
    res["startup_s"] = time.perf_counter() - t0
    res["kv_blocks"] = engine.block_manager.num_blocks
    rng = random.Random(0)

    def tpot(eng, prompt_len=512, new=128) -> float:
        eng.add_request(random_prompt(rng, prompt_len, cfg.vocab_size),
                        SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, detokenize=False))
        stamps = []
        while eng.has_unfinished():
            if eng.step():
                stamps.append(time.perf_counter())
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    tpot(engine, 64, 8)  # warm-up
    if args.only_b:  # the prefill shapes' warm-up that (c) otherwise gives
        engine.generate([random_prompt(rng, 2000, cfg.vocab_size) for _ in range(2)],
                        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False))
    else:
        res["a_tpot_graphs_s"] = min(tpot(engine) for _ in range(3))
        engine.config.async_scheduling = False  # the baseline of the same run: no lookahead
        res["a_tpot_graphs_no_lookahead_s"] = min(tpot(engine) for _ in range(3))
        engine.config.async_scheduling = True
        eager = LLMEngine(EngineConfig(**common, cuda_graphs=False, num_kv_blocks=256), tokenizer=engine.tokenizer,
                          model=engine.model)
        tpot(eager, 64, 8)
        res["a_tpot_eager_s"] = min(tpot(eager) for _ in range(2))
        del eager
        torch.cuda.empty_cache()
        res["a_floor_s"] = 2 * params / ceilings["copy_bandwidth_Bps"]  # the floor: all weight bytes
        # What a decode step must read: every weight but the embedding table (one row of it is read).
        res["a_floor_read_s"] = 2 * (params - cfg.vocab_size * cfg.hidden_size) / ceilings["copy_bandwidth_Bps"]
    if args.only_a:
        return res

    if not args.only_b:
        res.update(ttft_c(engine, rng, cfg))

    # (b) offline throughput, with the lookahead and without it (the same run's baseline).
    work = workload_b()
    brng = random.Random(1)  # its own: the same prompts whichever parts ran before
    prompts = [random_prompt(brng, p, cfg.vocab_size) for p, _ in work]

    def throughput(lookahead: bool, log_steps: bool = False) -> dict:
        engine.config.async_scheduling = lookahead
        engine.block_manager.reset_prefix_cache()
        preempted = engine.scheduler.num_preemptions
        steps_log = StepLog(engine.runner) if log_steps else None
        t = time.perf_counter()
        for prompt, (_, out) in zip(prompts, work):
            engine.add_request(prompt, SamplingParams(max_tokens=out, temperature=0, ignore_eos=True, detokenize=False))
        generated = steps = 0
        while engine.has_unfinished():
            generated += sum(len(o.new_token_ids) for o in engine.step())
            steps += 1
        wall = time.perf_counter() - t
        out = {"output_tokens": generated, "wall_s": wall, "tok_s": generated / wall, "steps": steps,
               "preemptions": engine.scheduler.num_preemptions - preempted}
        if steps_log is not None:
            out["breakdown"] = steps_log.breakdown(params, kv_per_token, ceilings)
            out["gc_pauses"] = [(g, round(t * 1e3, 3)) for g, t in steps_log.gc_pauses]
            out["per_step"] = steps_log.per_step  # [prefill tokens, decodes, interval ms, forward ms]
        return out

    if args.only_b:  # compile what (b)'s mixed steps launch (the no-lookahead run does it otherwise)
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, detokenize=False))
        while engine.has_unfinished():
            engine.step()
    no_lookahead = None if args.only_b else throughput(False)
    for key, value in throughput(True, args.steps).items():
        res[f"b_{key}"] = value
    for key, value in (no_lookahead or {}).items():
        res[f"b_no_lookahead_{key}"] = value
    res["b_floor_s"] = floor_b(work, params, kv_per_token, ceilings)
    res["b_floor_tok_s"] = sum(o for _, o in work) / res["b_floor_s"]
    return res


class StepLog:
    """Per launched step of (b): what it held (prefill tokens, decodes, context tokens read) and
    its device time, from CUDA events recorded around each step's forward pass. A step's interval
    runs from the end event of the step before, so it includes any idle gap the host left and the
    previous step's sampling and input copies; ``forward_s`` is the forward pass alone (start to
    end event: the graph replay, or an eager step's kernels and launch gaps). Costs two events
    and a list append a step."""

    BINS = ((193, 256), (129, 192), (65, 128), (17, 64), (1, 16))

    def __init__(self, runner):
        self.rows: list[tuple[int, int, int]] = []
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        execute = runner.execute

        def logged(inputs, ids=None):
            n, d = len(inputs.input_ids), inputs.num_decodes
            self.rows.append((n - d, d, sum(inputs.context_lens[:d])))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = execute(inputs, ids)
            end.record()
            self.events.append((start, end))
            return out

        runner.execute = logged
        # Collections of Python's cyclic GC during the run: (generation, seconds) each.
        self.gc_pauses: list[tuple[int, float]] = []
        started = [0.0]

        def on_gc(phase, info):
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                self.gc_pauses.append((info["generation"], time.perf_counter() - started[0]))

        gc.callbacks.append(on_gc)

        def restore():
            runner.execute = execute
            if on_gc in gc.callbacks:
                gc.callbacks.remove(on_gc)

        self._restore = restore

    def breakdown(self, params, kv_per_token, ceilings) -> list[dict]:
        """Steps grouped as mixed (prefill tokens in the step) or decode by batch size: device
        seconds against the floor's (weights + the decodes' KV at the copy bandwidth, prefill
        tokens at the matmul rate) and against a roofline that also lets the decode GEMMs be
        compute-bound (2 x params FLOPs a decode row)."""
        self._restore()
        torch.cuda.synchronize()
        bw, flops = ceilings["copy_bandwidth_Bps"], ceilings["bf16_matmul_flops"]
        groups: dict[str, dict] = {}
        for i in range(1, len(self.events)):
            prefill, decodes, ctx = self.rows[i]
            dt = self.events[i - 1][1].elapsed_time(self.events[i][1]) / 1e3
            forward = self.events[i][0].elapsed_time(self.events[i][1]) / 1e3
            weights = 2 * params / bw if decodes else 0.0
            floor = prefill * 2 * params / flops + weights + ctx * kv_per_token / bw
            roof = (prefill * 2 * params / flops + max(weights, decodes * 2 * params / flops)
                    + ctx * kv_per_token / bw)
            if prefill:
                key = "mixed"
            else:
                key = next(f"decode {lo}-{hi}" for lo, hi in self.BINS if lo <= decodes <= hi)
            g = groups.setdefault(key, {"group": key, "steps": 0, "device_s": 0.0, "floor_s": 0.0, "roofline_s": 0.0,
                                        "forward_s": 0.0, "prefill_tokens": 0, "decode_tokens": 0})
            g["steps"] += 1
            g["device_s"] += dt
            g["forward_s"] += forward
            g["floor_s"] += floor
            g["roofline_s"] += roof
            g["prefill_tokens"] += prefill
            g["decode_tokens"] += decodes
        self.per_step = [[p, d, round(self.events[i - 1][1].elapsed_time(self.events[i][1]), 3),
                          round(self.events[i][0].elapsed_time(self.events[i][1]), 3)]
                         for i, (p, d, _) in enumerate(self.rows) if i]
        for gen in range(3):
            pauses = [t for g, t in self.gc_pauses if g == gen]
            if pauses:
                print(f"gc generation {gen}: {len(pauses)} collections, {sum(pauses) * 1e3:.1f} ms in all, "
                      f"longest {max(pauses) * 1e3:.1f} ms", flush=True)
        out = sorted(groups.values(), key=lambda g: g["group"])
        for g in out:
            g["of_floor"] = g["floor_s"] / g["device_s"]
            g["excess_s"] = g["device_s"] - g["floor_s"]
        for g in out:
            print(f"{g['group']:>14}: {g['steps']:5d} steps {g['device_s']:7.3f} s, floor {g['floor_s']:7.3f} s "
                  f"({100 * g['of_floor']:5.1f}%), roofline {g['roofline_s']:7.3f} s, excess {g['excess_s']:6.3f} s, "
                  f"forward {g['forward_s']:7.3f} s",
                  flush=True)
        return out


def ttft_c(engine, rng, cfg) -> dict:
    """(c) prefix-cache TTFT: 1,900 of 2,000 prompt tokens cached vs none."""
    from worker.engine.sampling_params import SamplingParams

    res: dict = {}
    cached_seen: list[int] = []

    def ttft(prompt) -> float:
        t = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        elapsed = time.perf_counter() - t
        cached_seen.append(outs[-1].usage.cached_tokens)
        return elapsed

    for _ in range(2):
        ttft(random_prompt(rng, 2000, cfg.vocab_size))  # warm-up of the prefill shapes
    base = random_prompt(rng, 2000, cfg.vocab_size)
    res["c_ttft_uncached_s"] = min(ttft(random_prompt(rng, 2000, cfg.vocab_size)) for _ in range(3))
    engine.block_manager.reset_prefix_cache()
    ttft(base[:1900] + random_prompt(rng, 100, cfg.vocab_size))  # caches the first 1,900 tokens
    res["c_ttft_cached_1900_s"] = min(ttft(base[:1900] + random_prompt(rng, 100, cfg.vocab_size)) for _ in range(3))
    res["c_ttft_uncached_again_s"] = min(ttft(random_prompt(rng, 2000, cfg.vocab_size)) for _ in range(3))
    res["c_cached_tokens_seen"] = cached_seen
    return res


# --- transformers -----------------------------------------------------------------------------------


def run_hf(args) -> dict:
    import transformers as tf

    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    cfg, params, kv_per_token = shape_numbers()
    hf_cfg = tf.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={**cfg.rope_scaling, "rope_theta": cfg.rope_theta}, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlamaForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    res = {"ceilings": ceilings, "transformers": tf.__version__}
    rng = random.Random(0)
    x = torch.tensor([random_prompt(rng, 512, cfg.vocab_size)], device=device)

    def gen(new, **kw) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    modes = () if args.hf_skip_a else (("static", dict(cache_implementation="static")), ("dynamic", {}))
    for label, kw in modes:
        try:
            for _ in range(2):  # compile / warm up
                gen(128, **kw)
            full = min(gen(128, **kw) for _ in range(2))
            one = min(gen(1, **kw) for _ in range(2))
            res[f"a_tpot_{label}_s"] = (full - one) / 127
        except Exception as exc:  # record, keep going
            res[f"a_tpot_{label}_error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(json.dumps({k: v for k, v in res.items() if k.startswith("a_")}), flush=True)

    if args.hf_requests:
        work = workload_b()[: args.hf_requests]
        prompts = [random_prompt(rng, p, cfg.vocab_size) for p, _ in work]
        gcfg = tf.GenerationConfig(max_new_tokens=max(o for _, o in work), do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
        try:
            t = time.perf_counter()
            with model.continuous_batching_context_manager(generation_config=gcfg, block=True, timeout=30) as mgr:
                ids = [mgr.add_request(p, max_new_tokens=o) for p, (_, o) in zip(prompts, work)]
                done, generated = 0, 0
                while done < len(ids):
                    r = mgr.get_result(timeout=5)
                    if r is not None and r.is_finished():
                        done += 1
                        generated += len(r.generated_tokens)
            wall = time.perf_counter() - t
            res.update(b_requests=len(work), b_output_tokens=generated, b_wall_s=wall, b_tok_s=generated / wall)
        except Exception as exc:
            res["b_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["ours", "hf"], required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--graph-step", type=int, default=None, help="cuda_graph_step: graph sizes above 64 (default: the engine's)")
    ap.add_argument("--only-a", action="store_true", help="kvcascade: only (a)")
    ap.add_argument("--only-b", action="store_true", help="kvcascade: only (b), with the lookahead (no baseline run)")
    ap.add_argument("--no-gc-freeze", action="store_true", help="kvcascade: EngineConfig.freeze_gc=False (the baseline)")
    ap.add_argument("--steps", action="store_true", help="kvcascade: (b)'s device time per kind of step (StepLog)")
    ap.add_argument("--decode-config", default=None, metavar="BLOCK_N,WARPS,STAGES",
                    help="kvcascade: one decode attention tile, warps, stages at every batch (default: the kernel's rule)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="override a module-level tuning constant for this run, e.g. "
                         "kernels.paged_attention.SPLIT_PROGRAMS_PER_SM=8 (an int, a float or a tuple)")
    ap.add_argument("--hf-requests", type=int, default=256, help="requests of workload (b) for transformers")
    ap.add_argument("--hf-skip-a", action="store_true", help="transformers: only workload (b)")
    args = ap.parse_args()
    if args.decode_config:
        from kernels import paged_attention

        n, w, st = (int(v) for v in args.decode_config.split(","))
        paged_attention.DECODE_BLOCK_N, paged_attention.DECODE_NUM_WARPS, paged_attention.DECODE_NUM_STAGES = n, w, st
        paged_attention.DECODE_NARROW = (n, w, st)
    for item in args.set:
        target, value = item.split("=", 1)
        module, name = target.rsplit(".", 1)
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise SystemExit(f"--set {item}: {module} has no {name}")
        setattr(mod, name, ast.literal_eval(value))
    res = run_ours(args) if args.part == "ours" else run_hf(args)
    res.update(part=args.part, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv),
               pdl=os.environ.get("KVCASCADE_PDL", "1") != "0", decode_config=args.decode_config,
               overrides=args.set)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
