"""The loader's GGUF reader (worker/models/loader.gguf_reader): gguf's reader with metadata arrays
read whole. It must read every field and tensor as gguf's own reader does, and parse the file in a
fraction of gguf's time (which made every model load parse a tokenizer's vocabulary into views of
single elements, several times)."""

from __future__ import annotations

import time

import gguf
import numpy as np

from contracts.models import resolve_model
from worker.models.loader import array_len, gguf_reader


def test_every_field_and_tensor_reads_as_ggufs_own_reader_gives_it():
    path = resolve_model("smollm2-135m").path
    started = time.perf_counter()
    ours = gguf_reader(path)
    ours_s = time.perf_counter() - started
    started = time.perf_counter()
    theirs = gguf.GGUFReader(str(path))
    theirs_s = time.perf_counter() - started

    assert list(ours.fields) == list(theirs.fields)
    strings = 0
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types[0]) == (field.offset, field.types[0]), key
        if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
            assert array_len(mine) == len(field.data) > 0, key  # stepped over, counted
            strings += 1
        else:
            assert mine.contents() == field.contents(), key
    assert strings == 3  # general.languages, the tokens and the merges
    assert array_len(ours.fields["tokenizer.ggml.token_type"]) == len(ours.fields["tokenizer.ggml.token_type"].contents())

    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for mine, t in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.data_offset, mine.n_bytes) == (t.name, t.tensor_type, t.data_offset,
                                                                                  t.n_bytes)
        assert np.array_equal(mine.shape, t.shape) and np.array_equal(mine.data[:2], t.data[:2])
    # 0.11 s against 7.3 measured on the 2-core CI machine: the vocabulary is no longer parsed
    assert ours_s < theirs_s / 5, (ours_s, theirs_s)
