"""The lookahead (async scheduling): step N+1 launched before step N's tokens are read. On CUDA it
overlaps host and device; here, on CPU, the same code runs in the same order, so its bookkeeping
(pending tokens fed from the device, dropped extra steps, aborts, fallbacks) is checked token
for token against transformers and against the plain engine."""

from __future__ import annotations

from worker.engine.sampling_params import SamplingParams

from tests.conftest import MAX_NEW

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def _count_lookahead_launches(engine) -> list[int]:
    launches = [0]
    original = engine.runner.launch

    def spy(inputs, seqs, prev_tokens=None):
        launches[0] += prev_tokens is not None
        return original(inputs, seqs, prev_tokens)

    engine.runner.launch = spy
    return launches


def test_lookahead_matches_transformers(make_engine, prompt_ids, hf_reference):
    engine = make_engine(async_scheduling=True)
    launches = _count_lookahead_launches(engine)
    assert engine.generate(prompt_ids, GREEDY) == hf_reference
    assert launches[0] >= MAX_NEW - 3  # nearly every decode step looked ahead
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0


def test_stops_inside_the_lookahead_drop_the_extra_step(make_engine, prompt_ids):
    # EOS and stop ids end requests at different steps while the next step is already launched.
    plain, ahead = make_engine(), make_engine(async_scheduling=True)
    params = [SamplingParams(max_tokens=5 + 4 * i, temperature=0, ignore_eos=i % 2 == 0) for i in range(len(prompt_ids))]
    expected = plain.generate(prompt_ids, params)
    assert ahead.generate(prompt_ids, params) == expected
    assert any(len(e) < p.max_tokens for e, p in zip(expected, params)), "no request stopped early"
    stop_ids = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[e[2]])
                for e in expected]
    assert ahead.generate(prompt_ids, stop_ids) == plain.generate(prompt_ids, stop_ids)
    ahead.check_integrity()
    assert ahead.stats().kv_blocks_used == 0


def test_abort_while_in_flight_frees_blocks_and_spares_the_others(make_engine, prompt_ids, hf_reference):
    engine = make_engine(async_scheduling=True)
    ids = [engine.add_request(p, GREEDY) for p in prompt_ids]
    tokens = {i: [] for i in ids}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
        if steps == 6:
            assert engine._inflight is not None  # a step is launched and unread
            engine.abort_request(ids[3])
    for i, rid in enumerate(ids):
        if i != 3:
            assert tokens[rid] == hf_reference[i]
    assert len(tokens[ids[3]]) < MAX_NEW
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0


def test_seeded_sampling_looks_ahead_and_logprobs_take_the_plain_step(make_engine, prompt_ids, hf_reference):
    # Tokens are drawn on the device with each seeded request's own generator, so a seeded answer
    # is the same with or without the lookahead (and whatever shares the batch).
    seeded = [SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_p=0.9, seed=7 + i, ignore_eos=True)
              for i in range(3)]
    params = [GREEDY, seeded[0], GREEDY, seeded[1], seeded[2]]
    plain = make_engine().generate(prompt_ids[:5], params)
    engine = make_engine(async_scheduling=True)
    launches = _count_lookahead_launches(engine)
    assert engine.generate(prompt_ids[:5], params) == plain
    assert launches[0] > 0
    with_logprobs = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=2)
    launches[0] = 0
    assert engine.generate(prompt_ids[:2], [GREEDY, with_logprobs]) == hf_reference[:2]
    assert launches[0] == 0


def test_a_full_pool_takes_the_plain_step(make_engine, prompt_ids, hf_reference):
    # 20 blocks: the lookahead's allocation fails now and then, preemption happens in plain steps.
    tight = make_engine(async_scheduling=True, num_kv_blocks=20)
    assert tight.generate(prompt_ids, GREEDY) == hf_reference
    tight.check_integrity()
    assert tight.stats().kv_blocks_free == 20
