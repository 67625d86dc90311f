"""The ``kvcascade`` command: ``serve`` (all in one process), ``worker`` (one worker) and ``generate``.

Engine flags map onto EngineConfig fields and take their defaults from the dataclass, so the
defaults live in one place; a flag left out is not passed at all.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.engine.config import EngineConfig

logger = logging.getLogger("kvcascade")

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "ki": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mi": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gi": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "ti": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'512MiB' -> 536870912. Binary for K/M/G/T, KiB.., Ki..; decimal for KB, MB, GB, TB."""
    match = _BYTES_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB, 2GiB or a number of bytes)")
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


def _format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


@dataclass(frozen=True)
class _EngineFlag:
    flag: str
    field: str  # the EngineConfig field it sets
    type: Callable[[str], Any]
    help: str
    unset: str = "auto"  # what the field's None default means, for --help


_ENGINE_FLAGS = (
    _EngineFlag("--model", "model", str, "built-in model name, a .gguf file or a safetensors folder"),
    _EngineFlag("--tokenizer", "tokenizer", str,
                "a tokenizer folder, tokenizer.json or .gguf to use instead of the model's (e.g. for dummy: models)"),
    _EngineFlag("--device", "device", str, "torch device: cpu, cuda, cuda:1, ..."),
    _EngineFlag("--dtype", "dtype", str, "weight and activation dtype: float32, bfloat16, float16"),
    _EngineFlag("--kv-cache-dtype", "kv_cache_dtype", str,
                "KV-cache storage: auto (the model's dtype), int8 or fp8 (e4m3; GPUs of compute capability 8.9+), "
                "each with a scale per token and KV head: about twice the tokens of a bf16 pool in the same memory"),
    _EngineFlag("--quantization", "quantization", str,
                "weight-only quantization (W8A16 / W4A16): none (dense floats), auto (a quantized checkpoint as it "
                "ships: GGUF Q4_0/Q4_1/Q4_K as int4, Q5_0/Q8_0/Q6_K as int8), int8 or int4 (a float checkpoint "
                "quantized at load, a scale per group of input columns); the LM head is int8"),
    _EngineFlag("--quantization-group-size", "quantization_group_size", int,
                "input columns per int8/int4 scale: 16, 32, 64, 128 or 256"),
    _EngineFlag("--block-size", "block_size", int, "tokens per KV-cache block"),
    _EngineFlag("--max-num-seqs", "max_num_seqs", int, "most requests running in one step"),
    _EngineFlag("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget of one engine step"),
    _EngineFlag("--max-model-len", "max_model_len", int, "longest prompt plus completion, in tokens"),
    _EngineFlag("--kv-cache-memory", "kv_cache_bytes", parse_bytes, "KV-cache size, e.g. 512MiB or 2GiB"),
    _EngineFlag("--max-queued-requests", "max_queued_requests", int, "requests in flight before new ones are refused"),
    _EngineFlag("--seed", "seed", int, "seed of dummy (random) weights"),
    _EngineFlag("--generation-config", "generation_config", str,
                "sampling defaults for fields a request leaves unset: auto (the model's generation_config.json, "
                "or its --tokenizer folder's), vllm (the engine's: temperature 1, top_p 1, no top-k) or a folder"),
    _EngineFlag("--speculative", "speculative", str,
                "speculative decoding: ngram or ngram:MIN-MAX: prompt lookup drafts (what followed the latest "
                "earlier match of the last MIN..MAX tokens; default 1-4), or draft:MODEL: a smaller model with the "
                "same tokenizer drafts (its KV shares the pool); one forward verifies them; the output "
                "is the target model's, exactly (greedy) or in distribution (sampled). A request opts out with "
                "speculative: false", unset="off"),
    _EngineFlag("--num-speculative-tokens", "num_speculative_tokens", int,
                "tokens --speculative drafts per step, 1 to 16"),
    _EngineFlag("--speculative-max-batch", "speculative_max_batch", int,
                "draft only while at most this many requests run (CPU: verification rows cost compute past ~4 "
                "rows; GPU: nearly free to ~100)", unset="always"),
    _EngineFlag("--speculative-draft-quantization", "speculative_draft_quantization", str,
                "the draft model's weights, as --quantization (default: the target's): e.g. a dense target "
                "checked against its checkpoint with an int4 draft, cheaper per drafted token", unset="the target's"),
    _EngineFlag("--tp", "tensor_parallel_size", int,
                "tensor parallel size: ranks (GPUs of this node with --device cuda, else CPU processes) the "
                "model is split over; --kv-cache-memory is then per rank"),
)


