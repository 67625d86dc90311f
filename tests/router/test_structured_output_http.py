"""Structured output over HTTP: response_format and vLLM's guided_* / structured_outputs fields,
conflicts and bad specs as 400s naming the field, and concurrent constrained requests."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.router.test_http_api import Stack, running_stack

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "population": {"type": "integer", "minimum": 1, "maximum": 99}},
          "required": ["city", "population"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Name a European capital, as JSON."}]


@pytest.fixture(scope="module")
def stack(smollm2) -> Iterator[Stack]:
    with running_stack(smollm2) as stack:
        yield stack


def _chat(stack: Stack, **body) -> dict:
    response = stack.post("/v1/chat/completions", {"model": stack.model, "messages": MESSAGES, "max_tokens": 40,
                                                   "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_response_format_json_schema_and_json_object(stack: Stack) -> None:
    choice = _chat(stack, response_format={"type": "json_schema",
                                           "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    choice = _chat(stack, response_format={"type": "json_object"}, max_tokens=60)
    if choice["finish_reason"] == "stop":  # an open-ended object may run past max_tokens
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert _chat(stack, response_format={"type": "text"}, max_tokens=4)["finish_reason"] == "length"


def test_vllm_guided_fields_on_completions_and_chat(stack: Stack) -> None:
    body = {"model": stack.model, "prompt": "My phone number is ", "max_tokens": 20, "temperature": 0.8, "seed": 3}
    response = stack.post("/v1/completions", {**body, "guided_regex": r"\d{3}-\d{4}"})
    assert response.status_code == 200, response.text
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", response.json()["choices"][0]["text"])
    assert _chat(stack, guided_choice=["yes", "no"])["message"]["content"] in ("yes", "no")
    text = _chat(stack, guided_json=SCHEMA)["message"]["content"]
    jsonschema.validate(json.loads(text), SCHEMA)
    assert _chat(stack, guided_grammar='start: "A" | "B"')["message"]["content"] in ("A", "B")
    text = _chat(stack, structured_outputs={"regex": "[a-z]{2,6} [a-z]{2,6}"}, max_tokens=20)["message"]["content"]
    assert re.fullmatch("[a-z]{2,6} [a-z]{2,6}", text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_specs_and_conflicts_are_400_naming_the_field(stack: Stack, body: dict, param: str) -> None:
    response = stack.post("/v1/chat/completions", {"model": stack.model, "messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_sixteen_concurrent_constrained_requests_all_valid(stack: Stack) -> None:
    def one(i: int) -> dict:
        return _chat(stack, guided_json=SCHEMA, temperature=0.9, seed=i)

    with ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(one, range(16)))
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    stack.wait_until_idle(within_s=30)
