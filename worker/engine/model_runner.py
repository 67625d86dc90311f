"""Turns a scheduled step into model inputs, runs the model, and samples.

It owns the KV pool: one [num_blocks, block_size, kv_heads, head_dim] tensor for K and one for V
per layer, allocated once and handed to the model with each step's attention metadata.

Under tensor parallelism every rank has a runner over its share of the heads (and of the pool);
rank 0 schedules and samples, the others follow:

    rank 0:  batch -> prepare -> StepInputs --broadcast--> execute -> logits -> sample [-> tokens]
    rank r:                      StepInputs <-------------  execute (same collectives, same order)

Every decision inside ``execute`` (graph or eager, which rows to sample) is a function of the
StepInputs alone, so all ranks issue the same collectives in the same order. Under the lookahead
a step's input ids may be tokens rank 0 sampled on the device and nobody has read
(``ahead_rows``): rank 0 broadcasts each such step's tokens on the device group once sampled
(``share_tokens``), and the followers feed them to their next step as rank 0 does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.distributed.group import get_tp
from worker.engine.config import EngineConfig
from worker.engine.outputs import TokenLogprob
from worker.engine.sampler import sample, sample_tokens, steer
from worker.engine.structured_output import GrammarMask, grammar_mask
from worker.engine.scheduler import ScheduledSeq
from worker.engine.speculative import verify
from kernels.kv_quant import KV_CACHE_DTYPES, is_quantized
from worker.models.attention import AttentionBackend, AttentionMetadata, LayerKV, forward_context
from worker.models.config import ModelConfig
from worker.models.transfer import to_device

PROMPT_LOGITS_ROWS = 256  # prompt logprobs: LM-head rows at a time
# Speculative verification replays graphs of up to this many rows (tokens); larger steps run eager.
MAX_VERIFY_GRAPH_ROWS = 128
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_storage_dtype(config: EngineConfig) -> torch.dtype:
    """What the KV pool stores: the model's dtype, or int8 / fp8 with scales (--kv-cache-dtype)."""
    if config.kv_cache_dtype == "auto":
        return DTYPES[config.dtype]
    dtype = KV_CACHE_DTYPES[config.kv_cache_dtype]
    if dtype == torch.float8_e4m3fn and config.device.startswith("cuda"):
        cap = torch.cuda.get_device_capability(torch.device(config.device))
        if cap < (8, 9):
            raise ValueError(f"kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or later (this one is "
                             f"{cap[0]}.{cap[1]}); use int8")
    return dtype


