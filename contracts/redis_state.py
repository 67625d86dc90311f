"""The registry and prefix index in Redis, shared by every router and worker of a deployment.

Key layout, under a configurable prefix P (default "kvc:", so deployments can share one Redis):

    P worker:{id}          hash   a field per WorkerInfo field (text), load as JSON; expires
                                  with the heartbeat TTL
    P workers              set    ids that registered; live_workers drops those whose hash expired
    P idx:{model}:{hash}   hash   worker_id -> epoch: who holds block {hash} (decimal u64)
    P held:{id}            set    "{model}:{hash}" of every entry of worker {id}, so "cleared" and
                                  drop_worker cost that worker's entries, never a SCAN
    P indexed              set    ids that have entries (finding dead workers' leftovers)

Every method is one round trip: a MULTI pipeline or a Lua script (EVALSHA, loaded again after a
Redis restart). Values are strings and JSON, never pickle. The scripts touch keys they build
from the prefix, so this is for one Redis (or a primary with replicas), not Redis Cluster.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from contracts.state import CacheEvent, PrefixIndex, Registry, StateUnavailable, WorkerInfo, WorkerLoad, check_events


def redis_client(url: str, connect_timeout_s: float = 0.5) -> Redis:
    """A client for ``url``, anything redis-py's ``from_url`` takes: ``redis://host:6379/0``,
    ``redis://user:password@host``, ``rediss://host`` for TLS (``?ssl_cert_reqs=required`` and
    the like in the query), ``unix:///path.sock``. A failed command is retried once on a fresh
    connection, so a Redis restart costs no error.

    No socket timeout: the registry and index put their own deadline (``timeout_s``, 1 s) around
    each call, so a dead or stalled Redis answers ``StateUnavailable`` within it instead of
    hanging a request. redis-py's ``socket_timeout`` sends every command under
    ``asyncio.wait_for``, which on Python 3.11 swallows a cancellation that arrives as the send
    completes (CPython gh-86296, fixed in 3.12): two of three cancels of a task in a Redis call
    were lost here, and a publisher's stop() waited forever on a task that never ended."""
    # Retried once on a connection error only: a stalled Redis must fail within the deadline.
    retry = Retry(ExponentialBackoff(cap=0.05, base=0.01), retries=1, supported_errors=(RedisConnectionError,))
    return Redis.from_url(url, decode_responses=True, socket_connect_timeout=connect_timeout_s,
                          socket_timeout=None, retry=retry)


def _store_call(method):
    """Each call within the store's deadline (asyncio.timeout, which tells its own expiry from a
    caller's cancel); the deadline and redis-py's connection and timeout errors become
    StateUnavailable (a ConnectionError), so the router catches one builtin type and never
    imports redis."""

    @functools.wraps(method)
    async def call(self, *args, **kwargs):
        try:
            async with asyncio.timeout(self._timeout_s):
                return await method(self, *args, **kwargs)
        except TimeoutError as e:  # the deadline (asyncio's TimeoutError is the builtin's from 3.11)
            raise StateUnavailable(f"redis: no answer within {self._timeout_s:g} s") from e
        except (RedisConnectionError, RedisTimeoutError) as e:
            raise StateUnavailable(f"redis: {e}") from e

    return call


def _check_client(client: Redis) -> None:
    # The decoding below reads str; a bytes client would compare b"e1" with "e1" and match nothing.
    if not client.connection_pool.connection_kwargs.get("decode_responses"):
        raise ValueError("the Redis client needs decode_responses=True (use redis_client(url))")


# KEYS[1] worker hash. ARGV: epoch, load JSON, last_seen, ttl ms. 1 if refreshed, 0 if not live
# under this epoch (HGET of a missing hash or field is false, never equal to a string).
_HEARTBEAT = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'load', ARGV[2], 'last_seen', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""

# KEYS[1] worker hash, KEYS[2] ids set. ARGV: epoch, worker id.
_DEREGISTER = """
if redis.call('HGET', KEYS[1], 'epoch') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
end
"""

# KEYS[1] ids set. ARGV: worker hash key prefix. Every live worker's HGETALL; ids whose hash
# expired leave the set here, so the set stays the size of the fleet without a SCAN.
_LIVE = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local fields = redis.call('HGETALL', ARGV[1] .. id)
  if #fields == 0 then redis.call('SREM', KEYS[1], id) else out[#out + 1] = fields end
