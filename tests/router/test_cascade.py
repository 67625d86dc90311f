"""The cascade over real parts: two in-process workers on loopback (both SmolLM2, so two tiers of
the same model test the mechanics), the router with a cascade file, its gRPC and HTTP fronts.

Thresholds that are certainly met (mean_logprob >= -1e9) or certainly not (min_prob >= 1.01)
make the decision known in advance. Both tiers being the same greedy model, a leak of a thrown-away
trial would show as text longer than one answer, or as messages tagged with the wrong tier."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc
from router.cascade_config import CascadeConfigError, CascadeFile, parse_cascade
from router.prompt_router import PromptRouter
from router.stacked_confidence import StackedModel
from router.grpc_api import RouterServer
from router.http_api import create_app, http_port, serve_http, stop_http
from contracts.memory_state import MemoryPrefixIndex, MemoryRegistry
from router.router import Router
from contracts.state import WorkerInfo
from worker.engine.async_engine import AsyncEngine
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.server import WorkerServer

from .loop_thread import LoopThread

MODEL = "smollm2-135m"
SURE = {"measure": "mean_logprob", "threshold": -1e9}  # always met
UNSURE = {"measure": "min_prob", "threshold": 1.01}  # never met


def cascade_yaml(small: dict, mode: str = "full", window: int | None = None) -> str:
    lines = [f"mode: {mode}", "tiers:", "  - name: small", f"    model: {MODEL}"]
    lines += [f"    {k}: {v}" for k, v in small.items()]
    if window:
        lines.append(f"    window: {window}")
    lines += ["  - name: large", f"    model: {MODEL}"]
    return "\n".join(lines) + "\n"


def write(path: Path, text: str) -> None:
    """Replace the file as a ConfigMap update does: a new file moved into place."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- the file -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, line, key", [
    ("tiers:\n  - model: a\n    threshold: -1\n    treshold: 2\n  - model: b\n", 4, "tiers[0].treshold"),
    ("tiers:\n  - model: a\n    threshold: high\n  - model: b\n", 3, "tiers[0].threshold"),
    ("tiers:\n  - model: a\n    measure: vibes\n    threshold: 1\n  - model: b\n", 3, "tiers[0].measure"),
    ("tiers:\n  - model: a\n  - model: b\n", 2, "tiers[0].threshold"),  # missing: the tier's line
    ("tiers:\n  - model: a\n    threshold: 1\n  - model: b\n    threshold: 1\n", 5, "tiers[1].threshold"),
    ("mode: early\ntiers:\n  - model: a\n    threshold: 1\n  - model: b\n", 3, "tiers[0].window"),
    ("tiers:\n  - model: a\n    threshold: 1\n    window: 0\n  - model: b\n", 4, "tiers[0].window"),
    ("tiers:\n  - {model: a, threshold: 1}\n  - {model: a}\n", 3, "tiers[1].name"),  # used twice
    ("mode: full\nmode: early\ntiers: []\n", 2, "mode"),  # duplicate key
    ("name: c\ntiers:\n  - model: a\n    threshold: 1\n", 2, "tiers"),  # one tier is no cascade
])
def test_a_bad_file_is_refused_naming_key_and_line(text: str, line: int, key: str) -> None:
    with pytest.raises(CascadeConfigError) as err:
        parse_cascade(text, "c.yaml")
    assert (err.value.line, err.value.key) == (line, key), str(err.value)
    assert str(err.value).startswith(f"c.yaml:{line}: {key}: ")


