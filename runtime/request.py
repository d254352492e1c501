"""One request's way through the model: what the server and the online rollouts both run.

A request's timeline, every part a timed segment (``runtime.timing.StageTimer``)::

    stage1      the caller's first decision: crops, insertion position, budget token
    preprocess  crops at the chosen max_crops, tokenisation
    prefix      vision tower + decoder blocks 0..p-1 (p = 0: the vision tower alone)
    stage2      the caller's second decision, on the latency token: top-K, block count
    suffix      the remaining active blocks of the prefill, norm, LM head: the first token
    decode      one segment per further token

:meth:`RequestExecutor.run` runs one request end to end with the two decisions given as
callables; the online rollouts, whose group members share stage 1, the prefix and stage 2's
distribution, call its parts (:meth:`RequestExecutor.prefix`, :meth:`RequestExecutor.answer`)
on shared segments. :class:`LatencyParts` is the one reading of the segments as latency parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from runtime.base import ModelInputs, ModelRuntime, PrefixState, greedy_decode
from runtime.timing import RequestTiming, StageTimer


class Stage1Decision(Protocol):
    """What the request's first decision fixes before the model runs."""

    @property
    def max_crops(self) -> int: ...

    @property
    def insertion_position(self) -> int: ...

    @property
    def budget_token(self) -> torch.Tensor | None: ...


Decision = TypeVar("Decision", bound=Stage1Decision)


def argmax_token(logits: torch.Tensor) -> int:
    return int(logits.argmax())


@dataclass(frozen=True)
class LatencyParts:
    """A resolved request timing read as latency parts (milliseconds).

    ``prefill_ms``: the first decoder block's entry to the last block's exit of the prefill
    (both parts); ``vision_ms``: the vision module's own interval; ``model_ms``: what the profile
    timed as one generate call (the prefix, the suffix and the decode steps);
    ``measured_ms``: every segment together (stages, preprocessing where timed, the model).
    """

    stage1_ms: float
    preprocess_ms: float | None
    vision_ms: float | None
    prefill_ms: float
    stage2_ms: float
    decode_ms: float
    decode_step_ms: tuple[float, ...]
    model_ms: float
    measured_ms: float

    @property
    def controller_ms(self) -> float:
        return self.stage1_ms + self.stage2_ms

    @classmethod
    def of(cls, timing: RequestTiming) -> LatencyParts:
        seg = {s.name: s for s in timing.segments if s.name != "decode"}
        steps = tuple(float(s.wall_ms or 0.0) for s in timing.by_prefix("decode"))
        prefix, suffix = seg["prefix"], seg["suffix"]
        decode_ms = float(sum(steps))
        return cls(
            stage1_ms=float(seg["stage1"].wall_ms or 0.0),
            preprocess_ms=seg["preprocess"].wall_ms if "preprocess" in seg else None,
            vision_ms=prefix.vision_ms,
            prefill_ms=(prefix.blocks_ms or 0.0) + (suffix.blocks_ms or 0.0),
            stage2_ms=float(seg["stage2"].wall_ms or 0.0),
            decode_ms=decode_ms, decode_step_ms=steps,
            model_ms=(prefix.wall_ms or 0.0) + (suffix.wall_ms or 0.0) + decode_ms,
            measured_ms=float(sum(s.wall_ms or 0.0 for s in timing.segments)))


@dataclass
class Answer:
    """The decoded part of a request: its tokens and the blocks that ran after the prefix."""

    tokens: list[int]
    active_blocks: tuple[int, ...]


@dataclass
class StartedRequest(Generic[Decision]):
    """A request through stage 2 (:meth:`RequestExecutor.start`): its decisions, inputs, prefix and
    the segments timed so far (not yet resolved)."""

    decision: Decision
    inputs: ModelInputs
    prefix: PrefixState
    top_k: int
    num_active_blocks: int
    timing: RequestTiming


@dataclass
class RequestOutcome(Generic[Decision]):
    """One request run end to end: both decisions, what ran, the tokens and the timing."""

    stage1: Decision
    inputs: ModelInputs
    top_k: int
    num_active_blocks: int
    answer: Answer
    timing: RequestTiming

    @property
    def tokens(self) -> list[int]:
        return self.answer.tokens

    @property
    def parts(self) -> LatencyParts:
        return LatencyParts.of(self.timing)


