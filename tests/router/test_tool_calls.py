"""The Hermes tool-call parser (router/tool_calls.py) on fixed answers, whole and streamed."""

from __future__ import annotations

import json

import pytest

from router.tool_calls import ToolCallStream, parse

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'


def _streamed(text: str, step: int, parallel: bool = True) -> tuple[str | None, list]:
    """``text`` fed ``step`` characters at a time: the content and calls a stream would send."""
    stream, content, calls = ToolCallStream(parallel), "", []
    for i in range(0, len(text), step):
        said, made = stream.feed(text[i:i + step])
        content, calls = content + said, calls + made
    said, made = stream.finish()
    return (content + said) or None, calls + made


def _names_args(calls: list) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    (CALL, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (CALL + "\n" + CALL2, None, [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                 ("get_time", {"tz": "Europe/Paris"})]),
    ("Let me check.\n" + CALL, "Let me check.\n", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("Plain answer, no call.", "Plain answer, no call.", []),
    ("", None, []),
    # Malformed JSON stays content, tags and all; the good call next to it still counts.
    ('<tool_call>\n{"name": "get_weather", "arguments": {city}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {city}}\n</tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>' + CALL, '<tool_call>{"arguments": {}}</tool_call>',
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # Unclosed at the end (max_tokens): a call when its JSON is whole, else content.
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', None, [("f", {"a": 1})]),
    ('<tool_call>\n{"name": "f", "argum', '<tool_call>\n{"name": "f", "argum', []),
    ("a < b and <tool", "a < b and <tool", []),  # a partial tag at the end is text after all
    ('<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", {})]),
    (CALL + "\nDone.", "\nDone.", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
])
def test_parse_whole_and_streamed(text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = parse(text)
    assert got_content == content and _names_args(got_calls) == calls
    for step in (1, 2, 3, 7, len(text) or 1):  # tags split across chunks every way
        s_content, s_calls = _streamed(text, step)
        assert s_content == content and _names_args(s_calls) == calls, step


def test_calls_have_ids_and_openai_shape() -> None:
    _, calls = parse(CALL + CALL2)
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert calls[0].openai() == {"id": calls[0].id, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}


def test_not_parallel_keeps_the_first_call() -> None:
    for got in (parse(CALL + CALL2, parallel=False), _streamed(CALL + CALL2, 3, parallel=False)):
        assert got[0] is None and [c.name for c in got[1]] == ["get_weather"]


def test_text_goes_out_until_a_tag_may_start() -> None:
    stream = ToolCallStream()
    assert stream.feed("Sure, ") == ("Sure, ", [])
    assert stream.feed("checking <tool_") == ("checking ", [])  # "<tool_" held back
    assert stream.feed('call>{"name": "f", "arguments": {}}') == ("", [])
    said, calls = stream.feed("</tool_call>")
    assert said == "" and [c.name for c in calls] == ["f"]
    assert stream.feed("\n") == ("", [])  # whitespace after a call waits: more text, a call, or the end
    assert stream.finish() == ("", [])


# --- the request side (router/openai_tools.py) and the template's inputs (contracts/chat.py) ----------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _chat(**fields):
    from router.openai_protocol import ChatRequest, chat_call

    return chat_call(ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields},
                                                strict=True))


def test_tools_reach_the_template_inputs_with_earlier_calls() -> None:
    from contracts.chat import template_inputs
    from router.openai_protocol import ChatRequest, chat_call

    body = ChatRequest.model_validate({"tools": [WEATHER], "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]}, strict=True)
    messages, tools = template_inputs(chat_call(body).request.messages)
    assert tools == [WEATHER]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert messages[2] == {"role": "tool", "content": "cold", "tool_call_id": "call_1"}
    assert messages[0] == {"role": "user", "content": "weather?"}  # plain turns render as before


def test_tool_choice_sets_how_answers_are_read() -> None:
    assert _chat().tools is None and not _chat().request.messages.tools_json
    assert _chat(tools=[WEATHER], tool_choice="none").tools is None  # rendered, not parsed
    auto = _chat(tools=[WEATHER])
    assert auto.tools.forced == "auto" and not auto.request.sampling.HasField("structured_output")
    named = _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.request.sampling.structured_output.json_schema) == WEATHER["function"]["parameters"]
    required = _chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(required.request.sampling.structured_output.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1


def test_forced_answers_are_read_as_json() -> None:
    named = _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}).tools
    message, called = named.message('{"city":"Oslo"}')
    assert called and message["content"] is None and message["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert named.finish_reason("stop", called) == "stop"  # a named function: "stop", as OpenAI answers
    required = _chat(tools=[WEATHER], tool_choice="required").tools
    message, called = required.message('[{"name":"get_weather","parameters":{"city":"Oslo"}}]')
    assert called and required.finish_reason("stop", called) == "tool_calls"
    assert required.message('[{"name":"get_wea')[0] == {"role": "assistant", "content": '[{"name":"get_wea'}
    deltas = required.stream()
    assert deltas.delta('[{"name":"get_weather",', last=False) == {}
    delta = deltas.delta('"parameters":{"city":"Oslo"}}]', last=True)
    assert delta["tool_calls"][0]["index"] == 0 and delta["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_named_functions_arguments_stream_as_they_come() -> None:
    """vLLM's shape: the call's id, type and name with the first piece, then argument pieces only."""
    named = _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}).tools
    deltas = named.stream()
    first = deltas.delta('{"ci', last=False)["tool_calls"]
    assert first[0]["index"] == 0 and first[0]["id"].startswith("call_") and first[0]["type"] == "function"
    assert first[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert deltas.delta("", last=False) == {}  # a held-back piece of text: nothing to say yet
    last = deltas.delta('ty":"Oslo"}', last=True)
    assert last == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Oslo"}'}}]}
    assert deltas.sent == 1 and named.finish_reason("stop", True) == "stop"
    empty_first = named.stream().delta("", last=False)["tool_calls"][0]
    assert empty_first["function"] == {"name": "get_weather", "arguments": ""}
