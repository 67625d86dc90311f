"""Continuous batching under a per-step token budget (chunked prefill falls out of it).

The one rule: each step, every scheduled sequence catches its computed tokens up towards its
known tokens (prompt + output so far), taking min(remaining, budget left). Running sequences go
first, so decodes in flight are never stalled by a long prompt; waiting ones follow in arrival
order (first come, first served: a waiting request that does not fit blocks those behind it).
When blocks run out, the newest running sequence is preempted: its blocks are freed and it
recomputes later (its full blocks usually come back from the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from worker.engine.block_manager import BlockManager
from worker.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # the drafts included
    # Speculative decoding: tokens a drafter proposed after the sequence's last, computed in this
    # step behind it (their logits verify them: speculative.py).
    draft: list[int] = field(default_factory=list)
    # True when this step completes the sequence's tokens, so the last one's logits give a token.
    # Fixed when scheduled: the lookahead advances the sequence before the step's tokens are read.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        known = self.num_new_tokens - len(self.draft)
        self.samples = self.seq.num_computed_tokens + known == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, skip: frozenset[int] = frozenset(), drafts: dict[int, list[int]] | None = None
                 ) -> tuple[list[ScheduledSeq], list[Sequence]]:
        """This step's work, decodes first; and sequences that can never fit (to finish by length).
        ``skip``: ids of running sequences to leave out (the lookahead: their pending token is
        their last; they keep their blocks until it is read). ``drafts``: id(seq) -> tokens a
        drafter proposed for a running sequence in decode; they ride along when the budget and
        free blocks allow (never at the cost of a preemption)."""
        drafts = drafts or {}
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        overflow: list[Sequence] = []
        preemptions_before = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if id(seq) in skip:
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            draft = drafts.get(id(seq), [])[: budget - 1]
            if draft and num_new == 1 and self.bm.allocate(seq, 1 + len(draft)):
                scheduled.append(ScheduledSeq(seq, 1 + len(draft), draft))
                budget -= 1 + len(draft)
                i += 1
                continue
            outcome = self._allocate_or_preempt(seq, num_new)
            if outcome == "ok":
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
            elif outcome == "overflow":
                overflow.append(seq)
        preempted = self.num_preemptions > preemptions_before
        # Admit waiting sequences; not in a step that had to preempt (they would only thrash).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if seq.num_pending_tokens:  # preempted with a token in flight: admitted once it is read
                break
            cached = self.bm.find_cached_prefix(seq)
            num_cached = len(cached[0]) * self.bm.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.bm.allocate(seq, num_new, cached):
                break
            self.waiting.popleft()
            if seq.num_cached_tokens is None:  # the first admission is what the client is told
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
                self.bm.record_lookup(seq.num_prompt_tokens, seq.num_cached_tokens)
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        # Single-token steps first: the attention backend batches them as decodes.
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return scheduled, overflow

    def _allocate_or_preempt(self, seq: Sequence, num_new: int) -> str:
        """Allocate for ``seq``, preempting the newest running sequences until it fits.

        "ok"; "preempted" when ``seq`` itself was the newest and went back to waiting; "overflow"
        when it is the only running sequence and still does not fit: the pool cannot hold it at
        all, it leaves the running list and the engine finishes it by length.
        """
        while not self.bm.allocate(seq, num_new):
            victim = self.running.pop()
            if victim is not seq:
                self._preempt(victim)
                continue
            if self.running:
                self._preempt(seq)
                return "preempted"
            return "overflow"
        return "ok"

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of the queues and free its blocks (finish, abort or error alike)."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def check_integrity(self) -> None:
        self.bm.check_integrity(self.running + list(self.waiting))
        for seq in self.waiting:
            assert not seq.block_table, f"waiting request {seq.request_id} holds blocks"
