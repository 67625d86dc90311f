import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the dev extra): the kernels cannot run")

from kernels import tiled_matmul  # noqa: E402
from kernels.matmul import CANDIDATES, INTERPRETER_CONFIG  # noqa: E402

BM, BN, BK, _, WARPS, STAGES = INTERPRETER_CONFIG


def matmul(x, weight, bias=None, split_k=1):
    return tiled_matmul(x, weight, bias, block_m=BM, block_n=BN, block_k=BK, split_k=split_k,
                        num_warps=WARPS, num_stages=STAGES)


@pytest.fixture(autouse=True)
def _poisoned_empty(monkeypatch):
    """torch.empty (the output, the split-K partials) comes back full of NaN: an element the
    kernels leave unwritten, or a partial the sum reads but no program stored, shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


# bf16: the interpreter rounds fp32 to bf16 toward zero, up to 2**-7 off (the GPU rounds to nearest).
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiled_matmul_matches_linear(dtype, tol, split_k, with_bias):
    # M, N and K all off the interpreter's 16 x 16 x 16 tiles: 3 x 3 output tiles, each ragged
    # on its last row and column; K's 5 tiles split 3+2 or 2+2+1, the last one ragged.
    m, n, k = 37, 45, 70
    x = torch.randn(m, k).to(dtype)
    weight = torch.randn(n, k).to(dtype)
    bias = torch.randn(n).to(dtype) if with_bias else None
    want = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())

    got = matmul(x, weight, bias, split_k)

    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol * k**0.5, rtol=tol)


@pytest.mark.parametrize("m,n,k,split_k", [
    (1, 16, 64, 1),  # one row; K a multiple of the tile (no K mask)
    (5, 7, 64, 4),  # K's 4 tiles, one a split
    (3, 17, 20, 3),  # 2 K tiles for 3 splits: the last split is empty and must store zeros
    (16, 16, 16, 2),
])
def test_tiled_matmul_edge_shapes(m, n, k, split_k):
    x, weight, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    torch.testing.assert_close(matmul(x, weight, bias, split_k), torch.nn.functional.linear(x, weight, bias),
                               atol=1e-5 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("split_k", [1, 2, 3, 4])
def test_split_k_counts_every_column_of_k_once(split_k):
    """All ones: each output is exactly K (also in bf16), so a K tile that no split covers, or
    that two splits both add, moves it by at least the ragged last tile's 6."""
    m, n, k = 17, 18, 70
    got = matmul(torch.ones(m, k, dtype=torch.bfloat16), torch.ones(n, k, dtype=torch.bfloat16), split_k=split_k)
    assert torch.equal(got.float(), torch.full((m, n), float(k)))


def test_tiled_matmul_takes_a_strided_row_slice():
    buf = torch.randn(20, 96)
    x = buf[:, 32:64]
    weight = torch.randn(20, 32)
    torch.testing.assert_close(matmul(x, weight, split_k=2), x @ weight.T, atol=1e-5, rtol=1e-5)


def test_candidates_fit_an_h100():
    """The sweep's configs: wgmma-sized row tiles, warps of whole warpgroups, shared memory for
    the pipelined operand tiles within the 227 KB a block may take, and split-K among them."""
    assert len(set(CANDIDATES)) == len(CANDIDATES)
    for bm, bn, bk, split_k, warps, stages in CANDIDATES:
        assert bm % 64 == 0 and warps in (4, 8) and split_k >= 1
        assert all(b & (b - 1) == 0 for b in (bm, bn, bk)), "tl.arange needs powers of 2"
        assert (bm + bn) * bk * 2 * stages <= 227 * 1024
    assert {2, 4} <= {c[3] for c in CANDIDATES}
