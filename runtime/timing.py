"""Latency of a request, measured with PyTorch hooks on a runtime's modules (``docs/origin_format.md`` §3).

What the origin got wrong and these timers do instead (§9 D1-D3):

* prefill starts at a **pre**-hook on the first block that runs and stops at the post-hook of
  the last block that runs (block 0 included; D2); hooks fire only inside the request or
  segment they belong to, so a decode step can never overwrite the prefill (D1);
* every stage is its own measured interval, never a difference of two others; the total is a
  measured wall-clock interval too;
* N generated tokens take N-1 decode steps, each timed on its own (D3);
* on CUDA the marks are CUDA events (read after one synchronize at the end), on CPU
  ``time.perf_counter``.

Two timers share the hooks' base (:class:`HookTimer`):

* :class:`StageTimer` (the online two-stage request): a request is a sequence of named segments
  (``with timer.segment("prefix"): ...``) that partition it; inside a segment the hooks record the
  vision tower's interval and the interval from the first decoder block's entry to the last
  block's exit;
* :class:`GenerateTimer` (``ctrl profile``): the phases of one ``generate`` call, told apart by
  block 0's pre-hook, which opens every forward pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Self, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

from runtime.base import ModelRuntime


class Clock:
    """Marks on a timeline: perf_counter floats on CPU, recorded CUDA events on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def mark(self) -> object:
        if self.cuda:
            # the model's own GPU's stream, not the current device's: cuda:1 in a process whose
            # current device is cuda:0 would otherwise time an idle stream
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

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
        self._handles: list[RemovableHandle] = []

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

    @property
    def current_segment(self) -> str | None:
        """The name of the open segment, None outside one."""
        return None if self._current is None else self._current.name

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
            msg = f"segment {name!r} opened inside segment {self._current.name!r}"
            raise RuntimeError(msg)
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


@dataclass
class _Marks:
    start: object = None
    end: object = None
    vision_start: object = None
    vision_end: object = None
    pass_starts: list = field(default_factory=list)
    pass_ends: list = field(default_factory=list)


@dataclass
class GenerateTiming:
    """Milliseconds of one generate call.

    ``total_ms`` is measured around the call; ``embed_ms`` (start -> block 0's entry, the vision
    tower included), ``prefill_ms`` (block 0's entry -> the last block's exit, first pass),
    ``prefill_head_ms`` (-> the next pass) and ``decode_ms`` (the N-1 decode steps) partition it.
    A decode step runs from block 0's entry on its pass to block 0's entry on the next one (the
    last: to the end of the call), so it covers the final norm, the LM head and the token choice.
    """

    total_ms: float
    embed_ms: float
    vision_ms: float | None
    prefill_ms: float
    prefill_head_ms: float
    decode_ms: float
    decode_steps_ms: list[float]
    num_passes: int


class GenerateTimer(HookTimer):
    """Hooks on a runtime's vision module and decoder blocks that time the phases of one generate.

    Forward pass i starts at block 0's pre-hook (block 0 always runs, validated by the
    runtime) and its blocks end at the last post-hook before the next pass; pass 0 is the
    prefill. Outside :meth:`request` the hooks do nothing (warm-up runs are not timed).
    """

    def __init__(self, runtime: ModelRuntime) -> None:
        super().__init__(runtime.device)
        self._marks: _Marks | None = None
        layers = list(runtime.decoder_layers)
        self._hook(runtime.vision_module, self._vision_pre, self._vision_post)
        self._hook(layers[0], pre=self._pass_pre)
        for layer in layers:
            self._hook(layer, post=self._block_post)

    def _vision_pre(self, module, args) -> None:
        if self._marks is not None and self._marks.vision_start is None:
            self._marks.vision_start = self.clock.mark()

    def _vision_post(self, module, args, output) -> None:
        if self._marks is not None:
            self._marks.vision_end = self.clock.mark()

    def _pass_pre(self, module, args) -> None:
        if self._marks is not None:
            self._marks.pass_starts.append(self.clock.mark())
            self._marks.pass_ends.append(None)

    def _block_post(self, module, args, output) -> None:
        if self._marks is not None and self._marks.pass_ends:
            self._marks.pass_ends[-1] = self.clock.mark()

    @contextmanager
    def request(self) -> Iterator[_Marks]:
        """Time the block as one request (the generate call goes inside)."""
        if self._marks is not None:
            msg = "GenerateTimer.request is not re-entrant"
            raise RuntimeError(msg)
        marks = _Marks()
        self.clock.synchronize()
        marks.start = self.clock.mark()
        self._marks = marks
        try:
            yield marks
        finally:
            self._marks = None
            marks.end = self.clock.mark()

    def resolve(self, marks: _Marks) -> GenerateTiming:
        self.clock.synchronize()
        ms = self.clock.ms
        if not marks.pass_starts or marks.pass_ends[0] is None:
            msg = "no decoder forward pass was observed inside the request (hooks not firing?)"
            raise RuntimeError(msg)
        starts = marks.pass_starts
        bounds = starts[1:] + [marks.end]
        steps = [ms(starts[i], bounds[i]) for i in range(1, len(starts))]
        timed_vision = marks.vision_start is not None and marks.vision_end is not None
        vision = ms(marks.vision_start, marks.vision_end) if timed_vision else None
        return GenerateTiming(
            total_ms=ms(marks.start, marks.end), embed_ms=ms(marks.start, starts[0]), vision_ms=vision,
            prefill_ms=ms(starts[0], marks.pass_ends[0]), prefill_head_ms=ms(marks.pass_ends[0], bounds[0]),
            decode_ms=ms(starts[1], marks.end) if len(starts) > 1 else 0.0, decode_steps_ms=steps,
            num_passes=len(starts))


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


T = TypeVar("T")


def uncaptured_run(runtime: ModelRuntime, run: Callable[[], T]) -> T:
    """``run()`` (a timed generation or part of one), run once more where it captured a CUDA graph
    (a shape the warm-up did not see): the second run's result, whose timing holds no capture."""
    captures = runtime.graph_captures
    result = run()
    if runtime.graph_captures == captures:
        return result
    return run()