def test_the_shipped_example_is_valid() -> None:
    from router.cascade_config import load_cascade

    for name in ("cascade.example.yaml", "cascade.stacked.yaml", "cascade.routed.yaml"):
        config = load_cascade(Path(__file__).resolve().parents[2] / "deploy" / name)
        assert [t.model for t in config.tiers] == ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    # The stacked one's confidence (fit on the same half) trusts a draft less where the 0.5B is
    # often wrong: the same sure draft scores lower answering a unit conversion than an antonym
    # (conversions never get that far: the route in front sends them on).
    stacked = load_cascade(Path(__file__).resolve().parents[2] / "deploy" / "cascade.stacked.yaml").tiers[0]
    sure = [pb.TokenLogprob(logprob=-0.05, top=[pb.TopLogprob(logprob=-0.05), pb.TopLogprob(logprob=-3.0)])] * 2
    antonym = stacked.create_measure("What is the opposite of 'north'? Reply with one word only.").score(sure)
    convert = stacked.create_measure("How many minutes are in 37 hours? Reply with the number only.").score(sure)
    assert stacked.measure == "stacked" and antonym > stacked.threshold and antonym - convert > 0.1, (antonym, convert)
    # The routed one's prompt router (trained on the calibration half of deploy/cascade_tasks.jsonl)
    # sends what the 0.5B never gets right straight to the 1.5B, and keeps the 0.5B where it does.
    route = config.tiers[0].route
    assert route is not None and route.skips("How many minutes are in 37 hours? Reply with the number only.")
    assert not route.skips("What is the opposite of 'north'? Reply with one word only.")


def test_the_cli_refuses_a_bad_file_before_loading_anything(tmp_path, capsys) -> None:
    from kvcascade.cli import main

    bad = tmp_path / "cascade.yaml"
    bad.write_text("tiers:\n  - model: smollm2-135m\n    threshold: 1\n  - model: smollm2-135m\n    windw: 3\n")
    for argv in (["serve", "--cascade", str(bad)], ["router", "--redis-url", "redis://x", "--cascade", str(bad)]):
        with pytest.raises(SystemExit):
            main(argv)
        assert f"{bad}:5: tiers[1].windw: unknown key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--cascade", str(bad), "--model", "smollm2-135m"])
    assert "leave out --model" in capsys.readouterr().err


# --- the stack ----------------------------------------------------------------------------------


class Stack:
    def __init__(self, smollm2: LLMEngine, path: Path):
        self.path = path
        write(path, cascade_yaml(SURE))
        self.loop = LoopThread()
        self.engines, self.workers = [], []

        async def start():
            registry = MemoryRegistry()
            for i in range(2):
                engine = AsyncEngine(LLMEngine(EngineConfig(model=MODEL), tokenizer=smollm2.tokenizer,
                                               model=smollm2.model))
                engine.start()
                worker = WorkerServer(engine, "127.0.0.1", 0)
                await worker.start()
                self.engines.append(engine)
                self.workers.append(worker)
                await registry.register(WorkerInfo(worker_id=f"w{i}", epoch="e1", address=f"127.0.0.1:{worker.port}",
                                                   model=engine.model_id, model_source=MODEL, block_size=16,
                                                   capacity=64), ttl_s=3600)
            self.router = Router(registry, MemoryPrefixIndex(), cascade=CascadeFile(path))
            self.watcher = asyncio.create_task(self.router.cascade.watch(poll_s=0.2))
            self.server = RouterServer(self.router, "127.0.0.1", 0)
            await self.server.start()
            self.http, self.http_task = await serve_http(create_app(self.router), "127.0.0.1", 0)

        self.loop.run(start())
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.KVCascadeStub(self.channel)
        self.base_url = f"http://127.0.0.1:{http_port(self.http)}"

    def use(self, text: str) -> None:
        """Switch the cascade now (the watcher would within its poll)."""
        write(self.path, text)
        async def check() -> None:  # on the router's loop, like the watcher
            self.router.cascade.check()

        self.loop.run(check())
        assert self.router.cascade.config == parse_cascade(text)

    def ask(self, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        return list(self.stub.Generate(req, timeout=60))

    def metric(self, name: str, **labels: str) -> float:
        return self.router.metrics.registry.get_sample_value(name, labels) or 0.0

    def wait_until_idle(self, within_s: float = 5.0) -> None:
        deadline = time.monotonic() + within_s
        while any(e.stats().running or e.stats().kv_blocks_used for e in self.engines):
            assert time.monotonic() < deadline, [e.stats() for e in self.engines]
            time.sleep(0.05)

    def close(self) -> None:
        self.channel.close()
        self.loop.run(stop_http(self.http, self.http_task))
        self.loop.loop.call_soon_threadsafe(self.watcher.cancel)
        self.loop.run(self.server.stop(0))
        self.loop.run(self.router.close())
        for w in self.workers:
            self.loop.run(w.stop(0))
        for e in self.engines:
            e.shutdown()
        self.loop.close()


@pytest.fixture(scope="module")
def stack(smollm2: LLMEngine, tmp_path_factory) -> Iterator[Stack]:
    s = Stack(smollm2, tmp_path_factory.mktemp("cascade") / "cascade.yaml")
    try:
        yield s
    finally:
        s.close()


def request(model: str = "", max_tokens: int = 8, **fields) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model=model, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                      ignore_eos=True), **fields)
    req.messages.messages.add(role="user", content="What is the capital of France?")
    return req


