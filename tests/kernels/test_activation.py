import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the dev extra): the kernels cannot run")

from kernels import silu_and_mul, silu_and_mul_ref  # noqa: E402

# The interpreter rounds fp32 -> bf16 by truncation (a GPU rounds to nearest): one bf16 ulp.
TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (1e-3, 1e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,inter", [(5, 24), (2, 1500)])  # 1500: two programs per row, masked tail
def test_silu_and_mul_matches_reference(dtype, num_tokens, inter):
    x = (2 * torch.randn(num_tokens, 2 * inter)).to(dtype)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), atol=atol, rtol=rtol)
