"""The tensor-parallel group of this process: its rank and size, and the few collectives a model
and the step broadcast need. A process that never joins a group is rank 0 of 1, and every
collective is then a no-op, so single-GPU and CPU code paths pay nothing.

Two process groups: the device group (NCCL on GPUs, gloo on CPU) carries the model's all-reduces
and the logits gather; a gloo group carries each step's scheduled inputs from rank 0, which are
small Python objects and must not wait behind GPU work.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Followers wait for rank 0's next step for as long as the worker is idle; a dead rank 0 still
# shows at once, as a closed connection.
_IDLE_TIMEOUT = datetime.timedelta(days=365)


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
        """Rank 0's ``obj`` on every rank (rank 0 passes it, the others receive it)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


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


def destroy_tp() -> None:
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TPGroup()
