"""The engine core: an LLMEngine's step loop in a process of its own, next to no network server.

    front end (gRPC server, tokenizer, detokenizer, stop strings)    client.EngineCoreClient
        |  Add / Abort / Control (a request's inputs once)   ^  Ready, then one Step per engine step
        v                                                    |  (every request's new tokens, load, cache events)
    engine core (this module): scheduler, block manager, model runner; tensor-parallel rank 0

The loop takes whatever inputs have arrived (without waiting while requests run), steps once and
sends that step's outputs as one message. Requests run here with no stop strings and no
detokenization: the front end does both off the step loop and aborts a request a stop string ends.
It exits when told to, when its front end's process dies, or (code 1, after a ``Failed``) when
the engine breaks.

Started by ``EngineCoreClient`` as ``python -m worker.core.process``; not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time

import msgspec
import zmq

from worker.core.messages import TO_CORE, Abort, Add, CoreOutput, Failed, Ready, Step
from worker.engine.config import EngineConfig

log = logging.getLogger(__name__)

_IDLE_POLL_MS = 500  # idle, the loop wakes this often to see whether its front end still lives


class EngineCore:
    def __init__(self, engine, inputs: zmq.Socket, outputs: zmq.Socket):
        self.engine = engine
        self.inputs, self.outputs = inputs, outputs
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(TO_CORE).decode
        self._send_kv_events = False
        self._snapshot = False

    def run(self, parent_alive) -> None:
        """Step until told to stop (returns) or the front end's process is gone (returns)."""
        engine = self.engine
        poller = zmq.Poller()
        poller.register(self.inputs, zmq.POLLIN)
        while True:
            busy = engine.has_unfinished()
            handled = False
            if poller.poll(0 if busy else _IDLE_POLL_MS):
                handled = True
                if not self._take_inputs():
                    return
            elif not busy and not parent_alive():
                log.warning("engine core: the front end is gone; exiting")
                return
            if busy or engine.has_unfinished():
                self._send(engine.step())
            elif handled:
                self._send([])  # aborts or a snapshot while idle: the load and events changed

    def _take_inputs(self) -> bool:
        """Apply every message waiting on the socket; False when told to shut down."""
        engine = self.engine
        while True:
            try:
                msg = self._decode(self.inputs.recv(zmq.NOBLOCK, copy=False).buffer)
            except zmq.Again:
                return True
            if isinstance(msg, Add):
                try:
                    engine.add_request(msg.prompt_token_ids, msg.params, request_id=msg.request_id,
                                       arrival_time=msg.arrival_time)
                except Exception as exc:  # validated at the door: a race (e.g. a reused id), not a crash
                    self._send([], [CoreOutput(msg.request_id, [], finish_reason="error",
                                               error=f"{type(exc).__name__}: {exc}")])
            elif isinstance(msg, Abort):
                for request_id in msg.request_ids:
                    engine.abort_request(request_id)
            elif msg.kind == "shutdown":
                return False
            elif msg.kind == "kv_events":
                self._send_kv_events = True
            elif msg.kind == "snapshot":
                self._snapshot = True

    def _send(self, outputs, extra: list[CoreOutput] = ()) -> None:
        engine = self.engine
        bm = engine.block_manager
        events = bm.drain_events()
        snapshot, self._snapshot = self._snapshot, False
        if snapshot:
            events = bm.snapshot_events()  # supersedes what came before
        kv_events = [(e.kind, e.block_hash) for e in events] if self._send_kv_events or snapshot else []
        core_outputs = list(extra)
        requests = engine.requests
        for out in outputs:
            seq = requests.get(out.request_id)
            cached = out.usage.cached_tokens if out.usage is not None else (seq.num_cached_tokens or 0) if seq else 0
            logprobs = None
            if out.logprobs is not None:
                logprobs = [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]
            prompt_logprobs = None
            if out.prompt_logprobs is not None:
                prompt_logprobs = [(lp.token_id, lp.logprob, lp.top) for lp in out.prompt_logprobs]
            core_outputs.append(CoreOutput(out.request_id, out.new_token_ids, cached, logprobs,
                                           out.finish_reason if out.finished else None, out.error, prompt_logprobs))
        self.outputs.send(self._encode(Step(core_outputs, engine.stats(), kv_events, snapshot)), copy=False)


def core_params(params):
    """The request as the core runs it: the front end detokenizes and checks stop strings itself."""
    return dataclasses.replace(params, stop=[], detokenize=False)


def serve_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int,
               init_method: str | None = None) -> int:
    """Build the engine, say Ready, run the loop. The exit code the process ends with."""
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(output_addr)
    encode = msgspec.msgpack.Encoder().encode
    engine = None
    left = True
    try:
        if config.tensor_parallel_size > 1:
            from worker.distributed.ranks import join_as_rank0

            # The other ranks were started by the front end (child processes or Ray actors); it
            # watches them and ends this process if one dies.
            join_as_rank0(config, init_method, lambda: None)
        from worker.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
        outputs.send(encode(Ready(engine.model_id, engine.max_model_len, engine.model_config.vocab_size,
                                  engine.block_manager.num_blocks, config.block_size, os.getpid())))
        EngineCore(engine, inputs, outputs).run(lambda: os.getppid() == parent_pid)
        code = 0
    except BaseException as exc:  # say why before going, so the front end can tell its clients
        log.exception("engine core failed")
        try:
            outputs.send(encode(Failed(f"{type(exc).__name__}: {exc}")))
        except Exception:
            pass
        code = 1
    finally:
        if engine is not None:
            try:
                engine.close()  # tensor-parallel ranks leave their step loop
            except Exception:
                log.exception("closing the engine failed")
        if config.tensor_parallel_size > 1:
            from worker.distributed.group import leave_tp

            left = leave_tp()  # together with the other ranks, which leave as the close reaches them
        outputs.close(linger=2000)  # the last message goes out before the process does
        inputs.close(linger=0)
        ctx.term()
    if not left:  # the group's teardown hung: the interpreter's exit would wait on it too
        log.warning("engine core exits (code %d) without its tensor-parallel group's teardown", code)
        logging.shutdown()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a kvcascade worker's engine core (internal)")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--input", required=True, help="ZeroMQ address the front end sends requests on")
    parser.add_argument("--output", required=True, help="ZeroMQ address the outputs go to")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--init-method", help="tensor parallelism: tcp://host:port of the group")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s core %(name)s: %(message)s")
    # The front end decides when the core stops (after its drain): a Ctrl-C to the terminal's
    # process group must not end the steps of requests still finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from worker.distributed.ranks import dump_stacks_on_sigusr1, exit_when_parent_dies

    dump_stacks_on_sigusr1()
    exit_when_parent_dies(args.parent_pid)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = EngineConfig(**json.loads(args.config))
    started = time.monotonic()
    code = serve_core(config, args.input, args.output, args.parent_pid, args.init_method)
    log.info("engine core exits (code %d) after %.0f s", code, time.monotonic() - started)
    return code


if __name__ == "__main__":
    sys.exit(main())
