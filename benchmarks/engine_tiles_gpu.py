"""The 1-row Gluon tiles timed inside the engine (issue 18), not alone as the tuner times them.

    python benchmarks/engine_tiles_gpu.py [--quantization int4] [--only o_ g_late] [--variant o:STAGES=8]
        [--budget 400] [--out tiles.json]

One engine (dummy:llama-3.1-8b quantized at load, CUDA graphs for up to 16 rows). Each variant puts
its tiles into kernels/wq_gluon_tune.py's tuned configs, captures the decode graphs again and times
batch-1 decode steps the way benchmarks/quant_gpu.py does (the median interval between steps). A
process per variant costs ~35 s on an H200; here a variant costs 1-3 s, so a sweep of ~30 fits one
device call. The tuned tiles ("base") are timed again every few variants: a drift in them shows.

A variant is PROJECTION:FIELD=VALUE,...: qkv, o, gate_up or down, and fields over its tuned tile
(STAGES, SPLIT_K, NC, GC, ...; VALUE "-" drops the field), or LATE=1 / LATE=0: the next kernel
scheduled after this one's main loop / right after its wait (kernels/wq_gluon.py's late_launch;
the tuned tiles follow the model's early_next). Tiles outside the tuner's lists are taken as given.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRESET = "llama-3.1-8b"
GRAPH_ROWS = 16
# the 2026-11-29 sweep (docs/BENCHMARKS.md): around the tiles an H200 tuned for int4 at one row
DEFAULT_VARIANTS = [
    "o:STAGES=3", "o:STAGES=8", "o:SPLIT_K=2", "o:LATE=1", "o:NC=-", "o:NC=-,SPLIT_K=8", "o:NC=-,GC=80",
    "o:NC=-,GC=80,STAGES=8", "o:NC=-,GC=80,SPLIT_K=2", "o:NC=-,GC=64",
    "qkv:SPLIT_K=2", "qkv:STAGES=8", "qkv:STAGES=3", "qkv:GC=64", "qkv:GC=-,NC=2", "qkv:LATE=0", "qkv:SPLIT_K=8",
    "down:SPLIT_K=4", "down:STAGES=6", "down:STAGES=3", "down:GC=80", "down:GC=64", "down:NC=2,SPLIT_K=4",
    "down:LATE=0",
    "gate_up:STAGES=3", "gate_up:STAGES=6", "gate_up:GC=80", "gate_up:GC=-", "gate_up:LATE=1",
]


def parse_variant(spec: str) -> tuple[str, dict]:
    """'o:STAGES=8,NC=-' -> ('o', {'STAGES': 8, 'NC': None}): integers, None for '-', LATE a bool."""
    proj, _, fields = spec.partition(":")
    if proj not in ("qkv", "o", "gate_up", "down") or not fields:
        raise ValueError(f"a variant is qkv|o|gate_up|down:FIELD=VALUE,..., not {spec!r}")
    changes = {}
    for item in fields.split(","):
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise ValueError(f"{spec!r}: {item!r} is not FIELD=VALUE")
        changes[name] = None if value == "-" else (value == "1" if name == "LATE" else int(value))
    return proj, changes


def apply_changes(config: dict, changes: dict) -> dict:
    """The tuned ``config`` with ``changes`` (parse_variant's) over it; None drops a field."""
    out = dict(config)
    for name, value in changes.items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(N, K) of each decoder projection of a Llama-family ModelConfig (one TP rank: the whole)."""
    head_dim = cfg.head_dim
    q, kv = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
    return {"qkv": (q + 2 * kv, cfg.hidden_size), "o": (cfg.hidden_size, q),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="int4", choices=["int4", "int8"])
    ap.add_argument("--variant", action="append", default=[], help="PROJECTION:FIELD=VALUE,... (repeatable)")
    ap.add_argument("--only", nargs="+", default=[], help="the default variants that start with any of these")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps' medians a variant")
    ap.add_argument("--base-every", type=int, default=4)
    ap.add_argument("--budget", type=float, default=400.0, help="seconds of variants, then stop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = args.variant or [v for v in DEFAULT_VARIANTS
                                if not args.only or any(v.startswith(p) for p in args.only)]
    parsed = [(v, *parse_variant(v)) for v in variants]

    import torch
    from quant_gpu import decode_step_ms

    import kernels.wq_gluon as wq_gluon
    import kernels.wq_gluon_tune as tune
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine

    launch = tune._launch

    def launch_with_late(*a, **kw):  # a config's LATE: wq_gluon.PDL_LATE for its launches alone
        config = a[8]
        if "LATE" not in config:
            return launch(*a, **kw)
        before, wq_gluon.PDL_LATE = wq_gluon.PDL_LATE, config["LATE"]
        try:
            return launch(*a[:8], {k: v for k, v in config.items() if k != "LATE"}, *a[9:], **kw)
        finally:
            wq_gluon.PDL_LATE = before

    tune._launch = launch_with_late
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=f"dummy:{PRESET}", device="cuda", dtype="bfloat16", max_model_len=4096,
                                    max_num_batched_tokens=8192, max_num_seqs=GRAPH_ROWS,
                                    quantization=args.quantization))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    decode_step_ms(engine, 1, vocab, rng, 8)  # tunes (or reads) the 1-row tiles
    print(f"engine up in {time.perf_counter() - start:.0f} s", flush=True)
    shapes = projection_shapes(engine.model_config)
    keys = {}
    for proj, (n, k) in shapes.items():
        # tuned_config's keys: (N, K, group, bits, rows bucket (1: one row), bias)
        found = [key for key in tune._tuned if key[:2] == (n, k) and key[4] == 1]
        assert len(found) == 1, (proj, found)
        keys[proj] = found[0]
    base = {key: dict(tune._tuned[key]) for key in keys.values()}
    print(json.dumps({proj: base[key] for proj, key in keys.items()}), flush=True)
    runner = engine.runner

    def measure(label: str, proj: str | None = None, changes: dict | None = None) -> dict:
        tune._tuned.update({key: dict(cfg) for key, cfg in base.items()})
        if proj is not None:
            tune._tuned[keys[proj]] = apply_changes(base[keys[proj]], changes)
        t = time.perf_counter()
        runner.capture_graphs()
        ms = [decode_step_ms(engine, 1, vocab, rng) for _ in range(args.repeats)]
        print(f"{label:28s} {' '.join(f'{m:.4f}' for m in ms)}   ({time.perf_counter() - t:.0f} s)", flush=True)
        return {"variant": label, "ms": ms,
                "tile": None if proj is None else tune._tuned[keys[proj]]}

    results = {"gpu": torch.cuda.get_device_name(), "quantization": args.quantization,
               "tuned": {proj: base[key] for proj, key in keys.items()}, "runs": [measure("base")]}
    t0 = time.perf_counter()
    for i, (label, proj, changes) in enumerate(parsed):
        if time.perf_counter() - t0 > args.budget:
            print(f"budget: stopped before {label}", flush=True)
            break
        try:
            results["runs"].append(measure(label, proj, changes))
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile or launch
            print(f"{label}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            results["runs"].append({"variant": label, "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
            if "CUDA" in str(exc):  # the context may be gone
                break
        if i % args.base_every == args.base_every - 1:
            results["runs"].append(measure("base"))
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    results["runs"].append(measure("base"))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