end
return out
"""

# WorkerInfo's scalar fields, each a hash field as text (field types are strings under
# ``from __future__ import annotations``); load is JSON. Generic, so a field added to WorkerInfo
# round-trips without a change here, and a hash written before it existed decodes to the default.
_SCALARS = {f.name: {"str": str, "int": int, "float": float}[f.type]
            for f in dataclasses.fields(WorkerInfo) if f.name != "load"}
_LOAD_FIELDS = {f.name for f in dataclasses.fields(WorkerLoad)}


def _encode_worker(info: WorkerInfo) -> dict[str, str]:
    fields = {name: str(getattr(info, name)) for name in _SCALARS}
    fields["last_seen"] = repr(time.time())
    fields["load"] = json.dumps(dataclasses.asdict(info.load))
    return fields


def _decode_worker(flat: list[str]) -> WorkerInfo:
    f = dict(zip(flat[::2], flat[1::2]))
    load = {k: v for k, v in json.loads(f["load"]).items() if k in _LOAD_FIELDS}  # a newer writer's extras: skipped
    return WorkerInfo(**{name: conv(f[name]) for name, conv in _SCALARS.items() if name in f}, load=WorkerLoad(**load))


def _ttl_ms(ttl_s: float) -> int:
    return max(1, round(ttl_s * 1000))


class RedisRegistry(Registry):
    def __init__(self, client: Redis, key_prefix: str = "kvc:", timeout_s: float = 1.0):
        _check_client(client)
        self._redis = client
        self._timeout_s = timeout_s  # each call's deadline (_store_call)
        self._worker_prefix = f"{key_prefix}worker:"
        self._ids = f"{key_prefix}workers"
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._deregister = client.register_script(_DEREGISTER)
        self._live = client.register_script(_LIVE)

    @_store_call
    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        key = self._worker_prefix + info.worker_id
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)  # a new epoch starts from a clean hash
            pipe.hset(key, mapping=_encode_worker(info))
            pipe.pexpire(key, _ttl_ms(ttl_s))
            pipe.sadd(self._ids, info.worker_id)
            await pipe.execute()

    @_store_call
    async def heartbeat(self, worker_id: str, epoch: str, load: WorkerLoad, ttl_s: float) -> bool:
        args = [epoch, json.dumps(dataclasses.asdict(load)), repr(time.time()), _ttl_ms(ttl_s)]
        return bool(await self._heartbeat(keys=[self._worker_prefix + worker_id], args=args))

    @_store_call
    async def deregister(self, worker_id: str, epoch: str) -> None:
        await self._deregister(keys=[self._worker_prefix + worker_id, self._ids], args=[epoch, worker_id])

    @_store_call
    async def live_workers(self, model: str | None = None) -> list[WorkerInfo]:
        workers = [_decode_worker(flat) for flat in await self._live(keys=[self._ids], args=[self._worker_prefix])]
        return sorted((w for w in workers if model is None or w.model == model), key=lambda w: w.worker_id)

    async def aclose(self) -> None:
        await self._redis.aclose()


# ARGV: key prefix, worker id, epoch, model, then one (kind, hash) pair per event, hash "" for
# "cleared". The contract of PrefixIndex.apply, atomically; the events were checked in Python
# first, because a Lua error half-way would leave the first half applied.
_APPLY = """
local p, w, epoch, model = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local held = p .. 'held:' .. w
for i = 5, #ARGV, 2 do
  local kind, member = ARGV[i], model .. ':' .. ARGV[i + 1]
  if kind == 'cleared' then
    for _, m in ipairs(redis.call('SMEMBERS', held)) do redis.call('HDEL', p .. 'idx:' .. m, w) end
    redis.call('DEL', held)
  elseif kind == 'stored' then
    redis.call('HSET', p .. 'idx:' .. member, w, epoch)
    redis.call('SADD', held, member)
  elseif redis.call('HGET', p .. 'idx:' .. member, w) == epoch then
    redis.call('HDEL', p .. 'idx:' .. member, w)
    redis.call('SREM', held, member)
  end
end
if redis.call('EXISTS', held) == 1 then
  redis.call('SADD', p .. 'indexed', w)
else
  redis.call('SREM', p .. 'indexed', w)
end
"""

# KEYS: the index keys of the prompt's blocks, in prompt order (the hashes travel as decimal
# text inside the keys: a Lua number is a double and would round a 64-bit hash).
# ARGV: worker id, live epoch, worker id, live epoch, ...
# Returns each worker's count of leading blocks, in ARGV's order. Only workers that held every
# block so far are asked about the next one, and the walk stops when none is left.
_MATCH = """
local counts, alive = {}, {}
for j = 1, #ARGV / 2 do counts[j] = 0; alive[j] = j end
for b = 1, #KEYS do
  local ids = {}
  for k, j in ipairs(alive) do ids[k] = ARGV[2 * j - 1] end
  local epochs = redis.call('HMGET', KEYS[b], unpack(ids))
  local still = {}
  for k, j in ipairs(alive) do
    if epochs[k] == ARGV[2 * j] then still[#still + 1] = j; counts[j] = b end
  end
  alive = still
  if #alive == 0 then break end
end
return counts
"""


class RedisPrefixIndex(PrefixIndex):
    def __init__(self, client: Redis, key_prefix: str = "kvc:", timeout_s: float = 1.0):
        _check_client(client)
        self._redis = client
        self._timeout_s = timeout_s  # each call's deadline (_store_call)
        self._prefix = key_prefix
        self._apply = client.register_script(_APPLY)
        self._match = client.register_script(_MATCH)

    @_store_call
    async def apply(self, worker_id: str, epoch: str, model: str, events: list[CacheEvent]) -> None:
        check_events(events)
        if not events:
            return
        args = [self._prefix, worker_id, epoch, model]
        for ev in events:
            args += (ev.kind, "" if ev.block_hash is None else str(ev.block_hash))
        await self._apply(args=args)

    @_store_call
    async def match(self, model: str, block_hashes: list[int], workers: dict[str, str]) -> dict[str, int]:
        if not block_hashes or not workers:
            return dict.fromkeys(workers, 0)
        keys = [f"{self._prefix}idx:{model}:{int(h)}" for h in block_hashes]
        args = [x for worker_epoch in workers.items() for x in worker_epoch]
        counts = await self._match(keys=keys, args=args)
        return dict(zip(workers, counts))

    @_store_call
    async def drop_worker(self, worker_id: str) -> None:
        await self._apply(args=[self._prefix, worker_id, "", "", "cleared", ""])

    @_store_call
    async def indexed_workers(self) -> set[str]:
        return set(await self._redis.smembers(f"{self._prefix}indexed"))

    async def aclose(self) -> None:
        await self._redis.aclose()
