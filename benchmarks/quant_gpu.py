"""Weight-only quantization on one GPU: the W8A16/W4A16 kernel per projection, and the engine
with dummy:llama-3.1-8b quantized at load (bf16 vs int8 vs int4 in the same run).

    python benchmarks/quant_gpu.py --out quant.json [--configs none int8 int4] [--parts kernels engine]
        [--batches 1 8 16 64] [--sweep-prefill]

kernels  each Llama-3.1-8B projection (and the LM head in int8) at 1, 8, 16, 64 and 512 rows:
         median time (triton.testing.do_bench) of bf16 (the engine's path: skinny matmul at 1 row,
         cuBLAS above), int8 and int4 (group 128), the bytes each must read and its time at the
         measured copy rate, and the relative error against the dequantize-then-matmul reference
 engine  per --configs, in a process of its own (each sizes its KV pool from the whole GPU): ms per
         decode step at each --batches (prompts of 128 tokens, the median interval between steps
         once every request decodes; CUDA graphs and the lookahead as served), the weight bytes a
         step reads and their floor at the copy rate, and workload (b) of gpu_engine.py (256
         requests, prompt and output U[100, 1024], all at once) output tok/s
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_engine import measure_ceilings, random_prompt, workload_b  # noqa: E402

PRESET = "llama-3.1-8b"
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336), "lm_head": (128256, 4096)}


def bench_kernels(ceilings: dict, rows_list: list[int], sweep: bool) -> dict:
    from triton.testing import do_bench

    from kernels.wq_matmul import wq_matmul
    from kernels.wquant import quantize
    from worker.models.parallel_layers import linear

    dev = torch.device("cuda")
    bw = ceilings["copy_bandwidth_Bps"]
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        formats = {"bf16": w}
        for bits in ((8,) if name == "lm_head" else (8, 4)):
            q = quantize(w, bits, 128)
            q.scales, q.biases = q.scales.bfloat16(), None if q.biases is None else q.biases.bfloat16()
            formats[f"int{bits}"] = q
        for rows in rows_list:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            for fmt, wt in formats.items():
                if fmt == "bf16":
                    fn, nbytes, err = (lambda: linear(x, w)), w.numel() * 2, 0.0
                else:
                    fn, nbytes = (lambda: wq_matmul(x, wt)), wt.nbytes()
                    ref = x.float() @ wt.dequantize().t()
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                out[f"{name}/{rows}/{fmt}"] = {"ms": ms, "bytes": nbytes, "floor_ms": nbytes / bw * 1e3, "rel_err": err}
                print(f"{name:<13}{rows:>5} {fmt:<5}{ms * 1e3:>9.1f} us  floor {nbytes / bw * 1e6:>8.1f} us  "
                      f"err {err:.1e}", flush=True)
            if sweep and rows > 16 and name != "lm_head":
                for fmt in ("int8", "int4"):
                    for cfg in [(64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                                (128, 128, 128, 8, 3), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4)]:
                        try:
                            ms = do_bench(lambda: wq_matmul(x, formats[fmt], config=cfg), warmup=10, rep=50,
                                          return_mode="median")
                        except Exception as exc:  # a tile that does not fit shared memory
                            print(f"  sweep {cfg}: {type(exc).__name__}")
                            continue
                        out[f"{name}/{rows}/{fmt}/sweep/{cfg}"] = {"ms": ms}
                        print(f"  sweep {name} {rows} {fmt} {cfg}: {ms * 1e3:.1f} us", flush=True)
        del w, formats
        torch.cuda.empty_cache()
    return out


def decode_step_ms(engine, batch: int, vocab: int, rng: random.Random, new: int = 48) -> float:
    from worker.engine.sampling_params import SamplingParams

    for _ in range(batch):
        engine.add_request(random_prompt(rng, 128, vocab),
                           SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, detokenize=False))
    stamps = []
    while engine.has_unfinished():
        if engine.step():
            stamps.append(time.perf_counter())
    gaps = sorted(b - a for a, b in zip(stamps[4:], stamps[5:]))
    return gaps[len(gaps) // 2] * 1e3


def run_engine(quantization: str, args) -> dict:
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams
    from worker.models.quantization import weight_bytes

    ceilings = measure_ceilings(torch.device("cuda"))
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=f"dummy:{PRESET}", device="cuda", dtype="bfloat16", max_model_len=4096,
                                    max_num_batched_tokens=8192, max_num_seqs=256, quantization=quantization))
    res = {"quantization": quantization, "startup_s": time.perf_counter() - t0, "ceilings": ceilings,
           "kv_blocks": engine.block_manager.num_blocks}
    cfg = engine.model_config
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 2  # one row of it is read
    res["weight_bytes"] = weight_bytes(engine.model)
    res["step_read_bytes"] = res["weight_bytes"] - embed
    res["floor_ms"] = res["step_read_bytes"] / ceilings["copy_bandwidth_Bps"] * 1e3
    rng = random.Random(0)
    decode_step_ms(engine, 1, cfg.vocab_size, rng, 8)  # warm-up
    res["decode_ms"] = {b: decode_step_ms(engine, b, cfg.vocab_size, rng) for b in args.batches}
    for b, ms in res["decode_ms"].items():
        print(f"{quantization}: batch {b}: {ms:.3f} ms a step (weights' floor {res['floor_ms']:.3f} ms)", flush=True)
    work = workload_b()
    brng = random.Random(1)
    prompts = [random_prompt(brng, p, cfg.vocab_size) for p, _ in work]
    for prompt in prompts[:64]:  # compile what (b)'s mixed steps launch
        engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, detokenize=False))
    while engine.has_unfinished():
        engine.step()
    engine.block_manager.reset_prefix_cache()
    t = time.perf_counter()
    for prompt, (_, n) in zip(prompts, work):
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False))
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    wall = time.perf_counter() - t
    res["b"] = {"output_tokens": generated, "wall_s": wall, "tok_s": generated / wall}
    print(f"{quantization}: workload (b) {generated / wall:.0f} output tok/s ({wall:.1f} s)", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["none", "int8", "int4"])
    ap.add_argument("--parts", nargs="+", choices=["kernels", "engine"], default=["kernels", "engine"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 64])
    ap.add_argument("--kernel-rows", type=int, nargs="+", default=[1, 8, 16, 64, 512])
    ap.add_argument("--sweep-prefill", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: run this config's engine part
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.one:
        Path(args.out).write_text(json.dumps(run_engine(args.one, args)))
        return
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    if "kernels" in args.parts:
        res["ceilings"] = measure_ceilings(torch.device("cuda"))
        res["kernels"] = bench_kernels(res["ceilings"], args.kernel_rows, args.sweep_prefill)
        torch.cuda.empty_cache()
    if "engine" in args.parts:
        res["engine"] = {}
        for q in args.configs:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--one", q, "--out", f.name, "--batches", *map(str, args.batches)]
                if subprocess.run(cmd).returncode == 0:
                    res["engine"][q] = json.loads(Path(f.name).read_text())
                if args.out:  # what is done so far, in case a later config fails or times out
                    Path(args.out).write_text(json.dumps(res, indent=1))
        base = res["engine"].get("none")
        print(f"\n{'config':<7}{'GiB':>7}{'floor ms':>9}" + "".join(f"{'b' + str(b):>9}" for b in args.batches)
              + f"{'(b) tok/s':>11}")
        for q, r in res["engine"].items():
            rel = "" if base is None else f"  ({r['b']['tok_s'] / base['b']['tok_s']:.2f}x)"
            print(f"{q:<7}{r['weight_bytes'] / 2**30:>7.2f}{r['floor_ms']:>9.3f}"
                  + "".join(f"{r['decode_ms'][str(b)] if str(b) in r['decode_ms'] else r['decode_ms'][b]:>9.3f}"
                            for b in args.batches) + f"{r['b']['tok_s']:>11.0f}{rel}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
