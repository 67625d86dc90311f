"""Turns a scheduled step into model inputs, runs the model, and samples.

It owns the KV pool: one [num_blocks, block_size, kv_heads, head_dim] tensor for K and one for V
per layer, allocated once and handed to the model with each step's attention metadata.
"""

from __future__ import annotations

import torch

from worker.engine.config import EngineConfig
from worker.engine.outputs import TokenLogprob
from worker.engine.sampler import sample
from worker.engine.scheduler import ScheduledSeq
from worker.models.attention import AttentionBackend, AttentionMetadata, forward_context
from worker.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_bytes_per_block(model_cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return 2 * model_cfg.num_layers * block_size * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model: torch.nn.Module,
                 backend: AttentionBackend, num_blocks: int):
        self.config = config
        self.model = model
        self.backend = backend
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        dtype = DTYPES[config.dtype]
        shape = (num_blocks, config.block_size, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(model_cfg.num_layers)
        ]

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> list[tuple[int, TokenLogprob | None] | None]:
        """One forward pass; per scheduled sequence, its sampled token (None for a partial prefill)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens, block_tables, sample_rows = [], [], []
        bs = self.block_size
        for item in batch:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in pos)
            query_start.append(query_start[-1] + n)
            context_lens.append(start + n)
            block_tables.append(seq.block_table)
            if item.samples:
                sample_rows.append(query_start[-1] - 1)
        # The scheduler puts single-token steps first; the backend batches that run as decodes.
        num_decodes = next((i for i, it in enumerate(batch) if it.num_new_tokens != 1), len(batch))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            query_start=query_start,
            context_lens=context_lens,
            block_tables=block_tables,
            block_size=bs,
            num_decodes=num_decodes,
            kv_caches=self.kv_caches,
        )
        self.backend.prepare(meta, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        with forward_context(meta):
            hidden = self.model(ids, pos_t)
        results: list[tuple[int, TokenLogprob | None] | None] = [None] * len(batch)
        if not sample_rows:
            return results
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        samplers = [item for item in batch if item.samples]
        tokens, logprobs = sample(logits, [s.seq.params for s in samplers], [s.seq.generator for s in samplers])
        it = iter(zip(tokens, logprobs))
        for i, item in enumerate(batch):
            if item.samples:
                results[i] = next(it)
        return results