def text(msgs: list[pb.GenerateResponse]) -> str:
    return "".join(m.text for m in msgs)


@pytest.fixture(scope="module")
def plain(stack: Stack) -> list[pb.GenerateResponse]:
    """The model's own answer, without the cascade (the request names the model)."""
    return stack.ask(request(MODEL, max_tokens=24))


# --- behaviour ----------------------------------------------------------------------------------


def test_a_sure_first_tier_answers_without_escalating(stack: Stack, plain) -> None:
    stack.use(cascade_yaml(SURE))
    msgs = stack.ask(request(max_tokens=24))
    assert text(msgs) == text(plain) and msgs[-1].usage.completion_tokens == 24
    assert {(m.tier, m.escalated) for m in msgs} == {("small", False)}
    assert -20 < msgs[-1].confidence <= 0  # a mean logprob
    assert not any(m.logprobs for m in msgs)  # used by the router, not asked for by the client
    assert stack.metric("kvcascade_cascade_decisions_total", tier="small", outcome="accept") >= 1


@pytest.mark.parametrize("mode", ["full", "early"])
def test_an_unsure_first_tier_escalates_and_the_stream_shows_only_the_last_tier(stack: Stack, plain, mode) -> None:
    stack.use(cascade_yaml(UNSURE, mode, window=4 if mode == "early" else None))
    discarded = stack.metric("kvcascade_cascade_tokens_total", tier="small", outcome="discarded")
    msgs = stack.ask(request(max_tokens=24))
    assert text(msgs) == text(plain)  # one answer, not a trial's tokens and then the answer
    assert sum(len(m.token_ids) for m in msgs) == msgs[-1].usage.completion_tokens == 24
    assert {(m.tier, m.escalated) for m in msgs} == {("large", True)}
    assert -20 < msgs[-1].confidence <= 0
    thrown = stack.metric("kvcascade_cascade_tokens_total", tier="small", outcome="discarded") - discarded
    # full: the trial ran to its end; early: it was cancelled right after its 4-token window.
    assert thrown == 24 if mode == "full" else 4 <= thrown < 24
    assert stack.metric("kvcascade_cascade_escalations_total", tier="small", reason="confidence") >= 1
    stack.wait_until_idle()  # the cancelled trial freed its KV blocks


def test_early_mode_streams_an_accepted_tier_after_its_window(stack: Stack, plain) -> None:
    stack.use(cascade_yaml(SURE, "early", window=4))
    msgs = stack.ask(request(max_tokens=24))
    assert text(msgs) == text(plain)
    assert {(m.tier, m.escalated) for m in msgs} == {("small", False)}


