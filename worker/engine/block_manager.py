"""The paged KV pool's bookkeeping: block tables, reference counts and the prefix cache.

Every physical block is in exactly one of three states:

    state       ref_count  block_hash  where
    in use      >= 1       any         some sequence's block_table
    evictable   0          set         self._evictable (LRU order, oldest first)
    free        0          None        self._free

A full block enters the prefix cache (gets a hash) once all its tokens are computed; it stays
findable while in use or evictable and leaves the cache only when reallocated (evicted). Each
enter/leave is recorded as an event for the router's index. A sequence frees its blocks tail
first, so the blocks least likely to be shared again are evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from protos.block_hash import ROOT_HASH, hash_block
from worker.engine.sequence import Sequence


@dataclass(frozen=True)
class KVEvent:
    kind: str  # "stored" | "evicted" | "cleared"
    block_hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, model_id: str, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_id = model_id
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest id
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.events: list[KVEvent] = []
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found in cache

    # --- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: free ones plus unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """(blocks, hashes) of the longest cached prefix of ``seq.token_ids``.

        Stops one token short of the whole sequence so the last token's logits are always computed,
        and before the first prompt token whose logprob is wanted (``params.prompt_logprobs``).
        """
        if not self.enable_prefix_caching:
            return [], []
        blocks, hashes = [], []
        parent = ROOT_HASH
        usable = (seq.num_tokens - 1) // self.block_size
        if seq.params.prompt_logprobs is not None:  # the positions that score prompt tokens are computed
            usable = min(usable, (seq.prompt_logprobs_next - 1) // self.block_size)
        for i in range(usable):
            parent = hash_block(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size], self.model_id)
            block = self.hash_to_block.get(parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    # --- allocation ----------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: tuple[list[int], list[int]] | None = None) -> bool:
        """Give ``seq`` the blocks to hold ``num_new_tokens`` more tokens; all or nothing.

        ``cached`` (from ``find_cached_prefix``) adopts those blocks as the sequence's first ones.
        """
        cached_blocks, cached_hashes = cached or ([], [])
        num_cached_tokens = len(cached_blocks) * self.block_size
        total = max(seq.num_computed_tokens, num_cached_tokens) + num_new_tokens
        needed = self.blocks_needed(total) - len(seq.block_table) - len(cached_blocks)
        # Cached blocks that are evictable stop being free once adopted.
        adopt_from_free = sum(1 for b in cached_blocks if self.ref_count[b] == 0)
        if needed > self.num_free_blocks - adopt_from_free:
            return False
        for b in cached_blocks:
            if self.ref_count[b] == 0:
                del self._evictable[b]
            self.ref_count[b] += 1
        seq.block_table.extend(cached_blocks)
        seq.block_hashes.extend(cached_hashes)
        for _ in range(max(needed, 0)):
            seq.block_table.append(self._take_block())
        return True

    def _take_block(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)  # least recently used
            self._uncache(block)
        self.ref_count[block] = 1
        return block

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
                self.events.append(KVEvent("evicted", h))

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``, tail first; cached ones stay findable until evicted."""
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} freed twice"
            if self.ref_count[block] == 0:
                if self.block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table.clear()
        seq.block_hashes.clear()

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free ``seq``'s blocks past the first ``num_tokens`` tokens (speculative decoding: the
        blocks of rejected drafts). Such blocks hold no verified full block, so none is cached."""
        keep = self.blocks_needed(num_tokens)
        assert keep >= len(seq.block_hashes), "trimming a cached block"
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.ref_count[block] -= 1
            assert self.ref_count[block] == 0 and self.block_hash[block] is None, f"block {block} is shared or cached"
            self._free.append(block)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        for i in range(len(seq.block_hashes), num_full):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            parent = hash_block(parent, tokens, self.model_id)
            seq.block_hashes.append(parent)
            block = seq.block_table[i]
            if parent in self.hash_to_block:
                continue  # computed twice concurrently; the first copy stays the cached one
            self.block_hash[block] = parent
            self.hash_to_block[parent] = block
            self.events.append(KVEvent("stored", parent))

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (blocks in use keep their contents)."""
        for block in list(self._evictable):
            self._uncache(block)
            self._free.append(block)
        self._evictable.clear()
        self.events.append(KVEvent("cleared"))

    def snapshot_events(self) -> list[KVEvent]:
        """Events that rebuild an index of this cache from nothing: cleared, then every cached block."""
        return [KVEvent("cleared")] + [KVEvent("stored", h) for h in self.hash_to_block]

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def check_integrity(self, live: list[Sequence]) -> None:
        """Every block is in exactly one state, and reference counts match the live tables."""
        refs = [0] * self.num_blocks
        for seq in live:
            for b in seq.block_table:
                refs[b] += 1
        assert refs == self.ref_count, "reference counts disagree with block tables"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable, "a block is free twice"
        for b in range(self.num_blocks):
            in_use = self.ref_count[b] > 0
            assert in_use + (b in free) + (b in evictable) == 1, f"block {b} is in {in_use + (b in free) + (b in evictable)} states"
            if b in free:
                assert self.block_hash[b] is None, f"free block {b} still has a hash"
            if b in evictable:
                assert self.block_hash[b] is not None, f"evictable block {b} has no hash"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash map points at block {b}, which holds another hash"
