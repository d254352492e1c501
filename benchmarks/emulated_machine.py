"""An emulated machine for benchmarks: a model runtime whose vision pass, prefill and decode steps
take ``factor`` times as long as they do here, so that a benchmark can deploy a controller on a
machine whose stage costs differ from its profile's without depending on which CPU a run gets.

The product's timing is untouched: the extra time is real waiting inside each stage (a sleep in a
forward hook that runs before the product's own hooks close the stage), so every timer, the
profiler's, the online rollouts' and the server's, measures the stretched stage as it would a
slower machine's.

    with stretched(runtime, prefill=3.0, decode=1.5):
        ...  # profile, train online, evaluate: every stage as on the emulated machine
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageFactors:
    """How much longer each timed stage takes on the emulated machine than here."""

    vision: float = 1.0
    prefill: float = 1.0
    decode: float = 1.0

    @classmethod
    def parse(cls, text: str) -> StageFactors:
        """``"prefill=3,decode=1.5"`` (stages left out keep 1)."""
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in ("vision", "prefill", "decode"):
                msg = f"--stretch: {item!r} is not stage=factor with stage vision, prefill or decode"
                raise ValueError(msg)
            values[name] = float(value)
            if values[name] < 1.0:
                msg = f"--stretch: {name}={value} would make the stage faster; factors are >= 1"
                raise ValueError(msg)
        return cls(**values)

    def label(self) -> str:
        return f"vision x{self.vision:g}, prefill x{self.prefill:g}, decode x{self.decode:g}"


class _Stretch:
    """The hooks' shared state: a stage's work is its time less the sleeps inside it, and each
    stage's post-hook sleeps until (factor - 1) x work has been slept within it."""

    def __init__(self, factors: StageFactors) -> None:
        self.factors = factors
        self.slept_s = 0.0  # all sleeps so far
        self.phase = "prefill"  # of the fast path, which calls block hooks without arguments
        self.marks: dict[int, tuple[float, float, str]] = {}

    def pre(self, module: Any, args: tuple) -> None:
        phase = self.phase
        if args and hasattr(args[0], "shape") and len(args[0].shape) >= 2:  # eager: (batch, tokens, d)
            phase = "prefill" if args[0].shape[-2] > 1 else "decode"
        self.marks[id(module)] = (time.perf_counter(), self.slept_s, phase)

    def vision_pre(self, module: Any, args: tuple) -> None:
        self.marks[id(module)] = (time.perf_counter(), self.slept_s, "vision")

    def post(self, module: Any, args: tuple, output: Any) -> None:
        mark = self.marks.pop(id(module), None)
        if mark is None:
            return
        started, slept_before, phase = mark
        inside = self.slept_s - slept_before
        work = time.perf_counter() - started - inside
        owed = (getattr(self.factors, phase) - 1.0) * work - inside
        if owed > 0:
            time.sleep(owed)
            self.slept_s += owed


@contextmanager
def stretched(runtime: Any, factors: StageFactors | None = None, **by_stage: float) -> Iterator[StageFactors]:
    """Inside the block, ``runtime``'s stages take ``factors`` (or ``vision=``, ``prefill=``,
    ``decode=``) times as long; every hook and patch is removed on the way out."""
    factors = factors or StageFactors(**by_stage)
    state = _Stretch(factors)
    handles = []
    if factors.vision != 1.0:
        handles.append(runtime.vision_module.register_forward_pre_hook(state.vision_pre))
        handles.append(runtime.vision_module.register_forward_hook(state.post, prepend=True))
    if factors.prefill != 1.0 or factors.decode != 1.0:
        for layer in runtime.decoder_layers:
            handles.append(layer.register_forward_pre_hook(state.pre))
            handles.append(layer.register_forward_hook(state.post, prepend=True))
    fast = getattr(runtime, "fast", None)
    patched: list[tuple[Any, str]] = []
    if fast is not None:  # the fast path calls the block hooks without the hidden states: say which phase
        for name, phase in (("prefill", "prefill"), ("step", "decode")):
            original = getattr(fast, name)

            def in_phase(*args: Any, _original: Any = original, _phase: str = phase, **kwargs: Any) -> Any:
                previous, state.phase = state.phase, _phase
                try:
                    return _original(*args, **kwargs)
                finally:
                    state.phase = previous

            setattr(fast, name, in_phase)
            patched.append((fast, name))
    try:
        yield factors
    finally:
        for handle in handles:
            handle.remove()
        for obj, name in patched:
            delattr(obj, name)  # the instance attribute goes; the class's method shows again
