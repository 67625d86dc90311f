"""router/coalesce.py on its own: a writer that keeps up gets every item as it comes, one that lags
gets what piled up merged into one, a stalled one stops the reading, and closing stops the source."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos import kvcascade_pb2 as pb
from router.coalesce import coalesced, merge_responses
from router.errors import RouterError


def batches(batch: list[int]) -> list[int]:
    return batch  # "merging" that keeps the batch, so a test sees what went out together


class Source:
    """An async iterator of 0, 1, 2 ... that records how far it was read and whether it was closed."""

    def __init__(self, n: int | None, pause_s: float = 0.0, fail_after: int | None = None):
        self.n, self.pause_s, self.fail_after = n, pause_s, fail_after
        self.produced = 0
        self.closed = False

    async def items(self):
        try:
            i = 0
            while self.n is None or i < self.n:
                if i == self.fail_after:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE, "the worker went away")
                self.produced = i + 1
                yield i
                i += 1
                await asyncio.sleep(self.pause_s)
        finally:
            self.closed = True


async def test_a_writer_that_keeps_up_gets_every_item_on_its_own() -> None:
    source = Source(20, pause_s=0.005)
    out = [b async for b in coalesced(source.items(), batches)]
    assert out == [[i] for i in range(20)] and source.closed


async def test_a_writer_that_lags_gets_what_arrived_merged_and_nothing_held_back() -> None:
    source = Source(200)
    out = []
    async for batch in coalesced(source.items(), batches):
        out.append(batch)
        await asyncio.sleep(0.02)  # a slow client: everything produced meanwhile goes out next time
    assert [i for b in out for i in b] == list(range(200))
    assert len(out) <= 3, [len(b) for b in out]


async def test_a_stalled_writer_stops_the_reading_at_the_limit() -> None:
    source = Source(None)
    relay = coalesced(source.items(), batches, limit=8)
    assert await anext(relay) == [0]
    await asyncio.sleep(0.05)  # the writer stalls; the pump fills the buffer and waits
    assert source.produced == 1 + 8
    assert await anext(relay) == list(range(1, 9))
    await relay.aclose()
    assert source.closed


async def test_an_error_comes_after_the_items_before_it() -> None:
    source = Source(10, fail_after=5)
    relay = coalesced(source.items(), batches)
    assert await anext(relay) == [0]
    await asyncio.sleep(0.01)  # everything up to the error is in before the next read
    assert await anext(relay) == [1, 2, 3, 4]
    with pytest.raises(RouterError, match="went away"):
        await anext(relay)
    assert source.closed


@pytest.mark.parametrize("how", ["aclose", "cancel"])
async def test_a_writer_that_leaves_closes_the_source_before_it_is_gone(how: str) -> None:
    source = Source(None, pause_s=0.001)
    relay = coalesced(source.items(), batches)

    async def write() -> None:
        async for _ in relay:
            pass

    if how == "aclose":
        await anext(relay)
        await relay.aclose()
    else:
        writer = asyncio.create_task(write())
        await asyncio.sleep(0.02)
        writer.cancel()
        await asyncio.wait({writer})
    assert source.closed


def test_merged_responses_concatenate_tokens_and_keep_the_last_messages_fields() -> None:
    def lp(token_id: int) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=token_id, logprob=-0.5, top=[pb.TopLogprob(token_id=token_id, logprob=-0.5)])

    first = pb.GenerateResponse(request_id="r", token_ids=[1, 2], text="ab", logprobs=[lp(1), lp(2)], tier="small")
    middle = pb.GenerateResponse(request_id="r", token_ids=[3], text="", logprobs=[lp(3)], tier="small")
    last = pb.GenerateResponse(request_id="r", token_ids=[4], text="d", logprobs=[lp(4)], finish_reason="length",
                               usage=pb.Usage(prompt_tokens=5, cached_tokens=2, completion_tokens=4), ttft_s=0.25,
                               worker_id="w1", route_reason="prefix_hit", tier="small", escalated=True,
                               confidence=-0.5)
    merged = merge_responses([first, middle, last])
    expected = pb.GenerateResponse()
    expected.CopyFrom(last)
    expected.token_ids[:] = [1, 2, 3, 4]
    expected.text = "abd"
    del expected.logprobs[:]
    expected.logprobs.extend([lp(1), lp(2), lp(3), lp(4)])
    assert merged == expected
    assert list(first.token_ids) == [1, 2] and first.text == "ab"  # the inputs are left as they were
    assert merge_responses([last]) is last