def _field_default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    group = parser.add_argument_group("engine (EngineConfig)")
    for spec in _ENGINE_FLAGS:
        default = _field_default(fields[spec.field])
        shown = spec.unset if default is None else _format_bytes(default) if spec.type is parse_bytes else default
        # SUPPRESS: an absent flag stays absent, so EngineConfig applies its own default.
        group.add_argument(
            spec.flag, dest=spec.field, type=spec.type, default=argparse.SUPPRESS,
            metavar=spec.flag.removeprefix("--").replace("-", "_").upper(), help=f"{spec.help} (default: {shown})",
        )  # fmt: skip


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the engine flags given on the command line."""
    given = {spec.field: getattr(args, spec.field) for spec in _ENGINE_FLAGS if hasattr(args, spec.field)}
    return EngineConfig(**given)


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gRPC server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    group.add_argument("--port", type=int, default=50051, help="gRPC port; 0 picks a free one (default: %(default)s)")
    group.add_argument(
        "--grace-period", type=float, default=5.0,
        help="seconds running requests get to finish on SIGINT/SIGTERM (default: %(default)s)",
    )  # fmt: skip


def _add_generate_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:50051", help="server address (default: %(default)s)")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--max-tokens", type=int, help="most tokens to generate (default: the server's)")
    parser.add_argument("--temperature", type=float, help="0 is greedy (default: the server's)")
    parser.add_argument("--seed", type=int, help="makes a sampled answer reproducible")
    parser.add_argument("--timeout", type=float, help="deadline of the call in seconds")
    parser.add_argument("--api-key", help="the server's API key (default: KVCASCADE_API_KEY, if set)")
    parser.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's CAs")
    parser.add_argument("--tls-ca", metavar="PEM", help="connect over TLS trusting this CA certificate (so --tls)")


def _add_state_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("shared state")
    group.add_argument("--redis-url", help="Redis for the worker registry and prefix index "
                       "(redis://[:password@]host:port/db, rediss:// for TLS); default: in memory, one process")
    group.add_argument("--key-prefix", default="kvc:", help="Redis key prefix, so deployments can share one "
                       "Redis (default: %(default)s)")


def _add_router_flags(parser: argparse.ArgumentParser) -> None:
    from router.policy import POLICIES

    group = parser.add_argument_group("router")
    group.add_argument("--http-port", type=int, default=8000,
                       help="port of the OpenAI-style HTTP API (default: %(default)s)")
    group.add_argument("--http-workers", type=int, default=1, metavar="N",
                       help="processes serving the HTTP API on --http-port (SO_REUSEPORT: the kernel spreads "
                            "connections over them), for when one saturates a core relaying streams; they share "
                            "the registry and index in Redis, so serve without --redis-url then starts a local "
                            "redis-server. /metrics answers for the one process a scrape reaches (default: %(default)s)")
    group.add_argument("--policy", default="prefix_aware", choices=sorted(POLICIES),
                       help="how to pick a worker (default: %(default)s)")
    group.add_argument("--max-body-mb", type=float, default=16.0, metavar="MB",
                       help="largest HTTP request body taken, in MiB; a larger one is answered 413 before it is read "
                            "whole (default: %(default)s)")
    group.add_argument("--api-key", action="append", default=[], dest="api_keys",
                       help="require this API key (repeatable; also KVCASCADE_API_KEYS, comma-separated); never "
                            "logged. Health endpoints stay open")
    group.add_argument("--protect-metrics", action="store_true",
                       help="/metrics needs an API key too (default: open, for Prometheus inside the cluster)")
    group.add_argument("--rate-limit", type=float, metavar="RPS",
                       help="requests per second each client (API key, else address) may send, sustained; more get "
                            "429 / RESOURCE_EXHAUSTED with retry-after (default: no limit). Per router process")
    group.add_argument("--rate-burst", type=int, metavar="N",
                       help="requests a client may send at once above --rate-limit (default: the rate, at least 1)")
    group.add_argument("--max-concurrent-per-client", type=int, metavar="N",
                       help="requests each client may have under way at once (a stream counts until it ends); more "
                            "get 429 / RESOURCE_EXHAUSTED (default: no limit). Per router process")
    group.add_argument("--tls-cert", metavar="PEM", help="serve gRPC and HTTP over TLS with this certificate chain "
                       "(with --tls-key; a Kubernetes TLS Secret's tls.crt)")
    group.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert (tls.key)")
    group.add_argument("--cascade", metavar="FILE",
                       help="answer with a small model first, escalating by confidence, as this YAML file says "
                            "(deploy/cascade.example.yaml); re-read when it changes. serve starts one worker per "
                            "model the file names (so no --model)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcascade", description="Prefix-aware, cascading LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="run everything in one process (the embedded default)",
        description="Run a worker and the router in one process: gRPC on --port, the OpenAI-style "
                    "HTTP API on --http-port, in-memory registry and prefix index, CPU by default.",
    )  # fmt: skip
    worker = commands.add_parser(
        "worker", help="run one worker: an engine behind a gRPC server",
        description="Run one worker: an engine behind the KVCascade gRPC service; with --redis-url "
                    "it registers, heartbeats and publishes its prefix-cache events.",
    )  # fmt: skip
    router = commands.add_parser(
        "router", help="run the router over the workers registered in Redis",
        description="Route requests to the workers registered in Redis, by prefix-cache overlap and "
                    "load, over gRPC (the same API as a worker) and OpenAI-style HTTP.",
    )  # fmt: skip
    for sub in (serve, worker):
        _add_engine_flags(sub)
    for sub in (serve, worker, router):
        _add_server_flags(sub)
        _add_state_flags(sub)
    for sub in (serve, router):
        _add_router_flags(sub)
    router.add_argument("--tokenizer", metavar="PATH",
                        help="tokenize every model's prompts with this tokenizer folder, tokenizer.json or .gguf "
                             "(default: the one each worker registers: its --tokenizer, else its model's)")
    group = serve.add_argument_group("Ray (workers as actors; README: 'Ray and tensor parallelism')")
    group.add_argument("--workers", type=int, metavar="N",
                       help="run N workers (per model) as Ray actor groups, each on --tp GPUs or CPU ranks of one "
                            "node, behind the router in this process (default: one embedded worker, no Ray)")
    group.add_argument("--address", metavar="RAY_ADDRESS",
                       help="join this Ray cluster (host:port of its head) instead of starting a local one; "
                            "needs --redis-url that every node reaches")
    group = serve.add_argument_group("replicas (data parallel on this node, no Ray)")
    group.add_argument("--replicas", type=int, default=1, metavar="N",
                       help="run N engines per model, each in its own process on GPUs of its own (--tp of them; "
                            "N x --tp GPUs per model) or on an equal share of the CPU cores, behind the router in "
                            "this process, which routes by their prefix caches and load (default: %(default)s)")
    group = worker.add_argument_group("registration")
    group.add_argument("--worker-id", help="stable id of this worker (default: hostname-port)")
    group.add_argument("--advertise-address", help="host:port routers dial (default: --host:--port)")
    group.add_argument("--heartbeat-ttl", type=float, default=5.0,
                       help="seconds without a heartbeat before routers stop sending here (default: %(default)s)")
    generate = commands.add_parser(
        "generate", help="stream one completion from a running server to stdout",
        description="Send one Generate call and stream the text to stdout; usage goes to stderr.",
    )  # fmt: skip
    _add_generate_flags(generate)
    from loadtest.cli import add_arguments as add_loadtest_arguments  # argparse only: cheap

    from kvcascade.calibrate import add_arguments as add_cascade_arguments

    add_cascade_arguments(commands.add_parser(
        "cascade", help="cascade tools: calibrate a cascade file on labelled tasks",
        description="Tools for the cascade file (router --cascade): `calibrate` finds the cheapest setting "
                    "that keeps a target share of the last tier's quality on labelled tasks.",
    ))  # fmt: skip

    add_loadtest_arguments(commands.add_parser(
        "loadtest", help="run a load-test scenario against a server (or compare several)",
        description="Send a scenario's workload (YAML) over gRPC or OpenAI-style HTTP and report TTFT, TPOT, "
                    "latency, throughput, goodput and cache hits: a table, summary.json and plots in --out.",
    ))  # fmt: skip
    return parser


# --- serve / worker / router ------------------------------------------------------------------


async def _run(args: argparse.Namespace) -> None:
    # Imported here so `kvcascade --help` and `generate` do not pay for torch.
    from kvcascade.launch import (RouterOptions, Running, WorkerOptions, replica_placements, start_router,
                                  start_worker, wait_for_signal)

    running = Running()
    try:
        if args.command == "worker":
            await start_worker(engine_config(args), WorkerOptions(
                host=args.host, port=args.port, redis_url=args.redis_url, worker_id=args.worker_id,
                advertise_address=args.advertise_address, heartbeat_ttl_s=args.heartbeat_ttl,
                key_prefix=args.key_prefix, grace_s=args.grace_period, exit_on_failure=True), running)
        else:
            ropts = RouterOptions(host=args.host, port=args.port, http_port=args.http_port,
                                  redis_url=args.redis_url, policy=args.policy, access=args.access,
                                  tls=args.tls, key_prefix=args.key_prefix,
                                  cascade=args.cascade, http_workers=args.http_workers,
                                  max_body_bytes=int(args.max_body_mb * 2**20),
                                  tokenizer=args.tokenizer if args.command == "router" else None)
            if _needs_local_redis(args):
                from deploy.local import LocalRedis

                redis = LocalRedis().start()
                running.on_stop(redis.stop)
                ropts.redis_url = redis.url
            if args.command == "serve" and (args.workers or args.address):
                from kvcascade.ray_serve import start_ray_workers

                await start_ray_workers(_serve_engine_configs(args), args.workers or 1, running,
                                        address=args.address, redis_url=ropts.redis_url, key_prefix=args.key_prefix,
                                        grace_s=args.grace_period)
                await start_router(ropts, running, grace_s=args.grace_period)
            elif args.command == "serve":
                from contracts.stores import connect_state

                registry, index = connect_state(ropts.redis_url, args.key_prefix)
                running.on_stop(registry.aclose)
                # The embedded workers listen on free loopback ports; clients use the router's, and
                # the router in this process calls them directly.
                configs = [c for c in _serve_engine_configs(args) for _ in range(args.replicas)]
                placements = (replica_placements(len(configs), configs[0]) if args.replicas > 1
                              else [None] * len(configs))
                servers = await _start_all([
                    start_worker(config, WorkerOptions(host="127.0.0.1", port=0, grace_s=args.grace_period,
                                                       exit_on_failure=True),
                                 running, registry=registry, index=index, env=env)
                    for config, env in zip(configs, placements)])
                await start_router(ropts, running, registry=registry, index=index, grace_s=args.grace_period,
                                   local_workers=servers)
            else:
                await start_router(ropts, running, grace_s=args.grace_period)
        logger.info("kvcascade %s ready", args.command)
        await wait_for_signal()
        logger.info("shutting down (grace period %.1fs)", args.grace_period)
    finally:
        await running.stop()
    logger.info("stopped")


async def _start_all(starts: list) -> list:
    """Start workers together (their models load at once) and return their servers; the first
    failure is raised once every start has ended, so none is still starting while serve stops."""
    results = await asyncio.gather(*starts, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _needs_local_redis(args: argparse.Namespace) -> bool:
    """serve without --redis-url keeps the registry and index in memory, which Ray workers and
    other HTTP processes cannot see: it starts a redis-server of its own for them instead."""
    return args.command == "serve" and not args.redis_url and bool(args.workers or args.http_workers > 1)


def _serve_engine_configs(args: argparse.Namespace) -> list[EngineConfig]:
    """One engine per embedded worker: the --model one, or with --cascade one per model it names."""
    if not args.cascade:
        return [engine_config(args)]
    from router.cascade_config import load_cascade

    base = engine_config(args)
    return [dataclasses.replace(base, model=model) for model in load_cascade(args.cascade).models]


def _check_tokenizer_path(path: str | None) -> None:
    if path and not os.path.exists(path):
        raise FileNotFoundError(f"--tokenizer {path}: no such file or folder")


def _check_tp(config: EngineConfig) -> None:
    """Refuse a --tp the model cannot be split into, before any rank starts."""
    if config.tensor_parallel_size == 1:
        return
    from worker.distributed.partition import check_tp
    from contracts.models import resolve_model
    from worker.models.loader import load_config

    cfg = load_config(resolve_model(config.model))
    try:
        check_tp(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, config.tensor_parallel_size)
    except ValueError as err:
        raise ValueError(f"--tp {config.tensor_parallel_size}: {err}") from None


# --- generate ---------------------------------------------------------------------------------


def _access(args: argparse.Namespace):
    from kvcascade.launch import api_keys_from_env
    from router.access import Access
    from router.limits import Limits

    try:
        limits = Limits(rate=args.rate_limit, burst=args.rate_burst, concurrency=args.max_concurrent_per_client)
    except ValueError as err:
        raise ValueError(f"--rate-limit / --rate-burst / --max-concurrent-per-client: {err}") from None
    keys = (*args.api_keys, *api_keys_from_env())
    if args.protect_metrics and not keys:
        raise ValueError("--protect-metrics needs an API key (--api-key or KVCASCADE_API_KEYS)")
    return Access(api_keys=keys, limits=limits, protect_metrics=args.protect_metrics)


def _tls(args: argparse.Namespace):
    if args.tls_cert is None and args.tls_key is None:
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    from contracts.tls import TlsFiles

    return TlsFiles(args.tls_cert, args.tls_key)


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from protos import kvcascade_pb2 as pb
    from protos import kvcascade_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams()
    for name in ("max_tokens", "temperature", "seed"):
        if getattr(args, name) is not None:
            setattr(sampling, name, getattr(args, name))
    request = pb.GenerateRequest(sampling=sampling)
    if args.chat:
        request.messages.messages.add(role="user", content=args.prompt)
    else:
        request.text = args.prompt
    last = None
    key = args.api_key or os.environ.get("KVCASCADE_API_KEY")
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    if args.tls or args.tls_ca:
        ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
        channel = grpc.secure_channel(args.target, grpc.ssl_channel_credentials(root_certificates=ca))
    else:
        channel = grpc.insecure_channel(args.target)
    with channel:
        try:
            for last in pb_grpc.KVCascadeStub(channel).Generate(request, timeout=args.timeout, metadata=metadata):
                sys.stdout.write(last.text)
                sys.stdout.flush()
        except grpc.RpcError as err:
            print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print()
    if last is not None:
        u = last.usage
        print(
            f"[{last.finish_reason}] prompt {u.prompt_tokens} (cached {u.cached_tokens}), "
            f"completion {u.completion_tokens} tokens, ttft {last.ttft_s * 1000:.0f} ms",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "router":  # it only tokenizes: no torch for transformers to load (contracts/tokenizers.py)
        from contracts.tokenizers import hide_torch

        hide_torch()
    if args.command == "generate":
        return _generate(args)
    if args.command == "cascade":
        from kvcascade.calibrate import main as cascade_main

        return cascade_main(args)
    if args.command == "loadtest":
        from loadtest.cli import main as loadtest_main

        return loadtest_main(args)
    if args.command == "serve" and args.cascade and hasattr(args, "model"):
        parser.error("serve --cascade starts one worker per model the cascade file names: leave out --model")
    if args.command != "router":
        from contracts.models import resolve_model

        try:  # check the flags (and the cascade file) before loading anything
            for config in _serve_engine_configs(args) if args.command == "serve" else [engine_config(args)]:
                resolve_model(config.model)
                _check_tokenizer_path(config.tokenizer)
        except (ValueError, FileNotFoundError) as err:  # CascadeConfigError is a ValueError
            parser.error(str(err))
    elif args.cascade:
        from router.cascade_config import load_cascade

        try:
            load_cascade(args.cascade)
        except ValueError as err:
            parser.error(str(err))
    if args.command == "serve" and args.workers is not None and args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.command == "serve" and args.replicas < 1:
        parser.error(f"--replicas must be >= 1, got {args.replicas}")
    if args.command == "serve" and args.replicas > 1 and (args.workers or args.address):
        parser.error("--replicas runs engines on this node without Ray; --workers/--address run them as Ray actors: "
                     "use one or the other")
    if args.command == "serve" and args.replicas > 1:
        from kvcascade.launch import replica_placements

        try:
            configs = _serve_engine_configs(args)
            replica_placements(len(configs) * args.replicas, configs[0])
        except ValueError as err:
            parser.error(str(err))
    if args.command == "serve" and args.address and not args.redis_url:
        parser.error("--address needs --redis-url: workers on other nodes register there")
    if args.command in ("serve", "router") and args.http_workers < 1:
        parser.error(f"--http-workers must be >= 1, got {args.http_workers}")
    if args.command in ("serve", "router"):
        try:  # the options the fronts take, checked (and the TLS files read) before anything starts
            args.access, args.tls = _access(args), _tls(args)
            from kvcascade.launch import RouterOptions

            RouterOptions(max_body_bytes=int(args.max_body_mb * 2**20))
        except ValueError as err:
            parser.error(str(err))
    if _needs_local_redis(args):
        from deploy.local import redis_server_binary

        try:
            redis_server_binary()
        except FileNotFoundError as err:
            flag = f"--http-workers {args.http_workers}" if args.http_workers > 1 else f"--workers {args.workers}"
            print(f"kvcascade serve: error: {flag} without --redis-url needs a local Redis: {err}", file=sys.stderr)
            return 1
    if args.command != "router":
        try:
            for config in _serve_engine_configs(args) if args.command == "serve" else [engine_config(args)]:
                _check_tp(config)
        except ValueError as err:
            parser.error(str(err))
    if args.command == "router":
        try:
            _check_tokenizer_path(args.tokenizer)
        except FileNotFoundError as err:
            parser.error(str(err))
    if args.command == "router" and not args.redis_url:
        parser.error("router needs --redis-url: that is where workers register (kvcascade serve runs "
                     "router and worker in one process without Redis)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvcascade.launch import StartupError
    from router.event_loop import run

    try:
        run(_run(args))  # on uvloop where installed: less per gRPC message and SSE event
    except KeyboardInterrupt:  # a Ctrl-C while the model is still loading
        return 130
    except StartupError as err:  # everything started so far has been stopped by then
        print(f"kvcascade {args.command}: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
