"""OpenAI completions and chat completions on the wire <-> the router's proto messages.

Bodies are parsed in pydantic strict mode (a string is not a number) into the request models
below, then translated into a pb.GenerateRequest. The engine stays the one place that knows which
values are valid (temperature >= 0, top_p in (0, 1], max_tokens >= 1, ...): here only what the
proto cannot carry is refused, and the engine's complaint comes back naming the OpenAI field.

Unset fields stay unset in the proto, so the engine's defaults apply, with one exception:
completions get OpenAI's documented ``max_tokens`` default of 16. Chat completions have no
OpenAI default (the limit is the context window); without ``max_tokens`` (or
``max_completion_tokens``) the engine's default applies, which is 16 tokens today.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protos import kvcascade_pb2 as pb

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class BadRequest(Exception):
    """A request the front end refuses itself: HTTP 400 naming the OpenAI field in ``param``."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


# --- request bodies ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)  # the proto's uint64
    stop: list[str] | None = None
    n: int | None = None
    user: str | None = None  # accepted and ignored
    # Features the engine lacks: accepted only at their neutral value, never silently dropped.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Extensions, as vLLM accepts them.
    top_k: Int32 | None = None  # -1 (vLLM's "off") or 0 disables the cut
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    # Cascade extensions (router --cascade): false skips it; a tier name pins that tier.
    cascade: bool | None = None
    tier: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only n=1 is supported; send one request per choice")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0):
            raise ValueError("penalties are not supported; leave it unset or 0")
        return v

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> pb.SamplingParams:
        s = pb.SamplingParams()
        if max_tokens is not None:
            s.max_tokens = max_tokens
        if self.temperature is not None:
            s.temperature = self.temperature
        if self.top_p is not None:
            s.top_p = self.top_p
        if self.seed is not None:
            s.seed = self.seed
        if self.top_k is not None:
            s.top_k = 0 if self.top_k == -1 else self.top_k
        s.stop.extend(self.stop or ())
        s.stop_token_ids.extend(self.stop_token_ids or ())
        s.ignore_eos = bool(self.ignore_eos)
        if logprobs is not None:
            s.logprobs = logprobs
        return s


class CompletionRequest(_Request):
    prompt: str | list[int]
    max_tokens: Int32 | None = None
    logprobs: Int32 | None = None
    echo: bool | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        # OpenAI also takes a batch (a list of strings or of token lists); this server answers one.
        if isinstance(v, list) and v and all(isinstance(p, str | list) for p in v):
            if len(v) > 1:
                raise ValueError("a list of several prompts is not supported; send one request per prompt")
            v = v[0]
        # Checked here in full, so the union below never fails (its errors would name its members).
        if isinstance(v, str) or (isinstance(v, list) and all(type(t) is int and 0 <= t < 2**31 for t in v)):
            return v
        raise ValueError("must be a string or a list of token ids (integers >= 0)")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: str | None = None  # accepted and ignored

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if v is None:  # an assistant turn without text
            return ""
        if not isinstance(v, list):
            return v
        texts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} must be {{'type': 'text', 'text': <string>}}; only text is supported")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = None
    top_logprobs: Int32 | None = None


# --- translation --------------------------------------------------------------------------------


@dataclass
class Call:
    """One HTTP request turned into a router request, and what answering it needs."""

    kind: Literal["completion", "chat"]
    request: pb.GenerateRequest
    stream: bool
    include_usage: bool
    # Engine field names (max_tokens, logprobs, prompt, ...) -> the OpenAI field the client set.
    aliases: dict[str, str] = field(default_factory=dict)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def wants_logprobs(self) -> bool:
        return self.request.sampling.HasField("logprobs")

    def param(self, engine_field: str) -> str:
        """The OpenAI name of a field the router or the engine complained about."""
        name = engine_field.removeprefix("sampling.")
        return self.aliases.get(name, name)


def completion_call(body: CompletionRequest) -> Call:
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    rid = f"cmpl-{uuid.uuid4().hex}"
    request = pb.GenerateRequest(request_id=rid, model=body.model or "",
                                 sampling=body.sampling(max_tokens, body.logprobs))
    if isinstance(body.prompt, str):
        request.text = body.prompt
    else:
        request.token_ids.ids[:] = body.prompt
    _cascade_fields(request, body)
    aliases = {"text": "prompt", "token_ids": "prompt", "prompt_token_ids": "prompt"}
    return Call("completion", request, body.stream, _include_usage(body), aliases, rid)


