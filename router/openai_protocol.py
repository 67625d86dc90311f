"""OpenAI completions and chat completions on the wire <-> the router's proto messages.

Bodies are parsed in pydantic strict mode (a string is not a number) into the request models
below, then translated into a pb.GenerateRequest. The engine stays the one place that knows which
values are valid (temperature >= 0, top_p in (0, 1], max_tokens >= 1, ...): here only what the
proto cannot carry is refused, and the engine's complaint comes back naming the OpenAI field.

Unset fields stay unset in the proto, so the engine's defaults apply, with two exceptions, as
OpenAI documents them: completions default to ``max_tokens`` 16, and a chat answer without
``max_tokens`` (or ``max_completion_tokens``) runs until the context ends (proto max_tokens 0).
A prompt plus max_tokens over the context length is refused, naming both (the engine's check).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protos import kvcascade_pb2 as pb
from router.errors import BadRequest
from router.openai_structured import StructuredOutputError, StructuredOutputFields
from router.openai_tools import AssistantToolCall, Tool, ToolCalling, ToolDeltas, ToolFields, template_tools

MAX_CHOICES = 128  # n, best_of, and prompts x best_of: answers one request may ask for
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_TIMEOUT_S = 24 * 3600.0  # the "timeout" field: a day at most
CHAT_UNTIL_CONTEXT_ENDS = 0  # the proto's max_tokens for "no limit but the context"
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


# --- request bodies ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _Request(StructuredOutputFields):
    """Fields both endpoints share (structured output's: openai_structured.py). Unknown fields are
    ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)  # the proto's uint64
    stop: list[str] | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    user: str | None = None  # accepted and ignored
    # Seconds the answer may take, end to end (the workers' deadline): past it, 504 and the KV
    # blocks freed. As the OpenAI SDKs' client-side timeout, but the server stops working too.
    timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    # Features the engine lacks: accepted only at their neutral value, never silently dropped.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Extensions, as vLLM accepts them.
    top_k: Int32 | None = None  # -1 (vLLM's "off") or 0 disables the cut
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Int32 | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids (as strings) -> bias in [-100, 100]
    # kvcascade's: false opts this request out of the workers' speculative decoding (--speculative)
    speculative: bool | None = None
    # Cascade extensions (router --cascade): false skips it; a tier name pins that tier.
    cascade: bool | None = None
    tier: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

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
        if self.min_tokens is not None:
            s.min_tokens = self.min_tokens
        if self.speculative is not None:
            s.speculative = self.speculative
        for token, bias in (self.logit_bias or {}).items():
            # ASCII digits only ("²" is a digit to isdigit, not to int), and few of them before int().
            if not (token.isascii() and token.isdigit() and len(token) <= 10) or int(token) >= 2**31:
                raise BadRequest("logit_bias", f"logit_bias: keys must be token ids, got {token!r}")
            s.logit_bias[int(token)] = bias
        if logprobs is not None:
            s.logprobs = logprobs
        try:
            structured = self.structured_output()[0]
        except StructuredOutputError as exc:
            raise BadRequest(exc.param, exc.message) from None
        if structured is not None:
            s.structured_output.CopyFrom(structured)
        return s


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int and 0 <= t < 2**31 for t in v)


class CompletionRequest(_Request):
    # One prompt (a string or token ids) or a batch of them, normalised to a list of prompts.
    prompt: list[str | list[int]]
    max_tokens: Int32 | None = None
    logprobs: Int32 | None = None
    echo: bool = False  # the answer starts with the prompt (and, with logprobs, its tokens' logprobs)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)  # samples per prompt; the n likeliest are returned
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        # Checked here in full, so the union above never fails (its errors would name its members).
        if isinstance(v, str) or (_token_ids(v) and v):
            return [v]
        if isinstance(v, list) and v and all(isinstance(p, str) or (_token_ids(p) and p) for p in v):
            return v
        raise ValueError("must be a string, a list of token ids (integers >= 0), or a non-empty list of either")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (fill in the middle) is not supported by these models' prompts")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str
    name: str | None = None  # accepted and ignored
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn's calls (openai_tools.py)
    tool_call_id: str | None = None  # a tool turn: the call whose result it is

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


