"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.engine.outputs import TokenLogprob
from worker.engine.sampler import draw_seed
from worker.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    # prompt + output tokens: what the KV cache must eventually hold
    token_ids: list[int] = field(default_factory=list)
    # tokens whose K/V are in this sequence's blocks; a step computes [num_computed, +num_new)
    num_computed_tokens: int = 0
    # Tokens sampled on the device by launched steps and not read yet (the lookahead: 0-2). They
    # count in num_tokens, so the scheduler plans the next step as if they were known; the step
    # whose input one is takes it from the device.
    num_pending_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # chained hashes of the full blocks of token_ids that are registered (or found) in the cache
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens served from cache, fixed at first admission
    first_token_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-request RNG when a seed is given (next_generator)
    # params.structured_output: an llguidance matcher that has taken every output token (the engine
    # feeds it each sampled token; a preemption keeps the tokens, so it keeps the matcher). None
    # once the request is done.
    matcher: Any = None
    # Speculative decoding with a draft model: the position whose draft-model K/V is still to
    # write (the last draft's, when all were accepted: draft_model.py); None: none missing.
    draft_hole: int | None = None
    # Drafting backs off after rejections: steps to sit out, and fully rejected drafts in a row
    spec_skip: int = 0
    spec_misses: int = 0
    # Detokenization and streaming state (see detokenizer.py)
    output_text: str = ""
    emitted_text_len: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    pending_token_ids: list[int] = field(default_factory=list)  # produced, not yet handed out
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    # params.prompt_logprobs: entries for prompt tokens from the start on, as steps compute them;
    # handed out once, with the first output.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    def next_generator(self, device: torch.device, counted: int = 0) -> torch.Generator | None:
        """A seeded request's own RNG (made at its first draw, on the device that samples it), seeded
        for the token it draws next from (seed, that token's index within the answer: those before
        this request, ``seed_offset``, plus its own, pending ones included; ``counted``: 1 when the
        token being drawn is already counted as pending). Re-seeding a generator is a host-side
        write (about a microsecond); a launched draw has taken its state already."""
        index = self.params.seed_offset + self.num_output_tokens + self.num_pending_tokens - counted
        return self.generator_at(device, index)

    def generator_at(self, device: torch.device, index: int) -> torch.Generator | None:
        """A seeded request's RNG seeded for the token at ``index`` within its answer (speculative
        verification decides several at once); None (the device's) without a seed."""
        if self.params.seed is None:
            return None
        if self.generator is None:
            self.generator = torch.Generator(device=device)
        return self.generator.manual_seed(draw_seed(self.params.seed, index))

    @property
    def prompt_logprobs_next(self) -> int:
        """The prompt token whose logprob is wanted next (params.prompt_logprobs): the position
        before it must be computed, not taken from the prefix cache."""
        return max(self.params.prompt_logprobs_start, 1) + len(self.prompt_logprobs)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus those sampled and not yet read."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_prefill_pending(self) -> int:
        """Known tokens still to compute before the next one can be sampled (0 in plain decode):
        what a worker reports as queued prefill (EngineStats.pending_prefill_tokens)."""
        return max(self.num_tokens - self.num_computed_tokens - 1, 0)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens known (read back), not counting pending ones."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
