"""Per-request sampling in one batch, stop conditions, and the fields that are refused."""

from __future__ import annotations

import math

import pytest

from worker.engine.errors import InvalidRequestError
from worker.engine.sampling_params import SamplingParams


def run(engine, prompts, params):
    """(tokens, text, final output) per request, with text assembled from the streamed deltas."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist)]
    got = {i: ([], [], None) for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            toks, text, _ = got[out.request_id]
            toks += out.new_token_ids
            text.append(out.text_delta)
            if out.finished:
                got[out.request_id] = (toks, text, out)
    return [(got[i][0], "".join(got[i][1]), got[i][2]) for i in ids]


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine, prompt_ids):
    engine = make_engine()
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = run(engine, [prompt_ids[1]], sp)[0][0]
    others = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)
    in_batch = run(engine, [prompt_ids[0], prompt_ids[1], prompt_ids[2]], [others, sp, others])[1][0]
    assert alone == in_batch
    other_seed = run(engine, [prompt_ids[1]], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95,
                                                            seed=99, ignore_eos=True))[0][0]
    assert other_seed != alone


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_seeded_answer_goes_on_from_its_tokens_with_seed_offset(make_engine, prompt_ids, lookahead):
    """What the router sends when a stream's worker dies: the prompt plus the tokens so far, with
    seed_offset; the continuation draws what the whole answer did, whatever shares its batch."""
    engine = make_engine(async_scheduling=lookahead)
    prompt, seeded = prompt_ids[1], dict(temperature=1.0, seed=7, ignore_eos=True)
    whole = run(engine, [prompt], SamplingParams(max_tokens=24, **seeded))[0][0]
    head = run(engine, [prompt], SamplingParams(max_tokens=10, **seeded))[0][0]
    assert head == whole[:10]
    others = SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    tail = run(engine, [prompt_ids[0], prompt + head, prompt_ids[2]],
               [others, SamplingParams(max_tokens=14, seed_offset=10, **seeded), others])[1][0]
    assert head + tail == whole
    restarted = run(engine, [prompt + head], SamplingParams(max_tokens=14, **seeded))[0][0]
    assert restarted != tail  # without the offset the draws start over


def test_seeded_answers_are_the_same_when_preempted_and_recomputed(make_engine, prompt_ids):
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(prompt_ids))]
    roomy = make_engine().generate(prompt_ids, params)
    tight = make_engine(num_kv_blocks=20)  # too few for all ten at once (test_correctness)
    assert tight.generate(prompt_ids, params) == roomy
    assert tight.scheduler.num_preemptions > 0


def test_top_k_1_and_tiny_top_p_are_greedy(make_engine, prompt_ids, hf_reference):
    engine = make_engine()
    n = len(hf_reference[0])
    k1 = SamplingParams(max_tokens=n, temperature=1.3, top_k=1, ignore_eos=True, seed=5)
    p0 = SamplingParams(max_tokens=n, temperature=1.3, top_p=1e-6, ignore_eos=True, seed=5)
    results = run(engine, [prompt_ids[0], prompt_ids[0]], [k1, p0])
    assert results[0][0] == hf_reference[0]
    assert results[1][0] == hf_reference[0]


def test_logprobs_of_chosen_and_top_alternatives(make_engine, prompt_ids):
    engine = make_engine()
    ids = engine.add_request(prompt_ids[3], SamplingParams(max_tokens=5, temperature=0, logprobs=4))
    entries = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == ids
            entries += out.logprobs
            assert len(out.logprobs) == len(out.new_token_ids)
    assert len(entries) == 5
    for e in entries:
        assert len(e.top) == 4
        assert e.top[0][0] == e.token_id and math.isclose(e.top[0][1], e.logprob, abs_tol=1e-6)
        vals = [v for _, v in e.top]
        assert vals == sorted(vals, reverse=True) and all(v <= 0 for v in vals)
        assert math.fsum(math.exp(v) for v in vals) <= 1 + 1e-5


def test_generate_logprobs_gives_each_output_tokens_logprob_in_a_batch(make_engine, prompt_ids, hf_reference):
    engine = make_engine()
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    runs = engine.generate_logprobs(prompt_ids[:4], [greedy, greedy, greedy, SamplingParams(max_tokens=3)])
    for (toks, lps), ref in zip(runs[:3], hf_reference):
        assert toks == ref[:6] and len(lps) == 6 and all(lp <= 0 for lp in lps)
    assert len(runs[3][0]) == 3 and runs[3][1] == []  # no logprobs asked for: none
    # each one what the request alone reports, in the batch's order
    alone = engine.generate_logprobs([prompt_ids[1]], greedy)[0]
    assert alone[0] == runs[1][0] and alone[1] == pytest.approx(runs[1][1], abs=1e-4)


def test_max_tokens_eos_and_stop_token_ids(make_engine, prompt_ids, hf_reference):
    engine = make_engine()
    toks, _, out = run(engine, [prompt_ids[0]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert toks == hf_reference[0][:3] and out.finish_reason == "length"
    assert out.usage.completion_tokens == 3 and out.usage.prompt_tokens == len(prompt_ids[0])
    # "The capital of France is Paris." then <|im_end|>, the model's end-of-sequence token.
    toks, text, out = run(engine, [prompt_ids[0]], SamplingParams(max_tokens=40, temperature=0))[0]
    assert toks[-1] in engine.eos_token_ids and out.finish_reason == "stop" and "Paris" in text
    stop_at = hf_reference[0][2]
    toks, _, out = run(engine, [prompt_ids[0]], SamplingParams(max_tokens=40, temperature=0,
                                                                stop_token_ids=[stop_at]))[0]
    assert toks == hf_reference[0][:3] and out.finish_reason == "stop"


def test_stop_strings_cut_text_and_never_leak_in_stream(make_engine, prompt_ids):
    engine = make_engine()
    toks, full, _ = run(engine, [prompt_ids[4]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert full == engine.tokenizer.decode(toks, skip_special_tokens=True)
    needle = full[len(full) // 2 : len(full) // 2 + 4]
    assert needle.strip(), full
    _, text, out = run(engine, [prompt_ids[4]], SamplingParams(max_tokens=16, temperature=0, stop=[needle]))[0]
    assert out.finish_reason == "stop"
    assert text == full[: full.index(needle)]


@pytest.mark.parametrize("field, params", [
    ("max_tokens", SamplingParams(max_tokens=0)),
    ("temperature", SamplingParams(temperature=-0.5)),
    ("top_p", SamplingParams(top_p=0.0)),
    ("top_p", SamplingParams(top_p=1.5)),
    ("top_k", SamplingParams(top_k=-1)),
    ("logprobs", SamplingParams(logprobs=99)),
    ("stop", SamplingParams(stop=[""])),
    ("seed_offset", SamplingParams(seed=1, seed_offset=-1)),
    ("seed_offset", SamplingParams(seed=1, seed_offset=2**32)),
])
def test_bad_sampling_fields_are_named(smollm2, field, params):
    with pytest.raises(InvalidRequestError) as err:
        smollm2.validate([1, 2, 3], params)
    assert err.value.field == field


def test_bad_prompts_are_named(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(InvalidRequestError) as err:
        engine.tokenize(prompt="")
    assert err.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        engine.validate(list(range(64)), SamplingParams())
    assert err.value.field == "prompt" and "max_model_len" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        engine.validate([10**7], SamplingParams())
    assert err.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as err:
        engine.tokenize(messages=[{"role": "user"}])
    assert err.value.field == "messages[0]"
    small_pool = make_engine(num_kv_blocks=2)  # 32 tokens: the context it advertises
    with pytest.raises(InvalidRequestError) as err:
        small_pool.validate(list(range(40)), SamplingParams())
    assert err.value.field == "prompt" and "max_model_len=32" in err.value.message


def test_max_tokens_past_the_context_is_refused_and_none_runs_to_its_end(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(InvalidRequestError) as err:
        engine.validate(list(range(1, 41)), SamplingParams(max_tokens=25))
    assert err.value.field == "max_tokens" and "25" in err.value.message and "64" in err.value.message
    assert "at most 24" in err.value.message
    engine.validate(list(range(1, 41)), SamplingParams(max_tokens=24))  # exactly to the end: fine
    [out] = engine.generate([list(range(1, 41))], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    assert len(out) == 24


@pytest.mark.parametrize("lookahead", [False, True])
def test_logit_bias_steers_sampling_but_not_the_logprobs(make_engine, prompt_ids, hf_reference, lookahead):
    engine = make_engine(async_scheduling=lookahead)
    forced = 1234
    [out] = engine.generate([prompt_ids[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                            logit_bias={forced: 100.0}))
    assert out == [forced] * 4
    banned = hf_reference[0][0]  # greedy's first token, ruled out: the second likeliest comes instead
    rid = engine.add_request(prompt_ids[0], SamplingParams(max_tokens=1, temperature=0, logprobs=2,
                                                           logit_bias={banned: -100.0}))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    lp = next(entry for o in outs for entry in o.logprobs or ())
    assert lp.token_id != banned and lp.token_id == lp.top[1][0]
    assert lp.top[0][0] == banned and lp.logprob == pytest.approx(lp.top[1][1])  # the model's own logprob


@pytest.mark.parametrize("lookahead", [False, True])
def test_min_tokens_holds_back_eos(make_engine, smollm2, lookahead):
    engine = make_engine(async_scheduling=lookahead)
    prompt = smollm2.tokenize(messages=[{"role": "user", "content": "Say hi."}])
    [free] = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0))
    assert free[-1] in engine.eos_token_ids and len(free) < 35  # a short answer that ends with EOS
    at_least = len(free) + 5
    [held] = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, min_tokens=at_least))
    assert len(held) >= at_least and not set(held[: at_least - 1]) & engine.eos_token_ids
    assert held[: len(free) - 1] == free[:-1]  # the same answer up to where EOS was ruled out


@pytest.mark.parametrize("field, params", [
    ("min_tokens", SamplingParams(min_tokens=-1)),
    ("min_tokens", SamplingParams(max_tokens=4, min_tokens=5)),
    ("logit_bias", SamplingParams(logit_bias={5: 101.0})),
    ("logit_bias", SamplingParams(logit_bias={5: float("nan")})),
    ("logit_bias", SamplingParams(logit_bias={10**8: 1.0})),
])
def test_bad_steering_fields_are_named(smollm2, field, params):
    with pytest.raises(InvalidRequestError) as err:
        smollm2.validate([1, 2, 3], params)
    assert err.value.field == field
