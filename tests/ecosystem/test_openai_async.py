"""The stock `openai` SDK's async client (AsyncOpenAI), as async applications use it, against
`kvcascade serve`: many requests at once over one client, the fields of both endpoints, streamed
and not. (tests/router/test_http_api.py drives the sync client field by field.)"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.ecosystem.conftest import MODEL, new_requests, request_counts

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                           "visits": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["city", "visits"], "additionalProperties": False}


async def _completions(client: openai.AsyncOpenAI) -> None:
    prompt = "The capital of France is"
    many = await client.completions.create(model=MODEL, prompt=[prompt, "Once upon a time"], n=2, best_of=3,
                                           max_tokens=5, temperature=0.8, seed=11, logprobs=2, echo=True,
                                           stop=["\n\n"], logit_bias={"0": -100},
                                           extra_body={"min_tokens": 2, "top_k": 20})
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    for choice in many.choices:
        assert choice.logprobs is not None and choice.logprobs.token_logprobs[0] is None  # echo's first token
        assert choice.text.startswith(prompt) or choice.text.startswith("Once upon a time")
    assert many.usage.completion_tokens >= 2 * 3 * 2  # best_of samples generated, min_tokens each
    chunks = [c async for c in await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})]
    assert chunks[-1].usage.completion_tokens == 6 and all(c.usage is not None for c in chunks)
    whole = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


async def _chat(client: openai.AsyncOpenAI, i: int) -> None:
    messages = [{"role": "system", "content": "Answer with JSON."},
                {"role": "user", "content": f"Which city did traveller {i} visit, and how often?"}]
    answer = await client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=60, temperature=0.7, seed=i, n=2, logprobs=True,
        top_logprobs=3, response_format={"type": "json_schema", "json_schema": {"name": "visit", "schema": SCHEMA,
                                                                                 "strict": True}})
    for choice in answer.choices:
        value = json.loads(choice.message.content)
        assert value["city"] in ("Paris", "Rome", "Oslo") and 0 <= value["visits"] <= 9
        assert choice.finish_reason == "stop" and len(choice.logprobs.content[0].top_logprobs) == 3
    streamed = await client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8,
                                                    temperature=0, stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in streamed:
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert text and usage.completion_tokens <= 8


async def _bad(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             response_format={"type": "json_schema",
                                                              "json_schema": {"name": "x", "schema": {"type": 7}}})
    assert err.value.body["param"].startswith("response_format")
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    assert err.value.body["param"] == "max_tokens"


def test_the_async_client_with_many_requests_at_once(served) -> None:
    """16 chat requests (JSON-schema answers, n=2, logprobs), the completions fields and two bad
    requests, all at once over one AsyncOpenAI client: every answer right, none failed at the server
    but the two refused."""
    before = request_counts(served.url)

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            await asyncio.gather(_completions(client), _bad(client), *(_chat(client, i) for i in range(16)))

    asyncio.run(main())
    counts = new_requests(served.url, before)
    assert counts.get("ok", 0) >= 16 * 3 and set(counts) <= {"ok", "invalid_argument"}, counts
