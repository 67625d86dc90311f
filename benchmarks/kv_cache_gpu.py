"""The quantized KV cache on one GPU: capacity, a workload the pool limits, and decode attention's
time per byte of live KV, for each --kv-cache-dtype in the same run.

    python benchmarks/kv_cache_gpu.py --tokenizer .tok [--dtypes auto fp8 int8] [--kv-gib 8]
        [--requests 128] [--prompt 3000 4000] [--output 256] [--out results.json]
    python benchmarks/kv_cache_gpu.py --decode-operands [--rounds 3] [--out results.json]

Model: dummy:llama-3.1-8b in bf16 (random weights, loaded once and shared by the engines).
(1) Capacity: bytes per KV block and tokens per GiB, and the blocks the engine's own sizing
    (gpu_memory_utilization) gives the pool.
(2) Workload: --requests requests, prompts uniform in --prompt tokens (random ids, seed 0),
    --output new tokens, EOS ignored, all submitted at once to an engine whose pool is --kv-gib
    of KV (the same bytes for every dtype: the quantized pools get more blocks), so the pool, not
    max_num_seqs, bounds the running batch. Output tok/s, wall time, preemptions, mean batch.
(3) Decode attention alone (kernels.paged_decode_attention): batch 64 x 4,096-token contexts,
    32 query / 8 KV heads of 128: ms per call and live KV bytes read per second, against the
    measured copy bandwidth. --decode-operands: only this, for each of --variants (a pool and
    decode's dot operands, paged_attention.DECODE_QUANT_DOTS), interleaved over --rounds, with the
    max abs error against the fp32 reference.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tp_gpu import copy_bandwidth  # noqa: E402
from kernels.kv_quant import KV_CACHE_DTYPES  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.llm_engine import LLMEngine  # noqa: E402
from worker.engine.model_runner import allocate_kv_pool, cuda_kv_blocks, kv_bytes_per_block  # noqa: E402
from worker.models.backends import create_attention_backend  # noqa: E402
from worker.engine.sampling_params import SamplingParams  # noqa: E402

MODEL = "dummy:llama-3.1-8b"


def storage(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "auto" else KV_CACHE_DTYPES[name]


def _decode_pool(name: str, device, batch=64, ctx=4096, heads=32, kv_heads=8, dim=128, bs=16, gaussian=False):
    """A pool of ``batch`` x ``ctx``-token sequences, its tables and a bf16 q. Random bytes (0-119,
    finite values of both int8 and e4m3) with scales U(0.01, 0.02), or with ``gaussian`` normal K/V
    quantized as the engine stores them (and a q of 3 x normal, so the softmax is peaked)."""
    from kernels.kv_quant import quantize_kv

    blocks_per_seq = ctx // bs
    layer = allocate_kv_pool(1, batch * blocks_per_seq, bs, kv_heads, dim, storage(name), device)[0]
    for i, t in enumerate((layer.k, layer.v)):
        if gaussian:
            x = torch.randn(t.shape, device=device)
            if layer.scales is None:
                t.copy_(x)
            else:
                stored, scale = quantize_kv(x, t.dtype)
                t.copy_(stored)
                layer.scales[i].copy_(scale.transpose(1, 2))
        elif t.element_size() == 1:
            t.view(torch.uint8).random_(0, 120)
        else:
            t.normal_()
    if layer.scales is not None and not gaussian:
        for s in layer.scales:
            s.uniform_(0.01, 0.02)
    q = ((3 if gaussian else 1) * torch.randn(batch, heads, dim, device=device)).bfloat16()
    tables = torch.randperm(batch * blocks_per_seq, device=device).view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return layer, q, tables, lens


def decode_attention(name: str, device, pool=None, num_splits=None, reference=None) -> dict:
    """ms per call (5 warm-up, 50 timed eager calls) and live KV bytes read per second; with
    ``reference`` (the fp32 output), the max abs error of the bf16 output against it."""
    from kernels import paged_decode_attention

    layer, q, tables, lens = pool or _decode_pool(name, device)
    batch, _, dim = q.shape
    ctx, kv_heads = int(lens[0]), layer.k.shape[2]

    def call():
        return paged_decode_attention(q, layer.k, layer.v, tables, lens, dim**-0.5, num_splits=num_splits,
                                      kv_scales=layer.scales)

    for _ in range(5):
        out = call()
    torch.cuda.synchronize()
    n = 50
    start = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - start) / n
    live = 2 * batch * ctx * kv_heads * (dim * layer.k.element_size() + (4 if layer.scales is not None else 0))
    r = {"ms": ms, "live_kv_bytes": live, "gb_per_s": live / ms / 1e6}
    if reference is not None:
        r["max_abs_err"] = (out.float() - reference).abs().max().item()
        r["rel_l2_err"] = ((out.float() - reference).norm() / reference.norm()).item()
    return r


def _reference(pool, device) -> torch.Tensor:
    from kernels import paged_decode_attention_ref

    layer, q, tables, lens = pool
    return paged_decode_attention_ref(q.float(), layer.k, layer.v, tables, lens, q.shape[-1] ** -0.5,
                                      kv_scales=layer.scales)


# --decode-operands' default variants: pool[:dots[:rN (register cap, 0: none)][:sN (splits)]]; the
# module's defaults where not given
VARIANTS = ["auto", "fp8:fp16:r0", "fp8", "fp8:8bit_qk", "int8:fp16:r0", "int8", "int8:8bit_qk"]


def decode_operands(variants: list[str], device, rounds: int, accuracy_batch: int = 8) -> dict:
    """(3) per variant (the pool's dtype, decode's dot operands paged_attention.DECODE_QUANT_DOTS, a
    register cap, a split count), interleaved over ``rounds``, each pool built once; the max abs
    error against the fp32 reference, on the timed pool and on ``accuracy_batch`` sequences of
    normal K/V with a peaked softmax."""
    from kernels import paged_attention as pa

    saved = pa.DECODE_QUANT_DOTS, pa.DECODE_QUANT_MAXNREG
    pools, refs, gauss = {}, {}, {}
    out: dict[str, list] = {}
    for r in range(rounds):
        for spec in variants:
            name, *opts = spec.split(":")
            pa.DECODE_QUANT_DOTS = opts[0] if opts else saved[0]
            pa.DECODE_QUANT_MAXNREG = next((int(o[1:]) or None for o in opts[1:] if o[0] == "r"), saved[1])
            splits = next((int(o[1:]) for o in opts[1:] if o[0] == "s"), None)
            if name not in pools:
                torch.manual_seed(0)
                pools[name] = _decode_pool(name, device)
                refs[name] = _reference(pools[name], device)
                gauss[name] = _decode_pool(name, device, batch=accuracy_batch, gaussian=True)
                gauss[name] = (gauss[name], _reference(gauss[name], device))
            res = decode_attention(name, device, pools[name], splits, refs[name])
            if r == 0:
                g = decode_attention(name, device, gauss[name][0], splits, gauss[name][1])
                res["gaussian_max_abs_err"], res["gaussian_rel_l2_err"] = g["max_abs_err"], g["rel_l2_err"]
            out.setdefault(spec, []).append(res)
            print(f"  round {r} {spec:22s} {res['ms']:.3f} ms {res['gb_per_s']:5.0f} GB/s  max err {res['max_abs_err']:.4f}"
                  + (f"  normal K/V: max err {res['gaussian_max_abs_err']:.4f} rel {res['gaussian_rel_l2_err']:.2e}"
                     if r == 0 else ""), flush=True)
    pa.DECODE_QUANT_DOTS, pa.DECODE_QUANT_MAXNREG = saved
    return out


def sweep_decode(dtypes: list[str], device) -> dict:
    """Decode attention at each (tokens a step, warps, stages) for each dtype: the module's tile
    globals set per config, as the engine would run it (a float pool: the narrow config at this grid
    size; an int8/fp8 pool: DECODE_QUANT)."""
    from kernels import paged_attention as pa

    saved = pa.DECODE_BLOCK_N, pa.DECODE_NUM_WARPS, pa.DECODE_NUM_STAGES, pa.DECODE_NARROW, pa.DECODE_QUANT
    out = {}
    for name in dtypes:
        for block_n in (64, 128, 256):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    pa.DECODE_BLOCK_N, pa.DECODE_NUM_WARPS, pa.DECODE_NUM_STAGES = block_n, warps, stages
                    pa.DECODE_NARROW = pa.DECODE_QUANT = (block_n, warps, stages)
                    try:
                        r = decode_attention(name, device)
                    except Exception as exc:  # out of shared memory, say
                        print(f"  {name:5s} {block_n:3d} {warps} {stages}: {type(exc).__name__}", flush=True)
                        continue
                    out[f"{name} {block_n} {warps} {stages}"] = r
                    print(f"  {name:5s} {block_n:3d} {warps} {stages}: {r['ms']:.3f} ms {r['gb_per_s']:.0f} GB/s",
                          flush=True)
    pa.DECODE_BLOCK_N, pa.DECODE_NUM_WARPS, pa.DECODE_NUM_STAGES, pa.DECODE_NARROW, pa.DECODE_QUANT = saved
    return out


def workload(engine: LLMEngine, prompts: list[list[int]], output: int) -> dict:
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    steps = batch_sum = decode_steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        running = len(engine.scheduler.running)
        if running:
            batch_sum += running
            decode_steps += 1
    wall = time.perf_counter() - start
    out_tokens = len(prompts) * output
    return {"wall_s": wall, "output_tok_s": out_tokens / wall,
            "total_tok_s": (out_tokens + sum(map(len, prompts))) / wall, "steps": steps,
            "preemptions": engine.scheduler.num_preemptions, "mean_running": batch_sum / max(decode_steps, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="a tokenizer folder for the dummy model (the engine parts)")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "fp8", "int8"])
    ap.add_argument("--kv-gib", type=float, default=8.0, help="KV pool bytes of the workload, the same for every dtype")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=int, nargs=2, default=[3000, 4000])
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--skip-workload", action="store_true")
    ap.add_argument("--sweep-decode", action="store_true", help="only: decode attention's tile configs per dtype")
    ap.add_argument("--decode-operands", action="store_true",
                    help="only: decode attention per --variants (a pool's dtype and its dot operands), with errors")
    ap.add_argument("--variants", nargs="+", default=VARIANTS, help="with --decode-operands: pool[:dots[:rN][:sN]]")
    ap.add_argument("--rounds", type=int, default=3, help="with --decode-operands")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    results: dict = {"device": torch.cuda.get_device_name(), "args": vars(args),
                     "copy_gb_s": copy_bandwidth() / 1e9}
    print(f"{results['device']}: copy {results['copy_gb_s']:.0f} GB/s", flush=True)

    if args.sweep_decode or args.decode_operands:
        if args.sweep_decode:
            results["sweep"] = sweep_decode(args.dtypes, device)
        else:
            results["decode_operands"] = decode_operands(args.variants, device, args.rounds)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        return
    if not args.tokenizer:
        ap.error("--tokenizer is needed for the engine parts")
    print("(3) decode attention, batch 64 x 4096 tokens, 32/8 heads of 128")
    results["decode_attention"] = {}
    for name in args.dtypes:
        r = results["decode_attention"][name] = decode_attention(name, device)
        torch.cuda.empty_cache()
        print(f"  {name:5s} {r['ms']:.3f} ms  live KV {r['live_kv_bytes'] / 2**20:.0f} MiB  {r['gb_per_s']:.0f} GB/s "
              f"({r['gb_per_s'] / results['copy_gb_s']:.0%} of the copy rate)", flush=True)

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(*args.prompt))] for _ in range(args.requests)]
    max_len = args.prompt[1] + args.output + 16
    base = dict(model=MODEL, tokenizer=args.tokenizer, device="cuda", dtype="bfloat16",
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192, max_model_len=max_len)
    # Load the weights once (an engine with a pool for one request, no graphs); the engines share them.
    loader = LLMEngine(EngineConfig(**base, num_kv_blocks=-(-max_len // 16), cuda_graphs=False))
    model, tokenizer, model_cfg = loader.model, loader.tokenizer, loader.model_config
    loader.close()
    del loader
    results["engines"] = {}
    for name in args.dtypes:
        common = dict(base, kv_cache_dtype=name)
        gc.collect()
        torch.cuda.empty_cache()
        # (1) bytes per block, and the pool the engine's own sizing (gpu_memory_utilization) gives
        per_block = kv_bytes_per_block(model_cfg, 16, storage(name), model.kv_heads)
        sized = cuda_kv_blocks(EngineConfig(**common), model_cfg, model, create_attention_backend("triton"), max_len)
        r = results["engines"][name] = {
            "bytes_per_block": per_block, "tokens_per_gib": 2**30 // per_block * 16,
            "engine_sized_blocks": sized, "engine_sized_tokens": sized * 16}
        print(f"(1) {name:5s} {per_block} B/block  {r['tokens_per_gib']} tokens/GiB  pool sized by the engine "
              f"(gpu_memory_utilization 0.9): {r['engine_sized_tokens']} tokens", flush=True)
        blocks = int(args.kv_gib * 2**30) // per_block
        engine = LLMEngine(EngineConfig(**common, num_kv_blocks=blocks), tokenizer=tokenizer, model=model)
        if args.skip_workload:
            engine.close()
            continue
        workload(engine, prompts[:4], 8)  # warm-up (compiles the prefill kernels' shapes)
        engine.scheduler.num_preemptions = 0
        w = workload(engine, prompts, args.output)
        r["workload"] = {"kv_blocks": blocks, **w}
        print(f"(2) {name:5s} {blocks} blocks ({blocks * 16} tokens): {w['output_tok_s']:.0f} output tok/s, "
              f"{w['total_tok_s']:.0f} total tok/s, {w['wall_s']:.1f} s, {w['preemptions']} preemptions, "
              f"mean running {w['mean_running']:.1f}", flush=True)
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        if args.out:  # after every dtype: a later failure keeps what was measured
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