def test_the_client_gets_the_logprobs_it_asked_for_not_the_measures(stack: Stack) -> None:
    stack.use(cascade_yaml({"measure": "mean_entropy", "top_logprobs": 10, "threshold": 1e9}))
    req = request()
    req.sampling.logprobs = 2
    msgs = stack.ask(req)
    assert msgs[-1].tier == "small" and msgs[-1].confidence >= 0  # an entropy
    lps = [lp for m in msgs for lp in m.logprobs]
    assert len(lps) == 8 and all(len(lp.top) == 2 for lp in lps)


def test_a_pinned_tier_answers_and_opting_out_skips_the_cascade(stack: Stack) -> None:
    stack.use(cascade_yaml(UNSURE))
    pinned = stack.ask(request(tier="small"))
    assert {(m.tier, m.escalated) for m in pinned} == {("small", False)}  # pinned: never escalates
    out = stack.ask(request(cascade=pb.CASCADE_OFF))
    assert out[-1].finish_reason == "length" and not any(m.tier for m in out)
    named = stack.ask(request(MODEL))  # naming a model is opting out too
    assert not any(m.tier for m in named)
    with pytest.raises(grpc.RpcError) as err:
        stack.ask(request(tier="medium"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tier: unknown tier 'medium'" in err.value.details()


def test_http_extension_fields(stack: Stack) -> None:
    stack.use(cascade_yaml(UNSURE))
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
    body = httpx.post(f"{stack.base_url}/v1/chat/completions", json={**chat, "model": "cascade"}, timeout=60).json()
    assert (body["tier"], body["escalated"]) == ("large", True) and body["confidence"] <= 0
    body = httpx.post(f"{stack.base_url}/v1/chat/completions", json={**chat, "tier": "small"}, timeout=60).json()
    assert (body["tier"], body["escalated"]) == ("small", False)
    body = httpx.post(f"{stack.base_url}/v1/chat/completions", json={**chat, "cascade": False}, timeout=60).json()
    assert "tier" not in body and body["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", timeout=60,
                      json={"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
                            "stream": True}) as resp:
        chunks = [json.loads(line.removeprefix("data: ")) for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks and all((c["tier"], c["escalated"]) == ("large", True) for c in chunks)
    assert all(c["confidence"] is None for c in chunks[:-1]) and chunks[-1]["confidence"] <= 0
    models = httpx.get(f"{stack.base_url}/v1/models", timeout=10).json()
    assert {m["id"] for m in models["data"]} == {MODEL, "cascade"}


def test_the_file_is_reloaded_on_change_and_a_bad_one_is_refused(stack: Stack) -> None:
    stack.use(cascade_yaml(SURE))
    assert stack.ask(request(max_tokens=2))[-1].tier == "small"
    write(stack.path, cascade_yaml(UNSURE))  # the watcher (polling every 0.2 s here) picks it up
    deadline = time.monotonic() + 5
    while stack.router.cascade.config != parse_cascade(cascade_yaml(UNSURE)):
        assert time.monotonic() < deadline, "the changed file was not reloaded"
        time.sleep(0.05)
    assert stack.ask(request(max_tokens=2))[-1].tier == "large"
    errors = stack.metric("kvcascade_cascade_reloads_total", result="error")
    write(stack.path, "tiers:\n  - model: x\n    threshold: nope\n")
    deadline = time.monotonic() + 5
    while stack.metric("kvcascade_cascade_reloads_total", result="error") == errors:
        assert time.monotonic() < deadline, "the bad file was not looked at"
        time.sleep(0.05)
    assert stack.router.cascade.config == parse_cascade(cascade_yaml(UNSURE))  # the old one stays
    assert stack.ask(request(max_tokens=2))[-1].tier == "large"


def test_an_escalated_tier_can_see_the_draft_it_replaces(stack: Stack, plain) -> None:
    stack.use("original_prompt_only: false\n" + cascade_yaml(UNSURE))
    msgs = stack.ask(request(max_tokens=4))
    assert msgs[-1].tier == "large" and msgs[-1].escalated
    # The prompt grew by the draft (an assistant turn) and the review question (a user turn).
    assert msgs[-1].usage.prompt_tokens > plain[-1].usage.prompt_tokens + 4


# --- the judge: the next tier scores the draft in one prefill -----------------------------------


def judged(judge: dict, own: dict = UNSURE) -> str:
    return cascade_yaml({**own, "judge": judge})


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from contracts.models import resolve_model

    src = resolve_model(MODEL)
    return AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32)


def roles(msg: pb.GenerateResponse) -> list[tuple[str, str]]:
    return [(u.tier, u.role) for u in msg.tier_usage]


def test_a_judge_that_agrees_keeps_the_draft_and_scores_it_as_transformers_does(
        stack: Stack, plain, smollm2, hf_model) -> None:
    stack.use(judged({"threshold": -1e9}))
    accepted = stack.metric("kvcascade_cascade_judgements_total", tier="small", result="accept")
    msgs = stack.ask(request(max_tokens=8))
    assert text(plain).startswith(text(msgs))
    assert {(m.tier, m.escalated) for m in msgs} == {("small", False)}
    last = msgs[-1]
    assert roles(last) == [("large", "judge"), ("small", "answer")]
    prompt = smollm2.tokenize(messages=[{"role": "user", "content": "What is the capital of France?"}])
    draft = [t for m in msgs for t in m.token_ids]
    judge, answer = last.tier_usage
    assert (judge.prompt_tokens, judge.completion_tokens) == (len(prompt) + len(draft), 1)
    assert (answer.prompt_tokens, answer.completion_tokens) == (len(prompt), 8)
    # The score: the draft's mean logprob under the judging model, as transformers computes it.
    with torch.no_grad():
        x = torch.tensor([prompt + draft])
        lp = hf_model(x, attention_mask=torch.ones_like(x)).logits[0].float().log_softmax(-1)
    want = sum(lp[len(prompt) + i - 1, t].item() for i, t in enumerate(draft)) / len(draft)
    assert last.HasField("judge_score") and abs(last.judge_score - want) < 2e-3, (last.judge_score, want)
    assert stack.metric("kvcascade_cascade_judgements_total", tier="small", result="accept") == accepted + 1
    assert stack.metric("kvcascade_cascade_usage_tokens_total", tier="large", role="judge", kind="prompt") >= \
        judge.prompt_tokens
    body = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}).json()
    assert body["tier"] == "small" and body["judge_score"] <= 0
    assert [(u["tier"], u["role"]) for u in body["tier_usage"]] == [("large", "judge"), ("small", "answer")]


