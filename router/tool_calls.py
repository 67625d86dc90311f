"""Function calls in a chat answer, in the Hermes format that Qwen2.5's template asks for (vLLM's
``hermes`` tool parser reads the same):

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each well-formed call becomes an OpenAI tool call (arguments as a JSON string); everything else is
the message's content. A call whose JSON does not parse (or lacks a string "name" or an object
"arguments") stays in the content, tags and all, as vLLM leaves it: never an error. A call the
answer left unclosed (max_tokens) still counts when its JSON is complete. Text that is only
whitespace next to a call is dropped, so "newline, call, newline, call" has no content.

``parse`` reads a whole answer; ``ToolCallStream`` reads it as it streams and gives the same
content and calls: text goes out as soon as it cannot be the start of a ``<tool_call>`` tag, and
each call goes out whole (name and complete arguments in one delta) once its closing tag arrives.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(body: str) -> ToolCall | None:
    """The call a tag's JSON holds, or None when it is malformed."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _held(text: str) -> int:
    """How many characters at the end of ``text`` could be the start of a ``<tool_call>`` tag."""
    for n in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallStream:
    """One choice's answer, fed as it streams. ``feed`` and ``finish`` return (content, calls)
    to send now; ``calls`` counts every call sent. ``parallel`` False keeps only the first call."""

    parallel: bool = True
    calls: int = 0
    _pending: str = ""  # text not yet said: a possible tag start, a call's body, whitespace after a call
    _inside: bool = False  # _pending is the body of an open <tool_call>
    _said: bool = False  # some of the text since the last tag went out (it is not whitespace alone)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._inside:
                end = self._pending.find(END)
                if end < 0:
                    break
                self._close(self._pending[:end], content, calls)
                self._pending = self._pending[end + len(END):]
                continue
            start = self._pending.find(START)
            if start >= 0:
                self._say(self._pending[:start], content, final=True)
                self._pending, self._inside, self._said = self._pending[start + len(START):], True, False
                continue
            keep = _held(self._pending)
            said = self._say(self._pending[:len(self._pending) - keep], content, final=False)
            self._pending = self._pending[said:]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is still held at the answer's end: an unclosed call, or text that was not a tag."""
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._inside:
            self._close(self._pending, content, calls, closed=False)
        else:
            self._say(self._pending, content, final=True, at_end=True)
        self._pending, self._inside = "", False
        return "".join(content), calls

    def _say(self, text: str, content: list[str], *, final: bool, at_end: bool = False) -> int:
        """Send ``text`` as content; returns how much of it was consumed. Text between tags that is
        whitespace alone is held until what follows decides: more text (it goes out with it), a
        call (dropped), or the answer's end (said only if there was no call)."""
        if not self._said and not text.strip():
            if at_end and not self.calls:
                content.append(text)
            return len(text) if final else 0
        content.append(text)
        self._said = True
        return len(text)

    def _close(self, body: str, content: list[str], calls: list[ToolCall], closed: bool = True) -> None:
        self._inside = False
        call = _call(body)
        if call is None:
            content.append(START + body + (END if closed else ""))
            return
        if self.parallel or not self.calls:
            calls.append(call)
        self.calls += 1


def parse(text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when empty) and calls."""
    stream = ToolCallStream(parallel)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return (content + rest) or None, calls + more
