"""The OpenAI-compatible HTTP front over real parts: an in-process worker (engine + gRPC server) on
loopback, the router on the in-memory registry and index, uvicorn on a free port, and the stock
``openai`` client and httpx as the callers."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from router.access import Access
from router.http_api import create_app, http_port, serve_http, stop_http
from contracts.memory_state import MemoryPrefixIndex, MemoryRegistry
from router.router import Router
from contracts.state import WorkerInfo
from worker.engine.async_engine import AsyncEngine
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.server import WorkerServer

from .loop_thread import LoopThread

KEY = "sk-test-key"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
# Several KV blocks long, so a second request finds most of it in the worker's prefix cache.
DOCUMENT = ("Northwind Outfitters sells hiking and camping gear. Unused items can be returned within 30 days "
            "with the receipt; sale items within 14 days. Shipping is free above 50 euros and takes two to four "
            "working days inside the EU. Tents carry a two year warranty, boots one year. Question: how long "
            "is the warranty on boots? Answer:")


@dataclass
class Stack:
    loop: LoopThread
    engine: AsyncEngine
    worker: WorkerServer
    registry: MemoryRegistry
    info: WorkerInfo
    base_url: str

    @property
    def model(self) -> str:
        return self.info.model

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def post(self, path: str, body: Any = None, *, content: bytes | None = None, key: str | None = KEY,
             timeout: float = 60) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.base_url}{path}", json=body, content=content, headers=headers, timeout=timeout)

    def post_stream(self, path: str, body: Any) -> list[str]:
        """The ``data:`` lines of a streamed answer, [DONE] left out."""
        with httpx.stream("POST", f"{self.base_url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60) as response:
            return [line for line in response.iter_lines() if line.startswith("data: {")]

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(f"{self.base_url}{path}", headers=headers, timeout=30)

    def wait_until_idle(self, within_s: float) -> None:
        """The worker's engine runs nothing and holds no KV block (cached free blocks don't count)."""
        deadline = time.monotonic() + within_s
        while True:
            stats = self.engine.stats()
            if stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0:
                return
            assert time.monotonic() < deadline, f"the worker is still busy after {within_s}s: {stats}"
            time.sleep(0.05)


@contextlib.contextmanager
def running_stack(smollm2: LLMEngine, **engine_config: Any) -> Iterator[Stack]:
    """Worker, router and HTTP front on one background loop; the engine reuses the loaded model's
    weights and tokenizer (SmolLM2's, or another's: test_http_tools.py runs Qwen)."""
    loop = LoopThread()
    source = smollm2.config.model

    async def start():
        engine = AsyncEngine(LLMEngine(EngineConfig(model=source, **engine_config),
                                       tokenizer=smollm2.tokenizer, model=smollm2.model))
        engine.start()
        worker = WorkerServer(engine, "127.0.0.1", 0)
        await worker.start()
        registry = MemoryRegistry()
        info = WorkerInfo(worker_id="w0", epoch="e1", address=f"127.0.0.1:{worker.port}", model=engine.model_id,
                          model_source=source, block_size=16, capacity=64,
                          max_model_len=engine.max_model_len)
        await registry.register(info, ttl_s=3600)
        router = Router(registry, MemoryPrefixIndex())
        server, task = await serve_http(create_app(router, access=Access(api_keys=(KEY,))), "127.0.0.1", 0)
        return engine, worker, registry, info, router, server, task

    engine, worker, registry, info, router, server, task = loop.run(start())
    try:
        yield Stack(loop, engine, worker, registry, info, f"http://127.0.0.1:{http_port(server)}")
    finally:
        loop.run(stop_http(server, task))
        loop.run(router.close())
        loop.run(worker.stop(0))
        engine.shutdown()
        loop.close()


@pytest.fixture(scope="module")
def stack(smollm2: LLMEngine) -> Iterator[Stack]:
    with running_stack(smollm2) as stack:
        yield stack


# --- the stock openai client ----------------------------------------------------------------------


def test_completion_streamed_equals_non_streamed(stack: Stack) -> None:
    client = stack.client()
    kwargs = dict(model=stack.model, prompt=PROMPT, max_tokens=8, temperature=0)
    full = client.completions.create(**kwargs)
    assert full.id.startswith("cmpl-") and full.object == "text_completion" and full.model == stack.model
    choice = full.choices[0]
    assert choice.index == 0 and choice.text and choice.finish_reason in ("stop", "length")
    assert choice.logprobs is None
    usage = full.usage
    assert 0 < usage.completion_tokens <= 8 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert text_chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == usage.completion_tokens


def test_chat_streamed_equals_non_streamed(stack: Stack) -> None:
    client = stack.client()
    kwargs = dict(model=stack.model, messages=CHAT, max_tokens=8, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert full.choices[0].finish_reason in ("stop", "length")

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked for


def test_a_chunk_comes_with_every_step_even_while_its_text_is_held_back(stack: Stack) -> None:
    """A stop string of 40 characters holds back the last 39 characters of text until the end, so
    the first steps' text is empty: their chunks still come (with the tokens, as vLLM's do), the
    text joins to the whole answer's, and the last chunk names the worker and its own TTFT."""
    client = stack.client()
    kwargs = dict(model=stack.model, prompt=PROMPT, max_tokens=12, temperature=0, stop=["~" * 40])
    full = client.completions.create(**kwargs)
    assert full.worker_id == stack.info.worker_id and 0 < full.worker_ttft_s < 60
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json={**kwargs, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    texts = [e["choices"][0]["text"] for e in events]
    assert "".join(texts) == full.choices[0].text and len(full.choices[0].text) < 39 * 12
    assert texts[0] == "", "the first token's chunk, its text held back"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["worker_id"] == stack.info.worker_id and events[-1]["route_reason"]
    assert 0 < events[-1]["worker_ttft_s"] < 60
    assert all("worker_id" not in e for e in events[:-1])


def test_chat_text_parts_and_max_completion_tokens(stack: Stack) -> None:
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colors."}]
    answer = stack.client().chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": parts}], max_completion_tokens=3, temperature=0,
        extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 3 and answer.choices[0].finish_reason == "length"


def test_repeated_long_prompt_reports_cached_tokens(stack: Stack) -> None:
    client = stack.client()
    first = client.completions.create(model=stack.model, prompt=DOCUMENT, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 48
    second = client.completions.create(model=stack.model, prompt=DOCUMENT, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 48


def test_completion_logprobs(stack: Stack) -> None:
    answer = stack.client().completions.create(model=stack.model, prompt=PROMPT, max_tokens=4, temperature=0,
                                                logprobs=2, extra_body={"ignore_eos": True})
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset[0] == 0
    assert all(lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i]) for i in range(3))
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2
        assert top[token] == pytest.approx(logprob, abs=1e-4)  # greedy picks the likeliest


def test_completion_top_logprobs_hold_the_sampled_token_too(stack: Stack) -> None:
    """As OpenAI's and vLLM's: up to logprobs + 1 entries, the token itself among them even when a
    sample (temperature 1.5) or the prompt (echo) has one that is not among the likeliest."""
    body = stack.post("/v1/completions", {"model": stack.model, "prompt": PROMPT, "max_tokens": 12, "logprobs": 1,
                                          "echo": True, "temperature": 1.5, "seed": 7}).json()
    lp = body["choices"][0]["logprobs"]
    for token, logprob, top in list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))[1:]:
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(logprob, abs=1e-4)
    assert any(len(top) == 2 for top in lp["top_logprobs"][1:])  # some token was not the likeliest