def test_a_judge_that_disagrees_escalates(stack: Stack, plain) -> None:
    stack.use(judged({"threshold": 1e9}))
    rejected = stack.metric("kvcascade_cascade_escalations_total", tier="small", reason="judge")
    msgs = stack.ask(request(max_tokens=24))
    assert text(msgs) == text(plain)
    assert {(m.tier, m.escalated) for m in msgs} == {("large", True)}
    assert roles(msgs[-1]) == [("large", "judge"), ("small", "trial"), ("large", "answer")]
    assert stack.metric("kvcascade_cascade_escalations_total", tier="small", reason="judge") == rejected + 1
    stack.wait_until_idle()


def test_below_the_floor_a_draft_escalates_unjudged_and_above_its_threshold_it_is_kept(stack: Stack) -> None:
    stack.use(judged({"threshold": -1e9, "floor": 1.01}))  # min_prob never reaches 1.01: never judged
    judged_before = sum(stack.metric("kvcascade_cascade_judgements_total", tier="small", result=r)
                        for r in ("accept", "reject"))
    msgs = stack.ask(request())
    assert msgs[-1].tier == "large" and roles(msgs[-1]) == [("small", "trial"), ("large", "answer")]
    stack.use(judged({"threshold": 1e9}, own=SURE))  # sure of itself: no judge asked
    msgs = stack.ask(request())
    assert msgs[-1].tier == "small" and roles(msgs[-1]) == [("small", "answer")]
    assert not msgs[-1].HasField("judge_score")
    assert sum(stack.metric("kvcascade_cascade_judgements_total", tier="small", result=r)
               for r in ("accept", "reject")) == judged_before


