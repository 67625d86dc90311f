"""Triton, imported in one place and optionally.

kernels/ must import on machines without Triton or a GPU (the CPU engine and its tests), so the
kernel modules take ``jit``, ``tl`` and ``triton`` from here and write ``tl.constexpr`` annotations
under ``from __future__ import annotations`` (Triton reads them as strings). Calling a kernel
without Triton, or on CPU tensors outside the interpreter, raises with the reason.

The interpreter (``TRITON_INTERPRET=1``) is chosen when a kernel is decorated, so the variable
must be set before the first kernel module is imported.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a CPU-only install without the dev extra
    triton = None
    tl = None
    gdc_launch_dependents = gdc_wait = None

HAS_TRITON = triton is not None


def jit(fn: Callable[..., Any] | None = None, *, do_not_specialize: tuple[str, ...] = (),
        do_not_specialize_on_alignment: tuple[str, ...] = ()) -> Any:
    """``triton.jit`` when Triton is installed; otherwise the plain function (never launched).

    Triton compiles a kernel anew for each integer argument that is 1, divisible by 16 or neither,
    and for each pointer that is or is not 16-byte aligned. Arguments that change from step to step
    (a block table's width, a batch's sequence count, a pointer to row ``nd`` of a step's tensor) are
    named in ``do_not_specialize*``: otherwise a server meets new variants under load and stalls
    its step loop for a compile (seen on an H100: about 0.8 s in each 20 s served run)."""
    if fn is None:
        return lambda f: jit(f, do_not_specialize=do_not_specialize,
                             do_not_specialize_on_alignment=do_not_specialize_on_alignment)
    if triton is None:
        return fn
    return triton.jit(fn, do_not_specialize=do_not_specialize or None,
                      do_not_specialize_on_alignment=do_not_specialize_on_alignment or None)


def interpreting() -> bool:
    return triton is not None and bool(triton.knobs.runtime.interpret)


def _patch_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns loop bounds into ints with ``int(array_of_one)``, which
    NumPy 2.4 rejects (triton-lang/triton#9171, fixed upstream by #9172 after 3.6.0). Re-apply
    the upstream fix so dynamic ``range`` bounds work under TRITON_INTERPRET=1; a no-op elsewhere."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_kvcascade_fixed", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._kvcascade_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


if interpreting():
    _patch_interpreter_for_numpy_2_4()


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise a clear error where a Triton launch cannot work, before Triton raises an obscure one."""
    if triton is None:
        raise RuntimeError("Triton is not installed (pip install -e '.[dev]'); use the *_ref functions")
    if not interpreting() and not all(t.is_cuda for t in tensors):
        raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before import")


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a small stand-in for CPU (the interpreter)."""
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Programmatic dependent launch (Hopper and later): a kernel launched with it may be scheduled
# while the kernel before it in the stream drains, and waits (griddepcontrol.wait, first thing in
# each of our kernels) until that one's writes are visible. At batch 1 a decode step is ~350
# dependent launches, each otherwise paying its launch latency after its producer ends.
# KVCASCADE_PDL=0 turns it off (the A/B baseline).
PDL = os.environ.get("KVCASCADE_PDL", "1") != "0"
# A kernel that comes right before a quantized projection (RMS norm, SiLU, attention and its merge)
# may let the next kernel be scheduled before its own wait, not after it: the projection (its
# first weight tiles fetched before its wait: kernels/wq_gluon.py) then starts while the small
# kernel still waits for the one before it, two kernels ahead. Safe by transitivity: a kernel's
# wait returns once the kernel before it completed, and that one completed only after its own
# wait. The caller says when (``early_next``: the model knows which projection follows); only at
# up to EARLY_MAX_ROWS rows. H200, dummy Llama-3.1-8B (docs/BENCHMARKS.md): int4 batch 1 2.25 ->
# 2.17 ms, batch 16 2.65 -> 2.57; batch 64 3.90 -> 3.99; and a bf16 model's batch-1 step (skinny
# GEMVs, which wait before reading anything) 4.37-4.51 -> 4.85 ms, so never before those.
# KVCASCADE_PDL_EARLY=0: never (the A/B)
PDL_EARLY = os.environ.get("KVCASCADE_PDL_EARLY", "1") != "0"
EARLY_MAX_ROWS = 16


def early_next(flag: bool, rows: int) -> dict[str, bool]:
    """The EARLY launch option of a kernel before a projection (see above)."""
    return {"EARLY": bool(flag) and PDL_EARLY and rows <= EARLY_MAX_ROWS}


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The launch options for one of our kernels on ``device``: ``USE_PDL`` (the kernel's
    constexpr, which makes it wait for its producer) and ``launch_pdl`` together, or both off."""
    on = (PDL and device.type == "cuda" and not interpreting()
          and _cuda_capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0))
    return {"USE_PDL": on, "launch_pdl": on}


@jit
def launch_next_early(USE_PDL: tl.constexpr, EARLY: tl.constexpr):
    """First thing in a kernel that reads its static inputs before its wait: EARLY's launch of the
    next kernel, not delayed behind those reads (then wait_for_producer(..., LAUNCHED=True))."""
    if USE_PDL and EARLY:
        gdc_launch_dependents()


@jit
def wait_for_producer(USE_PDL: tl.constexpr, EARLY: tl.constexpr = False, LAUNCHED: tl.constexpr = False):
    """First thing in every kernel: before it, a PDL-launched kernel may not read what the
    previous kernel writes, nor exit (stream order after it relies on its having waited). Then
    the next kernel may be scheduled (it waits in turn), so its launch overlaps this one's work;
    EARLY (early_next above): scheduled before this one's wait (LAUNCHED: launch_next_early did).
    What no kernel writes (weights, the step's inputs copied in before it) may be read before."""
    if USE_PDL:
        if EARLY:
            if not LAUNCHED:
                gdc_launch_dependents()
            gdc_wait()
        else:
            gdc_wait()
            gdc_launch_dependents()
