"""The swapped W8A16 / W4A16 kernel lowered for an H100 / H200 (sm_90) without a GPU: its dot must
be a wgmma whose first operand (the dequantized weight) comes from registers, which is the
kernel's whole point (kernels/wq_matmul.py), and its loop must hold no layout conversion."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed (the dev extra): the kernels cannot be compiled")

ROOT = Path(__file__).resolve().parents[2]

# run in a subprocess: this session's kernels are decorated for the interpreter
CHECK = r'''
import re
from tests.kernels.compile_sm90 import C, P, compile_kernel
from kernels import wq_matmul

for bits, q in ((4, "*u8"), (8, "*i8")):
    for bn, bm, warps, perm, xsum in ((64, 16, 4, True, bits == 4), (64, 16, 4, False, False),
                                      (128, 128, 8, True, bits == 4)):
        args = dict(x_ptr=P, q_ptr=q, s_ptr=P, b_ptr=P, bias_ptr=P, out_ptr=P, ws_ptr="*fp32", cnt_ptr="*i32",
                    M="i32", N="i32", K="i32", stride_xm="i32", stride_qn="i32", stride_sn="i32", stride_om="i32",
                    ROWS_KEY="i32", BITS=C(bits), GROUP=C(128), HAS_BIAS=C(False), BLOCK_N=C(bn), BLOCK_M=C(bm),
                    BLOCK_K=C(128), SPLIT_K=C(2 if bm == 16 else 1), MAGIC=C(0x4300), OFFSET=C(128.0),
                    PERM=C(perm), XSUM_DOT=C(xsum), DOT_PRECISION=C("tf32"))
        ttgir = compile_kernel(wq_matmul._wq_swapped_kernel, args, warps, 3).asm["ttgir"]
        loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
        dots = [l for l in loop.splitlines() if "ttng.warp_group_dot " in l]
        label = f"int{bits} {bn}x{bm} perm={perm} xsum_dot={xsum}"
        assert dots, label + ": no wgmma"
        for d in dots:  # A: a register tensor in a dot-operand layout, not a shared-memory descriptor
            a_type = d.split("} : ")[1].split(" * ")[0]
            assert a_type.startswith("tensor<") and "opIdx = 0" in a_type, label + ": " + a_type
        assert "convert_layout" not in loop, label + ": a layout conversion in the loop"
        print("ok", label)
'''


def test_swapped_kernel_runs_wgmma_with_the_weight_in_registers():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
