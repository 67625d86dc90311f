"""Incremental detokenization and stop strings.

Decoding token by token breaks multi-byte characters and word-joining tokenizers, so each step
decodes from the previous read point (prefix_offset..end) and emits only what grew past the part already read,
holding back an incomplete character (U+FFFD). With stop strings, the last len(longest stop) - 1
characters are held back until the request ends, so a client never sees the start of a stop
string that is then cut off.
"""

from __future__ import annotations

from worker.engine.sequence import Sequence

def update_text(seq: Sequence, tokenizer) -> bool:
    """Extend ``seq.output_text`` with its newest token; True if a stop string ended it."""
    out = seq.output_token_ids
    prefix_text = tokenizer.decode(out[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
    full_text = tokenizer.decode(out[seq.prefix_offset :], skip_special_tokens=True)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return False  # an incomplete character: wait for the next token
    new_text = full_text[len(prefix_text) :]
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(out)
    before = len(seq.output_text)
    seq.output_text += new_text
    return _cut_at_stop(seq, before)


def _cut_at_stop(seq: Sequence, before: int) -> bool:
    stops = seq.params.stop
    if not stops:
        return False
    longest = max(len(s) for s in stops)
    start = max(0, before - longest + 1)
    hits = [(seq.output_text.find(s, start), s) for s in stops]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
        return False
    index, _ = min(hits)
    seq.output_text = seq.output_text[:index]  # the stop string itself is not returned
    return True


def take_text_delta(seq: Sequence, finished: bool) -> str:
    """The text not yet handed to the client, minus a possible stop-string start when unfinished."""
    end = len(seq.output_text)
    if not finished and seq.params.stop:
        end -= max(len(s) for s in seq.params.stop) - 1
    end = max(end, seq.emitted_text_len)
    delta = seq.output_text[seq.emitted_text_len : end]
    seq.emitted_text_len = end
    return delta
