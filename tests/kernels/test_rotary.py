import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the dev extra): the kernels cannot run")

from kernels import rotary_embedding, rotary_embedding_ref, rotary_store_kv, rotary_store_kv_ref  # noqa: E402

# The interpreter rounds fp32 -> bf16 by truncation (a GPU rounds to nearest): one bf16 ulp.
TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (1e-3, 1e-3), torch.bfloat16: (2e-2, 2e-2)}


def _tables(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (2, 2, 32), (6, 2, 16)])
def test_rotary_matches_reference_in_place_on_qkv_views(dtype, num_heads, num_kv_heads, head_dim):
    num_tokens, max_pos = 6, 100
    cos, sin = _tables(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,))
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    v_before = qkv[:, k_end:].clone()
    want_q, want_k = rotary_embedding_ref(positions, q.clone(), k.clone(), cos, sin)

    got_q, got_k = rotary_embedding(positions, q, k, cos, sin)

    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got_q, want_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(got_k, want_k, atol=atol, rtol=rtol)
    torch.testing.assert_close(q, want_q, atol=atol, rtol=rtol)  # in place
    assert torch.equal(qkv[:, k_end:], v_before)  # v, beside them in the buffer, untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(4, 2, 16, 4), (6, 2, 32, 16), (2, 1, 16, 4)])
def test_rotary_store_kv_equals_rotary_then_store(dtype, num_heads, num_kv_heads, head_dim, block_size):
    num_tokens, max_pos, num_blocks = 7, 100, 6
    cos, sin = _tables(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,))
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    views = lambda buf: (buf[:, :q_end].view(num_tokens, num_heads, head_dim),  # noqa: E731
                         buf[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim),
                         buf[:, k_end:].view(num_tokens, num_kv_heads, head_dim))
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 5]] = -1  # padding tokens: written nowhere
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    ref_buf, ref_k_cache, ref_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    rotary_store_kv_ref(positions, *views(ref_buf), cos, sin, ref_k_cache, ref_v_cache, slots)

    q, k, v = views(qkv)
    rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots)

    atol, rtol = TOL[dtype]
    torch.testing.assert_close(qkv, ref_buf, atol=atol, rtol=rtol)  # q and k rotated in place, v untouched
    assert torch.equal(qkv[:, k_end:], ref_buf[:, k_end:])
    torch.testing.assert_close(k_cache, ref_k_cache, atol=atol, rtol=rtol)
    assert torch.equal(v_cache, ref_v_cache)  # v is copied: exact
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[untouched],
                       ref_k_cache.view(-1, num_kv_heads, head_dim)[untouched])
