"""Hostile requests for the chaos tests: each a Probe that says what a correct server answers.

Every generator takes a seeded ``random.Random``, so a run sends the same requests in the same order.
HTTP probes carry raw bytes (so NaN, 1e309, invalid UTF-8 and 10,000 nested lists go out as written);
gRPC probes carry a GenerateRequest, or raw bytes sent with an identity serializer.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from protos import kvcascade_pb2 as pb

HTTP_400 = frozenset({400})
GRPC_INVALID = frozenset({"INVALID_ARGUMENT"})
VOCAB = 49152  # SmolLM2's, the fleet's model's
MB = 2**20


@dataclass
class Probe:
    proto: str  # "http" | "grpc"
    kind: str  # for the histogram
    expect: frozenset  # HTTP statuses, or gRPC status names ("OK": the stream finished)
    method: str = "POST"
    path: str = "/v1/completions"
    body: bytes | Callable[[], AsyncIterator[bytes]] | None = None  # a callable: sent chunked
    headers: dict[str, str] | None = None
    request: pb.GenerateRequest | bytes | None = None  # bytes: sent as they are
    valid: tuple[str, int] | None = None  # (how it is sent, prompt index): a valid request, answer checked


def _json(obj) -> bytes:
    return json.dumps(obj).encode()  # NaN and Infinity go out as the raw tokens NaN / Infinity


COMPLETION = {"prompt": "Hello", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}

# (field, a value the endpoint must refuse): wrong types, out-of-range values, unsupported features.
SHARED_WRONG = [
    ("max_tokens", "8"), ("max_tokens", 1.5), ("max_tokens", -1), ("max_tokens", True), ("max_tokens", 2**31 - 1),
    ("temperature", "hot"), ("temperature", -1), ("temperature", []), ("temperature", True),
    ("top_p", 0), ("top_p", 2), ("top_p", "x"), ("top_p", -0.5),
    ("n", 0), ("n", 129), ("n", "2"), ("n", 1.0), ("stream", "yes"), ("stream", 1),
    ("stop", 5), ("stop", [1, 2]), ("stop", [""]), ("stop", ["x" * 600]),
    ("seed", -1), ("seed", 2**64), ("seed", "7"),
    ("logit_bias", {"x": 1}), ("logit_bias", {"5": 1000}), ("logit_bias", []), ("logit_bias", {"5": "a"}),
    ("logit_bias", {"99999999": 1}), ("logit_bias", {"\u00b2": 1}), ("logit_bias", {"\u0663": 1}),
    ("logit_bias", {"9" * 5000: 1}), ("logit_bias", {"-5": 1}), ("logit_bias", {" 5": 1}),
    ("presence_penalty", 1.0), ("frequency_penalty", -2.0),
    ("stream_options", "x"), ("stream_options", {"include_usage": "yes"}),
    ("min_tokens", -1), ("min_tokens", 100), ("top_k", -2), ("top_k", 2**31),
    ("stop_token_ids", [-1]), ("stop_token_ids", "1"), ("stop_token_ids", [1.5]),
    ("model", 5), ("model", "no-such-model"), ("user", 5), ("ignore_eos", "yes"), ("cascade", "no"),
    ("tier", "fast"),
]
COMPLETION_WRONG = [
    ("prompt", 5), ("prompt", {"a": 1}), ("prompt", [1.5]), ("prompt", [True]), ("prompt", []), ("prompt", None),
    ("prompt", [[]]), ("prompt", ["a", 5]), ("logprobs", 21), ("logprobs", -1), ("suffix", "x"), ("best_of", 0),
    ("echo", "yes"),
]
CHAT_WRONG = [
    ("messages", "hi"), ("messages", []), ("messages", [{"role": "user"}]), ("messages", [{"role": 5, "content": "x"}]),
    ("messages", [{"role": "wizard", "content": "x"}]), ("messages", [{"role": "", "content": "x"}]),
    ("messages", [None]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    ("messages", [{"role": "user", "content": 5}]), ("top_logprobs", 21), ("logprobs", "yes"),
    ("max_completion_tokens", -3), ("max_completion_tokens", "4"),
]
JUNK_KEYS = ["a", "zz", "\u00e9t\u00e9", "__proto__", "constructor", "$where", "0", "", " ", "prompt ", "Messages"]
ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


def _junk_string(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abc \u00e9\u4e2d\U0001f600\"\\\n\t{}[]") for _ in range(n))


def _random_json(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.4:
        return rng.choice([None, True, False, rng.randint(-10**6, 10**6), rng.random() * 1e6, _junk_string(rng, 8)])
    if r < 0.7:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(JUNK_KEYS) + str(rng.randint(0, 9)): _random_json(rng, depth + 1)
            for _ in range(rng.randint(0, 4))}


def _with(base: dict, **fields) -> dict:
    return {**base, **fields}


# --- HTTP ----------------------------------------------------------------------------------------


def http_hostile(rng: random.Random, huge: str) -> Probe:
    """One hostile HTTP request, its kind drawn by weight. ``huge``: a string of a few MB, shared."""
    kind = rng.choices(list(_HTTP_KINDS), weights=[w for w, _ in _HTTP_KINDS.values()])[0]
    return _HTTP_KINDS[kind][1](rng, huge)


def _random_shape(rng, huge):
    value = _random_json(rng)
    return Probe("http", "random_shape", HTTP_400, path=rng.choice(ENDPOINTS), body=_json(value))


def _wrong_type(rng, huge):
    if rng.random() < 0.5:
        field, value = rng.choice(SHARED_WRONG + COMPLETION_WRONG)
        return Probe("http", "wrong_type", HTTP_400, body=_json(_with(COMPLETION, **{field: value})))
    field, value = rng.choice(SHARED_WRONG + CHAT_WRONG)
    return Probe("http", "wrong_type", HTTP_400, path="/v1/chat/completions", body=_json(_with(CHAT, **{field: value})))


def _nan_inf(rng, huge):
    token = rng.choice(["NaN", "Infinity", "-Infinity"])
    field = rng.choice(["temperature", "top_p", "max_tokens", "n", "seed", "top_k"])
    if rng.random() < 0.2:
        return Probe("http", "nan_inf", HTTP_400, body=f'{{"prompt":"Hello","logit_bias":{{"5":{token}}}}}'.encode())
    if rng.random() < 0.1:
        return Probe("http", "nan_inf", HTTP_400, body=token.encode())
    return Probe("http", "nan_inf", HTTP_400, body=f'{{"prompt":"Hello","max_tokens":4,"{field}":{token}}}'.encode())


def _huge_number(rng, huge):
    raw = rng.choice(['"temperature":1e309', '"top_p":1e309', '"temperature":1e308', '"max_tokens":1' + "0" * 40,
                      '"n":1' + "0" * 40, '"seed":1' + "0" * 40, '"top_k":1' + "0" * 40, '"min_tokens":-1' + "0" * 40,
                      '"stop_token_ids":[1' + "0" * 40 + "]", '"logit_bias":{"1":1e309}',
                      '"logit_bias":{"1' + "0" * 40 + '":1}', '"max_tokens":' + "9" * 5000])
    body = ('{"prompt":[1' + "0" * 40 + ']}' if rng.random() < 0.1 else '{"prompt":"Hello",' + raw + "}").encode()
    return Probe("http", "huge_number", HTTP_400, body=body)


def _huge_string(rng, huge):
    """A few MB in one field: refused by name or type before anything else; now and then as the
    prompt itself, refused once tokenized (about a million tokens, more than the context)."""
    if rng.random() < 0.08:
        return Probe("http", "huge_string", HTTP_400, body=_json(_with(COMPLETION, prompt=huge[:MB])))
    field, value = rng.choice([("model", huge), ("stop", [huge]), ("tier", huge), ("top_p", huge),
                               ("messages", [{"role": huge, "content": huge}]), ("stop", [huge[:600]] * 8)])
    base, path = (CHAT, "/v1/chat/completions") if field == "messages" else (COMPLETION, "/v1/completions")
    return Probe("http", "huge_string", HTTP_400, path=path, body=_json(_with(base, **{field: value})))


def _deep_nesting(rng, huge):
    depth = 10_000
    body = rng.choice([b"[" * depth + b"]" * depth,
                       b'{"prompt":' + b"[" * depth + b"]" * depth + b"}",
                       b'{"a":' * depth + b"1" + b"}" * depth,
                       b'{"messages":[{"role":"user","content":' + b"[" * depth + b"]" * depth + b"}]}"])
    return Probe("http", "deep_nesting", HTTP_400, path=rng.choice(ENDPOINTS[:2]), body=body)


def _invalid_utf8(rng, huge):
    bad = rng.choice([b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80\x80", b"\xf8\x88\x80\x80\x80"])
    if rng.random() < 0.3:  # valid UTF-8, but an escape that names no character
        return Probe("http", "invalid_utf8", HTTP_400, body=b'{"prompt":"Hel\\ud800lo","max_tokens":4}')
    body = b'{"prompt":"Hel' + bad + b'lo","max_tokens":4}'
    if rng.random() < 0.5:
        body = b'{"messages":[{"role":"user","content":"' + bad + b'"}]}'
        return Probe("http", "invalid_utf8", HTTP_400, path="/v1/chat/completions", body=body)
    return Probe("http", "invalid_utf8", HTTP_400, body=body)


def _unknown_fields(rng, huge):
    """Unknown fields are ignored (as OpenAI-compatible servers do); with a bad value beside them, refused."""
    junk = {f"x_{i}_{rng.choice(JUNK_KEYS)}": _random_json(rng) for i in range(rng.choice([1, 10, 1000]))}
    return Probe("http", "unknown_fields", HTTP_400, body=_json({**COMPLETION, **junk, "max_tokens": -4}))


def _many_stops(rng, huge):
    if rng.random() < 0.3:
        ids = list(range(rng.randint(1025, 5000)))
        return Probe("http", "many_stops", HTTP_400, body=_json(_with(COMPLETION, stop_token_ids=ids)))
    stops = [f"s{i}" for i in range(rng.randint(65, 5000))]
    return Probe("http", "many_stops", HTTP_400, body=_json(_with(COMPLETION, stop=stops)))


def _token_ids(rng, huge):
    prompt = rng.choice([[-1], [10**12], [VOCAB], [2**31 - 1], [1, 2, -5], [[1, 2], [-1]], [5, VOCAB + 7]])
    if rng.random() < 0.2:
        return Probe("http", "token_ids", HTTP_400, path="/detokenize", body=_json({"tokens": prompt}))
    return Probe("http", "token_ids", HTTP_400, body=_json(_with(COMPLETION, prompt=prompt)))


def _content_type(rng, huge):
    body, ctype = rng.choice([(b"prompt=Hello&max_tokens=4", "application/x-www-form-urlencoded"),
                              (b"--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nHi\r\n--b--\r\n",
                               "multipart/form-data; boundary=b"),
                              (b"<prompt>Hello</prompt>", "application/xml"),
                              (b"\x00\x01\x02\x03", "application/octet-stream"),
                              (b'{"prompt":"Hello","max_tokens":-4}', "text/plain")])
    return Probe("http", "content_type", HTTP_400, path=rng.choice(ENDPOINTS[:2]), body=body,
                 headers={"content-type": ctype})


def _empty(rng, huge):
    body = rng.choice([b"", b"null", b"{}", b"[]", b'""', b"0", b" ", b"\n\n"])
    return Probe("http", "empty", HTTP_400, path=rng.choice(ENDPOINTS), body=body)


def _wrong_method(rng, huge):
    if rng.random() < 0.15:
        return Probe("http", "wrong_method", frozenset({404}), method=rng.choice(["GET", "POST"]),
                     path=rng.choice(["/v1/nope", "/v2/completions", "/v1/completions/x", "/%00", "/..%2f..%2fetc"]))
    if rng.random() < 0.15:
        return Probe("http", "wrong_method", frozenset({405}), path=rng.choice(["/v1/models", "/healthz", "/readyz"]),
                     body=_json(COMPLETION))
    return Probe("http", "wrong_method", frozenset({405}), method=rng.choice(["GET", "PUT", "DELETE", "PATCH"]),
                 path=rng.choice(ENDPOINTS))


def _context_and_stream(rng, huge):
    body = rng.choice([_with(COMPLETION, max_tokens=2**31 - 1), _with(COMPLETION, stream=True, temperature=-1),
                       _with(COMPLETION, stream=True, stop=[f"s{i}" for i in range(100)]),
                       _with(COMPLETION, n=2, best_of=1), _with(COMPLETION, logprobs=5, echo="x")])
    return Probe("http", "context_stream", HTTP_400, body=_json(body))


_HTTP_KINDS: dict[str, tuple[float, Callable[[random.Random, str], Probe]]] = {
    "random_shape": (12, _random_shape), "wrong_type": (25, _wrong_type), "nan_inf": (8, _nan_inf),
    "huge_number": (8, _huge_number), "huge_string": (0.5, _huge_string), "deep_nesting": (3, _deep_nesting),
    "invalid_utf8": (6, _invalid_utf8), "unknown_fields": (4, _unknown_fields), "many_stops": (5, _many_stops),
    "token_ids": (6, _token_ids), "content_type": (5, _content_type), "empty": (5, _empty),
    "wrong_method": (6, _wrong_method), "context_stream": (4, _context_and_stream),
}


def big_bodies() -> list[Probe]:
    """50 MB bodies, refused (413) before they are read whole: two with a Content-Length, one chunked."""
    body = b'{"prompt":"' + b"x" * (50 * MB) + b'"}'

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(50):
            yield b"y" * MB

    return [Probe("http", "big_body", frozenset({413}), body=body),
            Probe("http", "big_body", frozenset({413}), path="/v1/chat/completions", body=body),
            Probe("http", "big_body", frozenset({413}), path="/tokenize", body=chunks)]


# --- gRPC ----------------------------------------------------------------------------------------

SAMPLING_WRONG = [
    dict(temperature=float("nan")), dict(temperature=-1.0), dict(temperature=float("inf")), dict(top_p=0.0),
    dict(top_p=2.0), dict(top_p=float("nan")), dict(max_tokens=-5), dict(max_tokens=-(2**31)),
    dict(max_tokens=2**31 - 1), dict(top_k=-1), dict(logprobs=21), dict(logprobs=-1), dict(prompt_logprobs=21),
    dict(max_tokens=4, min_tokens=10), dict(min_tokens=-3), dict(logit_bias={3: float("nan")}),
    dict(logit_bias={10**9: 1.0}), dict(logit_bias={-5: 1.0}), dict(logit_bias={3: 1000.0}),
    dict(prompt_logprobs=1, prompt_logprobs_start=-4), dict(stop=[""]), dict(stop=["x" * 600]),
    dict(stop_token_ids=[-1]),
]


def _text(sampling: dict | None = None, prompt: str = "Hello") -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(**{"max_tokens": 4, **(sampling or {})}))


def grpc_hostile(rng: random.Random, garbage: list[bytes]) -> Probe:
    r = rng.random()
    if r < 0.35:
        return Probe("grpc", "grpc_sampling", GRPC_INVALID, request=_text(rng.choice(SAMPLING_WRONG)))
    if r < 0.5:
        ids = rng.choice([[-1], [2**31 - 1], [VOCAB], [1, 2, -7], [5, VOCAB + 1], [-(2**31)]])
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=4))
        return Probe("grpc", "grpc_token_ids", GRPC_INVALID, request=req)
    if r < 0.6:
        sampling = rng.choice([dict(stop=[f"s{i}" for i in range(rng.randint(65, 5000))]),
                               dict(stop_token_ids=list(range(rng.randint(1025, 5000))))])
        return Probe("grpc", "grpc_many_stops", GRPC_INVALID, request=_text(sampling))
    if r < 0.9:
        req = rng.choice([pb.GenerateRequest(), pb.GenerateRequest(text=""),
                          pb.GenerateRequest(token_ids=pb.TokenIds()),
                          pb.GenerateRequest(messages=pb.ChatMessages()),
                          pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="", content="x")])),
                          pb.GenerateRequest(text="Hello", model="no-such-model"),
                          pb.GenerateRequest(text="Hello", tier="fast")])
        return Probe("grpc", "grpc_empty_or_unknown", GRPC_INVALID, request=req)
    # Raw bytes: a GenerateRequest's wire format broken (DecodeError), or decoding to one without a prompt.
    return Probe("grpc", "grpc_garbage", GRPC_INVALID, request=rng.choice(garbage))


def garbage_messages(rng: random.Random, count: int = 200) -> list[bytes]:
    """Random byte strings that are not a servable request: either they do not decode as a
    GenerateRequest, or what they decode to has no prompt (so nothing is generated)."""
    out = []
    while len(out) < count:
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(1, 256)))
        try:
            servable = pb.GenerateRequest.FromString(raw).WhichOneof("prompt") is not None
        except DecodeError:
            servable = False
        if not servable:
            out.append(raw)
    return out


def large_prompts(huge: str) -> list[Probe]:
    """Prompts past gRPC's default 4 MiB message but under the fronts' 16 MiB (--max-body-mb): a worker
    judges them (longer than the context: refused by name); past 16 MiB over gRPC, gRPC refuses it."""
    ids = [30000] * 1_400_000  # 4.2 MB as a proto, 8.4 MB as JSON
    grpc_ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=2))
    return [Probe("http", "large_prompt", HTTP_400, body=_json(_with(COMPLETION, prompt=ids))),
            Probe("grpc", "large_prompt", GRPC_INVALID, request=grpc_ids),
            Probe("http", "large_prompt", HTTP_400, body=_json(_with(COMPLETION, prompt=huge[:MB]))),
            Probe("grpc", "large_prompt", GRPC_INVALID, request=_text(prompt=huge[:MB])),
            Probe("grpc", "grpc_oversized", frozenset({"RESOURCE_EXHAUSTED"}), request=_text(prompt="x" * (17 * MB)))]


# --- the whole stream ----------------------------------------------------------------------------


def probes(rng: random.Random, prompts: int, count: int | None, grpc_share: float = 0.4,
           valid_share: float = 0.08) -> Iterator[Probe]:
    """``count`` probes (None: without end): hostile ones over HTTP and gRPC, valid ones
    (``valid_share``) interleaved, and the 50 MB bodies and oversized messages early on."""
    huge = _junk_string(rng, 64) * (2 * MB // 64)  # 2M characters, ~5 MB as JSON
    garbage = garbage_messages(rng)
    special = big_bodies() + large_prompts(huge)  # early: the memory they take is in the warm-up
    positions = {10 + 97 * i: p for i, p in enumerate(special)}
    i = 0
    while count is None or i < count:
        if i in positions:
            yield positions[i]
        elif rng.random() < valid_share:
            via = rng.choice(["http", "http_stream", "grpc"])
            yield Probe("grpc" if via == "grpc" else "http", "valid", frozenset({"OK", 200}),
                        valid=(via, rng.randrange(prompts)))
        elif rng.random() < grpc_share:
            yield grpc_hostile(rng, garbage)
        else:
            yield http_hostile(rng, huge)
        i += 1
