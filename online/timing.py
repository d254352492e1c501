"""Per-stage latency of one request, measured with PyTorch hooks (``origin_formats.md`` §3).

What the origin got wrong and this module does instead (§9 D1-D3):

* prefill starts at a **pre**-hook on the first block that runs and stops at the post-hook of
  the last block that runs (block 0 included; D2); hooks fire only inside the segment they
  belong to, so a decode step can never overwrite the prefill (D1);
* every stage is its own measured interval, never a difference of two others; the total is a
  measured wall-clock interval too (segments are timed end to end and partition the request);
* N generated tokens take N-1 decode steps, each timed on its own (D3);
* on CUDA the marks are CUDA events (read after one synchronize at the end), on CPU
  ``time.perf_counter``.

A request is a sequence of named segments (``with timer.segment("prefix"): ...``); inside a
segment the hooks record the vision tower's interval and the interval from the first decoder
block's entry to the last block's exit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Self

import torch


class Clock:
    """Marks on a timeline: perf_counter floats on CPU, recorded CUDA events on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, start: object, end: object) -> float:
        """Milliseconds from ``start`` to ``end`` (call :meth:`synchronize` first on CUDA)."""
        if self.cuda:
            return float(start.elapsed_time(end))  # type: ignore[attr-defined]
        return (end - start) * 1000.0  # type: ignore[operator]


@dataclass
class Segment:
    """One timed part of a request; ``*_ms`` are filled by :meth:`StageTimer.resolve`."""

    name: str
    start: object = None
    end: object = None
    vision_start: object = None
    vision_end: object = None
    blocks_start: object = None
    blocks_end: object = None
    blocks_calls: int = 0
    wall_ms: float | None = None
    vision_ms: float | None = None
    blocks_ms: float | None = None


@dataclass
class RequestTiming:
    """Resolved segments of one request, in order."""

    segments: list[Segment] = field(default_factory=list)

    def by_prefix(self, prefix: str) -> list[Segment]:
        return [s for s in self.segments if s.name.startswith(prefix)]


class HookTimer:
    """Base of the hook-based timers: a clock and forward hooks that ``close()`` (or leaving the
    ``with`` block) removes."""

    def __init__(self, device: torch.device) -> None:
        self.clock = Clock(device)
        self._handles: list[Any] = []

    def _hook(self, module: torch.nn.Module, pre: Callable | None = None, post: Callable | None = None) -> None:
        if pre is not None:
            self._handles.append(module.register_forward_pre_hook(pre))
        if post is not None:
            self._handles.append(module.register_forward_hook(post))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StageTimer(HookTimer):
    """Hooks on the vision module and every decoder block of a runtime; records into the open segment.

    Outside a segment the hooks do nothing (warm-up runs and gradient recomputes are not timed).
    """

    def __init__(self, vision_module: torch.nn.Module, decoder_layers: list[torch.nn.Module],
                 device: torch.device) -> None:
        super().__init__(device)
        self._current: Segment | None = None
        self._hook(vision_module, self._vision_pre, self._vision_post)
        for layer in decoder_layers:
            self._hook(layer, self._block_pre, self._block_post)

    # hooks: cheap (an attribute check and a mark)
    def _vision_pre(self, module, args) -> None:
        seg = self._current
        if seg is not None and seg.vision_start is None:
            seg.vision_start = self.clock.mark()

    def _vision_post(self, module, args, output) -> None:
        seg = self._current
        if seg is not None:
            seg.vision_end = self.clock.mark()

    def _block_pre(self, module, args) -> None:
        seg = self._current
        if seg is not None and seg.blocks_start is None:
            seg.blocks_start = self.clock.mark()

    def _block_post(self, module, args, output) -> None:
        seg = self._current
        if seg is not None:
            seg.blocks_end = self.clock.mark()
            seg.blocks_calls += 1

    @contextmanager
    def segment(self, name: str, into: RequestTiming | None = None) -> Iterator[Segment]:
        """Time the block as one segment (appended to ``into`` when given)."""
        if self._current is not None:
            raise RuntimeError(f"segment {name!r} opened inside segment {self._current.name!r}")
        seg = Segment(name)
        if into is not None:
            into.segments.append(seg)
        self.clock.synchronize()  # earlier queued GPU work must not land in this segment
        seg.start = self.clock.mark()
        self._current = seg
        try:
            yield seg
        finally:
            self._current = None
            seg.end = self.clock.mark()

    def resolve(self, timing: RequestTiming) -> RequestTiming:
        """Turn the marks into milliseconds (one synchronize for the whole request)."""
        self.clock.synchronize()
        for seg in timing.segments:
            if seg.wall_ms is not None:
                continue
            seg.wall_ms = self.clock.ms(seg.start, seg.end)
            if seg.vision_start is not None and seg.vision_end is not None:
                seg.vision_ms = self.clock.ms(seg.vision_start, seg.vision_end)
            if seg.blocks_start is not None and seg.blocks_end is not None:
                seg.blocks_ms = self.clock.ms(seg.blocks_start, seg.blocks_end)
        return timing


@contextmanager
def cpu_threads(threads: int, device: torch.device | str) -> Iterator[None]:
    """Run the block with ``threads`` torch intra-op threads on CPU (0 = leave torch's setting).

    Measured requests use 1 by default: on a shared 2-core machine torch's spinning worker
    threads made single requests of the small embedded model 10-20x slower and noisy."""
    saved = torch.get_num_threads()
    if threads and torch.device(device).type == "cpu":
        torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(saved)
