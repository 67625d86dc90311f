import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the dev extra): the kernels cannot run")

from kernels import (  # noqa: E402
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    store_kv,
)
from kernels import paged_attention  # noqa: E402
from tests.kernels.test_kv_quant import QUANT_DTYPES, e4m3_exact, quantized_pool  # noqa: E402

# (query heads, KV heads): GQA ratio 2, plain multi-head, and a group of 3 (not a power of two).
HEADS = [(4, 2), (2, 2), (6, 2)]


@pytest.fixture(params=["default_tiles", "wide_tiles", "small_tiles"])
def tiles(request, monkeypatch):
    """The GPU tile sizes (the narrow decode config at these tiny batches, or the wide one forced;
    a quantized pool's own), and small ones so tiny shapes still cross many tiles and splits."""
    if request.param == "wide_tiles":
        monkeypatch.setattr(paged_attention, "WIDE_MIN_PROGRAMS_PER_SM", 0)
    if request.param == "small_tiles":
        monkeypatch.setattr(paged_attention, "DECODE_BLOCK_N", 16)
        monkeypatch.setattr(paged_attention, "DECODE_NARROW", (16, 4, 2))
        monkeypatch.setattr(paged_attention, "DECODE_QUANT", (16, 4, 2))
        monkeypatch.setattr(paged_attention, "PREFILL_BLOCK_M", 16)
        monkeypatch.setattr(paged_attention, "PREFILL_BLOCK_N", 16)
    return request.param


def _pool(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    return k_cache, torch.randn_like(k_cache)


def _block_tables(context_lens, block_size, num_blocks, extra_width=1):
    """Each sequence gets distinct blocks in shuffled order; rows padded with 0 past their end."""
    needed = [-(-ctx // block_size) for ctx in context_lens]
    width = max(needed) + extra_width
    free = torch.randperm(num_blocks).tolist()
    assert sum(needed) <= num_blocks
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
    return tables


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("head_dim,block_size", [(16, 4), (32, 16)])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_decode_matches_reference(tiles, num_heads, num_kv_heads, head_dim, block_size, num_splits):
    # A context of 0 (an idle CUDA-graph row), 1, and lengths off block and tile boundaries.
    context_lens = [37, 0, 1, 70]
    num_blocks = 40 if block_size == 4 else 10
    k_cache, v_cache = _pool(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    tables = _block_tables(context_lens, block_size, num_blocks)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn(len(context_lens), num_heads, head_dim)
    scale = head_dim**-0.5

    got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits=num_splits)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, scale)

    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_in_a_given_order_of_sequences(num_splits):
    # Longest first, as the engine launches them: every row still lands in its own place.
    context_lens = [9, 0, 41, 23, 1]
    k_cache, v_cache = _pool(24, 4, 2, 16, torch.float32)
    tables = _block_tables(context_lens, 4, 24)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    order = torch.argsort(ctx, descending=True).to(torch.int32)
    q = torch.randn(len(context_lens), 4, 16)

    got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25, num_splits=num_splits, order=order)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.25)

    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    with pytest.raises(AssertionError):  # an order of the wrong dtype is refused, not misread
        paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25, order=order.long())


