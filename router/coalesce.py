"""Relaying a stream to a writer that may lag: what is already there goes out as one message.

A worker sends one GenerateResponse per engine step. Relayed one for one, a client (or a router)
that falls behind pays a gRPC message or an SSE event per token and falls further behind. Here a
pump task reads the upstream stream into a buffer as fast as it comes; each time the writer asks
for the next message it gets everything buffered so far merged into one, and never waits for more
than that:

    worker --> pump task --> pending [m1 m2 m3] --> writer ready --> merge -> one write
                  ^                 |
                  +-- waits while --+ pending holds ``limit`` messages (a stalled client
                                      pushes back on the worker instead of filling memory)

Order and content are unchanged: merged messages concatenate token ids, text and logprobs, and a
stream's last message keeps its finish reason, usage and the rest. Closing the relay cancels the
pump, which closes the upstream stream, so a client that leaves still cancels the worker call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from protos import kvcascade_pb2 as pb

T = TypeVar("T")

# Messages buffered for a writer that lags; at this many the pump stops reading upstream.
DEFAULT_LIMIT = 256


def merge_responses(batch: list[pb.GenerateResponse]) -> pb.GenerateResponse:
    """One message saying what ``batch`` says, in order. Repeated fields (token_ids, logprobs)
    concatenate and every other field set in a later message replaces an earlier one (protobuf's
    merge), so the last message's finish_reason, usage, ttft_s, error, worker, tier, escalated and
    confidence are kept; text is the one field merged by hand, as a concatenation."""
    if len(batch) == 1:
        return batch[0]
    merged = pb.GenerateResponse()
    for msg in batch:  # into a new message: the batch's messages may still be referenced upstream
        merged.MergeFrom(msg)
    merged.text = "".join(msg.text for msg in batch)
    return merged


async def coalesced(source: AsyncIterator[T], merge: Callable[[list[T]], T] = merge_responses,
                    limit: int = DEFAULT_LIMIT) -> AsyncIterator[T]:
    """``source``'s items, each yield merging all that arrived since the previous one; its error
    (after the items before it). Close it (aclose) to stop reading: that closes ``source`` too."""
    assert limit >= 1, limit
    pending: list[T] = []
    arrived = asyncio.Event()  # pending grew, or the pump ended
    drained = asyncio.Event()  # the writer took pending

    async def pump() -> None:
        try:
            async with contextlib.aclosing(source):
                async for item in source:
                    pending.append(item)
                    arrived.set()
                    if len(pending) >= limit:
                        drained.clear()
                        await drained.wait()
        finally:
            arrived.set()

    task = asyncio.create_task(pump(), name="coalesce-pump")
    try:
        while True:
            if not pending:
                if task.done():
                    task.result()  # the source's error, if it ended with one
                    return
                arrived.clear()
                await arrived.wait()
                continue
            batch = pending[:]
            pending.clear()
            drained.set()
            yield merge(batch)
    finally:
        # The writer is done (finished, failed, cancelled or closed): stop the pump and wait for it,
        # so the upstream stream (and its worker call) is closed before this returns.
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: an error after the writer left is not worth a warning
