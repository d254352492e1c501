"""This process's place in a torch.distributed job: online training and profiling share it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Dist", "current_dist", "init_distributed_from_env"]


@dataclass
class Dist:
    """This process's place in a torch.distributed job (rank 0 of 1 without one)."""

    rank: int = 0
    world_size: int = 1

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self.active:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()


def current_dist() -> Dist:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return Dist(torch.distributed.get_rank(), torch.distributed.get_world_size())
    return Dist()


def init_distributed_from_env(device: str) -> Dist:
    """Join the torchrun job described by the environment (RANK/WORLD_SIZE/MASTER_ADDR...), if any:
    gloo on CPU, nccl on CUDA. Without those variables: a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return current_dist()
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend=backend)
    return current_dist()