def _decode_step(context_lens, block_size, num_blocks):
    """A decode step's block tables and context lengths, and each row's new token's position and
    slot (the last of its context; -1 for an idle row of context 0)."""
    tables = _block_tables(context_lens, block_size, num_blocks)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    positions = (ctx - 1).clamp(min=0).long()
    slots = torch.tensor([-1 if c == 0 else int(tables[i, (c - 1) // block_size]) * block_size + (c - 1) % block_size
                          for i, c in enumerate(context_lens)])
    return tables, ctx, positions, slots


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 2)])
def test_decode_with_rotary_and_kv_store_fused(tiles, num_heads, num_kv_heads, num_splits):
    # The step's new token arrives unrotated and not yet in the pool: rows of context 1 (only the
    # new token), 0 (an idle graph row, slot -1) and lengths across tiles and splits.
    from kernels import rotary_embedding_ref

    torch.manual_seed(0)
    block_size, head_dim = 4, 16
    context_lens = [37, 0, 1, 70, 5]
    k_cache, v_cache = _pool(40, block_size, num_kv_heads, head_dim, torch.float32)
    tables, ctx, positions, slots = _decode_step(context_lens, block_size, 40)
    q = torch.randn(len(context_lens), num_heads, head_dim)
    k = torch.randn(len(context_lens), num_kv_heads, head_dim)
    v = torch.randn_like(k)
    angles = torch.rand(128, head_dim // 2) * 6.0
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q0, k0 = q.clone(), k.clone()
    want_k, want_v = k_cache.clone(), v_cache.clone()

    got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.3, num_splits=num_splits,
                                 rope_store=(positions, k, v, cos, sin, slots))
    want = paged_decode_attention_ref(q, want_k, want_v, tables, ctx, 0.3,
                                      rope_store=(positions, k, v, cos, sin, slots))

    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(k_cache, want_k, atol=1e-6, rtol=1e-6)  # the new K/V stored, once
    torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # the inputs are left as they were
    # and it equals the unfused path: rotate, store, then attend
    q_rot, k_rot = rotary_embedding_ref(positions, q, k, cos, sin)
    assert not torch.allclose(q_rot, q)
    k2, v2 = _pool(40, block_size, num_kv_heads, head_dim, torch.float32)
    k2.copy_(want_k)
    v2.copy_(want_v)
    torch.testing.assert_close(got, paged_decode_attention(q_rot, k2, v2, tables, ctx, 0.3, num_splits=num_splits),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_fp16(num_splits):
    # bf16 attention is checked on the GPU only: the interpreter's tl.dot multiplies bf16's raw bits.
    context_lens = [50, 17, 3]
    k_cache, v_cache = _pool(12, 16, 2, 32, torch.float16)
    tables = _block_tables(context_lens, 16, 12)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn(3, 4, 32).half()

    got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 32**-0.5, num_splits=num_splits)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 32**-0.5)

    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_default_num_splits():
    cpu = torch.device("cpu")  # stands in for a 4-SM device: a target of 8 programs
    assert default_num_splits(8, 2, 4096, cpu) == 1  # enough (sequence, KV head) programs already
    assert default_num_splits(1, 2, 4096, cpu) == 4  # long context, small batch: split to fill the chip
    assert default_num_splits(1, 2, 128, cpu) == 1  # too short to be worth a merge
    assert default_num_splits(1, 1, 10**6, cpu) == 8


