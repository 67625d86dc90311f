"""One engine step as every tensor-parallel rank needs it: plain lists, which pickle small and
fast for the step broadcast (TPGroup.broadcast_object; a fixed-layout int32 form of the same
lists measured 2-4x slower to build on the host than pickling them: docs/BENCHMARKS.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PromptRows:
    rows: list[int]
    targets: list[int]
    counts: list[int]  # per scheduled sequence, in batch order
    top: int


@dataclass
class StepInputs:
    """One step's model inputs: plain lists (prepared on the host, broadcast under TP)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # flat pool slot of each new token
    query_start: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    sample_rows: list[int]  # rows of the flat batch whose logits are sampled
    # The lookahead: rows of this step whose input id is a token the step before sampled and
    # nobody has read (``ahead_rows``), and that token's index among the step before's tokens.
    ahead_rows: list[int] | None = None
    prev_rows: list[int] | None = None
    # Prompt logprobs (params.prompt_logprobs): the rows scoring a prompt token, that token, how
    # many rows each scheduled sequence has, and the most alternatives any of them wants.
    prompt: PromptRows | None = None
    # Decode rows of one sequence share the step (as_decode_rows): K/V stored before attention.
    store_first: bool = False
    # Under TP with the lookahead: rank 0 broadcasts this step's sampled tokens on the device
    # group after sampling them, so followers can feed the next step's ``ahead_rows``.
    share_tokens: bool = False
