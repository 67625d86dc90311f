import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the dev extra): the kernels cannot run")

from kernels.argmax import _STATES, argmax_rows  # noqa: E402


def _check(x: torch.Tensor, block: int) -> None:
    got = argmax_rows(x, block=block)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))
    keys, tickets = _STATES[x.device][-1]  # left at rest for the next call (no clearing launch)
    assert bool((keys == -(2**63)).all()) and bool((tickets == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,cols,block", [(1, 50, 16), (5, 64, 16), (3, 37, 64), (2, 1000, 128)])
def test_argmax_matches_torch(dtype, rows, cols, block):
    for _ in range(2):  # twice: the second call starts from the state the first left
        _check(torch.randn(rows, cols).to(dtype), block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_ties_pick_the_lowest_index(dtype):
    # Coarse values (bf16 logits tie often): many equal maxima in different chunks, and at both
    # ends of a chunk.
    x = torch.randint(-3, 3, (6, 70)).to(dtype)
    x[1, [5, 17, 33, 69]] = 9
    x[2, [16, 15]] = 9  # the winner is the first of a chunk, its tie the last of the one before
    x[3] = 0.0
    x[4] = -1.0
    x[4, 20], x[4, 3] = 0.0, -0.0  # -0.0 equals +0.0: the lower index wins
    x[5] = float("-inf")
    _check(x, 16)


def test_argmax_nan_and_infinities_as_torch():
    x = torch.randn(4, 40)
    x[0, 7] = float("inf")
    x[0, 30] = float("inf")
    x[1, 25] = float("nan")  # NaN wins over everything
    x[1, 3] = float("inf")
    x[2, [9, 31]] = float("nan")  # the first NaN
    x[3, 12] = -float("nan")  # a NaN with its sign bit set counts as NaN all the same
    _check(x, 16)


def test_argmax_strided_rows_and_no_rows():
    x = torch.randn(4, 48)[:, :40]  # rows of a wider buffer (stride 48)
    _check(x, 16)
    assert argmax_rows(torch.randn(0, 40)).shape == (0,)


def test_argmax_state_grows_for_more_rows():
    _check(torch.randn(3, 20), 8)
    _check(torch.randn(300, 20), 8)  # past the first buffer's 256 rows
    _check(torch.randn(2, 20), 8)
