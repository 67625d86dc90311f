"""Structured output (guided decoding) through llguidance: per request a matcher, per step a mask.

    admission:  spec --grammar()--> llguidance grammar (LRU) --Grammars.matcher()--> LLMatcher (a copy
                of a cached one: no re-compile)
    each step:  constrained rows' allowed-token bitmasks, filled on the host by llguidance's executor
                (its threads, one call for the batch) -> GrammarMask -> ``apply`` on the logits' device
                (one masked_fill for every constrained row) -> sample -> matcher.consume_token

EOS is in the mask only where the answer is complete, and a matcher that can take nothing more
ends its request ("stop"). A constrained row needs its token of step N in its matcher before step
N+1's mask, so batches that sample one take the engine's plain path, never the lookahead.

Why llguidance (not xgrammar, vLLM's default, nor outlines-core): no Python dependencies at all
(xgrammar pulls triton, apache-tvm-ffi and pydantic into the worker), no ahead-of-time grammar
compilation (a matcher for a typical JSON schema is built in ~0.5 ms and its lexer grows lazily,
where outlines-core builds a whole-vocabulary index per regex, seconds for a rich schema), masks in
tens of microseconds a row, and the widest input: JSON Schema, regex, Lark grammars and GBNF (choice is a
Lark alternation), all checked with messages that point into the spec.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.torch as llg_torch
from llguidance.gbnf_to_lark import any_to_lark
import torch

from worker.engine.errors import InvalidRequestError
from worker.engine.sampling_params import StructuredOutput

log = logging.getLogger(__name__)

MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar; a choice list's strings together
MAX_CHOICES = 1024
# Compact JSON (no free whitespace between tokens): a small model left free to indent can pad an
# answer with newlines until max_tokens; the value is the same JSON either way.
JSON_OPTIONS = {"whitespace_flexible": False}
_MAX_ERROR_CHARS = 600
_LL_TOKENIZERS: dict[tuple, tuple] = {}  # (id(tokenizer), vocab, eos ids) -> (tokenizer, LLTokenizer)
_LL_LOCK = threading.Lock()


def field_name(so: StructuredOutput) -> str:
    """The request field a complaint about ``so`` names (the proto's path under sampling)."""
    return f"structured_output.{so.kind}"


@functools.lru_cache(maxsize=512)
def grammar(so: StructuredOutput) -> str:
    """``so`` as an llguidance grammar, checked (the engine's only compile step, cached by spec).
    Raises InvalidRequestError naming the field, with llguidance's message."""
    name = field_name(so)
    if len(so.spec) + sum(map(len, so.choices)) > MAX_SPEC_CHARS:
        raise InvalidRequestError(name, f"at most {MAX_SPEC_CHARS} characters")
    match so.kind:
        case "json_schema":
            try:
                schema = json.loads(so.spec)
            except ValueError as exc:
                raise InvalidRequestError(name, f"not JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(name, "a JSON Schema is an object (or true/false)")
            text = llguidance.LLMatcher.grammar_from_json_schema(so.spec, defaults=JSON_OPTIONS)
        case "json_object":
            text = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        case "regex":
            # \d and \w as JSON Schema and JavaScript read them ([0-9], [0-9A-Za-z_]), not all of Unicode
            text = f"start: /{llguidance.regex_to_lark(so.spec, 'dw')}/"
        case "choice":
            if not so.choices or len(so.choices) > MAX_CHOICES:
                raise InvalidRequestError(name, f"give 1 to {MAX_CHOICES} strings, got {len(so.choices)}")
            if not all(so.choices):
                raise InvalidRequestError(name, "the choices must be non-empty strings")
            # Lark string literals take JSON's escapes: any string is one literal, matched exactly.
            text = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choices)
        case "grammar":  # Lark, or GBNF (llama.cpp's and xgrammar's EBNF: "root ::= ..."), which becomes Lark
            try:
                text = llguidance.LLMatcher.grammar_from_lark(any_to_lark(so.spec))
            except Exception as exc:  # the GBNF converter's own errors
                raise InvalidRequestError(name, f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]) from None
        case _:
            raise InvalidRequestError("structured_output", f"unknown kind {so.kind!r}")
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise InvalidRequestError(name, error.strip()[:_MAX_ERROR_CHARS])
    return text


def llguidance_tokenizer(tokenizer, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer: the model's vocabulary size and EOS ids.

    Tokenizers converted from GGUF (contracts/tokenizers.py) decode byte-level BPE through a
    Sequence (ByteFallback, Fuse, Replace, ByteLevel) that llguidance does not see through, and it
    would then take "Ġ" for a character rather than a space: the ByteLevel decoder alone is what
    such a vocabulary means."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["padding"] = spec["truncation"] = None
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        byte_level = [d for d in decoder.get("decoders", ()) if d.get("type") == "ByteLevel"]
        if byte_level:
            spec["decoder"] = byte_level[0]
    return llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=list(eos_token_ids))


