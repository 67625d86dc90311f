"""Chat messages (and tools) to prompt token ids through the model's chat template.

The router renders a chat prompt to hash it for routing and the worker renders it again for its
engine; both go through ``template_inputs`` and ``render_chat`` here, so the two token id lists,
and so the prefix-cache hashes, are the same.
"""

from __future__ import annotations

import json
from typing import Any

from protos import kvcascade_pb2 as pb


def template_inputs(chat: pb.ChatMessages) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The template's ``messages`` and ``tools`` (None: no tools) from the proto.

    Keys a plain turn lacks stay absent, so a conversation without tools renders as it always
    did. A call's arguments go to the template parsed (it writes them with ``tojson``), as vLLM
    hands them; arguments that are not JSON go as the text they are. Raises ValueError when
    ``tools_json`` is not a JSON array of objects."""
    messages = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": _parsed(c.arguments)}}
                                     for c in m.tool_calls]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    if not chat.tools_json:
        return messages, None
    tools = json.loads(chat.tools_json)
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools_json must be a JSON array of objects")
    return messages, tools


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def takes_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders ``tools`` at all: one that never names them
    would drop them silently, so the request is refused instead."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: "default", "tool_use", ...
        template = " ".join(template.values())
    return "tools" in template


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt's token ids, the assistant's turn opened (callers check ``takes_tools`` first)."""
    return list(tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))