def test_chat_logprobs(stack: Stack) -> None:
    answer = stack.client().chat.completions.create(model=stack.model, messages=CHAT, max_tokens=4, temperature=0,
                                                     logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 4
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token


def test_models_lists_the_served_model(stack: Stack) -> None:
    models = stack.client().models.list()
    assert [m.id for m in models] == [stack.model]
    assert models.data[0].max_model_len == stack.engine.max_model_len  # vLLM's field


# --- as clients use it: context, batches, choices, echo, tokenize -------------------------------


def test_max_tokens_over_the_context_names_both_numbers(stack: Stack) -> None:
    error = stack.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 100000}).json()["error"]
    length = stack.engine.max_model_len
    assert error["param"] == "max_tokens" and "100000" in error["message"] and str(length) in error["message"]


def test_a_chat_without_max_tokens_runs_until_the_context_ends(smollm2: LLMEngine) -> None:
    with running_stack(smollm2, max_model_len=80) as small:
        answer = small.client().chat.completions.create(model=small.model, messages=CHAT, temperature=0,
                                                         extra_body={"ignore_eos": True})
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 80  # not OpenAI's completions 16


def test_a_pool_smaller_than_the_context_caps_it_and_says_so(smollm2: LLMEngine, caplog) -> None:
    with caplog.at_level("WARNING"):
        engine = LLMEngine(EngineConfig(model="smollm2-135m", num_kv_blocks=8), tokenizer=smollm2.tokenizer,
                           model=smollm2.model)
    assert engine.max_model_len == 8 * 16 and "max_model_len 8192 -> 128" in caplog.text
    with pytest.raises(ValueError, match="max_model_len=1000 does not fit the KV pool"):
        LLMEngine(EngineConfig(model="smollm2-135m", num_kv_blocks=8, max_model_len=1000),
                  tokenizer=smollm2.tokenizer, model=smollm2.model)