class RequestExecutor:
    """Runs requests on ``runtime``, each part a segment of ``timer``."""

    def __init__(self, runtime: ModelRuntime, timer: StageTimer) -> None:
        self.runtime, self.timer = runtime, timer

    @contextmanager
    def configured(self, insertion_position: int, top_k: int, num_active_blocks: int) -> Iterator[tuple[int, ...]]:
        """A request's knobs after its insertion point p: ``top_k`` in blocks p.. (blocks before it
        ran at the default) and the blocks kept for ``num_active_blocks`` (blocks 0..p-1 always:
        they ran); yields those blocks."""
        runtime, p = self.runtime, int(insertion_position)
        active = runtime.blocks_for(num_active_blocks, first_kept=max(p, 1))
        with runtime.knobs(top_k={i: int(top_k) for i in range(p, runtime.num_layers)}):
            yield active

    def prefix(self, inputs: ModelInputs, insertion_position: int, budget_token: torch.Tensor | None,
               timing: RequestTiming) -> PrefixState:
        """The vision tower and blocks 0..p-1, timed as ``prefix``."""
        with self.timer.segment("prefix", timing):
            return self.runtime.prefill_prefix(inputs, insertion_position, budget_token)

    def answer(self, prefix: PrefixState, top_k: int, num_active_blocks: int, timing: RequestTiming, *,
               max_tokens: int, pick: Callable[[torch.Tensor], int] = argmax_token,
               until: Callable[[int], bool] | None = None, check: Callable[[], None] | None = None,
               on_token: Callable[[int], None] | None = None) -> Answer:
        """The rest of the prefill (``suffix``) at ``top_k`` in blocks p.. and ``num_active_blocks``
        blocks, then the decode steps (``decode`` each) up to EOS, ``max_tokens`` or ``until``.

        ``check()`` runs before each decode step (a cancellation raises there); ``on_token(n)``
        after each token, with the count of tokens so far."""
        runtime = self.runtime
        with self.configured(prefix.insertion_position, top_k, num_active_blocks) as active:
            with self.timer.segment("suffix", timing):
                state = runtime.prefill_suffix(prefix, active)
            first = pick(state.logits)
            count = 1
            if on_token is not None:
                on_token(count)

            def next_token(token: int) -> int:
                nonlocal count
                if check is not None:
                    check()
                with self.timer.segment("decode", timing):
                    runtime.decode_step(state, token)
                    count += 1
                    if on_token is not None:
                        on_token(count)
                    return pick(state.logits)

            tokens = greedy_decode(first, next_token, runtime.eos_id, max_tokens, until)
        return Answer(tokens, active)

    def warm_up(self, prefix: PrefixState, top_k: int, num_active_blocks: int) -> None:
        """The rest of the prefill and one decode step, untimed: a configuration's one-time costs
        (allocations, kernel selection) paid before its first measured run."""
        with self.configured(prefix.insertion_position, top_k, num_active_blocks) as active:
            state = self.runtime.prefill_suffix(prefix, active)
            self.runtime.decode_step(state, argmax_token(state.logits))

    def start(self, stage1: Callable[[], Decision], inputs: Callable[[int], ModelInputs],
              stage2: Callable[[Decision, PrefixState], tuple[int, int]], *,
              check: Callable[[int | None], None] | None = None) -> StartedRequest[Decision]:
        """A request up to its answer: ``stage1()``, ``inputs(max_crops)``, the prefix and
        ``stage2(decision, prefix)``, each timed (``check`` as in :meth:`run`); the answer then runs
        alone (:meth:`answer`) or as a row of a batch (``ModelRuntime.answer_prefixes``)."""
        runtime, timing = self.runtime, RequestTiming()

        def between() -> None:
            if check is not None:
                check(None)

        blocks_checked = runtime.between_blocks(check) if check is not None else nullcontext()
        with torch.inference_mode(), blocks_checked:
            with self.timer.segment("stage1", timing):
                decision = stage1()
            between()
            with self.timer.segment("preprocess", timing):
                model_inputs = inputs(decision.max_crops)
            prefix = self.prefix(model_inputs, decision.insertion_position, decision.budget_token, timing)
            between()
            with self.timer.segment("stage2", timing):
                top_k, blocks = stage2(decision, prefix)
            between()
        return StartedRequest(decision, model_inputs, prefix, int(top_k), int(blocks), timing)

    def run(self, stage1: Callable[[], Decision], inputs: Callable[[int], ModelInputs],
            stage2: Callable[[Decision, PrefixState], tuple[int, int]], *, max_tokens: int,
            pick: Callable[[torch.Tensor], int] = argmax_token, until: Callable[[int], bool] | None = None,
            check: Callable[[int | None], None] | None = None,
            on_token: Callable[[int], None] | None = None) -> RequestOutcome[Decision]:
        """One request: ``stage1()`` decides crops and insertion, ``inputs(max_crops)`` preprocesses,
        ``stage2(decision, prefix)`` decides (top-K, block count) on the prefix; then the answer.

        ``check(block)`` runs before each decoder block and ``check(None)`` between the parts and
        before each decode step: an exception it raises stops the request there. The timing is
        resolved on return."""
        started = self.start(stage1, inputs, stage2, check=check)
        return self.complete(started, max_tokens=max_tokens, pick=pick, until=until, check=check, on_token=on_token)

    def complete(self, started: StartedRequest[Decision], *, max_tokens: int,
                 pick: Callable[[torch.Tensor], int] = argmax_token, until: Callable[[int], bool] | None = None,
                 check: Callable[[int | None], None] | None = None,
                 on_token: Callable[[int], None] | None = None) -> RequestOutcome[Decision]:
        """A started request's answer alone (``check`` and the rest as in :meth:`run`); the timing is
        resolved on return."""
        blocks_checked = self.runtime.between_blocks(check) if check is not None else nullcontext()
        with torch.inference_mode(), blocks_checked:
            answer = self.answer(started.prefix, started.top_k, started.num_active_blocks, started.timing,
                                 max_tokens=max_tokens, pick=pick, until=until,
                                 check=None if check is None else lambda: check(None), on_token=on_token)
        self.timer.resolve(started.timing)
        return RequestOutcome(started.decision, started.inputs, started.top_k, started.num_active_blocks, answer,
                              started.timing)
