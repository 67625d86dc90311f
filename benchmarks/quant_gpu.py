"""Weight-only quantization on one GPU: the W8A16/W4A16 kernel per projection, and the engine
with dummy:llama-3.1-8b quantized at load (bf16 vs int8 vs int4 in the same run).

    python benchmarks/quant_gpu.py --out quant.json [--configs none int8 int4] [--parts kernels engine]
        [--batches 1 8 16 64] [--sweep-prefill] [--decode-rows 1 2 4 8 16] [--sweep-gemv] [--gemv-tl-load]
        [--swap-sweep 16 64 512] [--shapes qkv_proj ...] [--swap-max-rows 8:128] [--paths swapped dense]
        [--gluon-sweep 16 64] [--gluon-tiles 64:4:16:4 ...] [--gluon-inflight 0 1] [--no-gluon] [--gluon-rows 3:128]
        [--profile-batch 16]

kernels  each Llama-3.1-8B projection (and the LM head in int8) at 1, 8, 16, 64 and 512 rows:
         median time (triton.testing.do_bench) of bf16 (the engine's path: skinny matmul at 1 row,
         cuBLAS above), int8 and int4 (group 128), the bytes each must read and its time at the
         measured copy rate, and the relative error against the dequantize-then-matmul reference
 decode  each path of kernels/wq_matmul.py (gemv, dequant, gluon, swapped, dense, and the one it picks)
         per projection at --decode-rows, against bf16 (the engine's linear: skinny kernel or
         cuBLAS), in CUDA graphs over weight copies that miss the L2 (as a decode step meets them);
         --sweep-gemv: the GEMV's tiles and splits; --swap-sweep: the swapped kernel's tiles,
         splits and switches at the rows given; --gluon-sweep: kernels/wq_gluon.py's tiles and splits
         (int4); last, a table of µs a layer (qkv + o + gate_up + down) per path
 engine  per --configs, in a process of its own (each sizes its KV pool from the whole GPU): ms per
         decode step at each --batches (prompts of 128 tokens, the median interval between steps
         once every request decodes; CUDA graphs and the lookahead as served), the weight bytes a
         step reads and their floor at the copy rate, and workload (b) of gpu_engine.py (256
         requests, prompt and output U[100, 1024], all at once) output tok/s; --profile-batch B: the
         GPU time of a decode step at batch B by kernel (torch.profiler): each kernel's span, and its
         marginal time (its end after the end of the kernel before it: under PDL these add up to
         the step where the spans overlap) with the device's idle time before it; then the same by
         kernel and launch grid, which tells one kernel's projections apart
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
            if f"int{bits}" not in configs:
                continue
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


def graph_us(calls: list) -> float:
    """Median µs a call of ``calls`` (one per weight copy, together several times the L2), replayed
    from one CUDA graph as the engine's decode step runs them."""
    from kernels.wq_gluon_tune import graph_us as replayed

    return replayed(calls, samples=9, replays=4)


# --swap-sweep: the swapped kernel's tiles (BLOCK_N, BLOCK_M, warps, stages) per row bucket, each
# with K splits (rows <= WORKSPACE_ROWS) and the PERM / XSUM_DOT switches (int4 (True, True), (True, False),
# (False, False); int8 (True, False), (False, False))
SWAP_SWEEP_TILES = [(64, 16, 4, 3), (64, 16, 4, 4), (128, 16, 8, 3), (64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3),
                    (128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3)]


def swap_sweep_configs(rows: int, bits: int) -> list[dict]:
    from kernels.wq_matmul import WORKSPACE_ROWS

    bucket = max(16, 1 << (rows - 1).bit_length())
    switches = [(True, True), (True, False), (False, False)] if bits == 4 else [(True, False), (False, False)]
    out = []
    for bn, bm, warps, stages in SWAP_SWEEP_TILES:
        if bm > bucket or bm < min(bucket, 256) // 4:
            continue
        for perm, xsum in switches:
            for split in ((1, 2, 4, 8) if rows <= WORKSPACE_ROWS else (1,)):
                out.append(dict(BLOCK_N=bn, BLOCK_M=bm, SPLIT_K=split, PERM=perm, XSUM_DOT=xsum, num_warps=warps,
                                num_stages=stages))
    return out


