"""Greedy output token for token against Hugging Face transformers, however the engine batches."""

from __future__ import annotations

from worker.engine.sampling_params import SamplingParams

from tests.conftest import MAX_NEW

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def test_one_by_one_matches_transformers(make_engine, prompt_ids, hf_reference):
    engine = make_engine(enable_prefix_caching=False)
    for ids, ref in zip(prompt_ids, hf_reference):
        assert engine.generate([ids], GREEDY) == [ref]
    engine.check_integrity()


def test_one_batch_of_mixed_lengths_matches(make_engine, prompt_ids, hf_reference):
    engine = make_engine()
    assert len({len(p) for p in prompt_ids}) > 5
    assert engine.generate(prompt_ids, GREEDY) == hf_reference
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0


def test_tiny_token_budget_forces_chunked_prefill(make_engine, prompt_ids, hf_reference):
    engine = make_engine(max_num_batched_tokens=13, enable_prefix_caching=False)
    steps_with_partial_prefill = 0
    original = engine.runner.run

    def spy(batch, *rest):
        nonlocal steps_with_partial_prefill
        steps_with_partial_prefill += any(1 < s.num_new_tokens and not s.samples for s in batch)
        assert sum(s.num_new_tokens for s in batch) <= 13
        return original(batch, *rest)

    engine.runner.run = spy
    assert engine.generate(prompt_ids, GREEDY) == hf_reference
    assert steps_with_partial_prefill > 0


def test_second_request_hits_prefix_cache(make_engine, prompt_ids, hf_reference):
    engine = make_engine()
    long_ids, ref = prompt_ids[7], hf_reference[7]
    assert engine.generate([long_ids], GREEDY) == [ref]
    rid = engine.add_request(long_ids, GREEDY)
    tokens, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            final = out
    assert final.request_id == rid and tokens == ref
    bs = engine.config.block_size
    # Everything but the last (partial, or held-back last token's) block came from the cache.
    assert final.usage.cached_tokens == (len(long_ids) - 1) // bs * bs > 0
    assert final.usage.prompt_tokens == len(long_ids)
    assert engine.stats().prefix_hits == final.usage.cached_tokens


def test_preemption_by_recompute_keeps_outputs(make_engine, prompt_ids, hf_reference):
    # 20 blocks of 16 tokens cannot hold ten ~40-token prompts plus 16 new tokens each at once.
    engine = make_engine(num_kv_blocks=20)
    assert engine.generate(prompt_ids, GREEDY) == hf_reference
    assert engine.scheduler.num_preemptions > 0
    engine.check_integrity()
    assert engine.stats().kv_blocks_free == 20
