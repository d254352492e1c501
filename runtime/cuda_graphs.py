"""CUDA graphs captured once per key and replayed: the one implementation of capture, its warm-up,
its memory pool, its least-recently-used bound and its failure handling, shared by the fast path's
decode steps and the vision tower's ViT.

A *body* is a function of no arguments that reads only tensors at fixed addresses (its static
inputs, which the caller fills before each replay) and returns its output tensors; the graph keeps
those outputs, and each replay overwrites them. A capture runs the body twice on a side stream
(kernels chosen, workspaces allocated outside the graph), then once under capture. A capture that
raises turns this cache's graphs off with one warning; the caller then runs its body uncaptured.

``backend`` is what records and replays: CUDA's graphs on a GPU, or :class:`RerunBackend`, which
"replays" by running the body again and copying its results into the captured outputs. That
backend gives a CPU the same contract (static inputs in, the same output tensors out, updated in
place), so tests check a caller's use of a graph without a device.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

Outputs = tuple[torch.Tensor, ...]
Body = Callable[[], Outputs]


@dataclass
class GraphStats:
    """What a cache holds and has done: graphs held, captures run (ever) and their seconds."""

    graphs: int = 0
    captures: int = 0
    capture_s: float = 0.0


@dataclass
class Captured:
    """One captured body: what replays it and the output tensors each replay overwrites."""

    replay: Callable[[], None]
    outputs: Outputs


class CudaGraphBackend:
    """Capture on the device's side stream into one memory pool shared by all of this cache's graphs
    (they never run at once), under the model's device so that a model on cuda:N captures there."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.pool = None

    def capture(self, body: Body) -> Captured:
        with torch.cuda.device(self.device):
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    body()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = body()
        return Captured(graph.replay, outputs)

    def pool_bytes(self) -> int:
        if self.pool is None or self.device.type != "cuda":
            return 0
        return sum(int(segment.get("total_size", 0)) for segment in torch.cuda.memory_snapshot()
                   if tuple(segment.get("segment_pool_id") or ()) == tuple(self.pool))


class RerunBackend:
    """A graph's contract without a device: the body runs at capture (twice for the warm-up, once
    more for the outputs, as a CUDA capture does) and again at each replay, its results copied into
    the outputs of the capture. A body that reads anything but its static inputs, or a caller that
    reads anything but the captured outputs, computes wrong results here as it would on a GPU."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device

    def capture(self, body: Body) -> Captured:
        for _ in range(2):
            body()
        with torch.inference_mode(False):  # the caller's buffers: written in place at every replay
            outputs = tuple(t.clone() for t in body())

        def replay() -> None:
            for static, fresh in zip(outputs, body(), strict=True):
                static.copy_(fresh)

        return Captured(replay, outputs)

    def pool_bytes(self) -> int:
        return 0


@dataclass
class GraphCache:
    """Captured bodies by key, at most ``max_graphs`` (the least recently replayed goes first).

    ``label`` names what is captured in the warning of a failed capture. ``enabled`` is False after
    a capture failed (``error`` says why) or when the caller turns graphs off."""

    backend: CudaGraphBackend | RerunBackend
    max_graphs: int = 512
    label: str = "graph"
    enabled: bool = True
    error: str | None = None
    stats: GraphStats = field(default_factory=GraphStats)
    _graphs: dict[object, Captured] = field(default_factory=dict)

    @classmethod
    def for_device(cls, device: torch.device, **kwargs: object) -> GraphCache:
        """CUDA graphs on ``device`` (a GPU), or the rerun backend elsewhere."""
        device = torch.device(device)
        backend = CudaGraphBackend(device) if device.type == "cuda" else RerunBackend(device)
        return cls(backend, **kwargs)

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def get(self, key: object, body: Body,
            around: Callable[[], AbstractContextManager] = nullcontext) -> Captured | None:
        """The capture of ``body`` under ``key``, captured now if it is not held (inside ``around()``,
        which may set the static inputs to the capture's values and restore them after, whether it
        worked or not); None when graphs are off or this capture failed."""
        captured = self._graphs.pop(key, None)
        if captured is None:
            if not self.enabled:
                return None
            started = time.perf_counter()
            try:
                with around():
                    captured = self.backend.capture(body)
            except RuntimeError as exc:  # a kernel that cannot be captured (or reads the device)
                self.enabled = False
                self.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                warnings.warn(f"CUDA graph capture failed, the {self.label} runs uncaptured: {self.error}",
                              RuntimeWarning, stacklevel=3)
                return None
            self.stats.captures += 1
            self.stats.capture_s += time.perf_counter() - started
        self._graphs[key] = captured  # the most recently used last
        while len(self._graphs) > self.max_graphs:
            del self._graphs[next(iter(self._graphs))]
        self.stats.graphs = len(self._graphs)
        return captured

    def clear(self) -> None:
        """Drop every graph (their inputs moved, or their memory is wanted back)."""
        self._graphs.clear()
        self.stats.graphs = 0

    def pool_bytes(self) -> int:
        """Bytes the graphs' shared pool reserves on the device (0 without a device pool)."""
        return self.backend.pool_bytes()


@contextmanager
def restored(*tensors: torch.Tensor) -> Iterator[None]:
    """The values of ``tensors`` put back on leaving, however the block ends (a capture's warm-up
    and capture write a graph's static inputs, which the caller's next step reads)."""
    saved = [t.clone() for t in tensors]
    try:
        yield
    finally:
        for tensor, value in zip(tensors, saved, strict=True):
            tensor.copy_(value)