def test_a_batch_of_prompts_with_n_choices_each(stack: Stack) -> None:
    client = stack.client()
    prompts = [PROMPT, "Once upon a time"]
    kwargs = dict(model=stack.model, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    both = client.completions.create(prompt=prompts, n=2, **kwargs)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone for _ in range(2)]  # greedy
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # each prompt once
    assert both.usage.completion_tokens == 4 * 5
    chunks = list(client.completions.create(prompt=prompts, n=2, stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)}
    assert [texts[i] for i in range(4)] == [c.text for c in both.choices]
    assert chunks[-1].usage.completion_tokens == 20
    ids = stack.post("/v1/completions", {"model": stack.model, "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2})
    assert ids.status_code == 200 and len(ids.json()["choices"]) == 2  # token-id prompts too


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_continuous_usage_stats_give_the_usage_so_far_on_every_chunk(stack: Stack, kind: str) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk's usage is the usage so far (prompt
    once per prompt, completion tokens counted as they came), ending at the whole answer's."""
    client = stack.client()
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = dict(model=stack.model, max_tokens=6, temperature=0, n=2, stream=True, stream_options=options,
                  extra_body={"ignore_eos": True})
    if kind == "chat":
        chunks = list(client.chat.completions.create(messages=CHAT, **common))
        whole = client.chat.completions.create(messages=CHAT, model=stack.model, max_tokens=6, temperature=0, n=2,
                                               extra_body={"ignore_eos": True})
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **common))
        whole = client.completions.create(prompt=PROMPT, model=stack.model, max_tokens=6, temperature=0, n=2,
                                          extra_body={"ignore_eos": True})
    assert all(c.usage is not None for c in chunks)
    assert {c.usage.prompt_tokens for c in chunks} == {whole.usage.prompt_tokens}
    completions = [c.usage.completion_tokens for c in chunks]
    assert completions == sorted(completions) and completions[-1] == whole.usage.completion_tokens == 12
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    plain = list(client.completions.create(prompt=PROMPT, model=stack.model, max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_chat_n_choices_seeded_sampling(stack: Stack) -> None:
    client = stack.client()
    kwargs = dict(model=stack.model, messages=CHAT, max_tokens=8, temperature=1.0, seed=7, n=3)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # seed, seed + 1, seed + 2: different samples
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant") == [0, 1, 2]


def test_best_of_returns_the_likeliest_sample(stack: Stack) -> None:
    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    samples = stack.post("/v1/completions", {**body, "n": 3, "logprobs": 0}).json()["choices"]
    best = max(samples, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    answer = stack.post("/v1/completions", {**body, "best_of": 3}).json()
    assert [c["text"] for c in answer["choices"]] == [best["text"]] and answer["choices"][0]["logprobs"] is None
    assert answer["usage"]["completion_tokens"] == 3 * 6  # every sample's tokens are paid for


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(stack: Stack, smollm2: LLMEngine) -> None:
    # lm-evaluation-harness's loglikelihood request (local-completions): echo, logprobs 1, max_tokens 1.
    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    choice = stack.post("/v1/completions", body).json()["choices"][0]
    ids = smollm2.tokenizer.encode(PROMPT, add_special_tokens=False)
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and all(len(t) >= 1 for t in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"][: len(ids)]) == PROMPT and lp["text_offset"][len(ids)] == len(PROMPT)
    # The prompt's logprobs are the model's: the engine's prompt_logprobs for the same ids.
    engine = LLMEngine(EngineConfig(model="smollm2-135m"), tokenizer=smollm2.tokenizer, model=smollm2.model)
    rid = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    want = next(o.prompt_logprobs for o in engine.step() if o.request_id == rid)
    assert lp["token_logprobs"][1: len(ids)] == pytest.approx([e.logprob for e in want], abs=1e-4)
    chunks = [json.loads(line[6:]) for line in stack.post_stream("/v1/completions", {**body, "stream": True})]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_logit_bias_and_min_tokens(stack: Stack) -> None:
    client = stack.client()
    forced = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=3, temperature=0,
                                            logit_bias={"1234": 100}, logprobs=True)
    assert [e.token for e in forced.choices[0].logprobs.content] == [stack.engine.engine.tokenizer.decode([1234])] * 3
    held = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=60, temperature=0, extra_body={"min_tokens": 50})
    assert held.usage.completion_tokens >= 50


def test_tokenize_and_detokenize(stack: Stack, smollm2: LLMEngine) -> None:
    ids = smollm2.tokenizer.encode(PROMPT, add_special_tokens=False)
    got = stack.post("/tokenize", {"model": stack.model, "prompt": PROMPT}).json()
    assert got == {"count": len(ids), "max_model_len": stack.engine.max_model_len, "tokens": ids}
    chat = stack.post("/tokenize", {"messages": CHAT}).json()  # the one served model by default
    assert chat["tokens"] == smollm2.tokenize(messages=CHAT)
    assert stack.post("/detokenize", {"tokens": ids}).json() == {"prompt": PROMPT}
    for path, body, param in [("/tokenize", {"prompt": PROMPT, "messages": CHAT}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/tokenize", {"model": "nope", "prompt": "x"}, "model")]:
        error = stack.post(path, body).json()["error"]
        assert error["param"] == param, error
    assert stack.post("/tokenize", {"prompt": "x"}, key=None).status_code == 401  # behind the key like /v1


def test_many_batched_requests_at_once_and_leaving_frees_every_block(stack: Stack) -> None:
    client = stack.client()
    kwargs = dict(model=stack.model, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    want = client.completions.create(prompt=[PROMPT, "Hello"], n=2, **kwargs)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: client.completions.create(prompt=[PROMPT, "Hello"], n=2, **kwargs), range(8)))
    assert all([c.text for c in g.choices] == [c.text for c in want.choices] for g in got)
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": stack.model, **ENDLESS, "n": 3, "stream": True}, timeout=30) as response:
        next(response.iter_lines())  # three streams under way, then the client leaves
    stack.wait_until_idle(within_s=10)


# --- errors ---------------------------------------------------------------------------------------

MESSAGES = {"messages": CHAT}
BAD_BODIES = {
    "invalid json": ("/v1/chat/completions", b'{"messages": [', None),
    "not an object": ("/v1/completions", b"[1, 2]", None),
    "missing messages": ("/v1/chat/completions", {}, "messages"),
    "missing prompt": ("/v1/completions", {}, "prompt"),
    "temperature -1": ("/v1/chat/completions", {**MESSAGES, "temperature": -1}, "temperature"),
    "temperature a string": ("/v1/completions", {"prompt": PROMPT, "temperature": "0.5"}, "temperature"),
    "top_p 0": ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
    "max_tokens 0": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    "max_completion_tokens 0": ("/v1/chat/completions", {**MESSAGES, "max_completion_tokens": 0},
                                "max_completion_tokens"),
    "n 0": ("/v1/chat/completions", {**MESSAGES, "n": 0}, "n"),
    "n x prompts over the bound": ("/v1/completions", {"prompt": ["a", "b"], "n": 100}, "n"),
    "best_of below n": ("/v1/completions", {"prompt": PROMPT, "n": 3, "best_of": 2}, "best_of"),
    "best_of streamed": ("/v1/completions", {"prompt": PROMPT, "best_of": 2, "stream": True}, "best_of"),
    "suffix": ("/v1/completions", {"prompt": PROMPT, "suffix": "end"}, "suffix"),
    "logit_bias key not a token id": ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"a": 1}}, "logit_bias"),
    "logit_bias key a superscript digit": ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"\u00b2": 1}},
                                           "logit_bias"),
    "logit_bias key of 5000 digits": ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"9" * 5000: 1}},
                                      "logit_bias"),
    "logit_bias over 100": ("/v1/chat/completions", {**MESSAGES, "logit_bias": {"5": 200}}, "logit_bias"),
    "speculative not a bool": ("/v1/chat/completions", {**MESSAGES, "speculative": "notabool"}, "speculative"),
    "min_tokens over max_tokens": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 3},
                                   "min_tokens"),
    "max_tokens over the context": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 100000}, "max_tokens"),
    "unknown model": ("/v1/chat/completions", {**MESSAGES, "model": "no-such-model"}, "model"),
    "message without role": ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    "image part": ("/v1/chat/completions",
                   {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                   "messages[0].content"),
    "an empty prompt list": ("/v1/completions", {"prompt": []}, "prompt"),
    "a list with a number": ("/v1/completions", {"prompt": ["a", 3]}, "prompt"),
    "top_logprobs 99": ("/v1/chat/completions", {**MESSAGES, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    "stop not strings": ("/v1/completions", {"prompt": PROMPT, "stop": [1]}, "stop[0]"),
    "65 stop strings": ("/v1/completions", {"prompt": PROMPT, "stop": [f"s{i}" for i in range(65)]}, "stop"),
    "a stop string of 513 characters": ("/v1/chat/completions", {**MESSAGES, "stop": ["x" * 513]}, "stop"),
    "1025 stop token ids": ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": list(range(1025))},
                            "stop_token_ids"),
}


def test_a_body_over_the_limit_is_413_and_the_server_goes_on(stack: Stack) -> None:
    """Declared too large (Content-Length), or found too large while arriving (chunked, no length):
    413 naming the limit, nothing parsed; then the next request is answered as ever."""
    router = Router(stack.registry, MemoryPrefixIndex())
    server, task = stack.loop.run(serve_http(create_app(router, max_body_bytes=4096), "127.0.0.1", 0))
    url = f"http://127.0.0.1:{http_port(server)}/v1/completions"
    try:
        big = {"model": stack.model, "prompt": "word " * 2000, "max_tokens": 2}
        declared = httpx.post(url, json=big, timeout=30)

        def chunks():
            yield b'{"model": "' + stack.model.encode() + b'", "prompt": "'
            for _ in range(100):
                yield b"word " * 20
            yield b'", "max_tokens": 2}'

        chunked = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"}, timeout=30)
        for response in (declared, chunked):
            assert response.status_code == 413, response.text
            error = response.json()["error"]
            assert error["code"] == "request_too_large" and "4,096 bytes" in error["message"]
        ok = httpx.post(url, json={"model": stack.model, "prompt": PROMPT, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        stack.loop.run(stop_http(server, task))
        stack.loop.run(router.close())


@pytest.mark.parametrize("case", list(BAD_BODIES.values()), ids=list(BAD_BODIES))
def test_bad_body_is_400_naming_the_field(stack: Stack, case: tuple[str, Any, str | None]) -> None:
    path, body, param = case
    if isinstance(body, bytes):
        response = stack.post(path, content=body)
    else:
        response = stack.post(path, {"model": stack.model, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ") if param else error["message"]


def test_api_key_is_required_on_v1_only(stack: Stack) -> None:
    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": 1}
    for key in (None, "sk-wrong"):
        response = stack.post("/v1/completions", body, key=key)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert stack.get("/v1/models").status_code == 401
    assert stack.get("/v1/models", key=KEY).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        stack.client(api_key="sk-wrong").models.list()
    for path in ("/healthz", "/readyz", "/metrics"):
        assert stack.get(path).status_code == 200, path


def test_readyz_follows_the_registry(stack: Stack) -> None:
    assert stack.get("/readyz").status_code == 200
    stack.loop.run(stack.registry.deregister(stack.info.worker_id, stack.info.epoch))
    try:
        assert stack.get("/readyz").status_code == 503
        response = stack.post("/v1/completions", {"model": stack.model, "prompt": PROMPT, "max_tokens": 1})
        assert response.status_code == 503 and response.json()["error"]["message"]
    finally:
        stack.loop.run(stack.registry.register(stack.info, ttl_s=3600))
    assert stack.get("/readyz").status_code == 200


def test_metrics(stack: Stack) -> None:
    stack.client().completions.create(model=stack.model, prompt=PROMPT, max_tokens=2)
    response = stack.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert 'kvcascade_requests_total{status="ok"}' in response.text
    assert "kvcascade_ttft_seconds_count" in response.text


# --- clients that leave -------------------------------------------------------------------------

ENDLESS = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


def test_disconnect_mid_stream_frees_the_workers_blocks(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{stack.base_url}/v1/completions", headers=headers,
                         json={"model": stack.model, **ENDLESS, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert stack.engine.stats().kv_blocks_used > 0  # generating, and holding its blocks
    stack.wait_until_idle(within_s=5)


def test_disconnect_while_waiting_for_a_whole_answer_frees_the_blocks(stack: Stack) -> None:
    with pytest.raises(httpx.ReadTimeout):
        stack.post("/v1/completions", {"model": stack.model, **ENDLESS}, timeout=1.0)
    stack.wait_until_idle(within_s=5)


def test_worker_dying_mid_stream_ends_it_with_an_error_event(smollm2: LLMEngine) -> None:
    with running_stack(smollm2, num_kv_blocks=160) as stack, httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{stack.base_url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"model": stack.model, **ENDLESS, "stream": True}) as response:
            events = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
            assert json.loads(next(events))["choices"][0]["text"] is not None
            stack.loop.run(stack.worker.stop(0))
            *_, error, done = events
    assert done == "[DONE]"
    assert json.loads(error)["error"]["type"] == "service_unavailable"


def test_unknown_route_is_an_openai_error(stack: Stack) -> None:
    response = stack.get("/v1/nothing", key=KEY)
    assert response.status_code == 404 and response.json()["error"]["message"]
