"""The chained KV-block hash shared by the router and the engine (pure Python, no torch).

The hash of full block i is a stable 64-bit digest of (hash of block i-1, the block's token ids,
the model id). It must never depend on the process (Python's ``hash()`` does), so router replicas
and every worker agree on it; blake2b is in the standard library and fast enough for prompts.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 16
# The parent of block 0. Any fixed value works; it only has to be the same everywhere.
ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int], model_id: str) -> int:
    """The hash of one full block, chained on its parent's hash."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(model_id.encode("utf-8"))
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    token_ids: Sequence[int], block_size: int, model_id: str, parent_hash: int = ROOT_HASH
) -> list[int]:
    """The chained hashes of every *full* block of ``token_ids`` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size], model_id)
        hashes.append(parent_hash)
    return hashes
