import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the dev extra): the kernels cannot run")

from kernels import skinny_matmul  # noqa: E402
from kernels.skinny import MAX_ROWS  # noqa: E402


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_matmul_matches_linear(dtype, tol, rows, with_bias):
    # N and K off the interpreter's 16 x 32 tiles, so the edge masks are exercised.
    n, k = 37, 70
    x = torch.randn(rows, k).to(dtype)
    weight = torch.randn(n, k).to(dtype)
    bias = torch.randn(n).to(dtype) if with_bias else None
    want = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())

    got = skinny_matmul(x, weight, bias)

    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol * k**0.5, rtol=tol)


def test_skinny_matmul_takes_a_strided_row_slice():
    """q, k and v come from one qkv buffer: x may be a column slice (rows strided)."""
    buf = torch.randn(4, 96)
    x = buf[:, 32:64]
    weight = torch.randn(20, 32)
    torch.testing.assert_close(skinny_matmul(x, weight), x @ weight.T, atol=1e-5, rtol=1e-5)


def test_skinny_matmul_refuses_too_many_rows():
    with pytest.raises(AssertionError, match="rows"):
        skinny_matmul(torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8))
