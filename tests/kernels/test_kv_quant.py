"""The quantized KV format (kernels/kv_quant.py) and the references' quantized paths, in torch.

Also the helpers the kernel tests share for quantized pools."""

import pytest
import torch

from kernels.kv_quant import EPS, KV_CACHE_DTYPES, QMAX, dequantize_kv, quantize_kv, token_major
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, store_kv_ref

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]


def quantized_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    """Random K and V in a quantized pool: (k_cache, v_cache, (k_scales, v_scales)), every slot written."""
    pool = []
    for _ in range(2):
        x = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
        x[..., 0] *= 4.0  # a channel of outliers, as RoPE'd keys have
        pool.append(quantize_kv(x, dtype))
    (k_cache, k_scales), (v_cache, v_scales) = pool
    return k_cache, v_cache, (pool_scales(k_scales), pool_scales(v_scales))


def pool_scales(scales):
    """``quantize_kv``'s scales of a whole pool's data, [num_blocks, block_size, KVH], laid out as
    a pool keeps them: [num_blocks, KVH, block_size], contiguous."""
    return scales.transpose(1, 2).contiguous()


def scales_by_slot(scales):
    """A pool's scales as [slot, KVH], a copy: row s holds flat slot s's scales."""
    return token_major(scales).reshape(-1, scales.shape[1])


def empty_scales(cache):
    """A quantized pool's scales before any write: NaN, so a slot written without its scale shows."""
    shape = (cache.shape[0], cache.shape[2], cache.shape[1])  # [num_blocks, KVH, block_size]
    return torch.full(shape, float("nan")), torch.full(shape, float("nan"))


