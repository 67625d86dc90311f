import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the dev extra): the kernels cannot run")

from kernels import store_kv, store_kv_ref  # noqa: E402
from kernels.kv_quant import EPS, QMAX  # noqa: E402
from tests.kernels.test_kv_quant import QUANT_DTYPES, e4m3_exact, empty_scales, scales_by_slot  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 16, 4), (1, 32, 16)])
def test_store_kv_matches_reference(dtype, num_kv_heads, head_dim, block_size):
    num_blocks, num_heads, num_tokens = 6, 4, 7
    # k and v as slices of one qkv projection: rows are strided, each token's [KVH, D] contiguous.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[1, 4]] = -1  # padding tokens of a CUDA-graph batch: written nowhere
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, k_ref, v_ref, slots)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # a copy: exact


def test_store_kv_all_padding_changes_nothing():
    k = torch.randn(3, 2, 16)
    k_cache = torch.randn(4, 4, 2, 16)
    v_cache = torch.randn_like(k_cache)
    before = k_cache.clone(), v_cache.clone()
    store_kv(k, k, k_cache, v_cache, torch.full((3,), -1, dtype=torch.long))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 16), (3, 32)])
def test_store_kv_quantized_matches_reference(dtype, cache_dtype, num_kv_heads, head_dim):
    num_blocks, block_size, num_heads, num_tokens = 6, 4, 4, 7
    if cache_dtype == torch.int8:
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim) * 3
    else:  # fp8: values it stores exactly (see e4m3_exact)
        qkv = e4m3_exact((num_tokens, num_heads + 2 * num_kv_heads, head_dim)).view(num_tokens, -1)
    qkv = qkv.to(dtype)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[1, 4]] = -1
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    scales = empty_scales(k_cache)
    k_ref, v_ref, scales_ref = k_cache.clone(), v_cache.clone(), empty_scales(k_cache)

    store_kv(k, v, k_cache, v_cache, slots, kv_scales=scales)
    store_kv_ref(k, v, k_ref, v_ref, slots, kv_scales=scales_ref)

    assert torch.equal(k_cache.float(), k_ref.float()) and torch.equal(v_cache.float(), v_ref.float())
    for got, want in zip(scales, scales_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # padding slots stay NaN


def test_store_kv_quantized_zero_vectors_ties_and_guards():
    k = torch.zeros(2, 2, 16)
    k[1, 0] = torch.randn(16)
    k[1, 1, :6] = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5, -126.5]) * 2.0**-3  # ties, half away from zero
    k_cache = torch.zeros(2, 4, 2, 16, dtype=torch.int8)
    v_cache = torch.ones_like(k_cache)
    scales = empty_scales(k_cache)
    store_kv(k, k, k_cache, v_cache, torch.tensor([0, 5]), kv_scales=scales)
    assert k_cache.view(-1, 2, 16)[0].eq(0).all() and v_cache.view(-1, 2, 16)[0].eq(0).all()
    assert scales_by_slot(scales[0])[0].eq(EPS / QMAX[torch.int8]).all()
    assert scales_by_slot(scales[0])[5].eq(k[1].abs().amax(-1) / QMAX[torch.int8]).all()  # block 1, offset 1
    assert k_cache.view(-1, 2, 16)[5, 1, :6].tolist() == [127, 1, -1, 2, -3, -127]
    with pytest.raises(AssertionError, match="needs kv_scales"):
        store_kv(k, k, k_cache, v_cache, torch.tensor([0, 5]))
    with pytest.raises(AssertionError, match="only int8/fp8 caches have scales"):
        store_kv(k, k, k_cache.float(), v_cache.float(), torch.tensor([0, 5]), kv_scales=scales)
    with pytest.raises(AssertionError, match="kv_scales must be contiguous float32"):
        store_kv(k, k, k_cache, v_cache, torch.tensor([0, 5]), kv_scales=(scales[0].half(), scales[1]))
    token_major = tuple(s.transpose(1, 2).contiguous() for s in scales)  # [num_blocks, block_size, KVH]
    with pytest.raises(AssertionError, match=r"kv_scales must be contiguous float32 \(2, 2, 4\)"):
        store_kv(k, k, k_cache, v_cache, torch.tensor([0, 5]), kv_scales=token_major)
