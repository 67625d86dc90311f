"""Speculative decoding: the output is the target's, token for token (greedy) and in
distribution (sampled); drafts' blocks come back; the counters count."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from tests.conftest import MAX_NEW
from worker.engine.config import EngineConfig, SpeculativeConfig
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence
from worker.engine.speculative import NgramDrafter

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
# Prompts whose answers repeat their context: the n-gram drafter's drafts get accepted.
REPEATING = [
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,",
    "The capital of France is Paris. The capital of France is Paris. The capital of France is",
]


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams())


def test_the_ngram_drafter_copies_what_followed_the_latest_longest_match():
    drafter = NgramDrafter(1, 3)
    # "7 8 9" occurs at 1 and at 6; the latest earlier occurrence (6) is followed by 4 5
    assert drafter.propose(_seq([5, 7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 7, 8, 9]), 2) == [4, 5]
    # no 3- or 2-gram match: the 1-gram "2" matches at 1, followed by 3 4 5
    assert drafter.propose(_seq([1, 2, 3, 4, 5, 9, 2]), 3) == [3, 4, 5]
    assert drafter.propose(_seq([1, 2, 3]), 4) == []  # nothing repeats
    assert drafter.propose(_seq([1, 2, 1]), 4) == [2, 1]  # what follows runs into the suffix itself
    assert NgramDrafter(2, 2).propose(_seq([1, 2, 3, 4, 5, 9, 2]), 3) == []  # 1-grams not allowed


def test_speculative_settings_are_checked_and_named():
    assert SpeculativeConfig.parse("ngram:2-5", 3) == SpeculativeConfig("ngram", 3, 2, 5)
    with pytest.raises(ValueError, match="speculative must be ngram, ngram:MIN-MAX or draft:MODEL, got 'medusa'"):
        EngineConfig(speculative="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
        EngineConfig(speculative="ngram:3-2")
    assert EngineConfig(device="cuda", speculative="ngram").async_scheduling is False


def test_greedy_with_ngram_drafts_is_the_transformers_output(make_engine, prompt_ids, hf_reference):
    engine = make_engine(speculative="ngram", num_speculative_tokens=4)
    assert engine.generate(prompt_ids, GREEDY) == hf_reference
    assert engine.spec_stats.verifications > 0
    engine.check_integrity()


@pytest.mark.parametrize("speculative, k", [("ngram:1-3", 5), ("draft:dummy:smollm2-mini", 3)])
def test_greedy_speculation_equals_plain_decoding_under_chunking_prefix_hits_and_preemption(make_engine,
                                                                                          speculative, k):
    """Repeating prompts (n-gram drafts accepted and rejected; a draft model of random weights
    with SmolLM2's vocabulary: nearly all rejected), each twice (prefix hits), a small token
    budget (chunked prefill beside verifications) and a pool too small for all at once (preemption)."""
    plain = make_engine()
    prompts = [plain.tokenize(prompt=p) for p in REPEATING[1:]] * 2 + [plain.tokenize(prompt="hi")]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = plain.generate(prompts, params)
    engine = make_engine(speculative=speculative, num_speculative_tokens=k, max_num_batched_tokens=24,
                         num_kv_blocks=9)
    assert engine.generate(prompts, params) == expected
    stats = engine.spec_stats
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_hits > 0
    assert stats.verifications > 0 and stats.accepted < stats.drafted, stats
    if speculative.startswith("ngram"):
        assert 0 < stats.accepted and 1 < stats.mean_accepted_length <= k + 1
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_drafts_stop_at_max_tokens_eos_and_stop_strings(make_engine):
    engine = make_engine(speculative="ngram", num_speculative_tokens=8)
    prompt = engine.tokenize(prompt=REPEATING[1])
    plain = make_engine()
    for params in (SamplingParams(max_tokens=5, temperature=0),
                   SamplingParams(max_tokens=16, temperature=0, stop=[" 17,"]),
                   SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[plain.tokenize(prompt=" 16")[-1]])):
        want = plain.generate([prompt], params)
        assert engine.generate([prompt], params) == want, params
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_are_the_targets_and_opting_out_never_speculates(make_engine):
    plain = make_engine()
    engine = make_engine(speculative="ngram", num_speculative_tokens=4)
    prompt = plain.tokenize(prompt=REPEATING[1])
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2)
    want = _run(plain, prompt, params)
    got = _run(engine, prompt, params)
    assert [e.token_id for e in got] == [e.token_id for e in want]
    for a, b in zip(got, want):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert engine.spec_stats.accepted > 0
    before = engine.spec_stats.verifications
    engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, speculative=False))
    assert engine.spec_stats.verifications == before


def _run(engine, prompt, params):
    rid = engine.add_request(prompt, params)
    entries = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            entries += out.logprobs or []
    return entries


def test_an_aborted_speculating_request_frees_its_blocks(make_engine):
    engine = make_engine(speculative="ngram", num_speculative_tokens=6)
    prompt = engine.tokenize(prompt=REPEATING[1])
    rid = engine.add_request(prompt, SamplingParams(max_tokens=64, temperature=0))
    other = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0))
    while engine.spec_stats.verifications < 2:
        engine.step()
    engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    assert other not in engine.requests
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


class _SecondChoice:
    """A drafter that proposes, after the first token, the target's second most likely next token
    (given from outside): drafts that are often wrong, so the residual decides many draws."""

    name = "second-choice"

    def __init__(self, prompt_len: int, choice: dict[int, int]):
        self.prompt_len, self.choice = prompt_len, choice

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if len(seq.token_ids) != self.prompt_len + 1:
            return []
        return [self.choice[seq.token_ids[-1]]]

    def fill(self, batch) -> None:
        return None


def test_sampled_speculation_draws_from_the_targets_distribution(make_engine):
    """The first 3 tokens of one prompt over 1,200 seeds, against the target's exact joint
    probabilities (temperature 1.5, top-k 3: 27 outcomes). Token 2 is drafted as the target's
    second choice and decided by the rejection rule; a residual that kept the draft would give it
    p + (1 - p) p instead of p, which this test sees as a chi-square of several hundred."""
    temp, top_k, n = 1.5, 3, 1200
    plain = make_engine()
    prompt = plain.tokenize(prompt="My favourite colour is")

    def dist(prefix: list[int]) -> dict[int, float]:
        out = _run(plain, prompt + prefix, SamplingParams(max_tokens=1, temperature=0, logprobs=top_k))
        weights = {t: math.exp(lp / temp) for t, lp in out[0].top}
        total = sum(weights.values())
        return {t: w / total for t, w in weights.items()}

    p1 = dist([])
    p2 = {a: dist([a]) for a in p1}
    exact = {(a, b, c): p1[a] * p2[a][b] * pc for a in p1 for b in p2[a] for c, pc in dist([a, b]).items()}
    second = {a: sorted(p2[a], key=p2[a].get)[-2] for a in p1}

    engine = make_engine(speculative="ngram", num_speculative_tokens=2, max_num_seqs=256,
                         max_num_batched_tokens=4096, num_kv_blocks=600)
    engine.drafter = _SecondChoice(len(prompt), second)
    params = [SamplingParams(max_tokens=3, temperature=temp, top_k=top_k, seed=s, ignore_eos=True) for s in range(n)]
    seen = Counter(tuple(t) for t in engine.generate([prompt] * n, params))
    assert engine.spec_stats.verifications == n and 0 < engine.spec_stats.accepted < n
    assert set(seen) <= set(exact)
    chi2 = sum((seen[o] - n * p) ** 2 / (n * p) for o, p in exact.items())
    assert chi2 < 60, f"chi-square {chi2:.0f} over {len(exact)} outcomes (p = 0.001 at 26 df: 54)"
    # Seeds make it reproducible.
    first = engine.generate([prompt] * 4, params[:4])
    assert engine.generate([prompt] * 4, params[:4]) == first


def test_the_rejection_rule_with_a_drafters_distribution_gives_the_targets():
    """verify() with q: one draft drawn from q, decided by min(1, p/q) and the residual
    max(0, p - q); the emitted first token must follow p, whatever q is."""
    import torch

    from worker.engine.speculative import verify

    torch.manual_seed(0)
    vocab, n = 6, 6000
    p_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0] * vocab])
    q = torch.tensor([0.05, 0.1, 0.5, 0.2, 0.1, 0.05])  # far from p: most of p's mass is under-proposed
    p = p_logits[0].softmax(-1)
    seq = Sequence("r", [1, 2], SamplingParams(temperature=1.0))
    counts = Counter()
    for _ in range(n):
        d = int(torch.multinomial(q, 1))
        counts[verify(p_logits, [[d]], [seq], [q.unsqueeze(0)])[0][0][0]] += 1
    chi2 = sum((counts[t] - n * p[t].item()) ** 2 / (n * p[t].item()) for t in range(vocab))
    assert chi2 < 20.5, f"chi-square {chi2:.1f} at 5 df (p = 0.001: 20.5); counts {dict(counts)}"


def test_a_draft_model_with_the_targets_weights_is_always_accepted(make_engine, prompt_ids, hf_reference):
    engine = make_engine(speculative="draft:smollm2-135m", num_speculative_tokens=3)
    assert engine.generate(prompt_ids, GREEDY) == hf_reference
    stats = engine.spec_stats
    assert stats.verifications > 0 and stats.accepted == stats.drafted, stats
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_draft_models_kv_is_counted_in_the_pool(make_engine):
    """One block id names the target's and the draft's KV of the same tokens: the pool is sized by
    both, and the draft's pool has the target's number of blocks."""
    import torch

    from contracts.models import resolve_model
    from worker.engine.model_runner import kv_bytes_per_block
    from worker.models.loader import load_config

    size = 64 * 2**20
    engine = make_engine(kv_cache_bytes=size, speculative="draft:dummy:smollm2-mini")
    draft = engine.drafter.runner
    target = kv_bytes_per_block(engine.model_config, 16, torch.float32, engine.model.kv_heads)
    drafts = kv_bytes_per_block(load_config(resolve_model("dummy:smollm2-mini")), 16, torch.float32,
                                draft.model.kv_heads)
    assert engine.block_manager.num_blocks == size // (target + drafts) == draft.num_blocks


def test_a_packed_draft_for_a_dense_target_keeps_the_targets_output(make_engine, prompt_ids, hf_reference):
    """--speculative-draft-quantization: the draft serves packed (int4 from its Q4_1 GGUF) while the
    target stays dense; the output is still the dense target's, the transformers reference."""
    from worker.models.quantization import QuantizedLinearWeight

    engine = make_engine(speculative="draft:smollm2-135m", num_speculative_tokens=3,
                         speculative_draft_quantization="auto")
    draft = engine.drafter.runner.model
    assert any(isinstance(m, QuantizedLinearWeight) for m in draft.modules())
    assert not any(isinstance(m, QuantizedLinearWeight) for m in engine.model.modules())
    assert engine.generate(prompt_ids, GREEDY) == hf_reference
    stats = engine.spec_stats
    assert 0 < stats.accepted < stats.drafted, stats  # int4 drafts: mostly, not always, the target's tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("overrides, message", [
    ({"speculative": "draft:smollm2-135m", "speculative_draft_quantization": "int3"},
     "speculative_draft_quantization must be none, auto, int8 or int4, got 'int3'"),
    ({"speculative": "ngram", "speculative_draft_quantization": "auto"},
     "speculative_draft_quantization needs speculative draft:MODEL"),
])
def test_a_bad_draft_quantization_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides)


