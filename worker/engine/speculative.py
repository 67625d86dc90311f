"""Speculative decoding: a drafter proposes k tokens, one target forward verifies them.

A sequence in plain decode (one known token to compute) with drafts is scheduled with 1 + k new
tokens: its last token and the k drafts, positions p .. p+k. The target's logits at those k + 1
rows say, for each draft, what the target itself would have produced there:

    row:      p        p+1      ...  p+k
    input:    last     d1       ...  dk
    decides:  d1?      d2?      ...  (bonus)

Verification walks the rows in order and stops at the first rejection, emitting the target's
own token there; when every draft is accepted the last row gives one more (the bonus). So a step
emits 1 .. k+1 tokens, and every one of them is what the target would have emitted:
- greedy: a draft is accepted when it is the target's argmax (the output is the plain run's);
- sampled: a draft d with drafter probability q(d) is accepted with probability min(1, p(d)/q(d)),
  and on rejection the token is drawn from the residual max(0, p - q) renormalised (Leviathan et
  al. 2023; Chen et al. 2023), which makes each emitted token distributed exactly as p. An n-gram
  drafter is deterministic (q is one-hot on d): accept with p(d), else draw from p without d.
p is the target's sampling distribution (logit_bias, temperature, top-k, top-p: sampler.py).

After verification the sequence's computed tokens are the last token plus the accepted drafts;
the KV the step wrote for rejected positions lies beyond them and is overwritten when those
positions are computed again, and blocks past what the sequence holds go back to the pool
(BlockManager.trim). No block is hashed until its tokens are verified.

Seeded requests draw each position's numbers from (seed, index of the token in the answer), as
plain sampling does, so a seeded answer is reproducible; it differs from the one drawn without
speculation (the random numbers are used differently), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from worker.engine.config import SpeculativeConfig
from worker.engine.outputs import TokenLogprob
from worker.engine.sampler import greedy_tokens, logprob_entries, probabilities, steer
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence


class Drafter(Protocol):
    """Proposes up to ``k`` next tokens for a sequence from its known tokens (before scheduling;
    a model drafter proposes placeholders, their number); ``fill`` runs after scheduling, once the
    drafts' KV slots exist, writes a model drafter's drafts into the batch and returns, per item,
    the drafter's distributions q [k, V] of sampled drafts (None: deterministic drafts)."""

    name: str

    def propose(self, seq: Sequence, k: int) -> list[int]: ...

    def fill(self, batch: list) -> list[torch.Tensor | None] | None: ...


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from
    ``max_n`` down to ``min_n``) in its prompt and output, and propose the k tokens that followed
    it. Free to run; pays where answers repeat their context (code edits, quotes, extraction)."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = np.asarray(seq.token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows that start before the suffix itself, each followed by at least one token
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []

    def fill(self, batch: list) -> None:
        return None


def make_ngram_drafter(spec: SpeculativeConfig) -> Drafter:
    return NgramDrafter(spec.ngram_min, spec.ngram_max)


@dataclass
class SpecStats:
    """Counters since start: drafted tokens, of them accepted, and verifications (sequence-steps
    that verified drafts). Acceptance rate = accepted / drafted; mean accepted length = tokens a
    verification emits on average, the bonus included: (accepted + verifications) / verifications."""

    drafted: int = 0
    accepted: int = 0
    verifications: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verifications += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted + self.verifications) / self.verifications if self.verifications else 0.0


def verify(logits: torch.Tensor, drafts: list[list[int]], seqs: list[Sequence],
           q: list[torch.Tensor | None] | None = None) -> list[list[tuple[int, TokenLogprob | None]]]:
    """Per speculating sequence, the tokens its step emits (1 .. k+1) with their logprobs when
    wanted. ``logits``: the target's rows, len(draft) + 1 per sequence, in order; ``q``: per
    sequence the drafter's distributions of its drafts [k, V], None where drafts are deterministic."""
    q = q or [None] * len(seqs)
    counts = [len(d) + 1 for d in drafts]
    params: list[SamplingParams] = [p for seq, c in zip(seqs, counts) for p in [seq.params] * c]
    steered = steer(logits, params, [None] * len(params))
    argmax = greedy_tokens(steered).tolist()
    out: list[list[tuple[int, TokenLogprob | None]]] = []
    row = 0
    for seq, draft, q_seq in zip(seqs, drafts, q):
        rows = slice(row, row + len(draft) + 1)
        if seq.params.greedy:
            tokens = _accept_greedy(argmax[rows], draft)
        else:
            tokens = _accept_sampled(steered[rows], draft, seq, q_seq)
        out.append(_with_logprobs(logits[rows], tokens, seq.params))
        row += len(draft) + 1
    return out


def _accept_greedy(argmax: list[int], draft: list[int]) -> list[int]:
    """The drafts up to the first that is not the target's argmax, then the target's token."""
    n = 0
    while n < len(draft) and draft[n] == argmax[n]:
        n += 1
    return draft[:n] + [argmax[n]]


def _accept_sampled(logits: torch.Tensor, draft: list[int], seq: Sequence, q: torch.Tensor | None) -> list[int]:
    """The rejection rule; ``q`` None: a deterministic drafter (q one-hot on each draft)."""
    probs = probabilities(logits, [seq.params] * logits.shape[0])
    index = seq.params.seed_offset + seq.num_output_tokens  # the answer index of the first token decided
    tokens: list[int] = []
    for j, d in enumerate(draft):
        gen = seq.generator_at(logits.device, index + j)
        u = torch.rand(1, generator=gen, device=logits.device).item()
        if u * (1.0 if q is None else q[j, d].item()) < probs[j, d].item():  # u < min(1, p(d) / q(d))
            tokens.append(d)
            continue
        if q is None:
            residual = probs[j].clone()
            residual[d] = 0.0  # max(0, p - q) with q one-hot on d
        else:
            residual = (probs[j] - q[j].to(probs.dtype)).clamp_(min=0)
        if residual.sum() <= 0:  # p <= q nowhere: p == q, so acceptance was certain (failed only on rounding)
            tokens.append(d)
            continue
        tokens.append(int(torch.multinomial(residual, 1, generator=gen)[0]))
        return tokens
    gen = seq.generator_at(logits.device, index + len(draft))
    tokens.append(int(torch.multinomial(probs[len(draft)], 1, generator=gen)[0]))
    return tokens


def _with_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams
                   ) -> list[tuple[int, TokenLogprob | None]]:
    """Each emitted token with the target's own logprob entry when the request wants them."""
    if params.logprobs is None:
        return [(t, None) for t in tokens]
    ids = torch.tensor(tokens, device=logits.device)
    return list(zip(tokens, logprob_entries(logits[: len(tokens)], ids, [params.logprobs] * len(tokens))))
