"""The tensor-parallel group of this process: its rank and size, and the few collectives a model
and the step broadcast need. A process that never joins a group is rank 0 of 1, and every
collective is then a no-op, so single-GPU and CPU code paths pay nothing.

Two process groups: the device group (NCCL on GPUs, gloo on CPU) carries the model's all-reduces,
the logits gather and, under the lookahead, rank 0's sampled tokens; a gloo group carries each
step's scheduled inputs from rank 0 (model_runner.StepInputs, pickled), which must not wait
behind GPU work.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Followers wait for rank 0's next step for as long as the worker is idle; a dead rank 0 still
# shows at once, as a closed connection.
_IDLE_TIMEOUT = datetime.timedelta(days=365)
# The step broadcast's fixed first message, in bytes: a pickled decode step of 256 sequences at
# 1k tokens fits whole, and a step of one costs no more than with 16 KiB (benchmarks/tp_broadcast.py)
FIRST_CHUNK = 1 << 16


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    device_group: Any = None  # torch ProcessGroup; None when size == 1
    cpu_group: Any = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank 0's slice first."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:  # one NCCL call, capturable in a CUDA graph
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.device_group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (ranks agree on a KV pool size)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (rank 0 passes it, the others receive it): pickled, its
        length and first bytes in one broadcast of FIRST_CHUNK bytes on the CPU group, any rest in
        a second (torch's broadcast_object_list always takes two, the length first)."""
        if self.size == 1:
            return obj
        chunk = torch.empty(FIRST_CHUNK, dtype=torch.uint8)
        buf = chunk.numpy()  # the same memory: written and read without copies
        head = FIRST_CHUNK - 8
        if self.is_driver:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            buf[:8] = memoryview(len(data).to_bytes(8, "little"))
            buf[8 : 8 + min(len(data), head)] = memoryview(data)[:head]
            dist.broadcast(chunk, src=0, group=self.cpu_group)
            if len(data) > head:
                dist.broadcast(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8), src=0,
                               group=self.cpu_group)
            return obj
        dist.broadcast(chunk, src=0, group=self.cpu_group)
        n = int.from_bytes(buf[:8].tobytes(), "little")
        if n <= head:
            return pickle.loads(buf[8 : 8 + n])
        rest = torch.empty(n - head, dtype=torch.uint8)
        dist.broadcast(rest, src=0, group=self.cpu_group)
        return pickle.loads(buf[8:].tobytes() + rest.numpy().tobytes())

    def broadcast_device(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's device tensor ``x`` on every rank, in place: sampled tokens, on the device
        group (NCCL on GPUs: queued on the device, the host does not wait)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.device_group)
        return x


_group = TPGroup()


def get_tp() -> TPGroup:
    return _group


def init_tp(rank: int, size: int, init_method: str, device: str, timeout_s: float = 600.0) -> TPGroup:
    """Join the tensor-parallel group of ``size`` ranks at ``init_method`` (tcp://host:port of rank 0);
    blocks until every rank has joined. ``timeout_s`` bounds the join and each device collective."""
    global _group
    if size == 1:
        _group = TPGroup()
        return _group
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    if "127.0.0.1" in init_method:
        # The ranks of a worker share a node and meet on loopback; gloo would otherwise pick its
        # interface from the hostname, which need not resolve here.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    _group = TPGroup(rank, size, dist.group.WORLD, cpu_group)
    return _group


def leave_tp(timeout_s: float = 10.0) -> bool:
    """Leave the group with the other ranks, after rank 0's close: meet at a barrier on the CPU
    group, then destroy the process groups all at once (a rank destroying NCCL alone, after the
    others had gone, hung on GPUs). Each part waits at most ``timeout_s``. False when the destroy
    did not finish: the process should then end with ``os._exit`` (the interpreter's exit would
    wait on it too)."""
    global _group
    group, _group = _group, TPGroup()
    if not dist.is_initialized():
        return True
    if group.cpu_group is not None:
        try:
            dist.monitored_barrier(group=group.cpu_group, timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # a rank that never came: destroy anyway, and say so
            log.warning("tensor-parallel rank %d: the other ranks did not reach the teardown: %s", group.rank, exc)
    destroyer = threading.Thread(target=dist.destroy_process_group, name="tp-destroy", daemon=True)
    destroyer.start()
    destroyer.join(timeout_s)
    if destroyer.is_alive():
        log.warning("tensor-parallel rank %d: destroying the process group took over %.0f s; leaving without it",
                    group.rank, timeout_s)
        return False
    return True
