import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the dev extra): the kernels cannot run")

from kernels import store_kv, store_kv_ref  # noqa: E402


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
