"""Prompt logprobs (``prompt_logprobs``, what a cascade's judge reads): the engine's equal those of
Hugging Face transformers on the same weights and ids, through chunked prefill, the prefix cache
(positions before ``prompt_logprobs_start`` may come from it) and the engine core's process."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.worker.test_engine_core import core  # noqa: F401 (the module's engine-core fixture)
from worker.engine.errors import InvalidRequestError
from worker.engine.sampling_params import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France? Reply with the city only."}]
DRAFT = "The capital of France is Paris."
TOL = 2e-3  # fp32 on both sides; the attention and matmul orders differ


@pytest.fixture(scope="module")
def ids(smollm2) -> tuple[list[int], int]:
    """A prompt and its draft answer as one sequence of ids, and where the draft starts."""
    prompt = smollm2.tokenize(messages=QUESTION)
    draft = smollm2.tokenizer.encode(DRAFT, add_special_tokens=False) + [smollm2.tokenizer.eos_token_id]
    return prompt + draft, len(prompt)


@pytest.fixture(scope="module")
def hf_logprobs(ids) -> torch.Tensor:
    """transformers' log-softmax at every position of the sequence [len, vocab]."""
    from transformers import AutoModelForCausalLM

    from contracts.models import resolve_model

    src = resolve_model("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32)
    with torch.no_grad():
        x = torch.tensor([ids[0]])
        logits = hf(x, attention_mask=torch.ones_like(x)).logits[0]
    return logits.float().log_softmax(-1)


def run(engine, prompt: list[int], params: SamplingParams):
    """The request's outputs: (prompt logprobs, the final output)."""
    rid = engine.add_request(prompt, params)
    got, last = None, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                got = out.prompt_logprobs if out.prompt_logprobs is not None else got
                last = out
    return got, last


def check_against_hf(entries, seq: list[int], start: int, hf: torch.Tensor, top: int) -> None:
    assert [e.token_id for e in entries] == seq[start:]
    for i, e in enumerate(entries, start):
        ref = hf[i - 1]  # position i - 1 predicts token i
        assert abs(e.logprob - ref[seq[i]].item()) < TOL, (i, e.logprob, ref[seq[i]].item())
        if top:
            vals, best = ref.topk(top)
            assert [t for t, _ in e.top] == best.tolist() or abs(vals[-1] - vals[-2]) < TOL
            assert all(abs(lp - v) < TOL for (_, lp), v in zip(e.top, vals.tolist()))


def test_every_prompt_token_in_chunks_equals_transformers(make_engine, ids, hf_logprobs) -> None:
    seq, _ = ids
    engine = make_engine(max_num_batched_tokens=16)  # the prompt takes several chunks
    entries, last = run(engine, seq, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))
    check_against_hf(entries, seq, 1, hf_logprobs, top=3)
    assert last.finished and last.usage.prompt_tokens == len(seq)


def test_the_draft_scored_after_a_cached_prompt_equals_transformers(make_engine, ids, hf_logprobs) -> None:
    seq, start = ids
    engine = make_engine()
    run(engine, seq[:start], SamplingParams(max_tokens=1, temperature=0))  # caches the prompt's full blocks
    entries, last = run(engine, seq, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0,
                                                    prompt_logprobs_start=start))
    assert last.usage.cached_tokens == (start - 1) // 16 * 16 > 0  # the prompt came from the cache
    check_against_hf(entries, seq, start, hf_logprobs, top=0)
    # Asked for from the first token, nothing before it may come from the cache.
    entries, last = run(engine, seq, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    assert last.usage.cached_tokens == 0 and len(entries) == len(seq) - 1


def test_a_preempted_request_reports_each_prompt_token_once(make_engine, ids, hf_logprobs) -> None:
    seq, _ = ids
    engine = make_engine(max_num_batched_tokens=16)
    rid = engine.add_request(seq, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0))
    engine.step()
    engine.step()  # two chunks computed, then preempted (as the scheduler does when blocks run out)
    running = engine.requests[rid]
    engine.scheduler.running.remove(running)
    engine.scheduler._preempt(running)
    got = None
    while engine.has_unfinished():
        for out in engine.step():
            got = out.prompt_logprobs if out.prompt_logprobs is not None else got
    check_against_hf(got, seq, 1, hf_logprobs, top=0)


@pytest.mark.parametrize("field, value", [("prompt_logprobs", 21), ("prompt_logprobs", -1),
                                          ("prompt_logprobs_start", -2)])
def test_bad_values_name_the_field(make_engine, ids, field, value) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(ids[0], SamplingParams(**{field: value}))
    assert err.value.field == field


def test_through_the_engine_core_process(core, ids, hf_logprobs) -> None:  # noqa: F811 (the fixture)
    seq, start = ids

    async def collect():
        params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2, prompt_logprobs_start=start)
        return [out async for out in core.generate(prompt_token_ids=seq, params=params)]

    outs = asyncio.run(collect())
    firsts = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(firsts) == 1  # once, on the first output
    check_against_hf(firsts[0], seq, start, hf_logprobs, top=2)
