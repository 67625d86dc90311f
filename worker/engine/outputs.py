"""What the engine hands back per request: incremental updates, usage and engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    completion_tokens: int


@dataclass
class RequestOutput:
    """One incremental update of a request: the tokens produced since the last update."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    logprobs: list[TokenLogprob] | None = None  # one per new token when asked for
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    usage: Usage | None = None  # on the last update
    ttft_s: float | None = None  # on the last update: seconds from arrival to first token
    error: str | None = None  # with finish_reason "error"
    # params.prompt_logprobs: the prompt tokens' from params.prompt_logprobs_start, on the first update
    prompt_logprobs: list[TokenLogprob] | None = None

    def merged(self, later: "RequestOutput") -> "RequestOutput":
        """This update followed by ``later`` as one (a stream that lags sends what is there at once)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return RequestOutput(self.request_id, self.new_token_ids + later.new_token_ids,
                             self.text_delta + later.text_delta, logprobs, later.finished, later.finish_reason,
                             later.usage, later.ttft_s, later.error,
                             self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs)


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int  # free or evictable (cached but unreferenced)
    kv_blocks_used: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found
    block_size: int
    pending_prefill_tokens: int = 0  # known tokens not yet computed, over running and waiting requests
    # Speculative decoding since start (speculative.SpecStats): drafted tokens, accepted ones, verifications
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_verifications: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
