import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the dev extra): the kernels cannot run")

from kernels import rms_norm, rms_norm_ref  # noqa: E402

# The interpreter rounds fp32 -> bf16 by truncation (a GPU rounds to nearest): one bf16 ulp.
TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (1e-3, 1e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 32), (2, 3, 48)])  # 48: a row that is not a power of two
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, shape, with_residual):
    x = torch.randn(shape).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    residual = torch.randn(shape).to(dtype) if with_residual else None
    atol, rtol = TOL[dtype]

    got = rms_norm(x, weight, 1e-6, residual)
    want = rms_norm_ref(x, weight, 1e-6, residual)

    if with_residual:
        torch.testing.assert_close(got[1], want[1], atol=atol, rtol=rtol)  # the new residual, x + residual
        got, want = got[0], want[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_rms_norm_leaves_inputs_alone():
    x, residual, weight = torch.randn(3, 32), torch.randn(3, 32), torch.randn(32)
    x0, r0 = x.clone(), residual.clone()
    rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0)
