"""The packed weight layout (kernels/wquant.py) and the W8A16 / W4A16 kernels against their references."""

import pytest
import torch

from kernels.wquant import QuantizedWeight, empty_quantized, pack_int4, quantize, unpack_int4

triton = pytest.importorskip("triton", reason="Triton is not installed (the dev extra): the kernels cannot run")

from kernels.wq_matmul import dequantize, wq_matmul  # noqa: E402


def test_int4_packing_round_trips_and_puts_even_columns_in_the_low_nibble():
    q = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 6)
    assert torch.equal(packed[:, 0] & 0x0F, q[:, 0]) and torch.equal(packed[:, 0] >> 4, q[:, 1])
    assert torch.equal(unpack_int4(packed), q)


def test_int8_error_is_within_half_a_step_of_each_group():
    w = torch.randn(16, 256)
    w[3, 5] = 40.0  # an outlier: only its own group's step grows
    qw = quantize(w, 8, 64)
    err = (qw.dequantize() - w).abs().view(16, 4, 64).amax(-1)
    step = w.view(16, 4, 64).abs().amax(-1) / 127
    assert (err <= step / 2 + 1e-6).all()
    assert err[0].max() < err[3, 0]


def test_int4_clipping_search_is_no_worse_than_min_max_per_group():
    w = torch.randn(16, 256)
    w[3, 5] = 40.0
    qw = quantize(w, 4, 64)
    g = w.view(16, 4, 64)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    min_max = torch.round((g - lo) / s).clamp(0, 15) * s + lo
    ours = qw.dequantize().view(16, 4, 64)
    assert ((ours - g).square().sum(-1) <= (min_max - g).square().sum(-1) + 1e-6).all()
    assert (qw.biases <= qw.scales * 0 + g.amax(-1)).all()  # b is the (shrunk) group minimum


def test_a_zero_group_stays_zero():
    w = torch.randn(4, 64)
    w[1, :32] = 0
    for bits in (4, 8):
        assert torch.equal(quantize(w, bits, 32).dequantize()[1, :32], torch.zeros(32))


def test_narrow_and_copy_like_a_tensor():
    w = torch.randn(8, 128)
    qw = quantize(w, 4, 32)
    rows = qw.narrow(0, 2, 3)
    assert rows.shape == (3, 128) and torch.equal(rows.dequantize(), qw.dequantize()[2:5])
    cols = qw.narrow(1, 64, 32)  # on the group grid: still packed
    assert isinstance(cols, QuantizedWeight) and torch.equal(cols.dequantize(), qw.dequantize()[:, 64:96])
    off = qw.narrow(1, 16, 32)  # off the grid: dequantized
    assert isinstance(off, torch.Tensor) and torch.equal(off, qw.dequantize()[:, 16:48])
    dst = empty_quantized(8, 128, 4, 32, torch.float32)
    dst.narrow(0, 0, 4).copy_(qw.narrow(0, 0, 4))  # same format: copied exactly, through the view
    dst.narrow(0, 4, 4).copy_(w[4:])  # a float tensor: quantized
    assert torch.equal(dst.dequantize(), qw.dequantize())
    other = empty_quantized(8, 128, 8, 128, torch.float32)
    other.copy_(qw)  # another format: dequantized and quantized again
    assert (other.dequantize() - qw.dequantize()).abs().max() < qw.dequantize().abs().max() / 127
    with pytest.raises(ValueError, match="shape"):
        dst.copy_(w[:4])


def test_group_size_must_divide_the_columns():
    with pytest.raises(ValueError, match="group size 48"):
        quantize(torch.randn(2, 64), 4, 48)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,k", [(16, 64), (32, 96), (128, 256), (96, 96)])  # 96 of 96: per channel
