"""Tensor parallelism on CPU (gloo): the split arithmetic, and `kvcascade worker --tp N` processes
giving the same greedy tokens as the one-process engine (and as transformers)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from deploy.local import WorkerProcess
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc
from worker.distributed.partition import check_tp, head_shard, split_evenly, vocab_shard
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

from tests.conftest import MAX_NEW

# --- the split ------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,kv,tp", [(32, 8, 1), (32, 8, 2), (32, 8, 8), (9, 3, 2), (9, 3, 3), (14, 2, 2),
                                         (14, 2, 4), (12, 2, 4), (4, 2, 4), (8, 1, 4)])
def test_every_head_lands_on_a_rank_with_its_kv_head(heads, kv, tp):
    group = heads // kv
    owner: dict[int, int] = {}
    for rank in range(tp):
        s = head_shard(heads, kv, tp, rank)
        assert s.q_count >= 1 and s.kv_count >= 1
        for q in range(s.q_start, s.q_start + s.q_count):
            assert q not in owner, f"query head {q} on two ranks"
            owner[q] = rank
            # the KV head this query head reads is on the same rank
            assert s.kv_start <= q // group < s.kv_start + s.kv_count
    assert sorted(owner) == list(range(heads))


def test_uneven_heads_give_the_first_ranks_one_more():
    assert [head_shard(9, 3, 2, r) for r in (0, 1)] == [
        head_shard(9, 3, 2, 0).__class__(0, 6, 0, 2), head_shard(9, 3, 2, 0).__class__(6, 3, 2, 1)]
    assert [split_evenly(10, 4, i) for i in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]


def test_vocab_slices_are_equal_and_cover_the_vocabulary():
    rows = []
    for rank in range(3):
        start, count, padded = vocab_shard(49153, 3, rank)
        assert padded == 16385 and count <= padded
        rows += range(start, start + count)
    assert rows == list(range(49153))


@pytest.mark.parametrize("heads,kv,inter,tp,message", [
    (9, 3, 1536, 4, "must divide evenly over the 3 KV heads"),
    (4, 1, 128, 8, "exceeds the 4 query heads"),
    (4, 2, 128, 0, "must be >= 1"),
])
def test_impossible_splits_say_why(heads, kv, inter, tp, message):
    with pytest.raises(ValueError, match=message):
        check_tp(heads, kv, inter, tp)


def test_a_tp_config_without_its_ranks_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 but this process is rank 0 of 1"):
        LLMEngine(EngineConfig(model="dummy:tiny", tensor_parallel_size=2))


# --- TP workers against the one-process engine ----------------------------------------------------


def _greedy(address: str, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    """All prompts at once (so the TP worker batches them), greedy, EOS ignored."""
    def one(ids):
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        req.token_ids.ids[:] = ids
        with grpc.insecure_channel(address) as ch:
            out = []
            for msg in pb_grpc.KVCascadeStub(ch).Generate(req, timeout=300):
                out += msg.token_ids
            return out

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


@pytest.fixture
def tp_worker(request):
    """`kvcascade worker --tp N ...` as a process (its ranks its children), stopped after the test."""
    procs = []

    def start(*args: str) -> WorkerProcess:
        w = WorkerProcess(f"tp-{len(procs)}", None, *args).start(timeout=300)
        procs.append(w)
        return w

    yield start
    for w in procs:
        w.stop()


@pytest.mark.slow
def test_tp2_smollm2_matches_tp1_and_transformers(tp_worker, smollm2, prompt_ids, hf_reference):
    # 9 query / 3 KV heads over 2 ranks: an uneven split (6+3 / 2+1), vocab and MLP halves.
    worker = tp_worker("--tp", "2", "--quantization", "none")  # the GGUF dequantized, as transformers reads it
    assert worker.stats().model == "smollm2-135m"
    tp1 = LLMEngine(EngineConfig(model="smollm2-135m", quantization="none"), tokenizer=smollm2.tokenizer,
                    model=smollm2.model)
    expected = tp1.generate(prompt_ids, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert expected == hf_reference
    assert _greedy(worker.address, prompt_ids) == expected
    # The second round hits the prefix cache of the TP worker: its blocks hold every rank's heads.
    assert _greedy(worker.address, prompt_ids[:3]) == expected[:3]
    assert worker.stats().prefix_hits > 0


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_dummy_model_tp_matches_tp1_with_replicated_kv_heads(tp_worker, tp):
    # dummy:tiny has 4 query / 2 KV heads: at tp=4 each KV head lives on two ranks. Random weights
    # come from a seed per tensor, so every rank count builds the same model.
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(6)]
    tp1 = LLMEngine(EngineConfig(model="dummy:tiny"))
    expected = tp1.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    worker = tp_worker("--model", "dummy:tiny", "--tp", str(tp), "--max-num-batched-tokens", "32")
    assert _greedy(worker.address, prompts, max_tokens=24) == expected
    # A stop leaves every rank's group together: the worker and all its ranks are gone in seconds.
    ranks = _children(worker.proc.pid, "worker.distributed.ranks")
    assert len(ranks) == tp - 1
    t0 = time.monotonic()
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(20) == 0 and time.monotonic() - t0 < 15
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)


@pytest.mark.slow
def test_a_dead_rank_ends_requests_and_the_worker(tp_worker):
    """SIGKILL rank 1 mid-stream: no request hangs, and rank 0 exits so that it is restarted whole."""
    worker = tp_worker("--model", "dummy:tiny", "--tp", "2")
    rank1 = _children(worker.proc.pid, "worker.distributed.ranks")
    assert len(rank1) == 1 and len(_children(worker.proc.pid, "worker.core.process")) == 1
    # First, a hung rank could say where it is: SIGUSR1 prints its stacks and it runs on.
    os.kill(rank1[0], signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while "in follow" not in Path(worker.log.name).read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "in follow" in Path(worker.log.name).read_text()  # its main thread, waiting for a step
    assert _greedy(worker.address, [[1, 2, 3]], max_tokens=4)[0] and worker.proc.poll() is None

    def long(i):
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=900, temperature=0, ignore_eos=True))
        req.token_ids.ids[:] = [i + 1] * 8
        with grpc.insecure_channel(worker.address) as ch:
            try:
                return sum(len(m.token_ids) for m in pb_grpc.KVCascadeStub(ch).Generate(req, timeout=60))
            except grpc.RpcError as err:
                return err.code()

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(long, i) for i in range(4)]
        time.sleep(1.0)
        os.kill(rank1[0], signal.SIGKILL)
        results = [f.result(timeout=30) for f in futures]  # none hangs
    assert all(r == grpc.StatusCode.UNAVAILABLE for r in results), results
    assert worker.proc.wait(15) == 70  # the watchdog's exit code


def _children(pid: int, module: str) -> list[int]:
    """The child processes of ``pid`` running ``python -m module``."""
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    if module in Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0"):
                        kids.append(int(entry))
        except (OSError, ValueError):
            continue
    return kids


# --- shard-by-shard loading -----------------------------------------------------------------------


@pytest.fixture
def as_rank():
    """Build models as rank r of n in this process (construction and loading use no collectives)."""
    from worker.distributed import group

    saved = group._group

    def set_rank(rank: int, size: int) -> None:
        group._group = group.TPGroup(rank, size)

    yield set_rank
    group._group = saved


def test_each_rank_loads_only_its_shard(as_rank):
    from worker.models.llama import LlamaForCausalLM
    from worker.models.loader import iter_weights, load_config, resolve_model

    src = resolve_model("smollm2-135m")
    cfg = load_config(src)
    full = dict(iter_weights(src))
    total = sum(t.numel() for t in full.values())
    shards = []
    for rank in (0, 1):
        as_rank(rank, 2)
        model = LlamaForCausalLM(cfg)
        model.load_weights(iter_weights(src))
        shards.append(model)
        held = sum(p.numel() for p in model.parameters())
        assert held < 0.6 * total, f"rank {rank} holds {held / total:.0%} of the model"
    hd = cfg.head_dim
    q = full["model.layers.3.self_attn.q_proj.weight"]
    k = full["model.layers.3.self_attn.k_proj.weight"]
    down = full["model.layers.3.mlp.down_proj.weight"]
    r0, r1 = (m.model.layers[3] for m in shards)
    # rank 0: query heads 0-5 and KV heads 0-1; rank 1: query heads 6-8 and KV head 2
    assert torch.equal(r0.self_attn.qkv_proj.weight[: 6 * hd], q[: 6 * hd])
    assert torch.equal(r1.self_attn.qkv_proj.weight[: 3 * hd], q[6 * hd:])
    assert torch.equal(r1.self_attn.qkv_proj.weight[3 * hd: 4 * hd], k[2 * hd:])
    assert torch.equal(r0.mlp.down_proj.weight, down[:, : cfg.intermediate_size // 2])
    assert torch.equal(r1.self_attn.o_proj.weight, full["model.layers.3.self_attn.o_proj.weight"][:, 6 * hd:])
    emb = full["model.embed_tokens.weight"]
    assert torch.equal(shards[1].model.embed_tokens.weight[: emb.shape[0] // 2], emb[emb.shape[0] // 2:])
    assert shards[1].lm_head.weight is shards[1].model.embed_tokens.weight  # tied: one slice


def test_a_checkpoint_of_another_shape_is_refused_naming_the_tensor(as_rank):
    from worker.models.config import ModelConfig, PRESETS
    from worker.models.llama import LlamaForCausalLM
    from worker.models.loader import iter_dummy_weights

    cfg = ModelConfig(**PRESETS["tiny"])
    as_rank(1, 2)
    model = LlamaForCausalLM(cfg)
    weights = dict(iter_dummy_weights(cfg, seed=0))
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3 * cfg.head_dim, cfg.hidden_size)
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight: k_proj: checkpoint has 48 rows"):
        model.load_weights(weights.items())


@pytest.mark.slow
def test_an_int8_kv_pool_under_tp_matches_tp1(tp_worker):
    """Each rank quantizes its own KV heads (a scale per token and head needs no other rank's): a
    TP=2 worker over an int8 pool gives the tokens of one process over an int8 pool."""
    prompts = [[(5 * i + 11 * j) % 500 + 1 for j in range(7 + 8 * i)] for i in range(6)]
    tp1 = LLMEngine(EngineConfig(model="dummy:tiny", kv_cache_dtype="int8"))
    expected = tp1.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    worker = tp_worker("--model", "dummy:tiny", "--tp", "2", "--kv-cache-dtype", "int8",
                       "--max-num-batched-tokens", "32")
    assert _greedy(worker.address, prompts, max_tokens=24) == expected


@pytest.mark.slow
def test_int4_weights_under_tp_match_tp1(tp_worker):
    """Each rank quantizes only its shard: with groups that the row-parallel shards split on
    (32 columns), a TP=2 worker over int4 weights gives the tokens of one int4 process."""
    prompts = [[(3 * i + 7 * j) % 500 + 1 for j in range(6 + 7 * i)] for i in range(6)]
    tp1 = LLMEngine(EngineConfig(model="dummy:tiny", quantization="int4", quantization_group_size=32))
    expected = tp1.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    worker = tp_worker("--model", "dummy:tiny", "--tp", "2", "--quantization", "int4",
                       "--quantization-group-size", "32", "--max-num-batched-tokens", "32")
    assert _greedy(worker.address, prompts, max_tokens=24) == expected


# --- the step broadcast, the lookahead and the teardown -----------------------------------------


_ECHO_RANK = """
import sys, zlib, pickle, torch, torch.distributed as dist
from worker.distributed.group import init_tp, leave_tp
tp = init_tp(1, 2, sys.argv[1], "cpu")
for _ in range(int(sys.argv[2])):
    got = tp.broadcast_object()
    dist.broadcast(torch.tensor([zlib.crc32(pickle.dumps(got))]), src=1, group=tp.cpu_group)
leave_tp()
"""


@pytest.mark.slow
def test_the_step_broadcast_carries_small_and_large_steps_whole():
    """Rank 0's objects reach the follower whole, in one fixed-size broadcast or, past its first
    chunk, two (a long prefill's step), checked by the follower's checksum of what it got."""
    import pickle
    import subprocess
    import sys
    import zlib

    import torch.distributed as dist

    from contracts.ports import free_port
    from worker.distributed.group import FIRST_CHUNK, init_tp, leave_tp
    from worker.engine.model_runner import PromptRows, StepInputs

    big = list(range(3 * FIRST_CHUNK))  # pickles past the first chunk
    objects = [StepInputs([5, 6], [10, 11], [170, 171], [0, 1, 2], [11, 12], [[10], [2]], 2, [0, 1],
                          ahead_rows=[0, 1], prev_rows=[1, 0], share_tokens=True),
               StepInputs(big, big, big, [0, len(big)], [len(big)], [big[::16]], 0, [len(big) - 1],
                          prompt=PromptRows([0, 1], [2, 3], [2], 5)),
               None]
    init = f"tcp://127.0.0.1:{free_port()}"
    other = subprocess.Popen([sys.executable, "-c", _ECHO_RANK, init, str(len(objects))],
                             cwd=Path(__file__).resolve().parents[2])
    try:
        tp = init_tp(0, 2, init, "cpu", timeout_s=60)
        for obj in objects:
            assert tp.broadcast_object(obj) is obj
            crc = torch.zeros(1, dtype=torch.int64)
            dist.broadcast(crc, src=1, group=tp.cpu_group)
            assert int(crc) == zlib.crc32(pickle.dumps(obj))
        assert leave_tp(timeout_s=10)
        assert other.wait(10) == 0
    finally:
        other.kill()
        other.wait()


@pytest.fixture
def in_process_tp():
    """Rank 0 in this process (as benchmarks/tp_gpu.py runs it), the other ranks its children."""
    from worker.distributed.ranks import LocalRanks

    started = []

    def start(config: EngineConfig) -> tuple[LLMEngine, LocalRanks]:
        ranks = LocalRanks(config)
        engine = LLMEngine(ranks.start())
        started.append((engine, ranks))
        return engine, ranks

    yield start
    for engine, ranks in started:
        engine.close()
        ranks.stop()


@pytest.mark.slow
def test_the_lookahead_under_tp_matches_tp1_and_every_rank_leaves_together(in_process_tp):
    """With the lookahead (async scheduling) rank 0 samples on the device and never reads a step
    before launching the next: the followers take its sampled tokens over the device group. The
    tokens are TP=1's, greedy and seeded, with requests leaving the batch at different steps (the
    lookahead's rows then differ from the step before's); after the close every rank exits at
    once, cleanly."""
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=6 + 4 * i, temperature=0, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=30 - 3 * i, temperature=0.8, seed=i, ignore_eos=True) for i in range(6)]
    common = dict(model="dummy:tiny", max_num_batched_tokens=32, async_scheduling=True)
    tp1 = LLMEngine(EngineConfig(**common))
    expected = tp1.generate(prompts, params)
    engine, ranks = in_process_tp(EngineConfig(**common, tensor_parallel_size=2))
    launched = []
    forward_ahead = engine.runner.forward_ahead
    engine.runner.forward_ahead = lambda *a, **kw: launched.append(1) or forward_ahead(*a, **kw)
    assert engine.generate(prompts, params) == expected
    assert len(launched) > 20  # the steps went through the lookahead, not the plain path
    # A sampling that fails on rank 0 fails its step's requests; the followers, which wait for
    # that step's tokens, are released, and the next requests are served as before.
    grammar, calls = engine.runner._grammar, []

    def failing_once(seqs):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected sampling fault")
        return grammar(seqs)

    engine.runner._grammar = failing_once
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    reasons = {}
    while engine.has_unfinished():
        reasons.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
    assert "error" in reasons.values() and set(reasons) == set(ids)
    engine.runner._grammar = grammar
    assert engine.generate(prompts, params) == expected
    assert engine.block_manager.num_used_blocks == 0  # the failed requests freed theirs
    engine.close()
    t0 = time.monotonic()
    ranks.stop()
    assert time.monotonic() - t0 < 5
    assert [p.returncode for p in ranks.procs] == [0]


@pytest.mark.slow
def test_leaving_does_not_wait_for_a_rank_that_never_comes():
    """A rank that never reaches the teardown (hung, or gone) costs the others the barrier's
    timeout, not forever: leave_tp returns and the group is gone."""
    import subprocess
    import sys

    import torch.distributed as dist

    from contracts.ports import free_port
    from worker.distributed.group import get_tp, init_tp, leave_tp

    init = f"tcp://127.0.0.1:{free_port()}"
    code = ("import time, sys; from worker.distributed.group import init_tp; "
            f"init_tp(1, 2, {init!r}, 'cpu'); time.sleep(120)")
    other = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2])
    try:
        init_tp(0, 2, init, "cpu", timeout_s=60)
        t0 = time.monotonic()
        assert leave_tp(timeout_s=1.0)  # the barrier times out; the destroy itself finishes
        assert time.monotonic() - t0 < 5
        assert not dist.is_initialized() and get_tp().size == 1
    finally:
        other.kill()
        other.wait()
