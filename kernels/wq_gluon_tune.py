"""kernels/wq_gluon.py's tiles, their tuner and the launch: the tile lists of the plain and the
warp-specialized kernel, the configs worth timing for a shape and rows, and the choice among them
at first use, timed as a decode step meets the kernel (back to back from a CUDA graph, over copies
of the weight that miss the L2); ``wq_gluon`` launches either kernel (here, not in wq_gluon.py,
which kernels/wq_gluon_ws.py imports its shared parts from)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from kernels import wq_gluon as wq_gluon_mod
from kernels._triton import PDL as ANY_PDL
from kernels._triton import pdl_launch, triton
from kernels.tune_cache import TuneCache, source_hash
from kernels.wq_gluon import BLOCK_K, TiledWeight

log = logging.getLogger(__name__)

# (BLOCK_N, num_warps, BLOCK_M, STAGES): a warpgroup owns BLOCK_N / (num_warps / 4) rows, 64 (one
# wgmma M) or 128 (two, which halves the loop's per-tile instructions a weight: 2.8 against 3.3 in
# the sm_90 SASS at 16 rows), each with the K splits below where the rows fit the split workspace
# (the engine's rows up to 64); 128 rows a warpgroup at 128 rows of x would spill
GLUON_TILES = [(64, 4, 8, 4), (64, 4, 16, 4), (64, 4, 16, 6), (128, 8, 16, 4),
               (128, 4, 16, 4), (128, 4, 16, 6), (256, 8, 16, 4), (64, 4, 32, 4), (128, 8, 32, 4), (128, 4, 32, 4),
               (64, 4, 64, 4), (128, 8, 64, 3), (128, 8, 64, 4), (128, 4, 64, 3), (64, 4, 128, 2), (64, 4, 128, 3),
               (64, 4, 128, 4), (128, 8, 128, 3), (64, 4, 256, 2), (128, 8, 256, 2)]
# the warp-specialized kernel's tiles (kernels/wq_gluon_ws.py; a fifth field, WS): 4 consumer warps,
# registers capped so that 3-4 CTAs fit an SM (wq_gluon.WS_MAXNREG). BLOCK_M 8 (wgmma's narrowest N,
# up to 8 rows of x) took every Llama-3.1-8B projection and the int8 LM head at 1 and 8 rows on an H200
# (docs/BENCHMARKS.md): gate_up at 1 row 24.6 µs against 30.7 with BLOCK_M 16 (int4), 35.9 against 41.2 (int8)
# A sixth field, NC 2: two consumer warpgroups taking alternate tiles (o_proj at 1 row 5.6 µs against 6.2,
# int8 7.5 against 8.3; gate_up and the LM head slower with it). 1-8 rows time BLOCK_M 8 tiles only:
# BLOCK_M 16 and 128-row BLOCK_M 8 tiles did not win there once these were listed, and every tile
# timed adds to the warm-up (82-88 s for the 8B in int4 or int8 with them, 58-65 s before)
# A seventh field, NS 2: two consumer warpgroups on the two halves of a 128-row tile of W, sharing x
# (kernels/wq_gluon_ws.py), timed from 33 rows of x, where one consumer's 64-row tiles re-read x from
# the L2 once each (gate_up at 256 rows, int8: 106.9 µs against 133.8, docs/BENCHMARKS.md); one CTA
# an SM (WS_NS_MAXNREG registers, 131-196 KB of shared memory)
# An eighth field, GC: one row of x, the group-column consumer (kernels/wq_gluon_ws.py), the field its
# register cap: the scales out of the unpacking, applied once a block of 8 tiles (int4: 110 instructions
# a tile in the sm_90 SASS's loop, not 171; int8 165, not 198). 64 registers let 4 CTAs share an SM
# (gate_up's 448 in one wave: int4 22.0 µs against 24.4 at 1 row, H200), 80 suit the small grids (qkv
# int4 6.6 against 7.9; docs/BENCHMARKS.md); timed for 1 row only
GLUON_WS_TILES = [(64, 4, 8, 3, True), (64, 4, 8, 4, True), (64, 4, 8, 4, True, 2),
                  (64, 4, 8, 4, True, 1, 1, 64), (64, 4, 8, 4, True, 1, 1, 80),
                  (64, 4, 16, 4, True), (64, 4, 16, 6, True), (64, 4, 32, 4, True), (64, 4, 64, 4, True),
                  (128, 4, 64, 4, True, 1, 2), (128, 4, 128, 3, True, 1, 2), (128, 4, 128, 4, True, 1, 2),
                  (128, 4, 256, 2, True, 1, 2)]
GLUON_NS = os.environ.get("KVCASCADE_GLUON_NS", "1") != "0"  # off: no NS tiles timed (the A/B)
GLUON_GC = os.environ.get("KVCASCADE_GLUON_GC", "1") != "0"  # off: no GC tiles timed (the A/B)
# GC tiles take x from the consumer, not the producer's TMA (kernels/wq_gluon_ws.py's GCX); off: the A/B
GLUON_GC_X = os.environ.get("KVCASCADE_GLUON_GC_X", "1") != "0"
WS_NS_MAXNREG = 168  # 12 warps at launch (the producer warp is padded to a warpgroup): 64 K registers an SM
GLUON_SPLITS = (1, 2, 4, 8)
# the most output tiles a projection that hands an RMS norm on (wq_gluon.py's _norm_out) may have: the
# next projection reads their partial sums one a lane of a warpgroup (_rms_parts)
RMS_MAX_PARTS = 128


def rows_block(m: int) -> int:
    """The BLOCK_M bucket of ``m`` rows: the power of two from 8 (wgmma's narrowest N) to 256."""
    return min(256, max(8, 1 << (m - 1).bit_length()))


def tile_flags(tile: tuple) -> tuple[bool, int, int, int]:
    """A tile tuple's fields after (BLOCK_N, num_warps, BLOCK_M, STAGES): (WS, NC, NS, GC), each
    at its default (False, 1, 1, 0) where the tuple stops or the tile is the plain kernel's."""
    ws = len(tile) > 4 and bool(tile[4])
    given = tuple(tile[5:8]) if ws else ()
    nc, ns, gc = given + (1, 1, 0)[len(given):]
    return ws, nc, ns, gc


def gluon_configs(m: int, n: int, k: int, split_rows: int, tiles: list[tuple] | None = None) -> list[dict]:
    """The tiles (GLUON_TILES, or ``tiles``) worth timing for ``m`` rows: BLOCK_M at the rows'
    bucket or half of it (from 16; 8 rows or fewer: 8 only), K splits into equal, even numbers of
    tiles while the blocks are few (~4 waves of 132 SMs). K must be an even number of tiles (gluon_fits)."""
    bucket = rows_block(m)
    out = []
    for tile in tiles or GLUON_TILES:
        bn, warps, bm, stages = tile[:4]
        ws, nc, ns, gc = tile_flags(tile)
        if gc:  # one row of x, BLOCK_M columns: x's row in column i % BLOCK_M of tile i
            if m != 1:
                continue
        elif bm not in ((8, ) if bucket == 8 else (bucket, max(16, bucket // 2))):
            continue
        if ns > 1 and m < 33:  # a CTA an SM and no K split: for the many rows only
            continue
        blocks = -(-n // bn) * -(-m // bm)
        for split in GLUON_SPLITS:
            if (k // BLOCK_K) % (2 * split * nc) or (split * nc > 1 and m > split_rows) or (split > 1 and ns > 1):
                continue
            if split > 1 and blocks * split > 528:
                continue
            out.append(dict(BLOCK_N=bn, num_warps=warps, BLOCK_M=bm, STAGES=stages, SPLIT_K=split, WS=ws,
                            **({"NC": nc} if nc > 1 else {}), **({"NS": ns} if ns > 1 else {}),
                            **({"GC": gc} if gc else {})))
    return out


_tuned: dict[tuple, dict] = {}
# the tuner times each tile over copies of the weight that together miss the L2 (50 MB on an
# H200), replayed back to back from one CUDA graph, as a decode step meets them: do_bench on
# the one weight (its L2 flushed between calls) picked tiles 15% slower a layer at 16 rows on an
# H200 than the sweep's best (docs/BENCHMARKS.md)
TUNE_BYTES = 256 << 20


def graph_us(calls: list, samples: int = 5, replays: int = 3) -> float:
    """Median µs a call of ``calls`` (compiled and tuned by a first call outside the capture),
    replayed back to back from one CUDA graph: the median of ``samples`` timings of ``replays``
    replays (benchmarks/quant_gpu.py times its paths so too)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays / len(calls) * 1e3)
    return sorted(times)[len(times) // 2]


_disk: dict[int, TuneCache] = {}


def disk_cache(device: torch.device) -> TuneCache:
    """The on-disk choices for ``device`` (kernels/tune_cache.py): fingerprinted by the GPU, torch,
    Triton, these kernels' sources (tile lists included) and the launch flags that move timings."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    cache = _disk.get(index)
    if cache is None:
        props = torch.cuda.get_device_properties(index)
        here = Path(__file__).resolve().parent
        sources = [here / f for f in ("wq_gluon.py", "wq_gluon_ws.py", "wq_gluon_tune.py")]
        fingerprint = dict(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                           torch=torch.__version__, triton=triton.__version__, source=source_hash(*sources),
                           pdl=bool(ANY_PDL and wq_gluon_mod.PDL), pdl_late=str(wq_gluon_mod.PDL_LATE),
                           pdl_late_rows=wq_gluon_mod.PDL_LATE_ROWS, ns=GLUON_NS, gc=GLUON_GC,
                           gc_x=GLUON_GC_X)
        cache = _disk[index] = TuneCache("wq_gluon", fingerprint)
    return cache


def tuned_config(x: torch.Tensor, weight: TiledWeight, out: torch.Tensor, bias: torch.Tensor | None,
                 ws: torch.Tensor, cnt: torch.Tensor, split_rows: int) -> dict:
    """The fastest of gluon_configs for this shape and rows bucket: read from the disk cache
    (kernels/tune_cache.py), else timed at first use (warm-up, before CUDA-graph capture) on the
    call's x, over transient copies of the weight (TUNE_BYTES), and written there."""
    (m, k), n = x.shape, weight.shape[0]
    key = (n, k, weight.group_size, weight.bits, rows_block(m) if m > 1 else 1, bias is not None)
    cfg = _tuned.get(key)
    if cfg is not None:
        return cfg
    ws_tiles = [t for t in GLUON_WS_TILES if (GLUON_NS or tile_flags(t)[2] == 1) and (GLUON_GC or not tile_flags(t)[3])]
    configs = gluon_configs(m, n, k, split_rows, GLUON_TILES + ws_tiles)
    disk = disk_cache(x.device)
    disk_key = TuneCache.key(key + (split_rows, ))
    cfg = disk.get(disk_key)
    if cfg is None or cfg not in configs:  # not there, or a config these lists no longer make
        assert not (x.is_cuda and torch.cuda.is_current_stream_capturing()), \
            "wq_gluon: a shape first met inside CUDA-graph capture"
        start = time.perf_counter()
        words, sb = weight.words, weight.sb
        copies = [(words, sb)] + [(words.clone(), sb.clone())
                                  for _ in range(max(1, TUNE_BYTES // (words.nbytes + sb.nbytes)) - 1)]
        timed = []
        for c in configs:
            calls = [lambda w=w, s=s, c=c: _launch(x, w, s, weight.group_size, out, bias, ws, cnt, c, False,
                                                   weight.bits) for w, s in copies]
            timed.append((graph_us(calls), len(timed), c))
        us, _, cfg = min(timed)
        del copies
        torch.cuda.empty_cache()
        seconds = time.perf_counter() - start
        log.debug("wq_gluon: %s tuned in %.1f s over %d configs: %s (%.1f µs)", key, seconds, len(configs), cfg, us)
        disk.put(disk_key, cfg, us=round(us, 2), configs=len(configs), seconds=round(seconds, 1))
    _tuned[key] = cfg
    return cfg


_descs: dict[tuple, object] = {}


def wq_gluon(x: torch.Tensor, weight: TiledWeight, out: torch.Tensor, bias: torch.Tensor | None,
             ws: torch.Tensor, cnt: torch.Tensor, config: dict, act: torch.Tensor | None = None,
             norm_out: tuple | None = None, norm_in: tuple | None = None, early_next: bool = False) -> None:
    """out = x @ W^T (+ bias) through the kernel at ``config`` (kernels/wq_gluon_tune.py's
    dicts); ws, cnt: kernels/wq_matmul.py's split workspace (zero), for SPLIT_K > 1. ``act``
    [M, N / 2]: out is gate|up, and act gets silu(gate) * up (wq_gluon.py's _silu_pair; N / 2 a
    multiple of the tile's BLOCK_N, cnt holding 1.5 counters an output tile, zero). One row of x
    only: ``norm_out`` (residual, norm_weight, parts): out gets an add-RMS norm's elementwise part
    instead, the residual the sum, in place (wq_gluon.py's _norm_out); ``norm_in`` (parts, eps): out scaled by
    that norm's 1 / rms (kernels/wq_matmul.py's wq_matmul_norm says the whole). ``early_next``: the
    next kernel scheduled right after this one's wait, not after its main loop (wq_gluon.py's late_launch)."""
    _launch(x, weight.words, weight.sb, weight.group_size, out, bias, ws, cnt, config, bits=weight.bits, act=act,
            norm_out=norm_out, norm_in=norm_in, early_next=early_next)


def block_n(config: dict) -> int:
    """The output rows (of W) a program of ``config`` owns."""
    return config.get("BLOCK_N", 16 * config["num_warps"])


def _launch(x: torch.Tensor, words: torch.Tensor, sb: torch.Tensor, group: int, out: torch.Tensor,
            bias: torch.Tensor | None, ws: torch.Tensor, cnt: torch.Tensor, config: dict,
            keep_desc: bool = True, bits: int = 4, act: torch.Tensor | None = None, norm_out: tuple | None = None,
            norm_in: tuple | None = None, early_next: bool = False) -> None:
    (m, k), n = x.shape, words.shape[0]
    bm, warps, split = config["BLOCK_M"], config["num_warps"], config["SPLIT_K"]
    bn = block_n(config)
    norm = dict(res_ptr=out, nw_ptr=out, ss_ptr=out, n_parts=0, eps=0.0)  # (unused: any pointers)
    if norm_out is not None or norm_in is not None:
        assert m == 1 and config.get("NS", 1) == 1 and not (norm_out is not None and (act is not None or norm_in))
    if norm_out is not None:
        res, nw, parts = norm_out
        assert res.shape == out.shape and res.is_contiguous()
        assert nw.shape == (n, ) and parts.shape == (triton.cdiv(n, bn), ) and parts.dtype == torch.float32
        norm.update(res_ptr=res, nw_ptr=nw, ss_ptr=parts, NORM_OUT=True)
    if norm_in is not None:
        parts, eps = norm_in
        assert parts.dtype == torch.float32 and parts.numel() <= RMS_MAX_PARTS
        norm.update(ss_ptr=parts, n_parts=parts.numel(), eps=float(eps), NORM_IN=True)
    if act is not None:  # _silu_pair's tiles pair up across the halves; its counters follow the split ones
        assert n % (2 * bn) == 0 and act.shape == (m, n // 2) and act.is_contiguous()
        assert cnt.numel() >= triton.cdiv(m, bm) * (n // bn) * 3 // 2
    x_layout = wq_gluon_mod.gl.NVMMASharedLayout.get_default_for([bm, BLOCK_K], wq_gluon_mod.gl.bfloat16)
    x_desc = wq_gluon_mod.TensorDescriptor(x, [m, k], [x.stride(0), 1], [bm, BLOCK_K], x_layout)
    key = (words.data_ptr(), bn)
    w_desc = _descs.get(key)
    if w_desc is None or w_desc.base is not words:
        wpt = BLOCK_K * bits // 32  # words a row's tile
        w_layout = wq_gluon_mod.gl.NVMMASharedLayout.get_default_for([bn, wpt], wq_gluon_mod.gl.int32)
        w_desc = wq_gluon_mod.TensorDescriptor(words, list(words.shape), [words.stride(0), 1], [bn, wpt], w_layout)
        if keep_desc:  # the tuner's transient copies are not kept alive by the cache
            _descs[key] = w_desc
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    kernel, extra = wq_gluon_mod._wq_gluon_kernel, {}
    if config.get("WS"):
        from kernels.wq_gluon_ws import _wq_gluon_ws_kernel as kernel

        ns, gc = config.get("NS", 1), config.get("GC", 0)
        extra = dict(maxnreg=WS_NS_MAXNREG if ns > 1 else gc or wq_gluon_mod.WS_MAXNREG[bm], x_ptr=x)
        if gc:  # its register cap
            assert m == 1, m
            extra.update(GC=1, GCX=GLUON_GC_X)
        if config.get("NC", 1) > 1:
            extra["NC"] = config["NC"]
        if ns > 1:
            extra["NS"] = ns
    kernel[grid](x_desc, w_desc, sb, out if bias is None else bias, out, ws, cnt, out if act is None else act, m, n,
                 k, sb.stride(0), out.stride(0), ACT=act is not None, GROUP=group, HAS_BIAS=bias is not None,
                 BLOCK_N=bn, BLOCK_M=bm,
                 STAGES=config["STAGES"], SPLIT_K=split, num_warps=warps, INFLIGHT=config.get("INFLIGHT", 1), BITS=bits,
                 LATE_LAUNCH=wq_gluon_mod.late_launch(m, early_next),
                 **(pdl_launch(x.device) if wq_gluon_mod.PDL else dict(USE_PDL=False, launch_pdl=False)), **extra,
                 **norm)
