"""Function calling on the OpenAI-style wire (``tools``, ``tool_choice``, ``parallel_tool_calls``)
as vLLM serves it for Qwen2.5 (its ``hermes`` parser).

The tools go to the model's chat template (ChatMessages.tools_json: the router and the worker
render the same prompt); the answer is read back here, never in the engine:

    tool_choice "auto" (the default with tools)  the model decides; <tool_call> tags in its answer
                                                 become tool_calls (router/tool_calls.py)
    "none"                                       the template still shows the tools (vLLM's default),
                                                 the answer is plain text, not parsed
    "required" / {"type": "function", ...}       guided decoding forces the call, as vLLM does: the
                                                 answer is JSON (a list of {"name", "parameters"}, or
                                                 the named function's arguments), not tags

finish_reason is "tool_calls" when a call was made, except for a named function ("stop", as
OpenAI and vLLM answer it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from protos import kvcascade_pb2 as pb
from router.errors import BadRequest
from router.tool_calls import ToolCall, ToolCallStream, parse

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of an object
    strict: bool | None = None  # accepted: forced calls always follow the schema

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise ValueError("must be 1 to 64 letters, digits, underscores or dashes")
        return v

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("must be a JSON Schema of an object ({\"type\": \"object\", ...})")
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str  # JSON text, as the answer gave it


class AssistantToolCall(BaseModel):
    """A call in an earlier assistant turn of the conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolFields(BaseModel):
    """The chat request's fields (a mixin of ChatRequest)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_calling(self) -> tuple[str, ToolCalling | None]:
        """The tools' JSON for the template ("" without tools) and how to read the answer (None:
        as text). Raises BadRequest naming the field."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise _bad("tool_choice", "only allowed when tools are given")
            return "", None
        tools_json = template_tools(self.tools)
        names = [t.function.name for t in self.tools]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise _bad(f"tools[{i}].function.name", f"{name!r} is named twice")
        choice = self.tool_choice or "auto"
        if choice == "none":
            return tools_json, None
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _bad("tool_choice.function.name", f"{choice.function.name!r} is not one of the tools")
        forced = choice.function.name if isinstance(choice, NamedToolChoice) else choice
        return tools_json, ToolCalling(self.tools, forced, self.parallel_tool_calls is not False)


def template_tools(tools: list[Tool]) -> str:
    """The tools as the chat template gets them (ChatMessages.tools_json)."""
    return json.dumps([t.model_dump(exclude_none=True) for t in tools], ensure_ascii=False)


@dataclass(frozen=True)
class ToolCalling:
    """How one request's answers are read: ``forced`` "auto" (tags), "required", or a function name."""

    tools: list[Tool]
    forced: str
    parallel: bool = True

    @property
    def named(self) -> bool:
        return self.forced not in ("auto", "required")

    def constraint(self) -> pb.StructuredOutput | None:
        """The guided decoding that forces the call (None for "auto"): vLLM's schemas."""
        if self.forced == "auto":
            return None
        params = {t.function.name: t.function.parameters or {"type": "object", "properties": {}}
                  for t in self.tools}
        if self.named:
            return pb.StructuredOutput(json_schema=json.dumps(params[self.forced]))
        one = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"]} for name, schema in params.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": one}}
        if not self.parallel:
            array["maxItems"] = 1
        return pb.StructuredOutput(json_schema=json.dumps(array))

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer's content and calls. A forced answer that is not the JSON asked for (cut
        short by max_tokens) stays content."""
        if self.forced == "auto":
            return parse(text, self.parallel)
        try:
            value = json.loads(text)
        except ValueError:
            return text or None, []
        if self.named:
            return (None, [ToolCall(self.forced, json.dumps(value, ensure_ascii=False))]) if isinstance(
                value, dict) else (text, [])
        if not (isinstance(value, list) and value and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                          and isinstance(c.get("parameters"), dict) for c in value)):
            return text, []
        calls = [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
        return None, calls if self.parallel else calls[:1]

    def finish_reason(self, engine_reason: str, called: bool) -> str:
        return "tool_calls" if called and engine_reason == "stop" and not self.named else engine_reason

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """A non-streamed answer's message, and whether it called a tool."""
        content, calls = self.read(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message, bool(calls)

    def stream(self) -> ToolDeltas:
        return ToolDeltas(self)


class ToolDeltas:
    """One streamed choice's deltas. "auto": text as it comes until a tag may start, each call
    whole (name and arguments in one delta) once its closing tag is in. A named function: the
    answer is the arguments' JSON (the grammar's), streamed as it comes the way vLLM does -- the
    call's id, name and empty arguments first, then argument pieces (an answer cut short by
    max_tokens leaves them partial, with finish_reason "length"). "required": the JSON array is
    held and the calls go out at the end (held JSON that was not what was asked goes out as content)."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self.parser = ToolCallStream(calling.parallel) if calling.forced == "auto" else None
        self.held: list[str] = []
        self.sent = 0  # calls sent: the next one's index
        self.named_call: ToolCall | None = None  # a named function's call, once its head is sent

    def delta(self, text: str, last: bool) -> dict[str, Any]:
        """The delta of one message's text (``last``: the answer's final message)."""
        if self.calling.named:
            return self._named(text)
        if self.parser is not None:
            content, calls = self.parser.feed(text)
            if last:
                more_content, more_calls = self.parser.finish()
                content, calls = content + more_content, calls + more_calls
        else:
            self.held.append(text)
            content, calls = ("", []) if not last else self.calling.read("".join(self.held))
            content = content or ""
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": self.sent + i, **c.openai()} for i, c in enumerate(calls)]
            self.sent += len(calls)
        return delta

    def _named(self, text: str) -> dict[str, Any]:
        if self.named_call is None:  # the first delta: the call's head, with what arguments there are
            self.named_call, self.sent = ToolCall(self.calling.forced, text), 1
            return {"tool_calls": [{"index": 0, **self.named_call.openai()}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}


def _bad(param: str, message: str) -> Exception:
    return BadRequest(param, f"{param}: {message}")