def _prefill_batch(prefixes, q_lens, num_kv_heads, head_dim, block_size, dtype):
    """A pool holding each sequence's cached prefix, and this step's new K/V written by store_kv."""
    context_lens = [p + n for p, n in zip(prefixes, q_lens)]
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    k_cache, v_cache = _pool(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = _block_tables(context_lens, block_size, num_blocks, extra_width=2)
    slots = []
    for i, (prefix, ctx) in enumerate(zip(prefixes, context_lens)):
        pos = torch.arange(prefix, ctx)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    num_tokens = sum(q_lens)
    k_new = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v_new = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    store_kv(k_new, v_new, k_cache, v_cache, torch.cat(slots))
    query_start = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return k_cache, v_cache, tables, query_start, torch.tensor(context_lens, dtype=torch.int32)


# A fresh prompt; a chunk after a cached prefix (past one default tile, so the unmasked prefix
# loop runs); a single-token query after a prefix; a block-aligned prefix with a block-sized chunk.
PREFIXES, Q_LENS = [0, 70, 29, 16], [21, 12, 1, 16]


@pytest.mark.parametrize("head_dim,block_size", [(16, 4), (32, 16)])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_prefill_matches_reference(tiles, num_heads, num_kv_heads, head_dim, block_size):
    k_cache, v_cache, tables, query_start, ctx = _prefill_batch(
        PREFIXES, Q_LENS, num_kv_heads, head_dim, block_size, torch.float32
    )
    q = torch.randn(sum(Q_LENS), num_heads, head_dim)
    scale = head_dim**-0.5

    got = paged_prefill_attention(q, k_cache, v_cache, tables, query_start, ctx, scale)
    want = paged_prefill_attention_ref(q, k_cache, v_cache, tables, query_start, ctx, scale)

    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_prefill_fp16(tiles):
    k_cache, v_cache, tables, query_start, ctx = _prefill_batch(PREFIXES, Q_LENS, 2, 32, 16, torch.float16)
    q = torch.randn(sum(Q_LENS), 4, 32).half()

    got = paged_prefill_attention(q, k_cache, v_cache, tables, query_start, ctx, 32**-0.5)
    want = paged_prefill_attention_ref(q, k_cache, v_cache, tables, query_start, ctx, 32**-0.5)

    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_prefill_of_single_tokens_equals_decode():
    context_lens = [9, 33, 2]
    k_cache, v_cache = _pool(20, 4, 2, 16, torch.float32)
    tables = _block_tables(context_lens, 4, 20)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn(3, 4, 16)
    query_start = torch.arange(4, dtype=torch.int32)

    prefill = paged_prefill_attention(q, k_cache, v_cache, tables, query_start, ctx, 0.25)
    decode = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25, num_splits=2)

    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_and_prefill_write_their_rows_of_one_output(num_splits):
    """A mixed step: decode rows first, then prefill rows, each kernel writing its rows of one
    output in place (no copy); rows outside each kernel's slice are left alone."""
    prefixes, q_lens = [0, 12], [7, 5]
    k_cache, v_cache, tables, query_start, ctx = _prefill_batch(prefixes, q_lens, 2, 16, 4, torch.float32)
    d_tables, d_ctx = tables, ctx - 1  # the decode rows read the same sequences' blocks
    nd, n = 2, 2 + sum(q_lens)
    q = torch.randn(n, 4, 16)
    out = torch.full_like(q, float("nan"))

    got_d = paged_decode_attention(q[:nd], k_cache, v_cache, d_tables, d_ctx, 0.25, num_splits=num_splits,
                                   out=out[:nd])
    assert got_d.data_ptr() == out.data_ptr() and out[nd:].isnan().all()
    got_p = paged_prefill_attention(q[nd:], k_cache, v_cache, tables, query_start, ctx, 0.25, out=out[nd:])
    assert got_p.data_ptr() == out[nd:].data_ptr()

    want = torch.cat([paged_decode_attention_ref(q[:nd], k_cache, v_cache, d_tables, d_ctx, 0.25),
                      paged_prefill_attention_ref(q[nd:], k_cache, v_cache, tables, query_start, ctx, 0.25)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    ref_out = torch.full_like(q, float("nan"))
    paged_prefill_attention_ref(q[nd:], k_cache, v_cache, tables, query_start, ctx, 0.25, out=ref_out[nd:])
    torch.testing.assert_close(ref_out[nd:], want[nd:])
    assert ref_out[:nd].isnan().all()


def test_out_of_the_wrong_shape_or_dtype_is_refused():
    k_cache, v_cache = _pool(8, 4, 2, 16, torch.float32)
    tables = _block_tables([5], 4, 8)
    ctx = torch.tensor([5], dtype=torch.int32)
    q = torch.randn(1, 4, 16)
    for bad in (torch.empty(2, 4, 16), torch.empty(1, 4, 16, dtype=torch.float16), torch.empty(1, 16, 4).transpose(1, 2)):
        with pytest.raises(ValueError, match="out must be"):
            paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25, out=bad)


# An int8 or fp8 pool: each kernel reads it dequantizing in registers, against the reference's
# attention over the dequantized pool (in fp32; the kernels scale scores and p by the scales).
# The tile sizes change nothing quantized: the GPU's and small ones (many tiles and splits) will do.
QUANT_TILES = pytest.mark.parametrize("tiles", ["default_tiles", "small_tiles"], indirect=True)


@QUANT_TILES
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 2)])
@pytest.mark.parametrize("cache_dtype", QUANT_DTYPES)
def test_decode_over_a_quantized_pool(tiles, cache_dtype, num_heads, num_kv_heads, num_splits):
    context_lens = [37, 0, 1, 70]
    k_cache, v_cache, kv_scales = quantized_pool(40, 4, num_kv_heads, 16, cache_dtype)
    tables = _block_tables(context_lens, 4, 40)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn(len(context_lens), num_heads, 16)

    got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25, num_splits=num_splits, kv_scales=kv_scales)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.25, kv_scales=kv_scales)

    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("cache_dtype", QUANT_DTYPES)
def test_decode_and_prefill_fp16_over_a_quantized_pool(cache_dtype):
    # q in fp16 and the pool in int8/fp8: each tile converts to fp16 exactly, p * scale is rounded to fp16.
    context_lens = [50, 17, 3]
    k_cache, v_cache, kv_scales = quantized_pool(12, 16, 2, 32, cache_dtype)
    tables = _block_tables(context_lens, 16, 12)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn(3, 4, 32).half()
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 32**-0.5, kv_scales=kv_scales)
    for num_splits in (1, 4):
        got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 32**-0.5, num_splits=num_splits,
                                     kv_scales=kv_scales)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    qp = torch.randn(20, 4, 32).half()
    qsl = torch.tensor([0, 10, 17, 20], dtype=torch.int32)  # chunks after cached prefixes of 40, 7 and 0
    got = paged_prefill_attention(qp, k_cache, v_cache, tables, qsl, ctx, 32**-0.5, kv_scales=kv_scales)
    want = paged_prefill_attention_ref(qp, k_cache, v_cache, tables, qsl, ctx, 32**-0.5, kv_scales=kv_scales)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