def chat_call(body: ChatRequest) -> Call:
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs", "top_logprobs: needs logprobs set to true")
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    request = pb.GenerateRequest(request_id=rid, model=body.model or "", sampling=body.sampling(max_tokens, logprobs))
    for m in body.messages:
        # "developer" is OpenAI's newer name for the system turn; chat templates know only "system".
        request.messages.messages.add(role="system" if m.role == "developer" else m.role, content=m.content)
    _cascade_fields(request, body)
    aliases = {"max_tokens": max_name, "logprobs": "top_logprobs", "prompt": "messages",
               "text": "messages", "token_ids": "messages", "prompt_token_ids": "messages"}
    return Call("chat", request, body.stream, _include_usage(body), aliases, rid)


def _cascade_fields(request: pb.GenerateRequest, body: _Request) -> None:
    if body.cascade is False:
        request.cascade = pb.CASCADE_OFF
    if body.tier:
        request.tier = body.tier


def _include_usage(body: _Request) -> bool:
    return body.stream and body.stream_options is not None and body.stream_options.include_usage


# --- responses ----------------------------------------------------------------------------------


def usage(u: pb.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


@dataclass
class Answer:
    """Builds one call's OpenAI response, or its stream chunks, from the worker's messages."""

    call: Call
    model: str
    tokenizer: Any = None  # turns logprob token ids into strings; None: "token_id:<id>"
    _text_offset: int = 0  # completions' text_offset runs on across chunks

    @property
    def _chat(self) -> bool:
        return self.call.kind == "chat"

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self._chat else "text_completion"
        return {"id": self.call.id, "object": kind, "created": self.call.created, "model": self.model}

    def response(self, messages: list[pb.GenerateResponse]) -> dict[str, Any]:
        text = "".join(m.text for m in messages)
        last = messages[-1]
        choice: dict[str, Any] = {"index": 0}
        if self._chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(messages)
        choice["finish_reason"] = last.finish_reason or None
        return {**self._head(chunk=False), "choices": [choice], "usage": usage(last.usage), **_cascade(last)}

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        if not self._chat:
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def chunk(self, msg: pb.GenerateResponse) -> dict[str, Any] | None:
        """The chunk of one worker message; None when it carries nothing to say."""
        logprobs = self._logprobs([msg])
        if not msg.text and not msg.finish_reason and not (logprobs and msg.logprobs):
            return None
        choice: dict[str, Any] = {"index": 0}
        if self._chat:
            choice["delta"] = {"content": msg.text} if msg.text else {}
        else:
            choice["text"] = msg.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = msg.finish_reason or None
        return {**self._chunk(choice), **_cascade(msg)}

    def usage_chunk(self, u: pb.Usage) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [], "usage": usage(u)}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._head(chunk=True), "choices": [choice]}
        if self.call.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the usage one
        return chunk

    # --- logprobs, in each endpoint's format ---------------------------------------------------

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def _logprobs(self, messages: list[pb.GenerateResponse]) -> dict[str, Any] | None:
        if not self.call.wants_logprobs:
            return None
        lps = [lp for m in messages for lp in m.logprobs]
        if self._chat:
            return {"content": [self._chat_logprob(lp) for lp in lps], "refusal": None}
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            # Reversed, so that of two ids with the same text the likelier one's logprob stays.
            "top_logprobs": [{self._token(t.token_id): t.logprob for t in reversed(lp.top)} for lp in lps],
            "text_offset": offsets,
        }

    def _chat_logprob(self, lp: pb.TokenLogprob) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = self._token(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]}


def _cascade(msg: pb.GenerateResponse) -> dict[str, Any]:
    """Extension fields of a cascade's answer: the tier that answered, whether it escalated, and
    (on the last message, where they are known) that tier's confidence and every tier's tokens
    (``tier_usage``: trials thrown away and judging included). Nothing without a cascade."""
    if not msg.tier:
        return {}
    if not msg.finish_reason:
        return {"tier": msg.tier, "escalated": msg.escalated, "confidence": None}
    tiers = [{"tier": u.tier, "model": u.model, "role": u.role, "prompt_tokens": u.prompt_tokens,
              "cached_tokens": u.cached_tokens, "completion_tokens": u.completion_tokens} for u in msg.tier_usage]
    judged = {"judge_score": msg.judge_score} if msg.HasField("judge_score") else {}
    return {"tier": msg.tier, "escalated": msg.escalated, "confidence": msg.confidence, **judged, "tier_usage": tiers}
