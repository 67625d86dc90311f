"""Per-request sampling parameters, validated on construction of the request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from worker.engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
# Every stop string is searched for after every token of its request, on the thread that detokenizes
# every request's output: thousands of them, or long ones, would slow every stream. OpenAI takes 4.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_SEED_OFFSET = 2**32 - 1  # the proto's uint32
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """What the answer must be (structured_output.py compiles and enforces it); hashable, the
    compiled-grammar cache's key."""

    kind: str  # one of STRUCTURED_KINDS
    spec: str = ""  # json_schema: the schema's JSON text; regex; grammar: Lark text; else empty
    choices: tuple[str, ...] = ()  # kind "choice": the answers allowed


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: until the context ends (max_model_len)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # a seed makes a sampled answer reproducible
    # Index within the answer of the first token this request generates: a seeded token's draw
    # depends on (seed, its index), so a continuation of an answer (the router moving a stream,
    # prompt + tokens so far) sets the count of tokens so far and draws what the answer would have.
    seed_offset: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the answer before this many tokens
    # Added to the logits of these token ids before sampling (-100: never, 100: always); logprobs
    # stay those of the model's own distribution.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # None: no logprobs; 0: the chosen token's logprob only; N: also the N most likely tokens.
    logprobs: int | None = None
    # Logprobs of the prompt's own tokens from index prompt_logprobs_start on (the first token
    # has none): None: not wanted; 0: each token's logprob only; N: also the N most likely tokens.
    # A cascade's judge scores a draft this way. The positions before the start may come from the
    # prefix cache; those from it are computed.
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 1
    detokenize: bool = True  # False: token ids only (no text, no stop strings), saves CPU per token
    structured_output: StructuredOutput | None = None  # None: any text
    # False: this request never speculates, even where the engine drafts (--speculative)
    speculative: bool = True

    def validate(self) -> None:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.seed_offset, int) or not 0 <= self.seed_offset <= MAX_SEED_OFFSET:
            raise InvalidRequestError("seed_offset", f"must be an integer in [0, {MAX_SEED_OFFSET}], "
                                                     f"got {self.seed_offset!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("prompt_logprobs",
                                      f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not isinstance(self.prompt_logprobs_start, int) or self.prompt_logprobs_start < 0:
            raise InvalidRequestError("prompt_logprobs_start", f"must be >= 0, got {self.prompt_logprobs_start!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequestError("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"{self.min_tokens} is more than max_tokens {self.max_tokens}")
        for token, bias in self.logit_bias.items():
            if not -100 <= bias <= 100:  # (NaN fails too)
                raise InvalidRequestError("logit_bias", f"token {token}: a bias must be in [-100, 100], got {bias!r}")
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop", "stop strings need detokenize=True")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if (longest := max(map(len, self.stop), default=0)) > MAX_STOP_CHARS:
            raise InvalidRequestError("stop", f"a stop string has at most {MAX_STOP_CHARS} characters, got {longest}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids",
                                      f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "token ids must be >= 0")
        if self.structured_output is not None:
            if self.structured_output.kind not in STRUCTURED_KINDS:
                raise InvalidRequestError("structured_output", f"kind must be one of {', '.join(STRUCTURED_KINDS)}")
            if self.min_tokens:  # held-back EOS could leave a finished answer nothing to sample
                raise InvalidRequestError("min_tokens", "cannot be combined with a structured output (the grammar "
                                                        "decides where the answer ends)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
