"""The attention backends by name: the one module that knows them all, so the interface
(attention.py) imports no implementation and no backend registers itself in it."""

from __future__ import annotations

from worker.models.attention import AttentionBackend, TorchAttentionBackend


def _triton() -> type[AttentionBackend]:
    from worker.models.triton_backend import TritonAttentionBackend  # Triton itself loads lazily

    return TritonAttentionBackend


_BACKENDS = {"torch": lambda: TorchAttentionBackend, "triton": _triton}


def create_attention_backend(name: str) -> AttentionBackend:
    try:
        cls = _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}") from None
    return cls()