@dataclass
class GrammarMask:
    """The allowed tokens of a step's constrained rows: ``rows`` of the logits, a packed bitmask
    per row (int32 [len(rows), ceil(vocab / 32)], bit t of word t // 32 set: token t allowed)."""

    rows: list[int]
    bitmask: torch.Tensor

    def apply(self, logits: torch.Tensor) -> None:
        """Rule out the disallowed tokens of the rows, in place, on the logits' device, in one op."""
        vocab = logits.shape[-1]
        # Little-endian words: byte j of a row holds tokens 8j..8j+7, which a 256 x 8 table of 0 /
        # -inf unpacks into a bias (an add: ~8x faster on CPU than a masked_fill with a bool mask).
        packed = self.bitmask.view(torch.uint8).to(logits.device, non_blocking=True)
        table = _bias_table(logits.device, logits.dtype)
        bias = table.index_select(0, packed.flatten().int()).view(len(self.rows), -1)[:, :vocab]
        if bias.shape[1] < vocab:  # logits padded past the tokenizer's vocabulary: never those
            bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
        if len(self.rows) == logits.shape[0]:
            logits.add_(bias)
        else:
            logits.index_add_(0, torch.tensor(self.rows, device=logits.device), bias)


class Grammars:
    """One engine's structured-output state: its llguidance tokenizer and matchers compiled once
    per spec (an LRU). ``warm``: build the tokenizer (~0.4 s) in a thread now, not in the step
    loop at the first constrained request; engines of one process share it."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 128, warm: bool = False):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        # A model that names no EOS (dummy: presets) ends a constrained answer with its tokenizer's.
        fallback = getattr(tokenizer, "eos_token_id", None)
        self._eos = tuple(sorted(eos_token_ids)) or ((fallback,) if isinstance(fallback, int) else ())
        self._cache_size = cache_size
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        if warm and tokenizer is not None and self._eos:
            threading.Thread(target=self._warm, name="llguidance-tokenizer", daemon=True).start()

    def _warm(self) -> None:
        try:
            self._ll()
        except InvalidRequestError as err:  # said again to the first constrained request
            log.info("structured output unavailable for this model: %s", err)

    def _ll(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            raise InvalidRequestError("structured_output", "this model has no tokenizer")
        if not self._eos:
            raise InvalidRequestError("structured_output", "this model has no end-of-sequence token to end a "
                                                           "constrained answer with")
        key = (id(self._tokenizer), self.vocab_size, self._eos)
        with _LL_LOCK:
            if key not in _LL_TOKENIZERS:
                start = time.perf_counter()
                try:
                    ll = llguidance_tokenizer(self._tokenizer, *key[1:])
                except ValueError as err:  # e.g. a dummy model's vocabulary smaller than its tokenizer's
                    raise InvalidRequestError("structured_output", f"not available for this model: {err}") from None
                # The tokenizer is kept with it, so its id is not reused while the entry lives.
                _LL_TOKENIZERS[key] = (self._tokenizer, ll)
                log.info("structured output: llguidance tokenizer built in %.2f s", time.perf_counter() - start)
            return _LL_TOKENIZERS[key][1]

    def matcher(self, so: StructuredOutput, answer_so_far: list[int] = ()) -> llguidance.LLMatcher:
        """A fresh matcher for ``so`` (a copy of the compiled one), having consumed ``answer_so_far``
        (a continuation's tokens already sent). Raises InvalidRequestError naming the field."""
        compiled = self._compiled.get(so)
        if compiled is None:
            text = grammar(so)
            compiled = llguidance.LLMatcher(self._ll(), text, log_level=0)
            if compiled.is_error():
                raise InvalidRequestError(field_name(so), compiled.get_error().strip()[:_MAX_ERROR_CHARS])
            self._compiled[so] = compiled
            if len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(so)
        matcher = compiled.deep_copy()
        if answer_so_far and not matcher.consume_tokens(list(answer_so_far)):
            raise InvalidRequestError("seed_offset", f"the answer so far (the prompt's last {len(answer_so_far)} "
                                                     f"tokens) does not follow {field_name(so)}")
        return matcher


def grammar_mask(matchers: list[llguidance.LLMatcher | None], vocab_size: int) -> GrammarMask | None:
    """The allowed tokens of the rows that have a matcher (None when none has), filled on the host
    by llguidance's threads in one call."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = torch.empty(llg_torch.get_bitmask_shape(len(rows), vocab_size), dtype=torch.int32)
    llg_torch.fill_next_token_bitmask_par(_executor(), [(matchers[r], j) for j, r in enumerate(rows)], bitmask)
    return GrammarMask(rows, bitmask)


@functools.cache
def _bias_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: 0 where bit i of byte b is set (token allowed), -inf where it is clear."""
    bits = (torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1
    return torch.where(bits == 1, 0.0, float("-inf")).to(dtype)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()  # a thread pool (80% of the CPUs, at most 32), one per process