@pytest.mark.parametrize("rows", [1, 5, 16, 20])  # the kernel's rows, then the dequantize + matmul path
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_wq_matmul_matches_dequantize_then_linear(bits, group, k, rows, dtype, tol):
    n = 37  # off the tiles: edge masks
    qw = quantize(torch.randn(n, k), bits, group)
    qw.scales = qw.scales.to(dtype)
    qw.biases = None if qw.biases is None else qw.biases.to(dtype)
    x = torch.randn(rows, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    want = torch.nn.functional.linear(x.float(), qw.dequantize(dtype).float(), bias.float())
    got = wq_matmul(x, qw, bias)
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol * k**0.5 * 4, rtol=tol)


@pytest.mark.parametrize("bits", [4, 8])
def test_wq_matmul_with_a_sweeps_tile_of_many_rows(bits):
    qw = quantize(torch.randn(70, 256), bits, 64)
    x = torch.randn(40, 256)
    # 2 row tiles; BLOCK_K 128 spans 2 groups
    got = wq_matmul(x, qw, config=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=2),
                    path="dequant")
    torch.testing.assert_close(got, x @ qw.dequantize().T, atol=1e-4, rtol=1e-5)


def _reference(bits, group, k, rows, dtype, n=37):
    qw = quantize(torch.randn(n, k), bits, group)
    qw.scales = qw.scales.to(dtype)
    qw.biases = None if qw.biases is None else qw.biases.to(dtype)
    x = torch.randn(rows, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    # the weight in float32, not rounded to dtype: the GEMV never rounds it
    want = torch.nn.functional.linear(x.float(), qw.dequantize().float(), bias.float())
    return qw, x, bias, want


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,k", [(16, 64), (32, 96), (128, 256), (96, 96), (32, 512)])
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-3)])
def test_gemv_matches_the_reference(bits, group, k, rows, dtype, tol):
    """The unpacking (nibbles and bytes ANDed out in place and read as float32 denormals, x
    prescaled) and its per-group sums; k 512 runs several K tiles and splits them (the workspace and its counters)."""
    qw, x, bias, want = _reference(bits, group, k, rows, dtype)
    got = wq_matmul(x, qw, bias, path="gemv")
    assert got.shape == (rows, 37) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol * k**0.5 * 4, rtol=tol)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kw,splits,bn", [(4, 4, 16), (8, 2, 32), (16, 1, 16)])  # a tile of 2 groups; splits
def test_gemv_tiles_and_splits_agree(bits, kw, splits, bn):
    qw, x, bias, want = _reference(bits, 32, 512, 3, torch.float32, n=45)
    for _ in range(2):  # the second call finds the workspace and counters left zero by the first
        got = wq_matmul(x, qw, bias, config=dict(BLOCK_N=bn, BLOCK_KW=kw, SPLITS=splits), path="gemv")
        assert ((got - want).norm() / want.norm()).item() < 1e-4


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,k", [(16, 64), (128, 512), (256, 256), (64, 1024)])  # tiles of groups, in one
def test_dequantize_kernel_is_within_a_hundredth_of_a_step_of_the_reference(bits, group, k):
    """The fields read as 2^(23 - p) + q and the constant taken out in the FMA: every weight of
    every field position within 2^-7 of its group's scale (the constant's rounding is at most
    2^-9 s)."""
    qw = quantize(torch.randn(70, k) * 3, bits, group)
    step = qw.scales.repeat_interleave(group, 1)
    assert ((dequantize(qw, torch.float32) - qw.dequantize()).abs() <= step / 128).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_falls_back_where_int4_rows_are_no_whole_words(bits):
    qw = quantize(torch.randn(5, 128), bits, 32)
    view = torch.zeros(5, qw.qweight.shape[1] + 2, dtype=qw.qweight.dtype)[:, 2:]  # 2 bytes in
    view.copy_(qw.qweight)
    qw.qweight = view
    assert torch.equal(dequantize(qw, torch.float32), qw.dequantize())



@pytest.mark.parametrize("bits", [4, 8])
def test_gemv_keeps_zeros_and_large_activations_exact_enough(bits):
    """x's columns are prescaled by up to 2^85 so every product x q lands on 2^-64 x q: zeros stay
    zero and |x| in the thousands neither overflows nor loses the small columns."""
    qw, x, bias, _ = _reference(bits, 128, 512, 1, torch.bfloat16)
    x[0, ::3] = 0.0
    x[0, 1::7] *= 3000.0
    want = torch.nn.functional.linear(x.float(), qw.dequantize().float(), bias.float())
    got = wq_matmul(x, qw, bias, path="gemv").float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2  # bf16's rounding of the output


