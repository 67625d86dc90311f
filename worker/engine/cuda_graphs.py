"""CUDA graphs for decode steps: one graph per batch size, replayed with static input buffers.

A decode step of a small batch is mostly launch overhead (hundreds of small kernels); a graph
replays them in one go. Graphs are captured for a ladder of sizes up to ``max_batch``; a step with b decodes replays the smallest graph of size >= b, its spare rows
padded (slot -1: nothing stored; context 0: a zero row). Block tables are as wide as
``max_model_len`` needs, so one graph serves every context length, and the decode kernel's split
count is fixed per size at capture (decided from that width, never from device data).

Each size is captured twice, over two sets of input buffers used in turn, so that a step's inputs
are copied in on a stream of their own while the step before still runs (it reads the other set):
in the compute stream, between two steps, run only the sampler and the ids' copy. One set of
inputs meant the copies waited behind the step before, five small copies in a row on the critical
path (~30 µs of a batch-1 step on an H200, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import numpy as np
import torch

from worker.models.attention import AttentionMetadata, forward_context


def graph_sizes(max_batch: int, step: int = 8) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every ``step`` (8 by default: above ~128 rows the
    GEMMs pay for padded rows; a larger step captures fewer graphs, each a compile and a warm-up)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(64 + step, max_batch + 1, step))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model, kv_caches, backend, *, block_size: int, max_model_len: int, max_batch: int,
                 num_kv_heads: int, device: torch.device, size_step: int = 8, store_first: bool = False):
        """``store_first``: rows may belong to one sequence (speculative verification, one row per
        token): each layer stores every row's K/V before attending (two launches, not one)."""
        from kernels import default_num_splits

        self.model = model
        self.block_size = block_size
        self.width = -(-max_model_len // block_size)
        self.sizes = graph_sizes(max_batch, size_step)
        n = max(self.sizes)
        self.inputs = [GraphInputs(n, self.width, device) for _ in range(2)]
        # Host staging in pinned memory, one per input set: one async copy per buffer per step.
        self.staging = [(torch.zeros(n, self.width, dtype=torch.int32).pin_memory(),
                         torch.zeros(3, n, dtype=torch.long).pin_memory(),  # ids, positions, slots
                         torch.zeros(2, n, dtype=torch.int32).pin_memory()) for _ in range(2)]
        self._turn = 0
        self._copy_stream = torch.cuda.Stream(device)
        self._copied = [torch.cuda.Event() for _ in range(2)]  # set k's copies done: its staging is free
        self._released = [torch.cuda.Event() for _ in range(2)]  # set k's last replay done: it may be written
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        for size in sorted(self.sizes, reverse=True):  # largest first: later ones reuse its memory
            for k, inp in enumerate(self.inputs):
                meta = AttentionMetadata(
                    slot_mapping=inp.slots[:size], query_start=list(range(size + 1)), context_lens=[0] * size,
                    block_tables=[], block_size=block_size, num_decodes=size, kv_caches=kv_caches, backend=backend,
                    extra={"decode_block_tables": inp.tables[:size], "decode_context_lens": inp.ctx_order[0, :size],
                           "decode_order": inp.ctx_order[1, :size],
                           "decode_num_splits": default_num_splits(size, num_kv_heads, self.width * block_size, device),
                           "decode_store_first": store_first},
                )
                with forward_context(meta):
                    if k == 0:
                        for _ in range(2):  # warm up (Triton compiles) outside the capture
                            model.compute_logits(model(inp.ids[:size], inp.positions[:size]))
                    torch.cuda.synchronize(device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        logits = model.compute_logits(model(inp.ids[:size], inp.positions[:size]))
                pool = graph.pool()
                self.graphs[size, k] = (graph, logits)

    def fits(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.sizes[-1]

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            context_lens: list[int], ids_device: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, vocab] of one decode step of b sequences (``ids_device``: the ids, on the device).
        The logits are the graph's output buffer: read them before the next replay."""
        b = len(ids)
        size = next(s for s in self.sizes if s >= b)
        k = self._turn
        self._turn ^= 1
        inp, staging = self.inputs[k], self.staging[k]
        # The staging's last copies (two steps ago) have run: this wait is for the host's safety,
        # and in a steady stream of steps they ran long ago.
        self._copied[k].synchronize()
        copies = stage_decode_inputs(staging, inp.buffers(), size, ids, positions, slots, tables, context_lens)
        compute = torch.cuda.current_stream(inp.ids.device)
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(self._released[k])  # the step that read this set is done
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            self._copied[k].record(self._copy_stream)
        compute.wait_event(self._copied[k])
        if ids_device is not None:
            inp.ids[:b].copy_(ids_device)
        graph, logits = self.graphs[size, k]
        graph.replay()
        self._released[k].record(compute)
        return logits[:b]


class GraphInputs:
    """One set of a graph's static inputs on the device, as wide as the largest graph: ids,
    positions, slots (-1: store nothing), block tables, and the context lengths with the order the
    decode kernel starts the sequences in (longest first, so the short ones fill the tail of the
    grid: measured, docs/BENCHMARKS.md)."""

    def __init__(self, n: int, width: int, device: torch.device):
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.ctx_order = torch.zeros(2, n, dtype=torch.int32, device=device)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.positions, self.slots, self.tables, self.ctx_order


def stage_decode_inputs(staging: tuple[torch.Tensor, torch.Tensor, torch.Tensor], buffers: tuple, size: int,
                        ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
                        context_lens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fill one set of host staging (tables [n, width], ids|positions|slots [3, n], contexts|order
    [2, n]) for a graph of ``size`` rows and return the (device buffer, host source) copies that
    move it. Every source is one contiguous block of the staging, so each is one async copy: a
    strided one goes through a pageable temporary and a scatter kernel on the device (two more
    operations a step; on an H200 their step time did not show, docs/BENCHMARKS.md). The context
    rows go whole (width n), their columns past ``size`` unread by this size's graph."""
    h_tables, h_vec, h_ctx_order = staging
    d_ids, d_positions, d_slots, d_tables, d_ctx_order = buffers
    b = len(ids)
    vec = h_vec.numpy()
    vec[0, :size] = 0
    vec[1, :size] = 0
    vec[2, :size] = -1
    vec[0, :b], vec[1, :b], vec[2, :b] = ids, positions, slots
    t = h_tables.numpy()
    t[:size] = 0
    for i, row in enumerate(tables):
        t[i, : len(row)] = row
    c = h_ctx_order.numpy()
    c[0, :size] = 0
    c[0, :b] = context_lens
    c[1, :size] = np.argsort(-c[0, :size], kind="stable")
    return [(d_ids[:size], h_vec[0, :size]), (d_positions[:size], h_vec[1, :size]),
            (d_slots[:size], h_vec[2, :size]), (d_tables[:size], h_tables[:size]), (d_ctx_order, h_ctx_order)]
