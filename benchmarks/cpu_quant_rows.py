"""What a packed projection costs on this CPU by rows: the served path's int4 and int8 matmuls
(worker/models/quantization.py: torch's packed kernels) against the float forms of the same weight.

    python benchmarks/cpu_quant_rows.py [--rows 1 16 64 256 512] [--out rows.json]

Per Qwen2.5-Coder-1.5B projection shape (random weights): the median time of one call of
- int4 in groups of 32 (the GGUF's Q4_K served as shipped) and int8 per channel, as
  ``QuantizedLinearWeight.matmul`` runs them (bf16 activations);
- fp32 ``F.linear`` (``--quantization none``: the GGUF dequantized) and the bf16 weight held packed
  for oneDNN (``worker/models/dense_packed.py``, where this CPU has bf16);
- the same int4 and int8 weights unpacked to bf16 a slab at a time and multiplied by oneDNN
  (``QuantizedLinearWeight._matmul_unpacked``, what the served path takes from
  ``quantization.CPU_UNPACK_ROWS`` rows), with its largest error against the dequantized weight.
One decode step is one row; a prefill chunk is its prompt's rows (up to max_num_batched_tokens).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F

from dense_packed_rows import median_ms  # (this folder: the script's own)
from kernels.wquant import quantize
from worker.models import quantization
from worker.models.dense_packed import PackedDenseWeight, packable
from worker.models.quantization import QuantizedLinearWeight, QuantSpec

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}


def packed_linear(w: torch.Tensor, bits: int, group: int) -> tuple[QuantizedLinearWeight, torch.Tensor]:
    """The projection as served, and its weight dequantized (the reference)."""
    layer = QuantizedLinearWeight(*w.shape, QuantSpec(bits, group), device="cpu")
    q = quantize(w, layer.bits, layer.group_size)
    layer.data.copy_(q)
    layer.finalize()
    return layer, q.dequantize(torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    bf16 = packable(torch.zeros(1, 1, dtype=torch.bfloat16))
    result = {"cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
              "amx": torch.cpu._is_amx_tile_supported(), "threads": torch.get_num_threads(), "shapes": {}}
    print(f"{result['capability']}, AMX {result['amx']}, {result['threads']} threads; ms a call")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * k ** -0.5
        (int4, ref4), (int8, ref8) = packed_linear(w, 4, 32), packed_linear(w, 8, k)
        dense = PackedDenseWeight(w.bfloat16()) if bf16 else None
        x = torch.randn(max(args.rows), k)
        top = x.bfloat16()
        row = {"unpacked max error": {
            "int4": (int4._matmul_unpacked(top).float() - top.float() @ ref4.t()).abs().max().item(),
            "int8": (int8._matmul_unpacked(top).float() - top.float() @ ref8.t()).abs().max().item()},
            "by rows": {}}
        quantization.CPU_UNPACK_ROWS = 0  # matmul: torch's packed kernels at any rows
        for m in args.rows:
            xm, xb = x[:m], top[:m]
            times = {"int4": median_ms(lambda: int4.matmul(xm), args.repeats),
                     "int4 unpacked": median_ms(lambda: int4._matmul_unpacked(xb), args.repeats),
                     "int8": median_ms(lambda: int8.matmul(xm), args.repeats),
                     "int8 unpacked": median_ms(lambda: int8._matmul_unpacked(xb), args.repeats),
                     "fp32": median_ms(lambda: F.linear(xm, w), args.repeats)}
            if dense is not None:
                times["bf16 (oneDNN packed)"] = median_ms(lambda: dense.matmul(xb), args.repeats)
            row["by rows"][m] = times
            print(f"{name:8s} {m:4d} rows: " + "  ".join(f"{key} {t:7.2f}" for key, t in times.items()), flush=True)
        print(f"{name:8s} unpacked, largest error against the dequantized weight: {row['unpacked max error']}")
        result["shapes"][name] = row
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
