"""The router over real worker processes and a real Redis: prefix-aware placement, spill under
load, worker death before and during a stream, restarts with a new epoch, and Redis going away."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest

from deploy.local import WorkerProcess
from protos import kvcascade_pb2 as pb
from protos import kvcascade_pb2_grpc as pb_grpc
from protos.block_hash import block_hashes
from router.grpc_api import RouterServer
from router.router import Router
from contracts.stores import connect_state

from .loop_thread import LoopThread

pytestmark = pytest.mark.slow

SYSTEM = ("You are the support assistant of Northwind Outfitters, a shop for hiking and camping gear. "
          "Answer briefly and politely. Our return policy: unused items can be returned within 30 days "
          "with the receipt; sale items within 14 days. Shipping is free above 50 euros and takes two to "
          "four working days inside the EU. Tents carry a two year warranty, boots one year. ")


def chat(system: str, question: str, max_tokens: int = 4) -> pb.GenerateRequest:
    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    req.messages.messages.add(role="system", content=system)
    req.messages.messages.add(role="user", content=question)
    return req


@pytest.fixture(scope="module")
def cluster(redis_server):
    url = redis_server.url
    # quantization none (fp32): a migrated stream's re-prefill then computes what decoding did, so
    # the stream it hands over equals the unbroken one token for token
    workers = {wid: WorkerProcess(wid, url, "--quantization", "none") for wid in ("w1", "w2")}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # load both models at once
        list(pool.map(lambda w: w.start(), workers.values()))
    loop = LoopThread()
    registry, index = connect_state(url, "kvc:")

    async def start():
        router = Router(registry, index)
        server = RouterServer(router, "127.0.0.1", 0)
        await server.start()
        return router, server

    router, server = loop.run(start())
    channel = grpc.insecure_channel(server.address)
    yield dict(workers=workers, router=router, stub=pb_grpc.KVCascadeStub(channel), loop=loop, index=index,
               redis=redis_server)
    channel.close()
    loop.run(server.stop(0))
    loop.run(router.close())
    loop.close()
    for w in workers.values():
        w.stop()


def ask(cluster, req, timeout=60) -> pb.GenerateResponse:
    """The last message of a Generate through the router (it carries worker_id and usage)."""
    last = None
    for last in cluster["stub"].Generate(req, timeout=timeout):
        pass
    return last


def wait_for(predicate, timeout=15.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def live_ids(cluster) -> set[str]:
    return {w.worker_id for w in cluster["loop"].run(cluster["router"].live_workers(fresh=True))}


def test_requests_sharing_a_prefix_land_on_the_worker_that_holds_it(cluster):
    first = ask(cluster, chat(SYSTEM, "Can I return boots?"))
    holder = first.worker_id
    assert holder in ("w1", "w2") and first.usage.cached_tokens == 0
    time.sleep(0.5)  # the holder publishes its stored blocks (every 50 ms)
    for q in ("Is shipping free?", "How long is the tent warranty?", "Do you ship to Norway?"):
        out = ask(cluster, chat(SYSTEM, q))
        assert out.worker_id == holder, out
        assert out.route_reason == "prefix_hit"
        assert out.usage.cached_tokens >= 64


def test_a_hot_prefix_spills_to_the_other_worker_under_load(cluster):
    other_system = SYSTEM.replace("Northwind Outfitters", "Southwind Supplies")
    ask(cluster, chat(other_system, "Hello"))
    time.sleep(0.5)
    reqs = [chat(other_system, f"Question number {i}: what do you sell?", max_tokens=24) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda r: ask(cluster, r), reqs))
    assert {o.worker_id for o in outs} == {"w1", "w2"}, [(o.worker_id, o.route_reason) for o in outs]
    assert "prefix_spill" in {o.route_reason for o in outs}
    assert all(o.finish_reason == "length" and o.usage.completion_tokens == 24 for o in outs)


def test_a_dead_worker_is_skipped_before_the_first_token_and_returns_with_a_new_epoch(cluster):
    workers, index = cluster["workers"], cluster["index"]
    victim = workers["w2"]
    # Give w2 a prefix only it holds, by asking it directly (its publisher indexes the blocks).
    system = SYSTEM.replace("hiking", "sailing")
    with grpc.insecure_channel(victim.address) as ch:
        for _ in pb_grpc.KVCascadeStub(ch).Generate(chat(system, "Hi"), timeout=60):
            pass
    assert wait_for(lambda: ask_route(cluster, chat(system, "Hi again")) == "w2")
    victim.kill()
    # Registry still lists w2 (its TTL has not run out): the router tries it, fails, moves on.
    out = ask(cluster, chat(system, "Anyone there?"))
    assert out.worker_id == "w1" and out.finish_reason == "length"
    assert wait_for(lambda: "w2" not in live_ids(cluster), timeout=10)
    # Restart under the same id: a new epoch; the old epoch's entries are gone and it serves again.
    victim.start()
    assert wait_for(lambda: "w2" in live_ids(cluster), timeout=10)
    router = cluster["router"]
    epochs = {w.worker_id: w.epoch for w in cluster["loop"].run(router.live_workers(fresh=True))}
    ids = cluster["loop"].run(router.route(chat(system, "x")))[0]
    held = cluster["loop"].run(index.match(victim_model(cluster), block_hashes(ids, 16, victim_model(cluster)),
                                           epochs))
    assert held["w2"] == 0


def _kill_mid_stream(cluster, req, after_tokens: int = 16, timings: dict | None = None):
    """Stream ``req`` through the router, kill the worker serving it after ``after_tokens`` tokens, read
    on; returns (messages, error or None, the killed worker), the worker restarted and live again.
    ``timings["ended"]``: when the stream ended (before the restart, which takes a model load)."""
    workers = cluster["workers"]
    stream = cluster["stub"].Generate(req, timeout=120)
    msgs, error, serving = [], None, None
    try:
        for msg in stream:
            msgs.append(msg)
            if serving is None and sum(len(m.token_ids) for m in msgs) >= after_tokens:
                serving = next(w for w in workers.values() if w.stats().running == 1)
                serving.kill()
    except grpc.RpcError as err:
        error = err
    if timings is not None:
        timings["ended"] = time.monotonic()
    serving.start()
    assert wait_for(lambda: serving.worker_id in live_ids(cluster), timeout=10)
    return msgs, error, serving


def test_a_worker_dying_mid_stream_hands_the_stream_to_another_that_goes_on(cluster):
    """Greedy: the client's one stream carries exactly the tokens and text of an uninterrupted answer."""
    req = chat(SYSTEM, "Write a very long story about a tent.", max_tokens=120)
    whole = list(cluster["stub"].Generate(req, timeout=120))
    started = time.monotonic()
    msgs, error, killed = _kill_mid_stream(cluster, req)
    assert error is None, error
    assert [t for m in msgs for t in m.token_ids] == [t for m in whole for t in m.token_ids]
    assert "".join(m.text for m in msgs) == "".join(m.text for m in whole)
    last = msgs[-1]
    assert last.finish_reason == "length" and last.route_reason == "migrated" and last.worker_id != killed.worker_id
    assert last.usage.completion_tokens == 120 and last.usage.prompt_tokens == whole[-1].usage.prompt_tokens
    assert time.monotonic() - started < 60
    metrics = cluster["router"].metrics.registry
    assert metrics.get_sample_value("kvcascade_stream_migrations_total", {"result": "resumed"}) >= 1


