"""What the worker's front end and its engine core process say to each other (msgspec MessagePack).

    front end --(Add | Abort | Control)-->  engine core     a request's inputs once, aborts batched
    front end <--(Ready | Step | Failed)--  engine core     one Step per engine step, for all requests

Structs are encoded as arrays (``array_like``), tagged so each socket carries one union. A Step
holds every request's new tokens of that step, the engine's load and its prefix-cache events; the
core never detokenizes (the front end does, and checks stop strings there).
"""

from __future__ import annotations

import msgspec

from worker.engine.outputs import EngineStats
from worker.engine.sampling_params import SamplingParams


class _Msg(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    pass


# --- front end -> core ----------------------------------------------------------------------------


class Add(_Msg):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # as the core runs it: no stop strings, no detokenization
    arrival_time: float  # time.monotonic(): one clock for every process of a host


class Abort(_Msg):
    request_ids: list[str]


class Control(_Msg):
    # "kv_events": start sending prefix-cache events; "snapshot": send "cleared" plus every cached
    # block next (superseding what came before); "shutdown": release the ranks and exit.
    kind: str


# --- core -> front end ----------------------------------------------------------------------------


class Ready(_Msg):
    model_id: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    pid: int


class CoreOutput(_Msg):
    request_id: str
    token_ids: list[int]
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # One (token id, logprob, [(top id, logprob), ...]) per token when the request asked for them.
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    # params.prompt_logprobs: the prompt tokens' entries, same shape as logprobs, once.
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


class Step(_Msg):
    outputs: list[CoreOutput]
    stats: EngineStats
    kv_events: list[tuple[str, int | None]] = []  # (kind, block hash), in order
    snapshot: bool = False  # kv_events rebuild the index from nothing: drop what was buffered


class Failed(_Msg):
    error: str  # "ValueError: ..." -- why the core cannot (or can no longer) serve


TO_CORE = Add | Abort | Control
FROM_CORE = Ready | Step | Failed
