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
"""

from __future__ import annotations

from kernels.wq_gluon import HAS_GLUON

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from kernels.wq_gluon import _BK, _pdl_wait, _store, _unpack_tile, _words_layout

    WS_NC2_REGS = gl.constexpr(64)  # the second consumer warpgroup's registers (a worker partition's)

    @gluon.jit
    def _producer(x_desc, w_desc, x_smem, w_smem, ready, empty, off_m, off_n, t0, tiles, STAGES: gl.constexpr,
                  USE_PDL: gl.constexpr, WPT: gl.constexpr, LATE_LAUNCH: gl.constexpr):
        """The TMA ring: the weights' first stages before the wait for the kernel before (PDL), x's
        after, then each tile once the consumer released the tile STAGES before it."""
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
        for i in gl.static_range(STAGES):
            pred = i < tiles
            mbarrier.expect(ready.index(i), nbytes, pred=pred)
            tma.async_copy_global_to_shared(w_desc, [off_n, (t0 + i) * WPT], ready.index(i), w_smem.index(i), pred)
        if USE_PDL:
            _pdl_wait(not LATE_LAUNCH)  # late: the consumer's wait at the end schedules the next kernel
        for i in gl.static_range(STAGES):
            tma.async_copy_global_to_shared(x_desc, [off_m, (t0 + i) * _BK], ready.index(i), x_smem.index(i),
                                            i < tiles)
        for i in range(STAGES, tiles):
            s = i % STAGES
            mbarrier.wait(empty.index(s), (i // STAGES - 1) & 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(w_desc, [off_n, (t0 + i) * WPT], ready.index(s), w_smem.index(s))
            tma.async_copy_global_to_shared(x_desc, [off_m, (t0 + i) * _BK], ready.index(s), x_smem.index(s))

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
                  C: gl.constexpr = 0, NC: gl.constexpr = 1, S: gl.constexpr = 0, NS: gl.constexpr = 1):
        """Consumer C of NC (alternate tiles) or S of NS (its BLOCK_N / NS rows of the tile's W)."""
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
        if USE_PDL:  # out and ws only after the kernel before
            _pdl_wait()
        # NC consumers: each adds its part as a K split of its own (NS: each stores its own rows;
        # pid_n counts NS-row tiles, which only split and SiLU counters would see: NS runs neither)
        _store(acc, off_n, off_m, pid_n, pid_m, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N, stride_om, mma,
               HAS_BIAS, ROWS, BLOCK_M, SPLIT_K * NC, ACT)

    @gluon.jit
    def _wq_gluon_ws_kernel(x_desc, w_desc, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N, K, stride_sb,
                            stride_om, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr,
                            BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr,
                            num_warps: gl.constexpr, INFLIGHT: gl.constexpr = 1, USE_PDL: gl.constexpr = False,
                            BITS: gl.constexpr = 4, LATE_LAUNCH: gl.constexpr = False, NC: gl.constexpr = 1,
                            ACT: gl.constexpr = False, NS: gl.constexpr = 1):
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
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, _BK], x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, WPT], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=NS)
        fence_async_shared()
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
                             BLOCK_N, BLOCK_M, STAGES, SPLIT_K, USE_PDL, num_warps, BITS, ACT, 0, 2)),
                (_producer, (x_desc, w_desc, x_smem, w_smem, ready, empty, off_m, off_n, t0, tiles, STAGES, USE_PDL,
                             WPT, LATE_LAUNCH)),
                (_consumer, (x_smem, w_smem, ready, empty, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N,
                             stride_sb,
                             stride_om, off_m, off_n, gl.program_id(0), gl.program_id(1), t0, tiles, GROUP, HAS_BIAS,
                             BLOCK_N, BLOCK_M, STAGES, SPLIT_K, USE_PDL, num_warps, BITS, ACT, 1, 2)),
            ], [1, 4], [24, WS_NC2_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (x_smem, w_smem, ready, empty, sb_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, act_ptr, M, N,
                             stride_sb,
                             stride_om, off_m, off_n, gl.program_id(0), gl.program_id(1), t0, tiles, GROUP, HAS_BIAS,
                             BLOCK_N, BLOCK_M, STAGES, SPLIT_K, USE_PDL, num_warps, BITS, ACT)),
                (_producer, (x_desc, w_desc, x_smem, w_smem, ready, empty, off_m, off_n, t0, tiles, STAGES, USE_PDL,
                             WPT, LATE_LAUNCH)),
            ], [1], [24])