@pytest.mark.parametrize("threshold, tier", [(-1e9, "small"), (1e9, "large")])
def test_many_judged_requests_at_once(stack: Stack, threshold, tier) -> None:
    stack.use(judged({"threshold": threshold}))
    questions = [f"What is {i} plus {i + 3}?" for i in range(10)]

    def ask(q: str, model: str = "") -> list[pb.GenerateResponse]:
        req = request(model, max_tokens=6)
        req.messages.messages[0].content = q
        return stack.ask(req)

    alone = {q: text(ask(q, MODEL)) for q in questions}
    with ThreadPoolExecutor(len(questions)) as pool:
        answers = list(pool.map(ask, questions))
    for q, msgs in zip(questions, answers):
        assert text(msgs) == alone[q] and msgs[-1].tier == tier
        assert roles(msgs[-1])[0] == ("large", "judge")
    stack.wait_until_idle()


@pytest.mark.parametrize("text_, line, key", [
    ("tiers:\n  - model: a\n    judge: {measure: vibes, threshold: 1}\n  - model: b\n", 3, "tiers[0].judge.measure"),
    ("tiers:\n  - model: a\n    judge:\n      floor: 1\n  - model: b\n", 3, "tiers[0].judge.threshold"),
    ("tiers:\n  - model: a\n    judge:\n      threshold: 1\n      flor: 2\n  - model: b\n", 5, "tiers[0].judge.flor"),
    ("tiers:\n  - model: a\n    threshold: 1\n  - model: b\n    judge: {threshold: 1}\n", 5, "tiers[1].judge"),
])
def test_a_bad_judge_is_refused_naming_key_and_line(text_: str, line: int, key: str) -> None:
    with pytest.raises(CascadeConfigError) as err:
        parse_cascade(text_, "c.yaml")
    assert (err.value.line, err.value.key) == (line, key), str(err.value)


# --- the prompt router in front of a tier (route) -------------------------------------------------

CAPITALS = [f"What is the capital of {c}?" for c in "France Peru Japan Kenya Chile Spain Egypt Nepal".split()]
PRODUCTS = [f"What is {a} times {b}?" for a, b in [(347, 29), (812, 77), (45, 908), (123, 456), (66, 781),
                                                    (999, 12), (305, 88), (71, 640)]]


@pytest.fixture(scope="module")
def router_file(tmp_path_factory) -> Path:
    """A prompt router that expects the small tier right on capitals and wrong on products."""
    path = tmp_path_factory.mktemp("route") / "small.router.json"
    PromptRouter.train(CAPITALS + PRODUCTS, [True] * len(CAPITALS) + [False] * len(PRODUCTS)).save(path)
    return path


def routed(router_file: Path, threshold: float = 0.5) -> str:
    return cascade_yaml(SURE).replace("  - name: large", f"    route: {{file: {router_file}, threshold: {threshold}}}\n"
                                                          "  - name: large")