def test_a_draft_model_of_another_vocabulary_is_refused_by_name(make_engine):
    with pytest.raises(ValueError, match="draft model 'dummy:tiny' has another vocabulary than the target"):
        make_engine(speculative="draft:dummy:tiny")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_verification_as_decode_rows_gives_the_chunks_logits(backend):
    """What the GPU's verify graphs run (model_runner.as_decode_rows): every token of a step as a
    decode row, rows of one sequence storing their K/V before any attends, gives the logits of
    the step run as chunks (varlen prefill); a decode beside it keeps its own."""
    import torch

    from worker.engine.llm_engine import LLMEngine
    from worker.engine.model_runner import as_decode_rows
    from worker.engine.scheduler import ScheduledSeq

    if backend == "triton":
        pytest.importorskip("kernels")
        import kernels

        if not kernels.HAS_TRITON:
            pytest.skip("triton is not installed")
    engine = LLMEngine(EngineConfig(model="dummy:tiny", attention_backend=backend, num_kv_blocks=32, block_size=4))
    runner = engine.runner
    seqs = [Sequence("a", list(range(3, 24)), SamplingParams()), Sequence("b", list(range(40, 49)), SamplingParams())]
    for seq in seqs:  # the context's KV, by a plain prefill
        assert engine.block_manager.allocate(seq, seq.num_tokens + 4)
        runner.execute(runner.prepare([ScheduledSeq(seq, seq.num_tokens - 1)]))
        seq.num_computed_tokens = seq.num_tokens - 1
    batch = [ScheduledSeq(seqs[1], 1), ScheduledSeq(seqs[0], 4, [7, 8, 9])]  # a decode, then a verification
    inputs = runner.prepare(batch)
    assert inputs.num_decodes == 1 and len(inputs.sample_rows) == 5
    rows = as_decode_rows(inputs)
    assert rows.num_decodes == 5 and rows.store_first and rows.context_lens == [9, 21, 22, 23, 24]
    as_rows, _ = runner.execute(rows)  # first: the drafts' slots hold nothing yet
    as_rows = as_rows.clone()
    chunked, _ = runner.execute(inputs)
    torch.testing.assert_close(as_rows, chunked, rtol=1e-4, atol=1e-4)


def test_no_drafts_while_more_requests_run_than_speculative_max_batch(make_engine):
    engine = make_engine(speculative="ngram", speculative_max_batch=1)
    prompt = engine.tokenize(prompt=REPEATING[1])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.generate([prompt, prompt], params)
    assert engine.spec_stats.verifications == 0
    engine.generate([prompt], params)
    assert engine.spec_stats.verifications > 0
    with pytest.raises(ValueError, match="speculative_max_batch must be >= 1"):
        EngineConfig(speculative="ngram", speculative_max_batch=0)
