"""Decode attention at short contexts: the CUDA graphs' split count against one split (no merge).

    python benchmarks/decode_splits_gpu.py [--batches 1 2 4 8 16] [--contexts 64 128 ...] [--out x.json]

A decode graph fixes its split count at capture from the block table's width (max_model_len, 4,096
here), so a 150-token context at batch 1 runs 32 splits, most of them empty, and the merge. Per
(batch, context, splits): a CUDA graph of 32 attention calls, one a layer over 32 layers' own
blocks of one pool (Llama-3.1-8B's 32 heads, 8 KV heads, head_dim 128, bf16, block 16), launched
with PDL as in the engine; µs a call, the median of replays with the L2 flushed before each.
The crossover measured here did not carry over to the engine (docs/BENCHMARKS.md, issue 18's
2026-11-27 argmax section): under PDL the attention overlaps the next projection's weight fetch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import default_num_splits, paged_decode_attention, paged_decode_attention_ref  # noqa: E402

H, KVH, D, BLOCK, LAYERS, MAX_LEN = 32, 8, 128, 16, 32, 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 128, 192, 256, 384, 512, 768, 1024, 2048])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    width = MAX_LEN // BLOCK
    blocks = LAYERS * max(args.batches) * -(-max(args.contexts) // BLOCK) + 1
    k_cache = torch.randn(blocks, BLOCK, KVH, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for batch in args.batches:
        default = default_num_splits(batch, KVH, MAX_LEN, dev)
        for ctx in args.contexts:
            need = -(-ctx // BLOCK)
            perm = torch.randperm(blocks - 1, device=dev)[: LAYERS * batch * need].to(torch.int32) + 1
            tables = torch.zeros(LAYERS, batch, width, dtype=torch.int32, device=dev)
            tables[:, :, :need] = perm.view(LAYERS, batch, need)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            q = torch.randn(LAYERS, batch, H, D, device=dev, dtype=torch.bfloat16)
            out = torch.empty(LAYERS, batch, H, D, device=dev, dtype=torch.bfloat16)
            row = {"batch": batch, "context": ctx, "default_splits": default, "us": {}}
            want = paged_decode_attention_ref(q[0], k_cache, v_cache, tables[0], lens, D**-0.5)
            for splits in sorted({default, *args.splits}):
                def step(s=splits):
                    for layer in range(LAYERS):
                        paged_decode_attention(q[layer], k_cache, v_cache, tables[layer], lens, D**-0.5, s, out=out[layer])
                step()
                err = (out[0].float() - want.float()).abs().max().item()
                assert err < 2e-2, (batch, ctx, splits, err)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                times = []
                for _ in range(args.reps):
                    flush.zero_()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3 / LAYERS)
                row["us"][splits] = statistics.median(times)
                del graph
            res["cases"].append(row)
            cells = "  ".join(f"{s}:{us:6.2f}" for s, us in sorted(row["us"].items()))
            print(f"batch {batch:3d} ctx {ctx:5d} (graph's {default:2d} splits)  us a call by splits  {cells}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