@pytest.mark.parametrize("route, line, key", [
    ("route: {file: missing.json, threshold: 0.5}", 4, "tiers[0].route.file"),
    ("route: {file: R, threshold: 1.5}", 4, "tiers[0].route.threshold"),
    ("route: {file: R}", 4, "tiers[0].route.threshold"),
    ("route: {file: R, threshold: 0.5, treshold: 1}", 4, "tiers[0].route.treshold"),
    ("route: R", 4, "tiers[0].route"),
])
def test_a_bad_route_is_refused_naming_key_and_line(router_file: Path, route: str, line: int, key: str) -> None:
    text_ = f"tiers:\n  - model: a\n    threshold: 1\n    {route.replace('R', str(router_file))}\n  - model: b\n"
    with pytest.raises(CascadeConfigError) as err:
        parse_cascade(text_, "c.yaml")
    assert (err.value.line, err.value.key) == (line, key), str(err.value)
    last = f"tiers:\n  - model: a\n    threshold: 1\n  - model: b\n    route: {{file: {router_file}, threshold: 0.5}}\n"
    with pytest.raises(CascadeConfigError, match="tiers\\[1\\].route: the last tier always answers"):
        parse_cascade(last, "c.yaml")


def test_a_route_file_is_read_beside_the_cascade_file(router_file: Path) -> None:
    from router.cascade_config import load_cascade

    cascade = router_file.parent / "cascade.yaml"
    cascade.write_text(routed(Path(router_file.name)))
    tier = load_cascade(cascade).tiers[0]
    assert tier.route is not None and tier.route.skips(PRODUCTS[0]) and not tier.route.skips(CAPITALS[0])
    assert not tier.route.skips(None)  # token ids: nothing to read, the tier runs


def test_many_routed_requests_at_once(stack: Stack, router_file: Path) -> None:
    """Products skip the small tier before it runs (no trial, no tokens of it); capitals keep it."""
    stack.use(routed(router_file))
    skipped = stack.metric("kvcascade_cascade_decisions_total", tier="small", outcome="skip")
    questions = CAPITALS + PRODUCTS

    def ask(q: str) -> list[pb.GenerateResponse]:
        req = request(max_tokens=6)
        req.messages.messages[0].content = q
        return stack.ask(req)

    with ThreadPoolExecutor(len(questions)) as pool:
        answers = dict(zip(questions, pool.map(ask, questions)))
    for q in CAPITALS:
        assert answers[q][-1].tier == "small" and roles(answers[q][-1]) == [("small", "answer")]
    for q in PRODUCTS:
        msgs = answers[q]
        assert {(m.tier, m.escalated) for m in msgs} == {("large", True)}
        assert roles(msgs[-1]) == [("large", "answer")] and msgs[-1].usage.completion_tokens == 6
    assert stack.metric("kvcascade_cascade_decisions_total", tier="small", outcome="skip") - skipped == len(PRODUCTS)
    assert stack.metric("kvcascade_cascade_escalations_total", tier="small", reason="route") >= len(PRODUCTS)
    stack.wait_until_idle()


# --- the stacked confidence: P(right) from the prompt and the draft together ---------------------


@pytest.fixture(scope="module")
def stacked_file(router_file: Path) -> Path:
    """A stacked confidence led by the prompt's words (the prompt router's weights, doubled:
    capitals likely right, products not), the draft's numbers nudging it; hand-set weights: the
    test is the serving, not the fit."""
    router = PromptRouter.load(router_file)
    weights = {"sum_logprob": 0.3, "mean_logprob": 0.2, "min_logprob": 0.1, "mean_entropy": -0.2, "log_tokens": 0.1}
    model = StackedModel(PromptRouter(2 * router.weights, 0.0), list(weights), list(weights.values()),
                         2 * router.bias + 0.3)
    path = router_file.parent / "small.stacked.json"
    model.save(path)
    return path


def stacked_yaml(stacked_file: Path, threshold: float = 0.5) -> str:
    small = {"measure": "stacked", "threshold": threshold, "stacked": f"{{file: {stacked_file}}}"}
    return cascade_yaml(small)


