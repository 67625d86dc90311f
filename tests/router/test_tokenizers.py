"""The router loads its workers' tokenizers when it starts, so no first request waits seconds for one."""

from __future__ import annotations

import time

from contracts.memory_state import MemoryPrefixIndex, MemoryRegistry
from router.router import Router
from contracts.state import WorkerInfo


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
