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


def test_a_full_pool_preempts_inside_the_lookahead(make_engine, prompt_ids, hf_reference):
    # 20 blocks: steps scheduled while the one before is in flight preempt now and then, sequences
    # with a token in flight included (they go back to waiting once it is read).
    tight = make_engine(async_scheduling=True, num_kv_blocks=20)
    assert tight.generate(prompt_ids, GREEDY) == hf_reference
    tight.check_integrity()
    assert tight.stats().kv_blocks_free == 20


def _count_mixed_lookahead_launches(engine) -> list[int]:
    """Launches by the lookahead of steps that hold prefill tokens (admissions, chunks)."""
    launches = [0]
    original = engine.runner.launch

    def spy(inputs, samplers, prev_tokens=None):
        launches[0] += prev_tokens is not None and inputs.num_decodes < len(inputs.context_lens)
        return original(inputs, samplers, prev_tokens)

    engine.runner.launch = spy
    return launches


def _staggered(engine, prompts, params, every: int = 2) -> tuple[list[list[int]], list]:
    """Requests arriving one every ``every`` steps while the others run; tokens and final outputs."""
    ids, tokens, finals = [], {}, {}
    pending = list(zip(prompts, params))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % every == 0:
            prompt, p = pending.pop(0)
            ids.append(engine.add_request(prompt, p))
            tokens[ids[-1]] = []
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
        steps += 1
    return [tokens[i] for i in ids], [finals[i] for i in ids]


def test_arrivals_and_chunked_prefill_look_ahead_too(make_engine, prompt_ids, hf_reference):
    """Requests arrive while others decode and prompts are chunked (a 24-token budget): the
    lookahead schedules those steps too (admissions, chunks, first tokens fed on the device), and
    every answer is still transformers' own."""
    engine = make_engine(async_scheduling=True, max_num_batched_tokens=24)
    mixed = _count_mixed_lookahead_launches(engine)
    got, finals = _staggered(engine, prompt_ids, [GREEDY] * len(prompt_ids))
    assert got == hf_reference
    assert mixed[0] > 5, "arrivals and chunks should have been looked ahead"
    assert all(f.finish_reason == "length" and f.usage.completion_tokens == MAX_NEW for f in finals)
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0


def test_arrivals_with_shared_prefixes_seeds_stops_and_a_tight_pool(make_engine, prompt_ids):
    """The plain engine and the lookahead agree token for token on a mix that exercises the
    lookahead's schedule: a long shared prefix (prefix hits while its first owner is in flight),
    seeded sampling, EOS stops, max_model_len cuts and preemption in a pool that barely holds the
    longest request."""
    shared = prompt_ids[7] * 2  # ~160 tokens: several full blocks
    prompts = [shared + p for p in prompt_ids[:4]] + prompt_ids[4:]
    max_len = max(map(len, prompts)) + 8
    params = []
    for i in range(len(prompts)):
        # max_model_len cuts the longest prompts' answers (no max_tokens: to the context's end).
        kw = dict(max_tokens=6 + 3 * i if len(prompts[i]) + 6 + 3 * i <= max_len else None, ignore_eos=i % 3 != 0)
        if i % 2:
            kw.update(temperature=0.9, top_p=0.95, seed=100 + i)
        else:
            kw.update(temperature=0)
        params.append(SamplingParams(**kw))
    block_size = make_engine().config.block_size
    # A pool that holds the longest request and little more: preemption now and then.
    config = dict(max_num_batched_tokens=40, num_kv_blocks=-(-max_len // block_size) + 2, max_model_len=max_len)
    plain_tokens, plain_finals = _staggered(make_engine(**config), prompts, params, every=3)
    engine = make_engine(async_scheduling=True, **config)
    mixed = _count_mixed_lookahead_launches(engine)
    got, finals = _staggered(engine, prompts, params, every=3)
    assert got == plain_tokens
    assert [f.finish_reason for f in finals] == [f.finish_reason for f in plain_finals]
    assert "length" in {f.finish_reason for f in finals}
    assert mixed[0] > 0
    assert engine.scheduler.num_preemptions > 0, "the pool should have been too small at times"
    # Blocks are registered when their step is launched, so hits are at least the plain engine's.
    assert sum(f.usage.cached_tokens for f in finals) >= sum(f.usage.cached_tokens for f in plain_finals) > 0
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0


def test_a_request_wanting_logprobs_arriving_mid_run_takes_plain_steps(make_engine, prompt_ids, hf_reference):
    with_logprobs = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=1)
    engine = make_engine(async_scheduling=True)
    got, finals = _staggered(engine, prompt_ids[:4], [GREEDY, GREEDY, with_logprobs, GREEDY], every=3)
    assert got == hf_reference[:4]
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0