@pytest.mark.parametrize("lines, line, key, message", [
    (["measure: stacked", "threshold: 0.5"], 2, "tiers[0].stacked", "missing: measure stacked reads"),  # the tier's
    (["threshold: 1", "stacked: {file: STACKED}"], 4, "tiers[0].stacked", "only with measure: stacked"),
    (["measure: stacked", "threshold: 1.5", "stacked: {file: STACKED}"], 4, "tiers[0].threshold", "a probability"),
    (["measure: stacked", "threshold: 0.5", "stacked: {file: missing.json}"], 5, "tiers[0].stacked.file",
     "cannot read"),
    (["measure: stacked", "threshold: 0.5", "stacked: {fil: STACKED}"], 5, "tiers[0].stacked.fil", "unknown key"),
    (["measure: stacked", "threshold: 0.5", "stacked: STACKED"], 5, "tiers[0].stacked", "must be a mapping"),
    (["measure: stacked", "threshold: 0.5", "stacked: {file: BAD}"], 5, "tiers[0].stacked.file",
     "weights: must be 5 numbers"),
    (["threshold: 1", "judge: {measure: stacked, threshold: 0.5}"], 4, "tiers[0].judge.measure", "must be one of"),
])
def test_a_bad_stacked_confidence_is_refused_naming_key_and_line(stacked_file: Path, tmp_path: Path, lines, line,
                                                                 key, message) -> None:
    bad = tmp_path / "bad.stacked.json"
    bad.write_text(json.dumps({**json.loads(stacked_file.read_text()), "weights": [1.0]}))
    body = "".join(f"    {x.replace('BAD', str(bad)).replace('STACKED', str(stacked_file))}\n" for x in lines)
    with pytest.raises(CascadeConfigError) as err:
        parse_cascade(f"tiers:\n  - model: a\n{body}  - model: b\n", "c.yaml")
    assert (err.value.line, err.value.key) == (line, key) and message in err.value.message, str(err.value)


def test_many_stacked_requests_at_once_score_as_the_replay_does(stack: Stack, stacked_file: Path) -> None:
    """Each draft's stacked confidence, served, equals what calibration's replay computes from the
    same prompt and the same logprobs (kvcascade/calibrate.py); the cascade keeps a draft exactly
    when it reaches the threshold, under concurrent requests."""
    from kvcascade.calibrate import answer_record, stacked_row
    from loadtest.tasks import Task

    stack.use(stacked_yaml(stacked_file))
    model = StackedModel.load(stacked_file)
    questions = CAPITALS + PRODUCTS

    def ask(q: str, tier: str = "") -> list[pb.GenerateResponse]:
        req = request(max_tokens=6, tier=tier)
        req.sampling.ClearField("ignore_eos")  # a draft may end early: its length is a feature
        req.sampling.logprobs = 20  # the client sees what the measure read
        req.messages.messages[0].content = q
        return stack.ask(req)

    with ThreadPoolExecutor(2 * len(questions)) as pool:
        drafts = pool.map(ask, questions, ["small"] * len(questions))  # the small tier's own draft
        answers = pool.map(ask, questions)  # the cascade
        drafts, answers = list(drafts), list(answers)
    for q, draft, msgs in zip(questions, drafts, answers):
        # The replay: the draft recorded as calibration records it, scored with its prompt.
        task = Task(id="t", prompt=q, answer="x", scorer="exact")
        record = answer_record(task, [], text(draft), [t for m in draft for t in m.token_ids],
                               [lp for m in draft for lp in m.logprobs], None, 20)
        replayed = model.score(q, stacked_row(record, None))
        assert draft[-1].tier == "small" and draft[-1].confidence == pytest.approx(replayed, abs=1e-6)
        kept = replayed >= 0.5
        assert {(m.tier, m.escalated) for m in msgs} == ({("small", False)} if kept else {("large", True)}), q
        if kept:
            assert text(msgs) == text(draft) and msgs[-1].confidence == pytest.approx(draft[-1].confidence, abs=1e-5)
    # The router leads: capitals kept, products escalated after their trial.
    assert [m[-1].tier for m in answers] == ["small"] * len(CAPITALS) + ["large"] * len(PRODUCTS)
    stack.wait_until_idle()