def test_a_seeded_sampled_stream_moved_mid_way_goes_on_with_the_same_tokens(cluster):
    """Sampled with a seed: the continuation draws from where the dead worker was (seed_offset), so
    the client's stream is the uninterrupted answer token for token."""
    req = chat(SYSTEM, "Write a very long story about a tent.", max_tokens=120)
    req.sampling.temperature, req.sampling.seed = 1.0, 1234
    whole = list(cluster["stub"].Generate(req, timeout=120))
    msgs, error, killed = _kill_mid_stream(cluster, req)
    assert error is None, error
    assert [t for m in msgs for t in m.token_ids] == [t for m in whole for t in m.token_ids]
    assert "".join(m.text for m in msgs) == "".join(m.text for m in whole)
    assert msgs[-1].route_reason == "migrated" and msgs[-1].worker_id != killed.worker_id


def test_a_worker_killed_under_16_concurrent_streams_none_hangs_or_fails(cluster):
    """16 streams at once over both workers; one worker is killed once every stream has its first
    tokens: every stream finishes whole, those of the killed worker on the other one."""
    workers = cluster["workers"]
    reqs = [chat(f"Story desk {i}. " + SYSTEM, f"Tell a long story number {i}.", max_tokens=60)
            for i in range(16)]
    firsts = [threading.Event() for _ in reqs]

    def run(i):
        msgs = []
        for msg in cluster["stub"].Generate(reqs[i], timeout=120):
            msgs.append(msg)
            firsts[i].set()
        return msgs

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
        futures = [pool.submit(run, i) for i in range(len(reqs))]
        assert all(f.wait(60) for f in firsts)
        victim = max(workers.values(), key=lambda w: w.stats().running)
        assert 0 < victim.stats().running < len(reqs), "both workers serve some of the streams"
        victim.kill()
        results = [f.result(timeout=120) for f in futures]
    lasts = [msgs[-1] for msgs in results]
    assert all(m.finish_reason == "length" and m.usage.completion_tokens == 60 for m in lasts)
    assert all(sum(len(m.token_ids) for m in msgs) == 60 for msgs in results)
    moved = [m for m in lasts if m.route_reason == "migrated"]
    assert moved and all(m.worker_id != victim.worker_id for m in moved)
    assert time.monotonic() - started < 90
    victim.start()
    assert wait_for(lambda: victim.worker_id in live_ids(cluster), timeout=10)


