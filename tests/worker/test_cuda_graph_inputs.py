"""The decode graphs' host side (worker/engine/cuda_graphs.py ``stage_decode_inputs``): what a
step writes into the graph's input buffers, padded rows included, and that every copy reads one
contiguous block of the staging (a strided source goes through a pageable temporary and a scatter
kernel). The graphs themselves need CUDA; the staging and the copies are plain
tensors, run here on the CPU as the engine runs them on a GPU."""

from __future__ import annotations

import torch

from worker.engine.cuda_graphs import stage_decode_inputs

N, WIDTH = 16, 6  # the largest graph's rows, block-table width


def _buffers():
    staging = (torch.zeros(N, WIDTH, dtype=torch.int32), torch.zeros(3, N, dtype=torch.long),
               torch.zeros(2, N, dtype=torch.int32))
    device = (torch.zeros(N, dtype=torch.long), torch.zeros(N, dtype=torch.long), torch.full((N, ), -1, dtype=torch.long),
              torch.zeros(N, WIDTH, dtype=torch.int32), torch.zeros(2, N, dtype=torch.int32))
    return staging, device


def _step(staging, device, size, ids, positions, slots, tables, context_lens):
    copies = stage_decode_inputs(staging, device, size, ids, positions, slots, tables, context_lens)
    for dst, src in copies:
        assert src.is_contiguous(), src.shape  # one block of the pinned staging: an async copy
        dst.copy_(src)


def test_a_step_fills_the_graph_rows_and_pads_the_rest():
    staging, (ids, positions, slots, tables, ctx) = _buffers()
    _step(staging, (ids, positions, slots, tables, ctx), 4, [11, 12, 13], [5, 9, 2], [40, 73, 18],
          [[1, 2], [3, 4, 5], [6]], [6, 10, 3])
    assert ids[:4].tolist() == [11, 12, 13, 0]
    assert positions[:4].tolist() == [5, 9, 2, 0]
    assert slots[:4].tolist() == [40, 73, 18, -1]  # the padded row stores nothing
    assert tables[:4].tolist() == [[1, 2, 0, 0, 0, 0], [3, 4, 5, 0, 0, 0], [6, 0, 0, 0, 0, 0], [0] * WIDTH]
    assert ctx[0, :4].tolist() == [6, 10, 3, 0]
    assert ctx[1, :4].tolist() == [1, 0, 2, 3]  # longest context first, ties in row order


def test_a_smaller_step_after_a_larger_one_sees_none_of_its_rows():
    staging, device = _buffers()
    ids, positions, slots, tables, ctx = device
    _step(staging, device, 8, list(range(1, 9)), list(range(8)), list(range(100, 108)),
          [[7] * WIDTH for _ in range(8)], [20 - i for i in range(8)])
    _step(staging, device, 2, [5], [3], [9], [[2]], [4])
    assert ids[:2].tolist() == [5, 0]
    assert slots[:2].tolist() == [9, -1]
    assert tables[:2].tolist() == [[2, 0, 0, 0, 0, 0], [0] * WIDTH]  # the larger step's tables are cleared
    assert ctx[0, :2].tolist() == [4, 0] and ctx[1, :2].tolist() == [0, 1]


def test_ties_keep_row_order_and_each_row_appears_once():
    staging, device = _buffers()
    lens = [3, 9, 9, 1, 9, 3, 0]
    _step(staging, device, 8, list(range(7)), [0] * 7, list(range(7)), [[1]] * 7, lens)
    order = device[4][1, :8].tolist()
    assert sorted(order) == list(range(8))
    assert order == [1, 2, 4, 0, 5, 3, 6, 7]