def e4m3_exact(shape, dtype=torch.float32, scale=2.0**-6):
    """Head vectors [..., D] that fp8 stores without rounding: e4m3 values times ``scale`` (a power
    of two), each vector holding +-448 * scale, so its scale is ``scale`` and x / scale is on the grid.

    The Triton interpreter's fp32 -> fp8 cast rounds wrongly (a carry into the exponent is lost:
    126.9 -> 64; ties round away from zero, not to even), so the kernels' fp8 stores are checked on
    the grid under it. On a GPU the cast is cvt.rn.satfinite: round to nearest even, as torch's."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()]
    x = grid[torch.randint(len(grid), shape)]
    x.view(-1, shape[-1])[:, 0] = 448.0 * torch.where(torch.rand(x.numel() // shape[-1]) < 0.5, -1.0, 1.0)
    return (x * scale).to(dtype)


def _half_step(x, scale, dtype):
    """The most a round trip may move x: half a quantization step. An int8 step is the scale; an
    e4m3 one at most 2^-3 of the value (3 mantissa bits), and 2^-9 * scale among the subnormals."""
    if dtype == torch.int8:
        bound = (scale / 2)[..., None].expand_as(x)
    else:
        bound = torch.maximum(x.abs() * 2.0**-4, scale[..., None] * 2.0**-10)
    return bound * (1 + 1e-5)  # the fp32 division and product


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_round_trip_is_within_half_a_step(dtype):
    x = torch.randn(64, 4, 32) * torch.logspace(-3, 3, 64)[:, None, None]  # magnitudes over six decades
    stored, scale = quantize_kv(x, dtype)
    assert stored.dtype == dtype and scale.shape == (64, 4) and scale.dtype == torch.float32
    assert stored.float().abs().amax(-1).eq(QMAX[dtype]).all()  # each vector's largest element takes the full range
    assert ((dequantize_kv(stored, scale, torch.float32) - x).abs() <= _half_step(x, scale, dtype)).all()


def test_int8_rounds_half_away_from_zero():
    x = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5, 2.4999, -126.5]) * 2.0**-3  # the scale is exactly 2^-3
    stored, scale = quantize_kv(x, torch.int8)
    assert scale.item() == 2.0**-3
    assert stored.tolist() == [127, 1, -1, 2, -3, 2, -127]


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_zero_vectors_store_zeros_with_a_tiny_scale(dtype):
    x = torch.zeros(3, 2, 16)
    x[1, 1] = torch.randn(16)  # one live head beside the zero ones keeps its own scale
    stored, scale = quantize_kv(x, dtype)
    assert torch.equal(scale[0], torch.full((2,), EPS / QMAX[dtype], dtype=torch.float32))
    assert stored[0].float().eq(0).all() and not stored.float().isnan().any()
    assert dequantize_kv(stored, scale, torch.float32)[0].eq(0).all()
    assert scale[1, 1] == x[1, 1].abs().amax() / QMAX[dtype]


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_an_outlier_costs_only_its_own_vector(dtype):
    x = torch.randn(4, 2, 32)
    y = x.clone()
    y[2, 0, 5] = 1000.0
    sx, scale_x = quantize_kv(x, dtype)
    sy, scale_y = quantize_kv(y, dtype)
    assert scale_y[2, 0] == 1000.0 / QMAX[dtype]
    others = torch.ones(4, 2, dtype=torch.bool)
    others[2, 0] = False
    assert torch.equal(scale_x[others], scale_y[others]) and torch.equal(sx[others].float(), sy[others].float())
    assert ((dequantize_kv(sy, scale_y, torch.float32) - y).abs() <= _half_step(y, scale_y, dtype)).all()


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_store_kv_ref_writes_data_and_scales_and_skips_padding(dtype):
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    k_cache = torch.zeros(3, 4, 2, 16, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    scales = empty_scales(k_cache)
    slots = torch.tensor([7, -1, 0, 11, -1])

    store_kv_ref(k, v, k_cache, v_cache, slots, kv_scales=scales)

    for x, cache, s in ((k, k_cache, scales[0]), (v, v_cache, scales[1])):
        stored, scale = quantize_kv(x[[0, 2, 3]], dtype)
        assert torch.equal(cache.view(-1, 2, 16)[[7, 0, 11]].float(), stored.float())
        assert torch.equal(scales_by_slot(s)[[7, 0, 11]], scale)
        assert torch.equal(s[1, :, 3], scale[0])  # slot 7: block 1, offset 3, its heads block_size apart
        assert s.isnan().sum() == 2 * (12 - 3)  # the padding tokens wrote nowhere


def test_a_quantized_pool_needs_its_scales_and_a_float_one_takes_none():
    k = torch.randn(2, 2, 16)
    slots = torch.tensor([0, 1])
    cache = torch.zeros(2, 4, 2, 16, dtype=torch.int8)
    with pytest.raises(AssertionError, match="needs kv_scales"):
        store_kv_ref(k, k, cache, cache.clone(), slots)
    float_cache = torch.zeros(2, 4, 2, 16)
    with pytest.raises(AssertionError, match="only int8/fp8 caches have scales"):
        store_kv_ref(k, k, float_cache, float_cache.clone(), slots, kv_scales=empty_scales(float_cache))


# Attention over a quantized pool against the same K/V in fp32, for N(0, 1) K/V with D = 64: the
# error's norm relative to the output's (measured over 5 seeds: int8 0.55-0.75%, fp8 2.5-3.3%).
ATTENTION_TOL = {torch.int8: 0.015, torch.float8_e4m3fn: 0.05}


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_reference_attention_over_a_quantized_pool_is_close_to_float(dtype):
    num_blocks, block_size, kvh, d = 24, 8, 2, 64
    k_float, v_float = torch.randn(num_blocks, block_size, kvh, d), torch.randn(num_blocks, block_size, kvh, d)
    (k_cache, k_scales), (v_cache, v_scales) = quantize_kv(k_float, dtype), quantize_kv(v_float, dtype)
    tables = torch.randperm(num_blocks).to(torch.int32).view(3, 8)
    ctx = torch.tensor([61, 1, 40], dtype=torch.int32)
    q = torch.randn(3, 4, d)
    scale = d**-0.5

    want = paged_decode_attention_ref(q, k_float, v_float, tables, ctx, scale)
    kv_scales = pool_scales(k_scales), pool_scales(v_scales)
    got = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, scale, kv_scales=kv_scales)
    assert (got - want).norm() <= ATTENTION_TOL[dtype] * want.norm()

    qsl = torch.tensor([0, 5, 6, 26], dtype=torch.int32)  # chunks after cached prefixes
    qp = torch.randn(26, 4, d)
    want = paged_prefill_attention_ref(qp, k_float, v_float, tables, qsl, ctx, scale)
    got = paged_prefill_attention_ref(qp, k_cache, v_cache, tables, qsl, ctx, scale, kv_scales=kv_scales)
    assert (got - want).norm() <= ATTENTION_TOL[dtype] * want.norm()
    # and exactly attention over the dequantized pool
    deq = [dequantize_kv(c, s, torch.float32) for c, s in ((k_cache, k_scales), (v_cache, v_scales))]
    torch.testing.assert_close(got, paged_prefill_attention_ref(qp, *deq, tables, qsl, ctx, scale))


def test_the_config_names_and_the_storage_dtypes_are_one_list():
    from worker.engine.config import KV_CACHE_DTYPE_NAMES

    assert set(KV_CACHE_DTYPE_NAMES) == {"auto", *KV_CACHE_DTYPES}
