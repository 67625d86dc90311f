"""A worker started with --speculative over gRPC: streams at once answer the plain engine's tokens,
a request can opt out, and Stats and the heartbeat carry the speculation counters."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from contracts.memory_state import MemoryPrefixIndex, MemoryRegistry
from protos import kvcascade_pb2 as pb
from tests.conftest import PROMPTS
from tests.worker.test_server import Served, _serve, _wait_until_idle
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.registration import WorkerPublisher

MAX_TOKENS = 24
GREEDY = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# Answers that repeat their prompt, so n-gram drafts get accepted, and plain chat questions.
REPEATING = [
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,",
    "The capital of France is Paris. The capital of France is Paris. The capital of France is",
    "red green blue red green blue red green",
]


@pytest.fixture(scope="module")
def speculating(smollm2: LLMEngine) -> Iterator[Served]:
    yield from _serve(EngineConfig(model="smollm2-135m", speculative="ngram", num_speculative_tokens=4),
                      reuse=smollm2)


@pytest.fixture(scope="module")
def prompts(smollm2: LLMEngine) -> list[list[int]]:
    return ([smollm2.tokenize(prompt=p) for p in REPEATING]
            + [smollm2.tokenize(messages=[{"role": "user", "content": p}]) for p in PROMPTS[:4]])


@pytest.fixture(scope="module")
def reference(smollm2: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """The same prompts on an engine without speculation."""
    plain = LLMEngine(EngineConfig(model="smollm2-135m"), tokenizer=smollm2.tokenizer, model=smollm2.model)
    return plain.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))


def _tokens(served: Served, ids: list[int], sampling: pb.SamplingParams = GREEDY) -> list[int]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sampling)
    return [t for r in served.stub.Generate(request, timeout=120) for t in r.token_ids]


def test_eight_greedy_streams_at_once_answer_the_plain_engines_tokens(speculating, prompts, reference):
    assert len(prompts) == 8
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda ids: _tokens(speculating, ids), prompts))
    assert answers == reference
    stats = _wait_until_idle(speculating, within_s=10)
    assert stats.spec_drafted_tokens > 0 and stats.spec_verifications > 0
    assert 0 < stats.spec_accepted_tokens <= stats.spec_drafted_tokens


def test_a_request_that_opts_out_drafts_nothing_and_answers_the_same(speculating, prompts, reference):
    opted_out = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, speculative=False)
    before = _wait_until_idle(speculating, within_s=10)
    assert _tokens(speculating, prompts[0], opted_out) == reference[0]
    after = _wait_until_idle(speculating, within_s=10)
    assert (after.spec_drafted_tokens, after.spec_verifications) == (before.spec_drafted_tokens,
                                                                     before.spec_verifications)
    # speculative=True is the default made explicit: it drafts again.
    opted_in = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, speculative=True)
    assert _tokens(speculating, prompts[0], opted_in) == reference[0]
    assert _wait_until_idle(speculating, within_s=10).spec_drafted_tokens > after.spec_drafted_tokens


def test_the_heartbeat_carries_the_counters_stats_reports(speculating, prompts):
    _tokens(speculating, prompts[1])
    stats = _wait_until_idle(speculating, within_s=10)

    async def published():
        registry = MemoryRegistry()
        pub = WorkerPublisher(speculating.engine, registry, MemoryPrefixIndex(), worker_id="w", address="127.0.0.1:1",
                              model_source="smollm2-135m")
        await pub.start()
        try:
            return (await registry.live_workers())[0].load
        finally:
            await pub.stop()

    load = speculating.loop.run(published())
    assert (load.spec_drafted_tokens, load.spec_accepted_tokens, load.spec_verifications) == (
        stats.spec_drafted_tokens, stats.spec_accepted_tokens, stats.spec_verifications)
    assert load.spec_drafted_tokens > 0