def kv_bytes_per_block(model_cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_heads: int) -> int:
    """Bytes of one KV block on one rank (``kv_heads``: this rank's share of the KV heads), the
    scales of a quantized pool included (a float32 per token and KV head, for K and for V)."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    per_token_head = model_cfg.head_dim * itemsize + (4 if is_quantized(dtype) else 0)
    return 2 * model_cfg.num_layers * block_size * kv_heads * per_token_head


def allocate_kv_pool(num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device) -> list[LayerKV]:
    """Per layer, K and V [num_blocks, block_size, kv_heads, head_dim] (and for a quantized pool
    their scales [num_blocks, kv_heads, block_size]: kernels/kv_quant.py), zeroed."""
    shape = (num_blocks, block_size, kv_heads, head_dim)

    def scales() -> tuple[torch.Tensor, torch.Tensor] | None:
        if not is_quantized(dtype):
            return None
        return tuple(torch.zeros(num_blocks, kv_heads, block_size, dtype=torch.float32, device=device)
                     for _ in range(2))

    return [LayerKV(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                    scales()) for _ in range(num_layers)]


@dataclass
class StepInputs:
    """One step as every rank needs it: plain lists, so it pickles small for the broadcast."""

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
    # Per scheduled sequence, whether its chunk is a verification (its last token and drafts): the
    # torch backend attends its rows as decodes (worker/models/attention.py). None: none is.
    verify: list[bool] | None = None


@dataclass
class PromptRows:
    rows: list[int]
    targets: list[int]
    counts: list[int]  # per scheduled sequence, in batch order
    top: int


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model: torch.nn.Module,
                 backend: AttentionBackend, num_blocks: int, max_model_len: int):
        self.config = config
        self.model = model
        self.backend = backend
        self.tp = get_tp()
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self._closed = False
        self.num_blocks = num_blocks
        self.eos_token_ids = frozenset(model_cfg.eos_token_ids)  # what min_tokens holds back
        self.vocab_size = model_cfg.vocab_size
        self.kv_dtype = kv_storage_dtype(config)
        self.kv_caches = allocate_kv_pool(model_cfg.num_layers, num_blocks, config.block_size, model.kv_heads,
                                          model_cfg.head_dim, self.kv_dtype, self.device)
        self.max_model_len = max_model_len
        self.graphs = self.verify_graphs = None
        self.capture_graphs()

    def capture_graphs(self) -> None:
        """The decode (and verification) CUDA graphs, captured anew over the kernels' current
        choices, the old ones released first (benchmarks/engine_tiles_gpu.py swaps tiles between
        captures); none off CUDA or with ``cuda_graphs`` off."""
        config, model = self.config, self.model
        if not (config.cuda_graphs and self.device.type == "cuda"):
            return
        from worker.engine.cuda_graphs import DecodeGraphs

        if self.graphs is not None or self.verify_graphs is not None:  # captured before: their memory back first
            self.graphs = self.verify_graphs = None
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.graphs = DecodeGraphs(model, self.kv_caches, self.backend, block_size=config.block_size,
                                   max_model_len=self.max_model_len, max_batch=config.max_num_seqs,
                                   num_kv_heads=model.kv_heads, device=self.device,
                                   size_step=config.cuda_graph_step)
        spec = config.speculative_config
        if spec is not None:  # verification steps replay graphs too, one row per token
            self.verify_graphs = DecodeGraphs(
                model, self.kv_caches, self.backend, block_size=config.block_size, max_model_len=self.max_model_len,
                max_batch=min(config.max_num_seqs * (spec.num_tokens + 1), MAX_VERIFY_GRAPH_ROWS),
                num_kv_heads=model.kv_heads, device=self.device, size_step=config.cuda_graph_step,
                store_first=True)

    def run(self, batch: list[ScheduledSeq], draft_probs: list[torch.Tensor | None] | None = None
            ) -> tuple[list, list[list[TokenLogprob]] | None]:
        """One forward pass (rank 0); per scheduled sequence, its sampled token (None for a partial
        prefill; with drafts, the tokens their verification emits), and when any wants them, per
        scheduled sequence the prompt logprobs this step computed. ``draft_probs``: per scheduled
        sequence its drafter's q (speculative.verify)."""
        inputs = self.prepare(batch)
        self.send(inputs)
        logits, prompt = self.execute(inputs)
        sampled = [None] * len(batch) if logits is None else self._sample(batch, logits, draft_probs)
        return sampled, prompt

    def prepare(self, batch: list[ScheduledSeq], prev_index: dict[int, int] | None = None) -> StepInputs:
        """``prev_index`` (the lookahead): id(seq) -> index of its pending token among the tokens of
        the step in flight; a sequence whose next input is that token reads it on the device."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens, block_tables, sample_rows = [], [], []
        ahead_rows: list[int] = []
        prev_rows: list[int] = []
        prompt = PromptRows([], [], [], 0)
        bs = self.block_size
        for item in batch:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            known = seq.token_ids[start : start + n - len(item.draft)]
            if len(known) < n - len(item.draft):  # its input is the token in flight: a decode row fed on the device
                assert n == 1 and prev_index is not None and id(seq) in prev_index, "input token not sampled yet"
                ahead_rows.append(len(input_ids))
                prev_rows.append(prev_index[id(seq)])
                known = [0]
            input_ids.extend(known)
            input_ids.extend(item.draft)  # speculative: verified by their logits (speculative.py)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in pos)
            query_start.append(query_start[-1] + n)
            context_lens.append(start + n)
            block_tables.append(seq.block_table)
            if item.samples:  # the last row, and with drafts the rows that verify them
                sample_rows.extend(range(query_start[-1] - 1 - len(item.draft), query_start[-1]))
            prompt.counts.append(_prompt_rows(seq, start, n, query_start[-2], prompt))
        # The scheduler puts single-token steps first; the backend batches that run as decodes.
        num_decodes = next((i for i, it in enumerate(batch) if it.num_new_tokens != 1), len(batch))
        verify = [bool(item.draft) for item in batch]
        return StepInputs(input_ids, positions, slots, query_start, context_lens, block_tables, num_decodes,
                          sample_rows, ahead_rows or None, prev_rows or None, prompt if prompt.rows else None,
                          verify=verify if any(verify) else None)

    @torch.inference_mode()
    def launch(self, inputs: StepInputs, samplers: list, prev_tokens: torch.Tensor | None = None) -> "PendingTokens":
        """Enqueue one step (no sampled row wants logprobs) and return its tokens unread, one per
        sampled row (``samplers``: their sequences, in row order): the host goes on while the
        device works. ``prev_tokens``: the step before's (on the device), feeding ``ahead_rows``."""
        return self.sample_launched(self.forward_ahead(inputs, prev_tokens), samplers, counted=0)

    @torch.inference_mode()
    def forward_ahead(self, inputs: StepInputs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """``launch``'s forward alone: the logits of the sampled rows, enqueued, not read (None when
        no row samples). A batch with structured outputs samples them later (``sample_launched``),
        once the matchers have taken the step before's tokens. Under TP rank 0 sends the step
        first, and ``sample_launched`` shares its tokens with the followers (``follow``)."""
        if self.tp.is_driver and self.tp.size > 1:
            inputs.share_tokens = bool(inputs.sample_rows)
            self.send(inputs)
        return self._forward_ahead(inputs, prev_tokens)

    def _forward_ahead(self, inputs: StepInputs, prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
        ids = None
        if inputs.ahead_rows is not None:
            n, rows, prev = len(inputs.input_ids), inputs.ahead_rows, inputs.prev_rows
            if rows == prev == list(range(n)):  # the usual decode step: nobody left the batch
                ids = prev_tokens[:n]
            else:  # non-blocking copies only: one that waited for the step in flight would undo the overlap
                ids = to_device(inputs.input_ids, self.device, torch.long)
                ids.index_copy_(0, to_device(rows, self.device, torch.long),
                                prev_tokens.index_select(0, to_device(prev, self.device, torch.long)))
        logits, _ = self.execute(inputs, ids)
        return logits

    @torch.inference_mode()
    def sample_launched(self, logits: torch.Tensor | None, samplers: list, counted: int = 1) -> "PendingTokens":
        """Enqueue the sampling of ``forward_ahead``'s logits; the tokens come back unread. (Under
        CUDA graphs the logits are the graph's output buffer: sampled before the next replay.)
        ``counted``: 1 when the sequences count the tokens drawn here as pending already (the
        engine counts them at launch), which the seeds and ``min_tokens`` must not count twice."""
        if logits is None:  # prefill chunks only: nothing samples
            return PendingTokens(torch.empty(0, dtype=torch.long, device=self.device))
        params = [s.params for s in samplers]
        try:
            steered = steer(logits, params, self._hold(samplers, counted), self._grammar(samplers))
            generators = [s.next_generator(logits.device, counted) for s in samplers]
            tokens = sample_tokens(steered, params, generators)
        except BaseException:
            # The followers wait for this step's tokens: send placeholders (the engine fails the
            # step's requests, so no later step reads them) rather than leave them waiting.
            if self.tp.size > 1:
                self.tp.broadcast_device(torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))
            raise
        if self.tp.size > 1:  # the followers' next lookahead step reads them (forward_ahead)
            self.tp.broadcast_device(tokens)
        return PendingTokens(tokens)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, list[list[TokenLogprob]] | None]:
        """The forward pass of one step on this rank: logits [len(sample_rows), vocab], or None when
        no row samples (every rank skips the LM head alike); and the prompt logprobs per scheduled
        sequence when any wants them. ``ids``: input ids already on the device."""
        n = len(inputs.context_lens)
        if self.graphs is not None and inputs.num_decodes == n and self.graphs.fits(n) and inputs.prompt is None:
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.slots, inputs.block_tables,
                                   inputs.context_lens, ids), None
        if (self.verify_graphs is not None and inputs.prompt is None and inputs.ahead_rows is None
                and self.verify_graphs.fits(len(inputs.input_ids))):
            rows = as_decode_rows(inputs)
            logits = self.verify_graphs.run(rows.input_ids, rows.positions, rows.slots, rows.block_tables,
                                            rows.context_lens)
            if inputs.sample_rows != rows.sample_rows:
                logits = logits[to_device(inputs.sample_rows, self.device, torch.long)]
            return (logits if inputs.sample_rows else None), None
        # Host-to-device copies through pinned memory (to_device): with the lookahead a step is
        # prepared while the one before runs, and a pageable copy would wait for it.
        meta = AttentionMetadata(
            slot_mapping=to_device(inputs.slots, self.device, torch.long),
            query_start=inputs.query_start,
            context_lens=inputs.context_lens,
            block_tables=inputs.block_tables,
            block_size=self.block_size,
            num_decodes=inputs.num_decodes,
            kv_caches=self.kv_caches,
            backend=self.backend,
            verify=inputs.verify,
        )
        self.backend.prepare(meta, self.device)
        meta.extra["decode_store_first"] = inputs.store_first
        if ids is None:
            ids = to_device(inputs.input_ids, self.device, torch.long)
        pos_t = to_device(inputs.positions, self.device, torch.long)
        with forward_context(meta):
            hidden = self.model(ids, pos_t)
        prompt = self._prompt_logprobs(hidden, inputs.prompt) if inputs.prompt is not None else None
        if not inputs.sample_rows:
            return None, prompt
        return self.model.compute_logits(hidden[to_device(inputs.sample_rows, self.device, torch.long)]), prompt

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt: PromptRows) -> list[list[TokenLogprob]]:
        """Each prompt row's target token logprob (and top), per scheduled sequence. The LM head
        runs on slices of rows: a 4k-token prompt's full logits in fp32 would take GBs at once."""
        rows = to_device(prompt.rows, self.device, torch.long)
        targets = to_device(prompt.targets, self.device, torch.long)
        chosen: list[float] = []
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        for s in range(0, len(prompt.rows), PROMPT_LOGITS_ROWS):
            lp = self.model.compute_logits(hidden[rows[s : s + PROMPT_LOGITS_ROWS]]).float().log_softmax(dim=-1)
            chosen += lp.gather(1, targets[s : s + PROMPT_LOGITS_ROWS].unsqueeze(1)).squeeze(1).tolist()
            if prompt.top:
                vals, ids = lp.topk(prompt.top, dim=-1)
                top_vals += vals.tolist()
                top_ids += ids.tolist()
        entries = [TokenLogprob(t, c, list(zip(top_ids[i], top_vals[i])) if prompt.top else [])
                   for i, (t, c) in enumerate(zip(prompt.targets, chosen))]
        out, at = [], 0
        for count in prompt.counts:
            out.append(entries[at : at + count])
            at += count
        return out

    def _hold(self, seqs: list, counted: int = 0) -> list[list[int] | None]:
        """Per sampled sequence, the token ids it may not sample yet: under ``min_tokens`` (its
        tokens so far, those in flight included; ``counted``: as in ``sample_launched``), EOS
        (unless ignored) and its stop ids."""
        out: list[list[int] | None] = []
        for seq in seqs:
            p = seq.params
            if p.min_tokens and seq.num_output_tokens + seq.num_pending_tokens - counted < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                out.append(sorted(ids) or None)
            else:
                out.append(None)
        return out

    def _grammar(self, seqs: list) -> GrammarMask | None:
        """The allowed tokens of the sampled sequences with a structured output (their matchers
        have taken every token so far: the engine never looks ahead past them)."""
        return grammar_mask([seq.matcher for seq in seqs], self.vocab_size)

    def send(self, inputs: StepInputs | None) -> None:
        """Rank 0: a step (None: the close) to the followers (TPGroup.broadcast_object)."""
        if self.tp.size > 1:
            self.tp.broadcast_object(inputs)

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks > 0: run the steps rank 0 sends until it sends the close (``close``); their logits
        and prompt logprobs go unread (rank 0 samples). A lookahead step's ``ahead_rows`` read the
        tokens rank 0 shared after sampling the step before (``share_tokens``)."""
        assert not self.tp.is_driver
        prev_tokens = None
        while (inputs := self.tp.broadcast_object()) is not None:
            if inputs.ahead_rows is not None:
                self._forward_ahead(inputs, prev_tokens)
            else:
                self.execute(inputs)
            if inputs.share_tokens:
                prev_tokens = self.tp.broadcast_device(
                    torch.empty(len(inputs.sample_rows), dtype=torch.long, device=self.device))

    def close(self) -> None:
        """Rank 0: release the followers (they return from ``follow``). Idempotent."""
        if self.tp.is_driver and not self._closed:
            self._closed = True
            self.send(None)

    def _sample(self, batch: list[ScheduledSeq], logits: torch.Tensor,
                draft_probs: list[torch.Tensor | None] | None = None) -> list:
        """Per scheduled sequence: None (a partial prefill), its (token, logprob), or with drafts
        the list of (token, logprob) its verification emits (speculative.py)."""
        results: list = [None] * len(batch)
        plain: list[int] = []  # indices into batch
        spec: list[int] = []
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        row = 0
        for i, item in enumerate(batch):
            if not item.samples:
                continue
            (spec if item.draft else plain).append(i)
            (spec_rows if item.draft else plain_rows).extend(range(row, row + len(item.draft) + 1))
            row += len(item.draft) + 1
        if plain:
            rows = logits if not spec else logits[to_device(plain_rows, self.device, torch.long)]
            seqs = [batch[i].seq for i in plain]
            tokens, logprobs = sample(rows, [s.params for s in seqs], [s.next_generator(rows.device) for s in seqs],
                                      self._hold(seqs), self._grammar(seqs))
            for i, token, logprob in zip(plain, tokens, logprobs):
                results[i] = (token, logprob)
        if spec:
            rows = logits if not plain else logits[to_device(spec_rows, self.device, torch.long)]
            q = [draft_probs[i] for i in spec] if draft_probs is not None else None
            for i, emitted in zip(spec, verify(rows, [batch[i].draft for i in spec], [batch[i].seq for i in spec], q)):
                results[i] = emitted
        return results


def as_decode_rows(inputs: StepInputs) -> StepInputs:
    """The step with every token as a decode row of its own: the row at position p attends to its
    sequence's first p + 1 tokens (what causal attention over the chunk gives it). Verification
    steps (last token + k drafts per sequence) then run as one batch of decodes -- a CUDA graph --
    instead of varlen prefill; rows of one sequence need their K/V stored before any attends
    (``decode_store_first``). Row indices are unchanged, so sample rows stay valid."""
    tables = [table for i, table in enumerate(inputs.block_tables)
              for _ in range(inputs.query_start[i + 1] - inputs.query_start[i])]
    rows = len(inputs.input_ids)
    return StepInputs(inputs.input_ids, inputs.positions, inputs.slots, list(range(rows + 1)),
                      [p + 1 for p in inputs.positions], tables, rows, list(range(rows)), store_first=True)


def _prompt_rows(seq, start: int, n: int, first_row: int, prompt: PromptRows) -> int:
    """Add the rows of this chunk (positions [start, start + n), flat rows from ``first_row``) that
    score a wanted prompt token -- position p scores token p + 1 -- and return how many."""
    if seq.params.prompt_logprobs is None:
        return 0
    lo = max(start, seq.prompt_logprobs_next - 1)
    hi = min(start + n, seq.num_prompt_tokens - 1)
    for p in range(lo, hi):
        prompt.rows.append(first_row + p - start)
        prompt.targets.append(seq.token_ids[p + 1])
    prompt.top = max(prompt.top, seq.params.prompt_logprobs)
    return max(0, hi - lo)


class PendingTokens:
    """A step's tokens on their way to the host. The copy is queued right behind the step, into
    pinned memory, with an event: reading them waits for that step only. (A plain ``.tolist()``
    would queue its copy behind whatever was launched since -- the next step -- and wait for it.)
    The copy runs on a stream of its own, so the next step, queued behind this one's sampling,
    does not also wait for the copy (~8 µs of a batch-1 step on an H200, docs/BENCHMARKS.md)."""

    def __init__(self, tokens: torch.Tensor):
        self.device = tokens  # feeds the next step's input ids without a round trip
        self._ready = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            side = _copy_out_stream(tokens.device)
            side.wait_stream(torch.cuda.current_stream(tokens.device))
            with torch.cuda.stream(side):
                self._host.copy_(tokens, non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record(side)
            tokens.record_stream(side)  # its memory is not reused before the copy has read it
        else:
            self._host = tokens

    def tolist(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


_COPY_OUT_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_out_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a device's sampled tokens go to the host on (one per device, made at first use)."""
    stream = _COPY_OUT_STREAMS.get(device)
    if stream is None:
        stream = _COPY_OUT_STREAMS[device] = torch.cuda.Stream(device)
    return stream