def test_a_stream_with_stop_strings_ends_with_unavailable_when_its_worker_dies(cluster):
    """A continuation cannot see a stop string across the break: such a stream is not moved."""
    req = chat(SYSTEM, "Write a very long story about a tent.", max_tokens=2000)
    req.sampling.stop.append("#### never in a story ####")
    started, timings = time.monotonic(), {}
    msgs, error, _ = _kill_mid_stream(cluster, req, timings=timings)
    assert msgs and error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert "stop strings" in error.details()
    # the stream's own end: the restart after it is a model load (~20 s on 2 busy cores, which
    # this bound once counted and so failed under load)
    assert timings["ended"] - started < 30, "the stream must end, not hang"


def test_a_deadline_passing_mid_stream_ends_it_with_deadline_exceeded_not_a_migration(cluster):
    """The client's deadline is not a worker failure: the stream ends with DEADLINE_EXCEEDED after its
    first tokens, is not moved to the other worker, and both workers' blocks come free."""
    metrics = cluster["router"].metrics.registry

    def moves():
        return sum(metrics.get_sample_value("kvcascade_stream_migrations_total", {"result": r}) or 0
                   for r in ("resumed", "not_moved"))

    before = moves()
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for msg in cluster["stub"].Generate(chat(SYSTEM, "Tell me everything about tents.", max_tokens=0),
                                            timeout=2.0):  # max_tokens 0: until the context ends
            got.append(msg)
    assert got, "the deadline should pass mid-stream, after the first tokens"
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert moves() == before
    assert wait_for(lambda: all(w.stats().kv_blocks_used == 0 and w.stats().running == 0
                                for w in cluster["workers"].values()), timeout=5)


def test_redis_down_keeps_serving_on_load_then_recovers(cluster):
    redis, router = cluster["redis"], cluster["router"]
    ask(cluster, chat(SYSTEM, "warm up"))
    redis.stop()
    try:
        out = ask(cluster, chat(SYSTEM, "Is shipping free?"))
        assert out.finish_reason == "length"
        assert router.metrics.registry.get_sample_value("kvcascade_state_backend_up") == 0
    finally:
        redis.start()
    # Workers notice the empty Redis, re-register with a snapshot of their caches; routing on
    # prefixes resumes without any router restart.
    assert wait_for(lambda: live_ids(cluster) == {"w1", "w2"}, timeout=20)
    assert wait_for(lambda: ask(cluster, chat(SYSTEM, "Can I return boots?")).route_reason == "prefix_hit", timeout=20)
    assert router.metrics.registry.get_sample_value("kvcascade_state_backend_up") == 1


def ask_route(cluster, req) -> str:
    return ask(cluster, req).worker_id


def victim_model(cluster) -> str:
    return cluster["loop"].run(cluster["router"].live_workers())[0].model


def test_cancelling_through_the_router_frees_the_workers_blocks(cluster):
    workers = cluster["workers"]
    stream = cluster["stub"].Generate(chat(SYSTEM, "Tell me everything about tents.", max_tokens=2000), timeout=120)
    assert next(stream).token_ids
    assert sum(w.stats().running for w in workers.values()) == 1
    stream.cancel()
    assert wait_for(lambda: all(w.stats().kv_blocks_used == 0 and w.stats().running == 0
                                for w in workers.values()), timeout=5)
