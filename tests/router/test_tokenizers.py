"""The router's tokenizers: loaded when it starts, so no first request waits seconds for one, and
without torch in the router's process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from contracts.memory_state import MemoryPrefixIndex, MemoryRegistry
from contracts.state import WorkerInfo
from contracts.stores import connect_state
from deploy.local import REPO, free_port
from router.router import Router

from .fake_worker import FakeWorker


async def test_a_starting_router_loads_the_tokenizers_of_the_registered_workers() -> None:
    registry = MemoryRegistry()
    for worker_id, source in (("w1", "smollm2-135m"), ("w2", "smollm2-135m"), ("bad", "no-such-model")):
        await registry.register(WorkerInfo(worker_id=worker_id, epoch="e1", address="127.0.0.1:1", model=source,
                                           model_source=source, capacity=8), ttl_s=60)
    router = Router(registry, MemoryPrefixIndex())
    try:
        assert len(router.tokenizers) == 0
        # Two workers of one model share a tokenizer; one whose model is unknown is logged, not fatal.
        assert await router.load_tokenizers() == 1
        workers = {w.worker_id: w for w in await router.live_workers()}
        start = time.perf_counter()
        tokenizer = await router.tokenizers.of(workers["w2"])
        assert time.perf_counter() - start < 0.05  # already there: no load on the request's path
        assert tokenizer.encode("hello world", add_special_tokens=False)
    finally:
        await router.close()


def test_the_router_process_tokenizes_without_torch(redis_server, tmp_path) -> None:
    """`kvcascade router` hides torch (contracts.tokenizers.hide_torch): it loads no libtorch, even
    when a GGUF's tokenizer must first be built (a child process does that, into a fresh cache here),
    and still tokenizes and routes: a completion through it to a fake worker comes back whole."""
    worker = FakeWorker()

    async def register() -> None:
        registry, _ = connect_state(redis_server.url, "kvc:")
        await registry.register(WorkerInfo(worker_id="fake", epoch="e1", address=worker.address, model="fake",
                                           model_source="smollm2-135m", capacity=8), ttl_s=600)
        await registry.aclose()

    asyncio.run(register())
    http = free_port()
    log = tmp_path / "router.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", KVCASCADE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "kvcascade", "router", "--redis-url", redis_server.url,
                             "--port", str(free_port()), "--http-port", str(http)],
                            cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "kvcascade router ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert "not loaded" not in log.read_text(), log.read_text()[-3000:]
        assert list((tmp_path / "cache" / "tokenizers").glob("*/tokenizer.json"))  # built by the child
        r = httpx.post(f"http://127.0.0.1:{http}/v1/completions",
                       json={"model": "fake", "prompt": "hello world", "max_tokens": 5}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps
    finally:
        proc.terminate()
        proc.wait(30)
        worker.close()


def test_short_prompts_at_low_load_are_tokenized_on_the_loop_others_in_a_thread():
    from contracts.tokenizers import INLINE_TOKENIZE_BELOW, INLINE_TOKENIZE_CHARS, tokenize_inline

    short, long = "word " * 100, "x" * (INLINE_TOKENIZE_CHARS + 1)
    assert tokenize_inline(short, None, 0)
    assert tokenize_inline(None, [{"role": "user", "content": short}], INLINE_TOKENIZE_BELOW - 1)
    assert not tokenize_inline(short, None, INLINE_TOKENIZE_BELOW), "under load: in a thread"
    assert not tokenize_inline(long, None, 0)
    halves = [{"role": "user", "content": long[:5000]}, {"role": "user", "content": long[5000:]}]
    assert not tokenize_inline(None, halves, 0), "the messages' contents count together"
