"""Per-request sampling inside one batch: greedy, temperature, top-k, top-p, seeds, logprobs.

Logprobs are those of the model's own distribution (before temperature and cuts), which is what
a confidence measure wants. A seeded request draws from its own generator, seeded afresh for each
token from (seed, the token's index within the answer): its tokens depend neither on what else
shares the batch nor on what ran before in this process, so a continuation elsewhere
(``seed_offset``) or after a preemption draws what the uninterrupted request would have.
"""

from __future__ import annotations

import torch

from kernels import HAS_TRITON
from kernels.argmax import TRITON_ARGMAX, argmax_rows
from kernels.argmax import fits as argmax_fits
from worker.engine.outputs import TokenLogprob
from worker.engine.sampling_params import SamplingParams
from worker.engine.structured_output import GrammarMask
from worker.models.transfer import to_device

_MASK64 = 2**64 - 1


def draw_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's draw for the token at ``index`` within its answer: output
    ``index`` of SplitMix64 started at ``seed``. Well mixed, so the samples of one request (seeds
    seed, seed + 1, ...: n > 1) draw unrelated numbers at every index, not shifted copies."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``logits`` [N, V], drawn where the logits are (no copy to the host, no
    wait for the device): a tensor [N]. ``generators``: each row's own RNG (seeded requests), on
    that device, or None for the device's default one."""
    tokens = greedy_tokens(logits)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        device = logits.device
        rows = to_device(sampled_rows, device, torch.long)
        probs = probabilities(logits[rows], [params[i] for i in sampled_rows])
        for j, i in enumerate(sampled_rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return tokens


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of ``logits`` [N, V] as they are (a bf16 -> fp32 cast is exact and
    keeps the order, so the token is the same; at batch 256 the cast would move ~200 MB a step).
    On a GPU one Triton launch (kernels/argmax.py: torch's reduction took ~37 µs of an H100's
    batch-1 step), the index torch gives, ties and NaN included; torch's argmax elsewhere."""
    if logits.is_cuda and HAS_TRITON and TRITON_ARGMAX and argmax_fits(logits):
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row of ``logits`` [N, V] samples from (temperature > 0: top-k and
    top-p cuts of the tempered logits, softmaxed), fp32 [N, V]."""
    temps = to_device([p.temperature for p in params], logits.device, torch.float32)
    sub = logits.float() / temps.unsqueeze(1)
    sub = _apply_top_k(sub, [p.top_k for p in params])
    sub = _apply_top_p(sub, [p.top_p for p in params])
    return sub.softmax(dim=-1)


def steer(logits: torch.Tensor, params: list[SamplingParams], hold: list[list[int] | None],
          grammar: GrammarMask | None = None) -> torch.Tensor:
    """The logits the rows sample from: each row's ``logit_bias`` added, the token ids in its
    ``hold`` (EOS and stop ids while it is under ``min_tokens``) ruled out, and with ``grammar``
    the tokens its structured output does not allow. The same tensor when no row asks for any of
    them (the usual case: no copy)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias or hold[i]]
    if not rows and grammar is None:
        return logits
    out = logits.clone()
    if grammar is not None:
        grammar.apply(out)
    for i in rows:
        if params[i].logit_bias:
            ids = to_device(list(params[i].logit_bias), logits.device, torch.long)
            bias = to_device(list(params[i].logit_bias.values()), logits.device, torch.float32)
            out[i].index_add_(0, ids, bias.to(out.dtype))
        if hold[i]:
            out[i, to_device(hold[i], logits.device, torch.long)] = float("-inf")
    return out


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    hold: list[list[int] | None] | None = None, grammar: GrammarMask | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of ``logits`` [N, V] (steered: ``steer``); with it, its logprob entry
    when asked for, from the model's own distribution."""
    tokens = sample_tokens(steer(logits, params, hold or [None] * len(params), grammar), params, generators)
    token_list = tokens.tolist()
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    entries: list[TokenLogprob | None] = [None] * len(params)
    if want:
        for i, entry in zip(want, logprob_entries(logits[want], tokens[want], [params[i].logprobs for i in want])):
            entries[i] = entry
    return token_list, entries


def logprob_entries(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[TokenLogprob]:
    """Per row of ``logits`` [N, V]: its token's logprob under the model's own distribution and
    the row's ``tops[i]`` most likely alternatives."""
    logprobs = logits.float().log_softmax(dim=-1)
    top_n = max(tops)
    top_vals, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    return [TokenLogprob(t, chosen[j], list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())) if n else [])
            for j, (t, n) in enumerate(zip(tokens.tolist(), tops))]


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    if not any(top_ks):
        return logits
    vocab = logits.shape[-1]
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_ps):
        return logits
    p = torch.tensor(top_ps, device=logits.device).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the best one always stays).
    drop = probs.cumsum(dim=-1) - probs >= p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
