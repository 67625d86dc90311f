import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the dev extra): the kernels cannot run")

from kernels import (  # noqa: E402
    rotary_embedding,
    rotary_embedding_ref,
    rotary_store_kv,
    rotary_store_kv_ref,
    store_kv_ref,
)
from tests.kernels.test_kv_quant import e4m3_exact, empty_scales  # noqa: E402

# The interpreter rounds fp32 -> bf16 by truncation (a GPU rounds to nearest): one bf16 ulp.
TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (1e-3, 1e-3), torch.bfloat16: (2e-2, 2e-2)}


def _tables(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _qkv_views(buf, num_heads, num_kv_heads, head_dim):
    t = buf.shape[0]
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    return (buf[:, :q_end].view(t, num_heads, head_dim), buf[:, q_end:k_end].view(t, num_kv_heads, head_dim),
            buf[:, k_end:].view(t, num_kv_heads, head_dim))


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
    k_end = (num_heads + num_kv_heads) * head_dim
    views = lambda buf: _qkv_views(buf, num_heads, num_kv_heads, head_dim)  # noqa: E731
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(4, 2, 16, 4), (6, 3, 32, 16)])
def test_rotary_store_kv_into_an_int8_pool(dtype, num_heads, num_kv_heads, head_dim, block_size):
    num_tokens, max_pos, num_blocks = 7, 100, 6
    cos, sin = _tables(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,))
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim) * 2).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 5]] = -1
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    scales, ref_scales = empty_scales(k_cache), empty_scales(k_cache)
    ref_buf, ref_k_cache, ref_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    rotary_store_kv_ref(positions, *_qkv_views(ref_buf, num_heads, num_kv_heads, head_dim), cos, sin,
                        ref_k_cache, ref_v_cache, slots, kv_scales=ref_scales)

    q, k, v = _qkv_views(qkv, num_heads, num_kv_heads, head_dim)
    rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots, kv_scales=scales)

    atol, rtol = TOL[dtype]
    torch.testing.assert_close(qkv, ref_buf, atol=atol, rtol=rtol)  # q and k rotated in place as before
    # The pool holds exactly what quantize_kv makes of the k it rotated (which differs from the
    # reference's by the interpreter's bf16 rounding), and of v.
    want_k_cache, want_v_cache = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_scales = empty_scales(k_cache)
    store_kv_ref(k, v, want_k_cache, want_v_cache, slots, kv_scales=want_scales)
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)
    assert torch.equal(v_cache, ref_v_cache)
    for got, want in zip(scales, want_scales):
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)  # padding slots stay NaN


def test_rotary_store_kv_into_an_fp8_pool():
    # Tables of +-1 and 0 rotate exactly (k_rot is +-k or +-rotate_half(k)), so k_rot stays on the
    # e4m3 grid, which the interpreter's fp8 cast stores exactly (see e4m3_exact).
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 16, 6
    cos = torch.tensor([1.0, 0.0, -1.0, 0.0])[:, None].expand(4, head_dim).contiguous()
    sin = torch.tensor([0.0, 1.0, 0.0, -1.0])[:, None].expand(4, head_dim).contiguous()
    positions = torch.tensor([0, 1, 2, 3, 1, 0])
    qkv = e4m3_exact((num_tokens, num_heads + 2 * num_kv_heads, head_dim), torch.bfloat16).view(num_tokens, -1)
    slots = torch.tensor([3, -1, 9, 0, 14, 7])
    k_cache = torch.zeros(4, 4, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    scales, ref_scales = empty_scales(k_cache), empty_scales(k_cache)
    ref_buf, ref_k_cache, ref_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    rotary_store_kv_ref(positions, *_qkv_views(ref_buf, num_heads, num_kv_heads, head_dim), cos, sin,
                        ref_k_cache, ref_v_cache, slots, kv_scales=ref_scales)

    rotary_store_kv(positions, *_qkv_views(qkv, num_heads, num_kv_heads, head_dim), cos, sin,
                    k_cache, v_cache, slots, kv_scales=scales)

    assert torch.equal(qkv, ref_buf)
    assert torch.equal(k_cache.float(), ref_k_cache.float()) and torch.equal(v_cache.float(), ref_v_cache.float())
    for got, want in zip(scales, ref_scales):
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