# The swapped kernel (out^T = W x^T, the weight the dot's first operand). The interpreter runs no
# bf16 dot, so fp16 (its magic 0x6400, 1024 + q) stands in for bf16's 0x4300; bf16 is checked on
# a GPU (benchmarks/quant_gpu.py --parts decode prints each path's rel_err).
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype,tol,perm,xsum_dot", [(torch.float32, 1e-5, False, False),  # no magic, no PERM
                                                     (torch.float16, 1e-3, False, False),
                                                     (torch.float16, 1e-3, True, False), (torch.float16, 1e-3, True, True)])
@pytest.mark.parametrize("rows,group,k,split", [(2, 128, 256, 2), (20, 32, 128, 1)])  # 2 row tiles: 20
def test_swapped_kernel_matches_the_reference(bits, dtype, tol, perm, xsum_dot, rows, group, k, split):
    """Per-tile scales on the dot's result, int4's magic constant taken out with the bias, x read
    in the PERM order (a lane's bytes contiguous), sum(x) as a dot, and K split through the workspace."""
    qw, x, bias, want = _reference(bits, group, k, rows, dtype)
    cfg = dict(BLOCK_N=16, BLOCK_M=16, SPLIT_K=split, PERM=perm, XSUM_DOT=xsum_dot)
    for _ in range(2):  # the second call finds the split's workspace and counters left zero
        got = wq_matmul(x, qw, bias, config=cfg, path="swapped")
        assert got.shape == (rows, 37) and got.dtype == dtype
        assert ((got.float() - want).norm() / want.norm()).item() < tol


def test_swapped_kernel_takes_int4_rows_of_no_whole_words_in_byte_order():
    """PERM reads int4 as int32 words; rows that are not 4-byte aligned fall back to the byte order."""
    qw, x, bias, want = _reference(4, 128, 256, 3, torch.float16)
    unaligned = torch.zeros(37, 130, dtype=torch.uint8)[:, 2:]  # rows 130 bytes apart, 2 bytes in
    unaligned.copy_(qw.qweight)
    qw.qweight = unaligned
    got = wq_matmul(x, qw, bias, config=dict(BLOCK_N=16, BLOCK_M=16, PERM=True, XSUM_DOT=True), path="swapped")
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-3


def test_each_path_is_chosen_by_rows_and_format():
    from kernels.wq_matmul import GEMV_ROWS, SWAP_MAX_ROWS, decode_path

    for bits in (4, 8):
        qw = quantize(torch.randn(64, 256), bits, 128)
        assert decode_path(qw, GEMV_ROWS[bits], torch.bfloat16) == "gemv"
        assert decode_path(qw, GEMV_ROWS[bits] + 1, torch.bfloat16) == "swapped"
        assert decode_path(qw, GEMV_ROWS[bits] + 1, torch.float32) == "swapped"
        assert decode_path(qw, SWAP_MAX_ROWS[bits], torch.bfloat16) == "swapped"
        assert decode_path(qw, SWAP_MAX_ROWS[bits] + 1, torch.bfloat16) == "dense"
    per_channel = quantize(torch.randn(64, 96), 8, 96)  # a group of no power of two: not the swapped kernel
    assert decode_path(per_channel, 8, torch.bfloat16) == "dequant"
    assert decode_path(per_channel, 17, torch.bfloat16) == "dense"


def test_swapped_kernel_with_more_splits_than_tiles():
    """Splits past K's last tile run no tile, read the last group's scales, and add nothing."""
    qw, x, bias, want = _reference(4, 128, 256, 3, torch.float16)  # 2 tiles, 8 splits
    got = wq_matmul(x, qw, bias, config=dict(BLOCK_N=16, BLOCK_M=16, SPLIT_K=8, PERM=True), path="swapped")
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-3