def sweep_gluon(x: torch.Tensor, ws: list, ref: torch.Tensor, tag: str, tiles: list[tuple] | None = None,
                inflight: tuple[int, ...] = (1,)) -> dict:
    """kernels/wq_gluon.py's tiles (kernels/wq_gluon_tune.py's GLUON_TILES or ``tiles``) and K
    splits for one shape and rows, each with the wgmma groups left in flight in ``inflight``: rel_err (the output poisoned with
    NaN first: an unwritten element fails; a wrong one is located) and µs, as bench_decode times."""
    from kernels.wq_gluon import gluon_weight
    from kernels.wq_gluon_tune import gluon_configs, wq_gluon
    from kernels.wq_matmul import WORKSPACE_ROWS, _workspace

    ws = [gluon_weight(w) for w in ws]  # the tiled form (kept beside each natural weight)
    (m, k), n = x.shape, ws[0].shape[0]
    work, cnt = _workspace(x.device, n, -(-n // 64) * -(-WORKSPACE_ROWS // 16))
    out, best = {}, None
    for cfg in [{**c, "INFLIGHT": f} for c in gluon_configs(m, n, k, WORKSPACE_ROWS, tiles) for f in inflight]:
        dst = torch.full((m, n), float("nan"), dtype=x.dtype, device=x.device)
        try:
            wq_gluon(x, ws[0], dst, None, work, cnt, cfg)
            err = ((dst.float() - ref).norm() / ref.norm()).item()
            us = graph_us([lambda w=w: wq_gluon(x, w, dst, None, work, cnt, cfg) for w in ws])
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit
            print(f"  gluon sweep {cfg}: {type(exc).__name__} {exc}"[:300], flush=True)
            continue
        label = "-".join(str(v) for v in cfg.values())
        out[f"{tag}/gluon-sweep/{label}"] = {"us": us, "rel_err": err, "config": cfg}
        print(f"  gluon {tag} {cfg}: {us:.1f} us  err {err:.1e}", flush=True)
        if not err < 2e-2:  # where: rows of x, 64-row blocks of W, 128-column tiles are not told apart here
            wrong = ~((dst.float() - ref).abs() <= 0.05 * ref.abs().max())
            rows_bad = wrong.any(1).nonzero().flatten().tolist()
            nblk_bad = sorted({c // 64 for c in wrong.any(0).nonzero().flatten().tolist()})
            out[f"{tag}/gluon-sweep/{label}"].update(wrong_frac=wrong.float().mean().item(), rows_bad=rows_bad[:64],
                                                     nblocks_bad=nblk_bad[:64])
            print(f"    wrong {wrong.float().mean().item():.3f} of outputs; x rows {rows_bad[:8]}..{rows_bad[-4:]} "
                  f"({len(rows_bad)}), 64-row W blocks {nblk_bad[:8]} ({len(nblk_bad)}); nan "
                  f"{dst.isnan().float().mean().item():.3f}", flush=True)
        if err == err and err < 2e-2 and (best is None or us < best[0]):
            best = (us, cfg)
    if best:
        out[f"{tag}/gluon-best"] = {"us": best[0], "config": best[1]}
    return out


def bench_decode(ceilings: dict, rows_list: list[int], sweep: bool, swap_sweep: list[int] = (),
                 shapes: list[str] | None = None, only: list[str] | None = None, gluon_sweep: list[int] = (),
                 gluon_tiles: list[tuple] | None = None, gluon_inflight: tuple[int, ...] = (1,),
                 configs: list[str] = ("int8", "int4")) -> dict:
    """Each path (kernels/wq_matmul.py) per projection and row count, timed in CUDA graphs over
    enough weight copies to miss the L2; with ``sweep`` the GEMV's tiles and splits at 1 row, and
    at the rows in ``swap_sweep`` the swapped kernel's (swap_sweep_configs); ``only``: these paths
    (and bf16, chosen); ``configs``: the formats (--configs; bf16 always)."""
    from kernels.wq_gluon import gluon_fits, tile_weight
    from kernels.wq_matmul import (DECODE_MAX_ROWS, GEMV_MAX_ROWS, GEMV_SPLITS, GEMV_TILES, GLUON_ROWS, decode_path,
                                   tiles_fit, wq_matmul)
    from kernels.wquant import quantize
    from worker.models.parallel_layers import linear

    dev = torch.device("cuda")
    bw = ceilings["copy_bandwidth_Bps"]
    out = {}
    for name, (n, k) in SHAPES.items():
        if shapes and name not in shapes:
            continue
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        formats = {"bf16": [w] + [w.clone() for _ in range(max(2, -(-256 * 2**20 // (n * k * 2))) - 1)]}
        for bits in ((8,) if name == "lm_head" else (8, 4)):
            if f"int{bits}" not in configs:
                continue
            q = quantize(w, bits, 128)
            q.scales, q.biases = q.scales.bfloat16(), None if q.biases is None else q.biases.bfloat16()
            cp = max(2, -(-256 * 2**20 // q.nbytes()))
            formats[f"int{bits}"] = [q] + [type(q)(q.qweight.clone(), q.scales.clone(),
                                                 None if q.biases is None else q.biases.clone(), bits, 128)
                                           for _ in range(cp - 1)]
            if tiles_fit(q):  # the engine's form on sm_90 (kernels/wq_matmul.prepare)
                formats[f"int{bits}t"] = [tile_weight(c) for c in formats[f"int{bits}"]]
        for rows in rows_list:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            for fmt, ws in formats.items():
                nbytes = ws[0].numel() * 2 if fmt == "bf16" else ws[0].nbytes()
                if fmt == "bf16":
                    paths = {"bf16": [lambda w=w: linear(x, w) for w in ws]}
                else:
                    ref = x.float() @ ws[0].dequantize().t()
                    paths = {}
                    if fmt.endswith("t"):  # tiled: the Gluon kernel and dequantize + cuBLAS only
                        names = ["gluon"] if rows <= GLUON_ROWS[ws[0].bits][1] else []
                    else:
                        names = (["gemv"] if rows <= GEMV_MAX_ROWS else []) + (["dequant"] if rows <= DECODE_MAX_ROWS else [])
                        names += ["gluon"] if gluon_fits(x, ws[0]) and rows >= 2 else []
                        names += ["swapped"]
                    for p in names + ["dense"]:
                        if only and p not in only:
                            continue
                        fns = [lambda w=w, p=p: wq_matmul(x, w, path=p) for w in ws]
                        err = ((fns[0]().float() - ref).norm() / ref.norm()).item()
                        paths[p] = fns
                        out[f"{name}/{rows}/{fmt}/{p}/rel_err"] = err
                        if err > 2e-2:
                            print(f"  {name} {rows} {fmt} {p}: rel err {err:.1e}", flush=True)
                    paths["chosen"] = [lambda w=w: wq_matmul(x, w) for w in ws]
                    out[f"{name}/{rows}/{fmt}/chosen/path"] = decode_path(ws[0], rows, x.dtype)
                for p, calls in paths.items():
                    us = graph_us(calls)
                    out[f"{name}/{rows}/{fmt}/{p}"] = {"us": us, "bytes": nbytes, "floor_us": nbytes / bw * 1e6}
                    print(f"{name:<13}{rows:>5} {fmt:<5}{p:<8}{us:>9.1f} us  floor {nbytes / bw * 1e6:>7.1f} us  "
                          f"{nbytes / us / 1e6:>6.2f} TB/s", flush=True)
                if rows in swap_sweep and fmt in ("int8", "int4"):
                    best = None
                    for cfg in swap_sweep_configs(rows, ws[0].bits):
                        try:
                            got = wq_matmul(x, ws[0], config=cfg, path="swapped").float()
                            err = ((got - ref).norm() / ref.norm()).item()
                            us = graph_us([lambda w=w: wq_matmul(x, w, config=cfg, path="swapped") for w in ws])
                        except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit
                            print(f"  swap sweep {cfg}: {type(exc).__name__} {exc}"[:200], flush=True)
                            continue
                        tag = "-".join(str(int(v)) for v in cfg.values())
                        out[f"{name}/{rows}/{fmt}/swap-sweep/{tag}"] = {"us": us, "rel_err": err, "config": cfg}
                        if err > 2e-2:
                            print(f"  swap sweep {cfg}: rel err {err:.1e}", flush=True)
                        elif best is None or us < best[0]:
                            best = (us, cfg)
                    if best:
                        out[f"{name}/{rows}/{fmt}/swap-best"] = {"us": best[0], "config": best[1]}
                        print(f"  swap sweep {name} {rows} {fmt}: best {best[0]:.1f} us at {best[1]}", flush=True)
                if rows in gluon_sweep and fmt in ("int8", "int4") and gluon_fits(x, ws[0]):
                    out.update(sweep_gluon(x, ws, ref, f"{name}/{rows}/{fmt}", gluon_tiles, gluon_inflight))
                if sweep and fmt in ("int8", "int4") and rows == 1:
                    best = None
                    for bn, kw, warps in GEMV_TILES[ws[0].bits]:
                        for splits in GEMV_SPLITS:
                            if (n + bn - 1) // bn * splits > 2048:
                                continue
                            cfg = dict(BLOCK_N=bn, BLOCK_KW=kw, SPLITS=splits, num_warps=warps)
                            try:
                                got = wq_matmul(x, ws[0], config=cfg, path="gemv").float()
                                err = ((got - ref).norm() / ref.norm()).item()
                                us = graph_us([lambda w=w: wq_matmul(x, w, config=cfg, path="gemv") for w in ws])
                            except Exception as exc:  # noqa: BLE001 - a tile that does not compile
                                print(f"  sweep {cfg}: {type(exc).__name__} {exc}"[:200], flush=True)
                                continue
                            out[f"{name}/{rows}/{fmt}/gemv-sweep/{bn}-{kw}-{warps}-{splits}"] = {"us": us, "rel_err": err}
                            if err > 2e-2:
                                print(f"  sweep {cfg}: rel err {err:.1e}", flush=True)
                            if best is None or us < best[0]:
                                best = (us, cfg)
                    print(f"  sweep {name} {fmt}: best {best[0]:.1f} us at {best[1]}", flush=True)
        del w, formats
        torch.cuda.empty_cache()
    print_decode_table(out, rows_list)
    return out


def print_decode_table(res: dict, rows_list: list[int]) -> None:
    """µs per projection summed over one layer (qkv, o, gate_up, down) per rows: bf16 and each path."""
    layer = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    found = {key.split("/")[3] for key in res if key.count("/") == 3 and isinstance(res[key], dict)}
    cols = [p for p in ("bf16", "gemv", "dequant", "gluon", "gluon-best", "swapped", "swap-best", "dense")
            if p in found] + ["chosen"]
    print(f"\n{'rows':>5} {'fmt':<5}" + "".join(f"{p:>10}" for p in cols) + "   (us a layer)")
    for rows in rows_list:
        for fmt in ("int8", "int8t", "int4", "int4t"):
            cells = []
            for p in cols:
                key = "bf16" if p == "bf16" else fmt
                vals = [res.get(f"{name}/{rows}/{key}/{p}", {}).get("us") for name in layer]
                cells.append(f"{sum(vals):>10.1f}" if all(v is not None for v in vals) else f"{'':>10}")
            print(f"{rows:>5} {fmt:<5}" + "".join(cells))


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


def profile_decode(engine, batch: int, vocab: int, rng: random.Random,
                   steps: int = 10) -> tuple[list[dict], list[dict]]:
    """The GPU kernels of ``steps`` decode steps at ``batch`` (torch.profiler, graph replays
    included), by total time a step: where a step's time goes, kernel by kernel; and the kernels
    again by launch grid (kernel_spans), which tells one kernel's projections apart."""
    from torch.profiler import ProfilerActivity, profile

    from worker.engine.sampling_params import SamplingParams

    for _ in range(batch):
        engine.add_request(random_prompt(rng, 128, vocab),
                           SamplingParams(max_tokens=steps + 24, temperature=0, ignore_eos=True, detokenize=False))
    for _ in range(8):  # the prefill and the first decode steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    rows = {e.key[:120]: {"kernel": e.key[:120], "us_a_step": e.device_time_total / steps, "calls_a_step": e.count / steps}
            for e in prof.key_averages() if e.device_time_total > 0}
    spans = [(e.time_range.start, e.time_range.end, e.name[:120]) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.name[:120] in rows]
    for name, (marginal, idle) in marginal_times(spans).items():
        rows[name].update(marginal_us_a_step=marginal / steps, idle_before_us_a_step=idle / steps)
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        with open(f"{tmp}/trace.json") as f:
            by_grid = grid_rows(kernel_spans(json.load(f)), steps)
    by_kernel = sorted(rows.values(), key=lambda r: -r.get("marginal_us_a_step", 0) - r.get("idle_before_us_a_step", 0))
    return by_kernel[:30], by_grid[:40]


def kernel_spans(trace: dict) -> list[tuple[float, float, str]]:
    """(start, end, label) in µs of each GPU kernel in a torch.profiler chrome trace: its name and
    launch grid (the trace's args), so that one kernel launched for different shapes (the Gluon
    kernel for qkv, o, gate_up, down and the LM head) counts once per shape."""
    spans = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        grid = e.get("args", {}).get("grid")  # [x, y, z] in kineto's traces; kept as written otherwise
        grid = "x".join(str(g) for g in grid) if isinstance(grid, list) else grid
        label = e["name"][:80] + (f" grid {grid}" if grid else "")
        spans.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), label))
    return spans


def grid_rows(spans: list[tuple[float, float, str]], steps: int) -> list[dict]:
    """Per label of kernel_spans, a step's calls, span and marginal time (marginal_times among the
    kernels alone), largest marginal first."""
    rows: dict[str, dict] = {}
    for start, end, label in spans:
        row = rows.setdefault(label, {"kernel": label, "calls_a_step": 0.0, "us_a_step": 0.0})
        row["calls_a_step"] += 1 / steps
        row["us_a_step"] += (end - start) / steps
    for label, (marginal, idle) in marginal_times(spans).items():
        rows[label].update(marginal_us_a_step=marginal / steps, idle_before_us_a_step=idle / steps)
    return sorted(rows.values(), key=lambda r: -r.get("marginal_us_a_step", 0))


def marginal_times(spans: list[tuple[float, float, str]]) -> dict[str, tuple[float, float]]:
    """Per kernel name, from (start, end, name) spans on one stream: (marginal, idle before). Under
    PDL the spans overlap (a kernel starts while the one before drains), so their durations say
    what runs, not what costs; a kernel's end after the end of the one before it does, and those
    add up to the whole span; idle: the device waiting (no kernel) before the kernel starts."""
    out: dict[str, tuple[float, float]] = {}
    spans = sorted(spans, key=lambda s: s[1])
    for (_, end0, _), (start, end, name) in zip(spans, spans[1:]):
        marginal, idle = out.get(name, (0.0, 0.0))
        out[name] = (marginal + end - max(start, end0), idle + max(0.0, start - end0))
    return out


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
    if args.profile_batch:
        try:
            res["profile"], res["profile_by_grid"] = profile_decode(engine, args.profile_batch, cfg.vocab_size, rng)
        except Exception as exc:  # noqa: BLE001 - the step times above still count
            res["profile"], res["profile_by_grid"] = [], []
            print(f"{quantization}: profile failed: {type(exc).__name__} {exc}", flush=True)
        for title, rows, n in (("by kernel", res["profile"], 20),
                               ("by kernel and launch grid", res["profile_by_grid"], 16)):
            print(f"{quantization}: batch {args.profile_batch}, GPU time a decode step {title} (us):", flush=True)
            print("  marginal   idle before   span   calls   (us a step)", flush=True)
            for row in rows[:n]:
                print(f"  {row.get('marginal_us_a_step', 0):9.1f} {row.get('idle_before_us_a_step', 0):9.1f} "
                      f"{row['us_a_step']:9.1f} {row['calls_a_step']:6.1f}x  {row['kernel'][:110]}", flush=True)
    for b, ms in res["decode_ms"].items():
        print(f"{quantization}: batch {b}: {ms:.3f} ms a step (weights' floor {res['floor_ms']:.3f} ms)", flush=True)
    if args.skip_b:
        res["b"] = {"tok_s": float("nan")}
        return res
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
    ap.add_argument("--parts", nargs="+", choices=["kernels", "decode", "engine"], default=["kernels", "engine"])
    ap.add_argument("--decode-rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--sweep-gemv", action="store_true")
    ap.add_argument("--swap-sweep", type=int, nargs="*", default=[], metavar="ROWS",
                    help="decode part: the swapped kernel's tiles and switches at these rows")
    ap.add_argument("--gluon-sweep", type=int, nargs="*", default=[], metavar="ROWS",
                    help="decode part: kernels/wq_gluon.py's tiles and splits at these rows")
    ap.add_argument("--gluon-tiles", nargs="+", metavar="BLOCK_N:WARPS:BLOCK_M:STAGES[:WS]",
                    help="--gluon-sweep: these tiles, not kernels/wq_gluon_tune.py's GLUON_TILES (WS 1: the "
                         "warp-specialized kernel, kernels/wq_gluon_ws.py)")
    ap.add_argument("--gluon-inflight", type=int, nargs="+", default=[1],
                    help="--gluon-sweep: wgmma groups left in flight (0: wait for each tile's, the A/B)")
    ap.add_argument("--no-gluon", action="store_true", help="kernels/wq_matmul.py's GLUON switch off (A/B)")
    ap.add_argument("--gluon-rows", default=None, metavar="LO:HI", help="override GLUON_ROWS[4] (A/B of the crossover)")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="decode part: these projections only")
    ap.add_argument("--swap-max-rows", nargs="+", default=[], metavar="BITS:ROWS",
                    help="override kernels/wq_matmul.py's SWAP_MAX_ROWS (A/B of the crossover), e.g. 8:128")
    ap.add_argument("--paths", nargs="+", help="decode part: these paths of kernels/wq_matmul.py only (and bf16, chosen)")
    ap.add_argument("--gemv-tl-load", action="store_true",
                    help="decode part: the GEMV's scales and x by tl.load, not inline asm (A/B of GEMV_ASM)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 64])
    ap.add_argument("--skip-b", action="store_true", help="engine part: the decode steps only, not workload (b)")
    ap.add_argument("--profile-batch", type=int, default=0, metavar="B",
                    help="engine part: the GPU kernels of 10 decode steps at batch B (torch.profiler)")
    ap.add_argument("--kernel-rows", type=int, nargs="+", default=[1, 8, 16, 64, 512])
    ap.add_argument("--sweep-prefill", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: run this config's engine part
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import kernels.wq_matmul

    for item in args.swap_max_rows:
        bits, rows = map(int, item.split(":"))
        kernels.wq_matmul.SWAP_MAX_ROWS[bits] = rows
    kernels.wq_matmul.GLUON = not args.no_gluon
    if args.gluon_rows:
        kernels.wq_matmul.GLUON_ROWS[4] = tuple(map(int, args.gluon_rows.split(":")))
    if args.one:
        Path(args.out).write_text(json.dumps(run_engine(args.one, args)))
        return
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    if "kernels" in args.parts:
        res["ceilings"] = measure_ceilings(torch.device("cuda"))
        res["kernels"] = bench_kernels(res["ceilings"], args.kernel_rows, args.sweep_prefill)
        torch.cuda.empty_cache()
    if "decode" in args.parts:
        res.setdefault("ceilings", measure_ceilings(torch.device("cuda")))
        if args.gemv_tl_load:
            import kernels.wq_matmul

            kernels.wq_matmul.GEMV_ASM = False
        try:
            res["decode"] = bench_decode(res["ceilings"], args.decode_rows, args.sweep_gemv, args.swap_sweep,
                                         args.shapes, args.paths, args.gluon_sweep,
                                         [tuple(map(int, t.split(":"))) for t in args.gluon_tiles or []] or None,
                                         tuple(args.gluon_inflight), args.configs)
        finally:
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=1))
        torch.cuda.empty_cache()
    if "engine" in args.parts:
        res["engine"] = {}
        for q in args.configs:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--one", q, "--out", f.name, "--batches", *map(str, args.batches),
                       "--profile-batch", str(args.profile_batch)]
                if args.swap_max_rows:
                    cmd += ["--swap-max-rows", *args.swap_max_rows]
                cmd += ["--no-gluon"] if args.no_gluon else []
                cmd += ["--skip-b"] if args.skip_b else []
                cmd += ["--gluon-rows", args.gluon_rows] if args.gluon_rows else []
                if subprocess.run(cmd).returncode == 0:  # a config listed again (a restart) as q#2
                    again = sum(name.split("#")[0] == q for name in res["engine"])
                    res["engine"][f"{q}#{again + 1}" if again else q] = json.loads(Path(f.name).read_text())
                if args.out:  # what is done so far, in case a later config fails or times out
                    Path(args.out).write_text(json.dumps(res, indent=1))
        base = res["engine"].get("none")
        print(f"\n{'config':<7}{'start s':>8}{'GiB':>7}{'floor ms':>9}"
              + "".join(f"{'b' + str(b):>9}" for b in args.batches) + f"{'(b) tok/s':>11}")
        for q, r in res["engine"].items():
            rel = "" if base is None else f"  ({r['b']['tok_s'] / base['b']['tok_s']:.2f}x)"
            print(f"{q:<7}{r['startup_s']:>8.1f}{r['weight_bytes'] / 2**30:>7.2f}{r['floor_ms']:>9.3f}"
                  + "".join(f"{r['decode_ms'][str(b)] if str(b) in r['decode_ms'] else r['decode_ms'][b]:>9.3f}"
                            for b in args.batches) + f"{r['b']['tok_s']:>11.0f}{rel}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
