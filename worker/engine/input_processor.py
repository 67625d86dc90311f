"""A request's prompt to token ids, and the checks that refuse what can never run.

Both need only the tokenizer and a few numbers fixed at start-up, so the worker's front end runs
them at the door (in its own process) and the engine core never spends a step on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contracts.chat import render_chat, takes_tools
from worker.engine.errors import InvalidRequestError
from worker.engine.sampling_params import SamplingParams
from worker.engine.structured_output import grammar


@dataclass(frozen=True)
class InputProcessor:
    model_id: str
    tokenizer: Any  # a Hugging Face tokenizer, or None (token ids only)
    max_model_len: int
    vocab_size: int

    def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                 tools: list[dict] | None = None) -> list[int]:
        """Prompt text or chat messages (with the functions the model may call) to token ids, the
        way the router does it too (contracts/chat.py)."""
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", f"{self.model_id} has no tokenizer: send token ids")
        if messages is not None:
            if not messages:
                raise InvalidRequestError("messages", "must hold at least one message")
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not m.get("role"):
                    raise InvalidRequestError(f"messages[{i}]", "needs a role and a string content")
            if tools and not takes_tools(self.tokenizer):
                raise InvalidRequestError("tools", "this model's chat template does not take tools")
            return render_chat(self.tokenizer, messages, tools)
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse what can never run; safe from any thread (reads only configuration)."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"{n} tokens leave no room to generate within max_model_len={self.max_model_len}")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens", f"{params.max_tokens} after a prompt of {n} tokens exceeds the context length of "
                              f"{self.max_model_len} tokens: at most {self.max_model_len - n}")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError("prompt_token_ids", f"token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.logit_bias):
            raise InvalidRequestError("logit_bias", f"token ids must be in [0, {vocab})")
        if params.structured_output is not None:
            grammar(params.structured_output)  # compiles it (cached): a bad spec is refused here