class ChatRequest(_Request, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = None
    top_logprobs: Int32 | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a completion prompt, or chat messages as the chat endpoint
    renders them (its template, with the assistant turn opened)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # rendered with the messages, as the chat endpoint does

    def generate_request(self) -> pb.GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("prompt", "prompt: give a prompt or messages, not both or neither")
        request = pb.GenerateRequest(model=self.model or "")
        if self.prompt is not None:
            request.text = self.prompt
        _add_messages(request, self.messages or ())
        if self.tools and self.messages is not None:
            request.messages.tools_json = template_tools(self.tools)
        return request


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[TokenId]


# --- translation --------------------------------------------------------------------------------


@dataclass
class Call:
    """One HTTP request turned into router requests, and what answering it needs: one request
    per sample, ``best_of`` per prompt, prompt-major (sample s is of prompt s // best_of)."""

    kind: Literal["completion", "chat"]
    requests: list[pb.GenerateRequest]
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # every chunk's usage is the usage so far (else null but the last's)
    # Engine field names (max_tokens, logprobs, prompt, ...) -> the OpenAI field the client set.
    aliases: dict[str, str] = field(default_factory=dict)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    n: int = 1  # choices per prompt
    best_of: int = 1  # samples per prompt (>= n): the n with the highest cumulative logprob are kept
    echo: bool = False
    logprobs: int | None = None  # what the client asked for (best_of > n asks the workers for 0 at least)
    timeout: float | None = None  # seconds, the deadline of every sample's request
    tools: ToolCalling | None = None  # chat with tools: how answers are read for calls (None: as text)

    @property
    def request(self) -> pb.GenerateRequest:
        """The first sample's request: model, sampling and fields shared by all."""
        return self.requests[0]

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def kept(self, samples: list[list[pb.GenerateResponse]]) -> list[tuple[int, int]]:
        """(choice index, sample) of the answers the client gets: per prompt, its n samples with
        the highest cumulative logprob when best_of > n, else all of them in order."""
        out = []
        for p in range(len(samples) // self.best_of):
            ids = range(p * self.best_of, (p + 1) * self.best_of)
            if self.best_of > self.n:
                ids = sorted(sorted(ids, key=lambda s: -sum(lp.logprob for m in samples[s] for lp in m.logprobs))
                             [: self.n])
            out += [(p * self.n + r, s) for r, s in enumerate(ids)]
        return out

    def param(self, engine_field: str) -> str:
        """The OpenAI name of a field the router or the engine complained about."""
        name = engine_field.removeprefix("sampling.")
        return self.aliases.get(name, name)


def completion_call(body: CompletionRequest) -> Call:
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if max_tokens < 1:  # 0 would mean "until the context ends" to the worker
        raise BadRequest("max_tokens", f"max_tokens: must be >= 1, got {max_tokens}")
    n, best_of = _choices(body, body.best_of)
    if body.stream and best_of > n:
        raise BadRequest("best_of", "best_of: cannot be larger than n when streaming (the best are known at the end)")
    rid = f"cmpl-{uuid.uuid4().hex}"
    # best_of > n ranks samples by their cumulative logprob: the workers send the chosen ones'.
    worker_logprobs = body.logprobs if body.logprobs is not None or best_of == n else 0
    template = pb.GenerateRequest(request_id=rid, model=body.model or "",
                                  sampling=body.sampling(max_tokens, worker_logprobs))
    if body.echo and body.logprobs is not None:
        template.sampling.prompt_logprobs = body.logprobs
    _cascade_fields(template, body)
    requests = []
    for prompt in body.prompt:
        request = pb.GenerateRequest()
        request.CopyFrom(template)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids[:] = prompt
        requests.append(request)
    aliases = {"text": "prompt", "token_ids": "prompt", "prompt_token_ids": "prompt", **body.structured_output()[1]}
    return Call("completion", _samples(requests, best_of, body.seed), body.stream, _include_usage(body),
                _continuous_usage(body), aliases, rid, n=n, best_of=best_of, echo=body.echo, logprobs=body.logprobs,
                timeout=body.timeout)


def _choices(body: _Request, best_of: int | None) -> tuple[int, int]:
    n = body.n or 1
    best_of = n if best_of is None else best_of
    if best_of < n:
        raise BadRequest("best_of", f"best_of: must be >= n ({n}), got {best_of}")
    prompts = len(body.prompt) if isinstance(body, CompletionRequest) else 1
    if prompts * best_of > MAX_CHOICES:
        raise BadRequest("n", f"n: {prompts} prompt(s) x {best_of} samples is over {MAX_CHOICES} answers")
    return n, best_of


def _samples(requests: list[pb.GenerateRequest], per_prompt: int, seed: int | None) -> list[pb.GenerateRequest]:
    """``per_prompt`` copies of each request, each its own id and, with a seed, its own seed
    (seed + i: the samples differ, and the same request gives the same answers again)."""
    out = []
    for request in requests:
        for i in range(per_prompt):
            sample = pb.GenerateRequest()
            sample.CopyFrom(request)
            sample.request_id = f"{request.request_id}-{len(out)}"
            if seed is not None and i:
                sample.sampling.seed = (seed + i) % 2**64
            out.append(sample)
    return out


def chat_call(body: ChatRequest) -> Call:
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs", "top_logprobs: needs logprobs set to true")
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = CHAT_UNTIL_CONTEXT_ENDS
    elif max_tokens < 1:
        raise BadRequest(max_name, f"{max_name}: must be >= 1, got {max_tokens}")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    request = pb.GenerateRequest(request_id=rid, model=body.model or "", sampling=body.sampling(max_tokens, logprobs))
    _add_messages(request, body.messages)
    request.messages.tools_json, tools = body.tool_calling()
    if tools is not None and (forced := tools.constraint()) is not None:
        if request.sampling.HasField("structured_output"):
            raise BadRequest("tool_choice", "tool_choice: a forced call cannot be combined with a structured output")
        request.sampling.structured_output.CopyFrom(forced)
    _cascade_fields(request, body)
    n, _ = _choices(body, None)
    aliases = {**body.structured_output()[1], "max_tokens": max_name, "logprobs": "top_logprobs", "prompt": "messages",
               "text": "messages", "token_ids": "messages", "prompt_token_ids": "messages"}
    return Call("chat", _samples([request], n, body.seed), body.stream, _include_usage(body),
                _continuous_usage(body), aliases, rid, n=n, best_of=n, logprobs=logprobs, timeout=body.timeout,
                tools=tools)


def _add_messages(request: pb.GenerateRequest, messages: Iterable[ChatMessage]) -> None:
    for m in messages:
        # "developer" is OpenAI's newer name for the system turn; chat templates know only "system".
        msg = request.messages.messages.add(role="system" if m.role == "developer" else m.role, content=m.content,
                                            tool_call_id=m.tool_call_id or "")
        for c in m.tool_calls or ():
            msg.tool_calls.add(id=c.id, name=c.function.name, arguments=c.function.arguments)


def _cascade_fields(request: pb.GenerateRequest, body: _Request) -> None:
    if body.cascade is False:
        request.cascade = pb.CASCADE_OFF
    if body.tier:
        request.tier = body.tier


def _include_usage(body: _Request) -> bool:
    return body.stream and body.stream_options is not None and body.stream_options.include_usage


def _continuous_usage(body: _Request) -> bool:
    return _include_usage(body) and body.stream_options.continuous_usage_stats


# --- responses ----------------------------------------------------------------------------------


def usage(u: pb.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


@dataclass(frozen=True)
class Echo:
    """What ``echo`` puts before a prompt's answers: its text and, for logprobs, its first token
    (which has no logprob; the workers send the others' as prompt_logprobs)."""

    text: str
    first_token: int | None = None


@dataclass
class Answer:
    """Builds one call's OpenAI response, or its stream chunks, from the workers' messages: one
    list (or stream) of messages per sample of the call."""

    call: Call
    model: str
    tokenizer: Any = None  # turns logprob token ids into strings; None: "token_id:<id>"
    echoes: list[Echo] | None = None  # per prompt, with echo
    _offsets: dict[int, int] = field(default_factory=dict)  # completions' text_offset, per choice
    _echoed: set[int] = field(default_factory=set)  # choices whose stream has had its echo
    _tool_deltas: dict[int, ToolDeltas] = field(default_factory=dict)  # chat streams with tools, per choice
    # Streams with continuous usage: each prompt's length (from its first message), each choice's
    # tokens so far.
    _prompt_tokens: dict[int, int] = field(default_factory=dict)
    _completion_tokens: dict[int, int] = field(default_factory=dict)

    @property
    def _chat(self) -> bool:
        return self.call.kind == "chat"

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self._chat else "text_completion"
        return {"id": self.call.id, "object": kind, "created": self.call.created, "model": self.model}

    def response(self, samples: list[list[pb.GenerateResponse]]) -> dict[str, Any]:
        choices = []
        for index, s in self.call.kept(samples):
            messages = samples[s]
            text = self._echo_text(s) + "".join(m.text for m in messages)
            choice: dict[str, Any] = {"index": index}
            finish_reason = messages[-1].finish_reason or None
            if self._chat and self.call.tools is not None:
                choice["message"], called = self.call.tools.message(text)
                finish_reason = self.call.tools.finish_reason(finish_reason, called)
            elif self._chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(index, s, messages)
            choice["finish_reason"] = finish_reason
            choices.append(choice)
        lasts = [m[-1] for m in samples]
        return {**self._head(chunk=False), "choices": choices, "usage": self.usage(lasts), **_served_by(lasts[0]),
                **_cascade(lasts[0])}

    def first_chunks(self, first: tuple[int, pb.GenerateResponse]) -> list[dict[str, Any]]:
        """Chat streams open with the assistant's role, per choice, as OpenAI's do (with continuous
        usage, the prompt's length already: ``first`` is the stream's first message)."""
        self._note_prompt(*first)
        if not self._chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(len(self.call.requests))]

    def chunk(self, index: int, msg: pb.GenerateResponse) -> dict[str, Any] | None:
        """The chunk of one worker message of choice ``index`` (streams: one sample per choice);
        None when it carries nothing to say."""
        echo = "" if index in self._echoed else self._echo_text(index)
        self._echoed.add(index)
        self._note_prompt(index, msg)
        self._completion_tokens[index] = self._completion_tokens.get(index, 0) + len(msg.token_ids)
        logprobs = self._logprobs(index, index, [msg])
        # A message with new tokens is a chunk even when their text is held back (an incomplete
        # character, a possible stop string): the client learns the stream advanced at once, as
        # vLLM's streams do, and the first chunk comes with the first token.
        if not (echo or msg.text or msg.token_ids or msg.finish_reason
                or (logprobs and (msg.logprobs or msg.prompt_logprobs))):
            return None
        choice: dict[str, Any] = {"index": index}
        finish_reason = msg.finish_reason or None
        if self._chat and self.call.tools is not None:
            deltas = self._tool_deltas.setdefault(index, self.call.tools.stream())
            choice["delta"] = deltas.delta(msg.text, last=bool(finish_reason))
            if finish_reason:
                finish_reason = self.call.tools.finish_reason(finish_reason, deltas.sent > 0)
        elif self._chat:
            choice["delta"] = {"content": msg.text} if msg.text or msg.token_ids else {}
        else:
            choice["text"] = echo + msg.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        return {**self._chunk(choice), **_served_by(msg), **_cascade(msg)}

    def usage(self, lasts: list[pb.GenerateResponse]) -> dict[str, Any]:
        """Usage over every sample: each prompt counted once, every sample's generated tokens."""
        firsts = lasts[:: self.call.best_of]
        return usage(pb.Usage(prompt_tokens=sum(m.usage.prompt_tokens for m in firsts),
                              cached_tokens=sum(m.usage.cached_tokens for m in firsts),
                              completion_tokens=sum(m.usage.completion_tokens for m in lasts)))

    def usage_chunk(self, lasts: list[pb.GenerateResponse]) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [], "usage": self.usage(lasts)}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._head(chunk=True), "choices": [choice]}
        if self.call.continuous_usage:  # vLLM's: the usage so far on every chunk
            prompt, completion = sum(self._prompt_tokens.values()), sum(self._completion_tokens.values())
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
        elif self.call.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the usage one
        return chunk

    def _note_prompt(self, index: int, msg: pb.GenerateResponse) -> None:
        if msg.prompt_tokens:  # an answer's first message says its prompt's length
            self._prompt_tokens[index // self.call.best_of] = msg.prompt_tokens

    def _echo_text(self, sample: int) -> str:
        return self.echoes[sample // self.call.best_of].text if self.echoes else ""

    # --- logprobs, in each endpoint's format ---------------------------------------------------

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def _logprobs(self, index: int, sample: int, messages: list[pb.GenerateResponse]) -> dict[str, Any] | None:
        if not self.call.wants_logprobs:
            return None
        lps = [lp for m in messages for lp in m.logprobs]
        if self._chat:
            return {"content": [self._chat_logprob(lp) for lp in lps], "refusal": None}
        tokens = [self._token(lp.token_id) for lp in lps]
        logprobs: list[float | None] = [lp.logprob for lp in lps]
        tops: list[dict[str, float] | None] = [self._top(lp) for lp in lps]
        prompt = [lp for m in messages for lp in m.prompt_logprobs]
        if self.echoes and prompt:  # echo: the prompt's tokens come first, the first without a logprob
            first = self.echoes[sample // self.call.best_of].first_token
            tokens = [self._token(first), *(self._token(lp.token_id) for lp in prompt), *tokens]
            logprobs = [None, *(lp.logprob for lp in prompt), *logprobs]
            tops = [None, *(self._top(lp) for lp in prompt), *tops]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(token)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _top(self, lp: pb.TokenLogprob) -> dict[str, float]:
        """A completions token's ``top_logprobs``: the most likely tokens and the token itself, as
        OpenAI's and vLLM's (up to logprobs + 1 entries). Reversed, so that of two ids with the same
        text the likelier one's logprob stays."""
        top = {self._token(t.token_id): t.logprob for t in reversed(lp.top)}
        top.setdefault(self._token(lp.token_id), lp.logprob)
        return top

    def _chat_logprob(self, lp: pb.TokenLogprob) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = self._token(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]}


def _served_by(msg: pb.GenerateResponse) -> dict[str, Any]:
    """Extension fields of a sample's last message, as gRPC clients get them: the worker that
    answered, why the router chose it, and the worker's own time to first token (its arrival to
    its first token: the rest of the client's is the way there and back)."""
    if not msg.finish_reason or not msg.worker_id:
        return {}
    return {"worker_id": msg.worker_id, "route_reason": msg.route_reason, "worker_ttft_s": msg.ttft_s or None}


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
