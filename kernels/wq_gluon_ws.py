"""kernels/wq_gluon.py's W4A16 kernel, warp-specialized: one producer warp keeps the TMA ring full
and the consumer warpgroup releases each stage by an mbarrier arrive once the wgmma that read it
is retired, so the loop holds no CTA barrier (the plain kernel's four a tile: its own stage
release and three that Triton puts around the expect and the TMA issues; ncu on an H200 saw 41% of
the scheduler cycles with no eligible warp, docs/BENCHMARKS.md).

Stage s's "ready" barrier completes when tile i's bytes land (the producer's expect and TMAs);
its "empty" barrier when the consumer releases tile i, which lets the producer load tile
i + STAGES there. Same tiles, unpacking, layout and epilogue as the plain kernel; one consumer
warpgroup (4 warps), so one arrive a release. With NC 2 a second consumer warpgroup takes every
other tile (each tile still released by one arrive) and the two add their sums as K splits.

With NS 2 (tiles of 33 rows of x and up) the two consumer warpgroups split the tile's BLOCK_N rows of W
instead, 64 each, and both read every stage's x (a stage released by two arrives): x is read from
the L2 once for each 128 rows of W, not 64. At 256 rows that re-reading was what bound the
one-consumer kernel (gate_up: ~0.94 GB of x a call, docs/BENCHMARKS.md); the 8-warp plain kernel
that halved it lost its gain to the CTA barriers its warps meet at each tile.

With GC (one row of x, the group-column consumer) the scale leaves the unpacking: a tile is unpacked
to 128 + q (int4: one LOP3 a nibble pair, 7 instructions a word, not 15) or q (int8: 7, not 9) and
its wgmma adds it times x into column i % 8 of the accumulator, x's one row having been put in row
i % 8 of tile i's stage by the producer (TMA at row -(i % 8) of a one-row tensor: the rows it
fills with zeros are the other seven). Each column then holds one tile's sums, exact in fp32, and
once a block of 8 tiles the consumer waits for its wgmmas and adds s P (int8) or s P + (b - 128 s) X
(int4; X the tile's sum of x, read from the L2) into the row's total. No weight is rounded to bf16,
so the outputs are closer to q s + b than the dequantized tile's (relative error 1.6-1.7e-3 against
2.3e-3). Reading an accumulator while other wgmmas fly made ptxas serialize them (C7514, the
tile-scale trial in docs/BENCHMARKS.md), so a block ends with its chain drained: one wait in 8 tiles.

With GCX (the group-column tiles as launched) x does not come through the ring: the consumer loads a
block's 8 tiles of x a block ahead into registers (8 bf16 a thread) and, once the block before is
drained, stores them as the 8 operand tiles the producer's boxes used to fill (tile j: x's tile in
row j, zeros in the others), so the producer streams the weight alone and never waits for the
kernel before. In the engine that was -13 to -16 µs a batch-1 step in int4 on an H200; leaving
x out of the ring altogether (wrong outputs) bounded it at -46 to -50 (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from kernels.wq_gluon import HAS_GLUON

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from kernels.wq_gluon import (_BK, _inv_rms, _pdl_launch, _pdl_wait, _rms_parts, _store, _unpack_tile,
                                  _unpack_tile_gc, _words_layout)

    WS_NC2_REGS = gl.constexpr(64)  # the second consumer warpgroup's registers (a worker partition's)

    @gluon.jit
    def _producer(x_desc, w_desc, x_smem, w_smem, ready, empty, off_m, off_n, t0, tiles, STAGES: gl.constexpr,
                  USE_PDL: gl.constexpr, WPT: gl.constexpr, LATE_LAUNCH: gl.constexpr, GC: gl.constexpr = 0,
                  XTMA: gl.constexpr = True):
        """The TMA ring: the weights' first stages before the wait for the kernel before (PDL), x's
        after, then each tile once the consumer released the tile STAGES before it. GC > 0 (one row of
        x, GC columns): tile i's x lands in row i % GC of its stage, the box's other rows zero (TMA fills rows
        outside the tensor with zeros, those above its first row too). XTMA False (GCX): the weights
        only, never waiting for the kernel before (no kernel writes them); the consumer puts x in place."""
        nbytes: gl.constexpr = (x_desc.block_type.nbytes if XTMA else 0) + w_desc.block_type.nbytes
        for i in gl.static_range(STAGES):
            pred = i < tiles
            mbarrier.expect(ready.index(i), nbytes, pred=pred)
            tma.async_copy_global_to_shared(w_desc, [off_n, (t0 + i) * WPT], ready.index(i), w_smem.index(i), pred)
        if USE_PDL and XTMA:
            _pdl_wait(not LATE_LAUNCH)  # late: the consumer's wait at the end schedules the next kernel
        elif USE_PDL and not LATE_LAUNCH:
            _pdl_launch()
        if XTMA:
            for i in gl.static_range(STAGES):
                xrow = off_m
                if GC:
                    xrow = off_m - i % GC
                tma.async_copy_global_to_shared(x_desc, [xrow, (t0 + i) * _BK], ready.index(i), x_smem.index(i),
                                                i < tiles)
        for i in range(STAGES, tiles):
            s = i % STAGES
            mbarrier.wait(empty.index(s), (i // STAGES - 1) & 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(w_desc, [off_n, (t0 + i) * WPT], ready.index(s), w_smem.index(s))
            if XTMA:
                xrow = off_m
                if GC:
                    xrow = off_m - i % GC
                tma.async_copy_global_to_shared(x_desc, [xrow, (t0 + i) * _BK], ready.index(s), x_smem.index(s))

    @gluon.jit
    def _consumer_tile(i, t0, tiles, acc, sb, sb_ptrs, x_smem, w_smem, ready, empty, a_layout: gl.constexpr,
                       w_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TPG: gl.constexpr,
                       BITS: gl.constexpr, NC: gl.constexpr = 1, S: gl.constexpr = 0, NS: gl.constexpr = 1):
        """Tile i: its wgmma issued, the consumer's tile before (i - NC) retired and its stage
        released (NC 2: two consumer warpgroups take alternate tiles; one retires each tile in its
        own step and releases it there, so that the two hold 2 stages, not 4). BLOCK_N: this
        consumer's rows of W, from row S BLOCK_N of the stage's; NS 2 retires each tile in its step
        too (an asynchronous chain in each of two partitions: ptxas serialized it, C7512), and the
        other consumer's unpacking fills the wait."""
        stage = i % STAGES
        sb_next = gl.load(sb_ptrs + (t0 + gl.minimum(i + NC, tiles - 1)) // TPG)
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        a = _unpack_tile(w_smem.index(stage).slice(S * BLOCK_N, BLOCK_N).load(w_layout), sb, a_layout, BLOCK_N, BITS)
        acc = warpgroup_mma(a, x_smem.index(stage).permute((1, 0)), acc, is_async=True)
        if NC == 1 and NS == 1:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(stage))
        return acc, sb_next

    @gluon.jit
    def _consumer(x_smem, w_smem, ready, empty, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N, stride_sb,
                  stride_om, off_m, off_n, pid_n, pid_m, t0, tiles, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr,
                  USE_PDL: gl.constexpr, num_warps: gl.constexpr, BITS: gl.constexpr, ACT: gl.constexpr,
                  C: gl.constexpr = 0, NC: gl.constexpr = 1, S: gl.constexpr = 0, NS: gl.constexpr = 1, K=0,
                  res_ptr=None, nw_ptr=None, ss_ptr=None, n_parts=0, eps=0.0,
                  NORM_OUT: gl.constexpr = False, NORM_IN: gl.constexpr = False):
        """Consumer C of NC (alternate tiles) or S of NS (its BLOCK_N / NS rows of the tile's W).
        NORM_OUT, NORM_IN: wq_gluon.py's _norm_out, _rms_parts (one row of x)."""
        if NORM_IN:  # the norm's parts, from the kernel before: after the wait for it
            if USE_PDL:
                _pdl_wait(False)
            inv_rms = _inv_rms(_rms_parts(ss_ptr, n_parts, num_warps), K, eps)
        ROWS: gl.constexpr = BLOCK_N // NS  # this consumer's rows of W
        off_n = off_n + S * ROWS
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        w_layout: gl.constexpr = _words_layout(ROWS, num_warps, BITS)
        rows = gl.minimum(off_n + gl.arange(0, ROWS, layout=gl.SliceLayout(1, w_layout)), N - 1)
        sb_ptrs = sb_ptr + rows.to(gl.int64) * stride_sb
        TPG: gl.constexpr = GROUP // _BK
        sb = gl.load(sb_ptrs + (t0 + C) // TPG)
        acc = gl.zeros([ROWS, BLOCK_M], gl.float32, mma)
        # two tiles an iteration: wq_gluon.py's _wq_gluon_kernel says why; consumer C of NC takes
        # tiles C, C + NC, ...
        for j in range(tiles // (2 * NC)):
            acc, sb = _consumer_tile(2 * NC * j + C, t0, tiles, acc, sb, sb_ptrs, x_smem, w_smem, ready, empty,
                                     a_layout, w_layout, ROWS, STAGES, TPG, BITS, NC, S, NS)
            acc, sb = _consumer_tile(2 * NC * j + NC + C, t0, tiles, acc, sb, sb_ptrs, x_smem, w_smem, ready, empty,
                                     a_layout, w_layout, ROWS, STAGES, TPG, BITS, NC, S, NS)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if NORM_IN:
            acc = acc * inv_rms
        if USE_PDL:  # out and ws only after the kernel before
            _pdl_wait()
        # NC consumers: each adds its part as a K split of its own (NS: each stores its own rows;
        # pid_n counts NS-row tiles, which only split and SiLU counters would see: NS runs neither)
        _store(acc, off_n, off_m, pid_n, pid_m, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N, stride_om, mma,
               HAS_BIAS, ROWS, BLOCK_M, SPLIT_K * NC, ACT, res_ptr, nw_ptr, ss_ptr, NORM_OUT)

    @gluon.jit
    def _gc_tile(i, release, acc, x_smem, w_smem, ready, empty, a_layout: gl.constexpr, w_layout: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, BITS: gl.constexpr, GC: gl.constexpr = 8,
                 GCX: gl.constexpr = False):
        """Tile i of the group-column consumer: its wgmma issued, the tile before retired and (release)
        its stage released. GCX: its x is x_smem's tile i % GC (_x_diag), not its stage's."""
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        a = _unpack_tile_gc(w_smem.index(stage).load(w_layout), a_layout, BLOCK_N, BITS)
        xt = x_smem.index(i % GC) if GCX else x_smem.index(stage)
        acc = warpgroup_mma(a, xt.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=release)
        return acc

    @gluon.jit
    def _gc_block(blk, total, x_ptr, x_offs, x_smem, w_smem, ready, empty, sb_rows, cols, t0, tiles,
                  a_layout: gl.constexpr, w_layout: gl.constexpr, mma: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, TPG: gl.constexpr, BITS: gl.constexpr, GC: gl.constexpr,
                  GCX: gl.constexpr = False, xv=None):
        """Block blk of GC tiles (nt of them: GC, or the split's last few, an even number), added into
        total. Its scales (and int4's x) are asked for first, so their latency passes under its tiles.
        GCX: its x is ``xv`` ([GC, 128], asked for a block ahead), put in place here (_x_diag)."""
        nt = gl.minimum(tiles - blk * GC, GC)
        tile0 = t0 + blk * GC
        sb = gl.load(sb_rows + gl.expand_dims((tile0 + gl.minimum(cols, nt - 1)) // TPG, 0))
        if GCX:
            _x_diag(xv, x_smem, GC)
        elif BITS == 4:
            xv = _x_block(x_ptr, x_offs, t0, blk, tiles, GC)
        acc = gl.zeros([BLOCK_N, GC], gl.float32, mma)
        # two tiles an iteration, not unrolled: the loop stays as small as the other kernels' (the
        # block unrolled, 8 tiles, was 12-19 KB of code a loop)
        for p in range(nt // 2):
            acc = _gc_tile(blk * GC + 2 * p, p > 0, acc, x_smem, w_smem, ready, empty, a_layout, w_layout, BLOCK_N,
                           STAGES, BITS, GC, GCX)
            acc = _gc_tile(blk * GC + 2 * p + 1, True, acc, x_smem, w_smem, ready, empty, a_layout, w_layout,
                           BLOCK_N, STAGES, BITS, GC, GCX)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((blk * GC + nt - 1) % STAGES))
        if BITS == 8:
            total += acc * (sb.to(gl.int32) << 16).to(gl.float32, bitcast=True)
        else:
            s = (sb << 16).to(gl.float32, bitcast=True)
            b = (sb & -65536).to(gl.float32, bitcast=True)
            xs = gl.convert_layout(gl.sum(xv.to(gl.float32), axis=1), gl.SliceLayout(0, mma))
            total += acc * s + gl.expand_dims(xs, 0) * (b - 128.0 * s)
        return total

    @gluon.jit
    def _x_block(x_ptr, x_offs, t0, blk, tiles, GC: gl.constexpr):
        """x's block blk of GC tiles of the split, [GC, 128] (row j: tile blk GC + j), zero past its end."""
        return gl.load(x_ptr + (t0 + blk * GC) * _BK + x_offs, mask=x_offs < (tiles - blk * GC) * _BK, other=0.0)

    @gluon.jit
    def _x_diag(xv, x_smem, GC: gl.constexpr):
        """A block's x into the wgmma's operand (GCX): x_smem's tile j [GC, 128] gets x's tile j in
        its row j and zeros in the others (what the producer's 8-row TMA box from row -j puts in a
        stage), from the block's x in registers, once a block; the block before's wgmmas are
        retired (_gc_block drains its chain), and the barrier makes every warp's stores its."""
        rows = gl.expand_dims(gl.arange(0, GC, layout=gl.SliceLayout(1, xv.type.layout)), 1)
        for j in gl.static_range(GC):
            x_smem.index(j).store(gl.where(rows == j, xv, gl.zeros_like(xv)))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _consumer_gc(x_ptr, x_smem, w_smem, ready, empty, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N,
                     stride_sb, stride_om, off_n, pid_n, t0, tiles, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr, USE_PDL: gl.constexpr,
                     num_warps: gl.constexpr, BITS: gl.constexpr, ACT: gl.constexpr, GC: gl.constexpr, K=0,
                     res_ptr=None, nw_ptr=None, ss_ptr=None, n_parts=0, eps=0.0,
                     NORM_OUT: gl.constexpr = False, NORM_IN: gl.constexpr = False, GCX: gl.constexpr = False):
        """The group-column consumer (one row of x; the module docstring): tile i's wgmma adds the
        unpacked tile without its scale (int4 128 + q, int8 q) times x into column i % GC, where the
        producer put x's row; once a block of GC tiles, the accumulator's column j (tile j's sums P_j,
        exact in fp32) is scaled into the row's total, s_j P_j (int8) or s_j P_j + (b_j - 128 s_j) X_j
        (int4, X_j the tile's sum of x), and the next block starts from zero. A split's last block
        may be partial (down's 28 tiles a split of 4: three blocks of 8 and one of 4)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, GC, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        w_layout: gl.constexpr = _words_layout(BLOCK_N, num_warps, BITS)
        # x's GC tiles of a block, 8 columns a thread: their sums (int4's bias term)
        xl: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        rows = gl.minimum(off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma)), N - 1)
        cols = gl.arange(0, GC, layout=gl.SliceLayout(0, mma))
        sb_rows = sb_ptr + gl.expand_dims(rows.to(gl.int64) * stride_sb, 1)
        x_offs = gl.expand_dims(gl.arange(0, GC, layout=gl.SliceLayout(1, xl)), 1) * _BK + \
            gl.expand_dims(gl.arange(0, _BK, layout=gl.SliceLayout(0, xl)), 0)
        TPG: gl.constexpr = GROUP // _BK
        if USE_PDL:  # x is read here too, not only through the producer's TMA
            _pdl_wait(False)
        if NORM_IN:
            inv_rms = _inv_rms(_rms_parts(ss_ptr, n_parts, num_warps), K, eps)
        total = gl.zeros([BLOCK_N, GC], gl.float32, mma)
        if GCX:  # x a block ahead, in registers (8 bf16 a thread)
            xn = _x_block(x_ptr, x_offs, t0, 0, tiles, GC)
            for blk in range(gl.cdiv(tiles, GC)):
                xv = xn
                xn = _x_block(x_ptr, x_offs, t0, blk + 1, tiles, GC)
                total = _gc_block(blk, total, x_ptr, x_offs, x_smem, w_smem, ready, empty, sb_rows, cols, t0, tiles,
                                  a_layout, w_layout, mma, BLOCK_N, STAGES, TPG, BITS, GC, GCX, xv)
        else:
            for blk in range(gl.cdiv(tiles, GC)):
                total = _gc_block(blk, total, x_ptr, x_offs, x_smem, w_smem, ready, empty, sb_rows, cols, t0, tiles,
                                  a_layout, w_layout, mma, BLOCK_N, STAGES, TPG, BITS, GC)
        out = gl.where(gl.expand_dims(cols, 0) == 0, gl.expand_dims(gl.sum(total, axis=1), 1), 0.0)
        if NORM_IN:
            out = out * inv_rms
        if USE_PDL:  # out and ws only after the kernel before; the next one scheduled now
            _pdl_wait()
        _store(out, off_n, 0, pid_n, 0, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N, stride_om, mma, HAS_BIAS,
               BLOCK_N, GC, SPLIT_K, ACT, res_ptr, nw_ptr, ss_ptr, NORM_OUT)

    @gluon.jit
    def _wq_gluon_ws_kernel(x_desc, w_desc, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N, K, stride_sb,
                            stride_om, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr,
                            BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr,
                            num_warps: gl.constexpr, INFLIGHT: gl.constexpr = 1, USE_PDL: gl.constexpr = False,
                            BITS: gl.constexpr = 4, LATE_LAUNCH: gl.constexpr = False, NC: gl.constexpr = 1,
                            ACT: gl.constexpr = False, NS: gl.constexpr = 1, x_ptr=None, GC: gl.constexpr = 0,
                            res_ptr=None, nw_ptr=None, ss_ptr=None, n_parts=0, eps=0.0,
                            NORM_OUT: gl.constexpr = False, NORM_IN: gl.constexpr = False,
                            GCX: gl.constexpr = False):
        """_wq_gluon_kernel's arguments and grid (INFLIGHT is always 1 here); num_warps 4: the
        consumer warpgroup (BLOCK_N 64 or 128), plus one producer warp; NC 2: and a second consumer
        warpgroup (_consumer_tile); NS 2: and a second consumer warpgroup, each taking 64 of the
        tile's 128 rows of W (no K split, no SiLU). The partitions' arguments are spelled out in
        each branch (a tuple of them loses the constexprs)."""
        tiles = K // _BK // SPLIT_K
        gl.assume(tiles >= 2)
        WPT: gl.constexpr = _BK * BITS // 32  # words a row's tile
        t0 = gl.program_id(2) * tiles
        off_n = gl.program_id(0) * BLOCK_N
        off_m = gl.program_id(1) * BLOCK_M
        if GCX:
            gl.static_assert(GC > 0)
        XTMA: gl.constexpr = GCX == False  # noqa: E712 (a constexpr): x through the producer's TMA
        # GCX: x's tiles of a block (BLOCK_M of them, x in row j of tile j), not a stage each
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [BLOCK_M if GCX else STAGES, BLOCK_M, _BK], x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, WPT], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=NS)
        fence_async_shared()
        gl.static_assert(NS == 1 or not (NORM_OUT or NORM_IN))  # one row of x: never NS
        if NS > 1:  # NS consumers (NC unused): no K split, no SiLU, 64 rows of W each
            gl.static_assert(SPLIT_K == 1)
            gl.static_assert(ACT == False)  # noqa: E712 (a constexpr)
            gl.static_assert(BLOCK_N == 64 * NS)
        if NS == 2:  # two consumer warpgroups on the tile's halves of W, x shared
            # the second's registers: its accumulator (BLOCK_M / 2 a thread), two tiles of A, the rest
            NS2_REGS: gl.constexpr = BLOCK_M // 2 + 96
            gl.warp_specialize([
                (_consumer, (x_smem, w_smem, ready, empty, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N,
                             stride_sb,
                             stride_om, off_m, off_n, gl.program_id(0), gl.program_id(1), t0, tiles, GROUP, HAS_BIAS,
                             BLOCK_N, BLOCK_M, STAGES, SPLIT_K, USE_PDL, num_warps, BITS, ACT, 0, 1, 0, 2)),
                (_producer, (x_desc, w_desc, x_smem, w_smem, ready, empty, off_m, off_n, t0, tiles, STAGES, USE_PDL,
                             WPT, LATE_LAUNCH)),
                (_consumer, (x_smem, w_smem, ready, empty, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N,
                             stride_sb,
                             stride_om, off_m, off_n, gl.program_id(0), gl.program_id(1), t0, tiles, GROUP, HAS_BIAS,
                             BLOCK_N, BLOCK_M, STAGES, SPLIT_K, USE_PDL, num_warps, BITS, ACT, 0, 1, 1, 2)),
            ], [1, 4], [24, NS2_REGS])
        elif NC == 2:  # a second consumer warpgroup: twice the warps unpacking on an SM (1-8 rows: a few CTAs an SM)
            gl.warp_specialize([
                (_consumer, (x_smem, w_smem, ready, empty, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N,
                             stride_sb,
                             stride_om, off_m, off_n, gl.program_id(0), gl.program_id(1), t0, tiles, GROUP, HAS_BIAS,
                             BLOCK_N, BLOCK_M, STAGES, SPLIT_K, USE_PDL, num_warps, BITS, ACT, 0, 2, 0, 1,
                             K, res_ptr, nw_ptr, ss_ptr, n_parts, eps, NORM_OUT, NORM_IN)),
                (_producer, (x_desc, w_desc, x_smem, w_smem, ready, empty, off_m, off_n, t0, tiles, STAGES, USE_PDL,
                             WPT, LATE_LAUNCH)),
                (_consumer, (x_smem, w_smem, ready, empty, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N,
                             stride_sb,
                             stride_om, off_m, off_n, gl.program_id(0), gl.program_id(1), t0, tiles, GROUP, HAS_BIAS,
                             BLOCK_N, BLOCK_M, STAGES, SPLIT_K, USE_PDL, num_warps, BITS, ACT, 1, 2, 0, 1,
                             K, res_ptr, nw_ptr, ss_ptr, n_parts, eps, NORM_OUT, NORM_IN)),
            ], [1, 4], [24, WS_NC2_REGS])
        elif GC:  # one row of x: the group-column consumer, BLOCK_M columns (tiles a block)
            gl.warp_specialize([
                (_consumer_gc, (x_ptr, x_smem, w_smem, ready, empty, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                                act_ptr, M, N, stride_sb, stride_om, off_n, gl.program_id(0), t0, tiles, GROUP,
                                HAS_BIAS, BLOCK_N, STAGES, SPLIT_K, USE_PDL, num_warps, BITS, ACT, BLOCK_M,
                                K, res_ptr, nw_ptr, ss_ptr, n_parts, eps, NORM_OUT, NORM_IN, GCX)),
                (_producer, (x_desc, w_desc, x_smem, w_smem, ready, empty, off_m, off_n, t0, tiles, STAGES, USE_PDL,
                             WPT, LATE_LAUNCH, BLOCK_M, XTMA)),
            ], [1], [24])
        else:
            gl.warp_specialize([
                (_consumer, (x_smem, w_smem, ready, empty, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N,
                             stride_sb,
                             stride_om, off_m, off_n, gl.program_id(0), gl.program_id(1), t0, tiles, GROUP, HAS_BIAS,
                             BLOCK_N, BLOCK_M, STAGES, SPLIT_K, USE_PDL, num_warps, BITS, ACT, 0, 1, 0, 1,
                             K, res_ptr, nw_ptr, ss_ptr, n_parts, eps, NORM_OUT, NORM_IN)),
                (_producer, (x_desc, w_desc, x_smem, w_smem, ready, empty, off_m, off_n, t0, tiles, STAGES, USE_PDL,
                             WPT, LATE_LAUNCH)),
            ], [1], [24])