@torch.inference_mode()
def cuda_kv_blocks(config: EngineConfig, model_cfg: ModelConfig, model: torch.nn.Module,
                   backend: AttentionBackend, max_model_len: int, extra_bytes_per_block: int = 0) -> int:
    """KV blocks that fit in what the weights and a warm-up forward at the full token budget leave
    of ``gpu_memory_utilization`` x the GPU's memory (the way a serving engine sizes its pool)."""
    device = torch.device(config.device)
    dtype = kv_storage_dtype(config)
    bs = config.block_size
    tokens = min(config.max_num_batched_tokens, max_model_len)
    blocks = -(-tokens // bs)
    caches = allocate_kv_pool(model_cfg.num_layers, blocks, bs, model.kv_heads, model_cfg.head_dim, dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens, device=device), query_start=[0, tokens], context_lens=[tokens],
        block_tables=[list(range(blocks))], block_size=bs, num_decodes=0, kv_caches=caches, backend=backend)
    backend.prepare(meta, device)
    with forward_context(meta):
        hidden = model(torch.zeros(tokens, dtype=torch.long, device=device), torch.arange(tokens, device=device))
    rows = min(tokens, config.max_num_seqs)
    model.compute_logits(hidden[:rows]).float().log_softmax(-1)  # the sampler's largest tensors
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del caches, hidden, meta
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(device)
    margin = 512 * 2**20  # CUDA graphs, the allocator's slack
    budget = int(total * config.gpu_memory_utilization) - peak - margin
    return max(0, budget // (kv_bytes_per_block(model_cfg, bs, dtype, model.kv_heads) + extra_bytes_per_block))