BF16_ATOL, BF16_RTOL = 1e-3, 2e-2  # bf16 outputs: rounding to 8 bits, and near-zero outputs


@pytest.mark.parametrize("dots", ["fp16", "pairs"])
@pytest.mark.parametrize("cache_dtype", QUANT_DTYPES)
def test_decode_bf16_over_a_quantized_pool_with_fp16_dots(monkeypatch, cache_dtype, dots):
    # A bf16 q with DECODE_QUANT_DOTS "fp16" or "pairs" (the tiles read as byte pairs, each split into
    # two fp16 operands; its inline-PTX convert runs on the GPU only): q converted to fp16 once, K/V
    # to fp16, p * scale rounded to fp16, fp32 accumulation; within bf16's rounding of the reference,
    # also with the new token rotated, stored and attended in the same launch. (The bf16-operand variant cannot be
    # checked here: Triton's interpreter gets bf16 dots wrong, a bf16 pool's decode included.)
    from kernels import rotary_embedding_ref

    monkeypatch.setattr(paged_attention, "DECODE_QUANT_DOTS", dots)
    context_lens = [50, 0, 17, 3]
    k_cache, v_cache, kv_scales = quantized_pool(16, 16, 2, 32, cache_dtype)
    tables, ctx, positions, slots = _decode_step(context_lens, 16, 16)
    q = (4 * torch.randn(len(context_lens), 4, 32)).bfloat16()
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 32**-0.5, kv_scales=kv_scales)
    for num_splits in (1, 4):
        got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 32**-0.5, num_splits=num_splits,
                                     kv_scales=kv_scales)
        torch.testing.assert_close(got, want, atol=BF16_ATOL, rtol=BF16_RTOL)
    k, v = torch.randn(2, len(context_lens), 2, 32).bfloat16()
    cos = torch.tensor([1.0, 0.0, -1.0, 0.0]).repeat(16)[:, None].expand(64, 32).contiguous()
    sin = torch.tensor([0.0, 1.0, 0.0, -1.0]).repeat(16)[:, None].expand(64, 32).contiguous()
    want_pool = (k_cache.clone(), v_cache.clone(), tuple(s.clone() for s in kv_scales))
    rope = (positions, k, v, cos, sin, slots)
    got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 32**-0.5, rope_store=rope, kv_scales=kv_scales)
    want = paged_decode_attention_ref(q, want_pool[0], want_pool[1], tables, ctx, 32**-0.5, rope_store=rope,
                                      kv_scales=want_pool[2])
    torch.testing.assert_close(got, want, atol=BF16_ATOL, rtol=BF16_RTOL)
    q_rot, _ = rotary_embedding_ref(positions, q, k, cos, sin)
    torch.testing.assert_close(got, paged_decode_attention(q_rot, k_cache, v_cache, tables, ctx, 32**-0.5,
                                                           kv_scales=kv_scales), atol=BF16_ATOL, rtol=BF16_RTOL)


def test_decode_bf16_over_an_int8_pool_with_8bit_dots(monkeypatch):
    # DECODE_QUANT_DOTS "8bit" (behind the flag): q quantized to int8 with a scale per head, QK^T an
    # int8 dot; the reference attends with that q dequantized. (fp8's e4m3 dots are checked on the
    # GPU only, by benchmarks/kv_cache_gpu.py --decode-operands: the interpreter's fp8 dot differs.)
    from kernels.kv_quant import dequantize_kv, quantize_kv

    monkeypatch.setattr(paged_attention, "DECODE_QUANT_DOTS", "8bit")
    context_lens = [50, 0, 17, 3]
    k_cache, v_cache, kv_scales = quantized_pool(16, 16, 2, 32, torch.int8)
    tables, ctx, _, _ = _decode_step(context_lens, 16, 16)
    q = torch.randn(len(context_lens), 4, 32).bfloat16()
    q_seen = dequantize_kv(*quantize_kv(q.float(), torch.int8), torch.float32)
    want = paged_decode_attention_ref(q_seen, k_cache, v_cache, tables, ctx, 32**-0.5, kv_scales=kv_scales)
    for num_splits in (1, 4):
        got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 32**-0.5, num_splits=num_splits,
                                     kv_scales=kv_scales)
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2e-2)


