"""What a 1-row projection's weight stream costs through TMA, by box shape: a warp-specialized
Gluon kernel whose producer warp keeps a ring of TMA boxes full and whose consumer warpgroup only
reads each stage from shared memory (XOR into a register tile) and releases it, no unpacking and no
wgmma. Asks whether int4's 64-byte box rows (a 64 x 16-word tile of a row-major [N, K / 8] weight)
cap the kernels/wq_gluon_ws.py kernels below the copy rate, where int8's 128-byte rows do not.

    python benchmarks/tma_box_gpu.py [--out tma.json]

Each line: µs a call, replayed back to back from a CUDA graph over copies of the weight that miss
the L2 (kernels/wq_gluon_tune.py graph_us, as the tuner times tiles), and the rate it reads at.
Layouts: "rows" boxes [BN, BW] of the row-major words; "tiles" the same bytes stored tile-major
(each BN x 16-word tile contiguous), read as [BN * 16 / 32, 32]-word boxes (128-byte rows).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.wq_gluon_tune import TUNE_BYTES, graph_us  # noqa: E402


@gluon.jit
def _load(w_desc, w_smem, ready, empty, row0, rstep, col0, cstep, tiles, STAGES: gl.constexpr):
    """Tile i of the program: the box at (row0 + i rstep, col0 + i cstep)."""
    for i in range(tiles):
        s = i % STAGES
        if i >= STAGES:
            mbarrier.wait(empty.index(s), (i // STAGES - 1) & 1)
        mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [row0 + i * rstep, col0 + i * cstep], ready.index(s), w_smem.index(s))


@gluon.jit
def _sink(w_smem, ready, empty, out_ptr, tiles, BR: gl.constexpr, BW: gl.constexpr, STAGES: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // BW, BW // 4], [4, 1], [1, 0])
    acc = gl.zeros([BR, BW], gl.int32, layout)
    for i in range(tiles):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        acc ^= w_smem.index(s).load(layout)
        mbarrier.arrive(empty.index(s))
    pid = gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
    gl.store(out_ptr + pid, gl.sum(gl.sum(acc, axis=1), axis=0))


@gluon.jit
def _stream_kernel(w_desc, out_ptr, tiles, RSTEP_N: gl.constexpr, RSTEP_T: gl.constexpr, CSTEP_N: gl.constexpr,
                   CSTEP_T: gl.constexpr, STAGES: gl.constexpr):
    """Program (n, k): tiles boxes from (n RSTEP_N + k tiles RSTEP_T, n CSTEP_N + k tiles CSTEP_T),
    each RSTEP_T rows and CSTEP_T columns after the one before."""
    BR: gl.constexpr = w_desc.block_type.shape[0]
    BW: gl.constexpr = w_desc.block_type.shape[1]
    n = gl.program_id(0)
    k = gl.program_id(1)
    row0 = n * RSTEP_N + k * tiles * RSTEP_T
    col0 = n * CSTEP_N + k * tiles * CSTEP_T
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BR, BW], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([(_sink, (w_smem, ready, empty, out_ptr, tiles, BR, BW, STAGES)),
                        (_load, (w_desc, w_smem, ready, empty, row0, RSTEP_T, col0, CSTEP_T, tiles, STAGES))],
                       [1], [24])


def run(n: int, kw: int, bn: int, bw: int, stages: int, split: int, tile_major: bool, maxnreg: int) -> dict:
    """Words [n, kw] int32 read in [bn, bw] boxes (tile_major: each bn x bw tile stored contiguously,
    read as [bn bw / 32, 32] boxes), n / bn x split programs."""
    copies = max(2, TUNE_BYTES // (n * kw * 4))
    if tile_major:
        br, bc = bn * bw // 32, 32
        ws = [torch.randint(-2**31, 2**31 - 1, (n * kw // 32, 32), dtype=torch.int32, device="cuda")
              for _ in range(copies)]
        tiles_row = kw // bw  # tiles along K in a row block, stored one after another
        steps = dict(RSTEP_N=tiles_row * br, RSTEP_T=br, CSTEP_N=0, CSTEP_T=0)
    else:
        br, bc = bn, bw
        ws = [torch.randint(-2**31, 2**31 - 1, (n, kw), dtype=torch.int32, device="cuda") for _ in range(copies)]
        steps = dict(RSTEP_N=bn, RSTEP_T=0, CSTEP_N=0, CSTEP_T=bw)
    layout = gl.NVMMASharedLayout.get_default_for([br, bc], gl.int32)
    descs = [TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [br, bc], layout) for w in ws]
    tiles = kw // bw // split
    out = torch.empty(n // bn * split, dtype=torch.int32, device="cuda")
    grid = (n // bn, split)

    def call(d):
        _stream_kernel[grid](d, out, tiles, STAGES=stages, num_warps=4, maxnreg=maxnreg, **steps)

    us = graph_us([lambda d=d: call(d) for d in descs])
    nbytes = n * kw * 4
    return dict(n=n, kw=kw, box=[br, bc], tile=[bn, bw], stages=stages, split=split, tile_major=tile_major,
                maxnreg=maxnreg, us=us, tbps=nbytes / us / 1e6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cases = []
    # gate_up int4 [28672, 512 words]: the GC kernel's 64 x 16-word boxes (64-byte rows), then wider
    # rows, deeper rings, taller boxes, and the tile-major form; int8's [28672, 1024] for reference
    for bn, bw, st, sp, tm, reg in [(64, 16, 4, 1, False, 64), (64, 16, 8, 1, False, 64), (64, 16, 4, 2, False, 64),
                                    (64, 32, 4, 1, False, 64), (64, 32, 2, 1, False, 64), (128, 16, 4, 1, False, 64),
                                    (64, 16, 4, 1, True, 64), (64, 16, 8, 1, True, 64), (128, 16, 4, 1, True, 64)]:
        cases.append(("gate_up int4", 28672, 512, bn, bw, st, sp, tm, reg))
    cases.append(("gate_up int8", 28672, 1024, 64, 32, 4, 1, False, 64))
    for bn, bw, st, sp, tm in [(64, 16, 4, 8, False), (64, 32, 4, 8, False), (64, 16, 4, 8, True),
                               (64, 16, 4, 4, False), (64, 16, 4, 4, True)]:
        cases.append(("down int4", 4096, 1792, bn, bw, st, sp, tm, 64))
    results = []
    for name, n, kw, bn, bw, st, sp, tm, reg in cases:
        t = time.time()
        try:
            r = dict(name=name, **run(n, kw, bn, bw, st, sp, tm, reg))
        except Exception as exc:  # noqa: BLE001 - a box that does not fit
            print(f"{name} {bn}x{bw} st{st} split{sp} tile_major={tm}: {type(exc).__name__} {exc}"[:300], flush=True)
            continue
        results.append(r)
        print(f"{name:13s} box {r['box']} tile {bn}x{bw} st{st} split{sp} {'tile-major' if tm else 'row-major '}"
              f" {r['us']:7.2f} us {r['tbps']:5.2f} TB/s ({time.time() - t:.0f} s)", flush=True)
    if args.out:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, results=results),
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
