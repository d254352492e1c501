"""This process's place in a torch.distributed job: feature extraction, online training and profiling share it."""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.errors import CtrlError
from runtime.base import ModelLoadError

__all__ = ["Dist", "RankFailedError", "current_dist", "init_distributed_from_env", "local_device"]


class RankFailedError(CtrlError):
    """Another rank of the torchrun job failed: this one stops too instead of waiting for it."""


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

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order), None on the others."""
        if not self.active:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        torch.distributed.gather_object(obj, out, dst=0)
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

    @contextmanager
    def fail_together(self) -> Iterator[None]:
        """Work every rank does between two collectives: when it raises on one rank, it raises on all.

        Every rank enters and leaves the block once, so no rank waits in a later collective for
        one that has stopped: the failing rank re-raises its own error after telling the others,
        which raise :class:`RankFailedError` naming it (one line).
        """
        if not self.active:
            yield
            return
        try:
            yield
        except Exception as e:
            self.all_gather(_one_line(e))
            raise
        failed = [(rank, error) for rank, error in enumerate(self.all_gather(None)) if error is not None]
        if failed:
            rank, error = failed[0]
            msg = f"rank {rank} of {self.world_size} failed: {error}"
            raise RankFailedError(msg)


def _one_line(error: Exception) -> str:
    lines = str(error).splitlines()
    text = lines[0] if lines else ""
    if isinstance(error, CtrlError) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def current_dist() -> Dist:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return Dist(torch.distributed.get_rank(), torch.distributed.get_world_size())
    return Dist()


def local_device(device: str) -> str:
    """This process's own GPU under torchrun: ``cuda`` becomes ``cuda:LOCAL_RANK``; anything else is
    kept. A fixed ``cuda:N`` with several ranks is refused: every rank would share one GPU, which
    nccl does not allow."""
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        return f"cuda:{int(os.environ['LOCAL_RANK'])}"
    if device.startswith("cuda:") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        msg = (f"--device {device} under torchrun with {os.environ['WORLD_SIZE']} ranks would put every rank on "
               "one GPU: give --device cuda (each rank takes the GPU of its LOCAL_RANK)")
        raise ModelLoadError(msg)
    return device


def init_distributed_from_env(device: str) -> Dist:
    """Join the torchrun job described by the environment (RANK/WORLD_SIZE/MASTER_ADDR...), if any:
    gloo on CPU, nccl on CUDA. Without those variables: a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return current_dist()
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":  # nccl's object collectives run on the current GPU: one per rank
        torch.cuda.set_device(torch.device(local_device(device)))
    torch.distributed.init_process_group(backend=backend)
    # leave the group while the interpreter is whole: a group torn down during interpreter
    # finalisation can abort the process after its work is done
    atexit.register(_leave_process_group)
    return current_dist()


def _leave_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
