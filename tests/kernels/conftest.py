"""Kernel tests run the Triton kernels on CPU through the Triton interpreter.

The interpreter is chosen when a kernel is decorated, so TRITON_INTERPRET must be set before
kernels/ (or triton) is first imported: here, at the top of the conftest, before collection
imports the test modules.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
