"""A per-stage latency model of a rollout's suffix and decode steps, fit on rollouts timed alone.

When a step's rollouts run batched (``ctrl train --online --rollout-batch``), a member that
shares a pass with others has no batch-1 time of its own for the part after its prefix: the
suffix of the prefill and the decode steps. Its stage 1, prefix and stage 2 still run alone and
are measured; this model supplies the rest from the members that were timed alone, per top-K:

* the suffix's wall time, linear in (blocks after the insertion point x prompt tokens): a
  prefill block's work grows with the tokens it runs, and the suffix runs that many blocks;
* the suffix's block interval, the wall time times the observed share of the blocks in it;
* a decode step's time, linear in the active blocks (a step runs every active block once).

A line needs two distinct feature values; until then the fit is a ratio through the origin
(or the mean where the feature is 0). A top-K is *ready* once it has ``min_observations``
suffixes and decode steps observed; before that its members are timed alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MemberShape:
    """What a member's suffix and decode steps cost depends on."""

    top_k: int
    suffix_blocks: int  # active blocks at or after the insertion point
    active_blocks: int  # blocks a decode step runs
    prompt_tokens: int


@dataclass(frozen=True)
class ModeledLatency:
    """A member's modeled suffix (wall and block interval) and decode step, in milliseconds."""

    suffix_ms: float
    suffix_blocks_ms: float | None
    step_ms: float

    def total_ms(self, decode_steps: int) -> float:
        """The modeled part of a member's latency: its suffix and ``decode_steps`` steps."""
        return self.suffix_ms + decode_steps * self.step_ms


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of ``ys`` on ``xs`` by least squares; with one distinct x, the ratio
    through the origin (the mean, with slope 0, where that x is 0)."""
    if not xs or len(xs) != len(ys):
        msg = "fit_line needs as many x as y values, at least one"
        raise ValueError(msg)
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread > 0:
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
        return mean_y - slope * mean_x, slope
    if mean_x > 0:
        return 0.0, mean_y / mean_x
    return mean_y, 0.0


@dataclass
class _Observations:
    suffix_x: list[float] = field(default_factory=list)
    suffix_ms: list[float] = field(default_factory=list)
    blocks_share: list[float] = field(default_factory=list)
    step_x: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)


class SuffixLatencyModel:
    """The model of the module docstring, per top-K; ``observe`` members timed alone, ``predict`` others."""

    def __init__(self, min_observations: int = 3) -> None:
        if min_observations < 1:
            msg = f"min_observations must be at least 1, got {min_observations}"
            raise ValueError(msg)
        self.min_observations = int(min_observations)
        self._by_top_k: dict[int, _Observations] = {}

    def ready(self, top_k: int) -> bool:
        obs = self._by_top_k.get(int(top_k))
        return (obs is not None and len(obs.suffix_ms) >= self.min_observations
                and len(obs.step_ms) >= self.min_observations)

    def observe(self, shape: MemberShape, suffix_ms: float, suffix_blocks_ms: float | None,
                step_ms: Sequence[float]) -> None:
        """One member timed alone: its suffix's wall time and block interval, its decode steps."""
        obs = self._by_top_k.setdefault(int(shape.top_k), _Observations())
        obs.suffix_x.append(float(shape.suffix_blocks * shape.prompt_tokens))
        obs.suffix_ms.append(float(suffix_ms))
        if suffix_blocks_ms is not None and suffix_ms > 0:
            obs.blocks_share.append(float(suffix_blocks_ms) / float(suffix_ms))
        if step_ms:
            obs.step_x.append(float(shape.active_blocks))
            obs.step_ms.append(float(statistics.median(step_ms)))

    def predict(self, shape: MemberShape) -> ModeledLatency:
        """The member's modeled latencies (its top-K must be :meth:`ready`)."""
        if not self.ready(shape.top_k):
            msg = f"the latency model has too few rollouts timed alone at top-K {shape.top_k}"
            raise ValueError(msg)
        obs = self._by_top_k[int(shape.top_k)]
        a, b = fit_line(obs.suffix_x, obs.suffix_ms)
        suffix = max(0.0, a + b * shape.suffix_blocks * shape.prompt_tokens)
        share = statistics.median(obs.blocks_share) if obs.blocks_share else None
        blocks = None if share is None or shape.suffix_blocks == 0 else suffix * share
        a, b = fit_line(obs.step_x, obs.step_ms)
        return ModeledLatency(suffix, blocks, max(0.0, a + b * shape.active_blocks))

    def relative_error(self, shape: MemberShape, suffix_ms: float, step_ms: Sequence[float]) -> float | None:
        """|modeled - measured| / measured for the modeled part of a member timed alone (None
        while its top-K is not ready): how far the model is from what it replaces."""
        if not self.ready(shape.top_k):
            return None
        measured = float(suffix_ms) + float(sum(step_ms))
        modeled = self.predict(shape).total_ms(len(step_ms))
        return abs(modeled - measured) / measured if measured > 0 else None