@QUANT_TILES
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("cache_dtype", QUANT_DTYPES)
def test_decode_with_rotary_and_kv_store_fused_into_a_quantized_pool(tiles, cache_dtype, num_splits):
    # The new token is stored quantized and attended as stored: the output equals the unfused path
    # (rotate, store, then attend over the pool), i.e. what the next step reading the pool computes.
    from kernels import rotary_embedding_ref

    block_size, head_dim, num_heads, num_kv_heads = 4, 16, 6, 2
    context_lens = [37, 0, 1, 70, 5]
    k_cache, v_cache, kv_scales = quantized_pool(40, block_size, num_kv_heads, head_dim, cache_dtype)
    tables, ctx, positions, slots = _decode_step(context_lens, block_size, 40)
    q = torch.randn(len(context_lens), num_heads, head_dim)
    if cache_dtype == torch.int8:
        k, v = torch.randn(2, len(context_lens), num_kv_heads, head_dim)
        angles = torch.rand(128, head_dim // 2) * 6.0
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    else:  # fp8: rotations by multiples of 90 degrees keep k on the grid its cast stores exactly (e4m3_exact)
        k, v = e4m3_exact((2, len(context_lens), num_kv_heads, head_dim))
        cos = torch.tensor([1.0, 0.0, -1.0, 0.0]).repeat(32)[:, None].expand(128, head_dim).contiguous()
        sin = torch.tensor([0.0, 1.0, 0.0, -1.0]).repeat(32)[:, None].expand(128, head_dim).contiguous()
    want_k, want_v, want_scales = k_cache.clone(), v_cache.clone(), tuple(s.clone() for s in kv_scales)
    rope = (positions, k, v, cos, sin, slots)

    got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.3, num_splits=num_splits, rope_store=rope,
                                 kv_scales=kv_scales)
    want = paged_decode_attention_ref(q, want_k, want_v, tables, ctx, 0.3, rope_store=rope, kv_scales=want_scales)

    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert torch.equal(v_cache.float(), want_v.float()) and torch.equal(kv_scales[1], want_scales[1])
    # k is rotated in fp32 by both, up to rounding: a stored value may sit one step off at a half.
    torch.testing.assert_close(kv_scales[0], want_scales[0], atol=0, rtol=1e-6)
    assert (k_cache.float() - want_k.float()).abs().max() <= (1 if cache_dtype == torch.int8 else 0)
    q_rot, _ = rotary_embedding_ref(positions, q, k, cos, sin)
    unfused = paged_decode_attention(q_rot, k_cache, v_cache, tables, ctx, 0.3, num_splits=num_splits,
                                     kv_scales=kv_scales)
    torch.testing.assert_close(got, unfused, atol=1e-5, rtol=1e-4)


@QUANT_TILES
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 2)])
@pytest.mark.parametrize("cache_dtype", QUANT_DTYPES)
def test_prefill_over_a_quantized_pool(tiles, cache_dtype, num_heads, num_kv_heads):
    context_lens = [p + n for p, n in zip(PREFIXES, Q_LENS)]
    num_blocks = sum(-(-c // 4) for c in context_lens) + 3
    k_cache, v_cache, kv_scales = quantized_pool(num_blocks, 4, num_kv_heads, 16, cache_dtype)
    tables = _block_tables(context_lens, 4, num_blocks, extra_width=2)
    query_start = torch.tensor([0] + Q_LENS, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn(sum(Q_LENS), num_heads, 16)

    got = paged_prefill_attention(q, k_cache, v_cache, tables, query_start, ctx, 0.25, kv_scales=kv_scales)
    want = paged_prefill_attention_ref(q, k_cache, v_cache, tables, query_start, ctx, 0.25, kv_scales=kv_scales)

    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_quantized_pool_needs_its_scales():
    k_cache, v_cache, kv_scales = quantized_pool(8, 4, 2, 16, torch.int8)
    tables = _block_tables([5], 4, 8)
    ctx = torch.tensor([5], dtype=torch.int32)
    q = torch.randn(1, 4, 16)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(AssertionError, match="needs kv_scales"):
        paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25)
    with pytest.raises(AssertionError, match="needs kv_scales"):
        paged_prefill_attention(q, k_cache, v_cache, tables, qsl, ctx, 0.25)
    float_pool = _pool(8, 4, 2, 16, torch.float32)
    with pytest.raises(AssertionError, match="only int8/fp8 caches have scales"):
        paged_decode_attention(q, *float_pool, tables, ctx, 0.25, kv_scales=kv_scales)
    with pytest.raises(AssertionError, match="only int8/fp8 caches have scales"):
        paged_prefill_attention(q, *float_pool, tables, qsl, ctx, 0.25, kv_scales=kv_scales)
