"""The cost model of the machine: what each configuration is expected to cost one request here, now,
and what the requests served cost. Every decider owns one (its ``cost``); the server and the deciders
ask it, nothing else.

A controller reads latencies in the units of the profile it was trained on: milliseconds recorded on
another machine, or on this one at another time (a shared machine's speed drifts by tens of percent
within minutes: docs/serving.md#latency-calibration). :class:`MachineCost` turns them into this
machine's, from three parts:

* **The request's own cost** in the profile's units, where the deployed controller carries a
  per-request latency model (``trainer.request_cost``: from the image's tiling, the prompt's length
  and the question); else each configuration's median over the profile's training split.
* **The latency scale** (:class:`controller.cost.LatencyScale`): served model time over that median,
  a quantile of the last requests, overall and per configuration (a machine unlike the profile's
  does not slow every configuration alike). The ratio assumes answers of the lengths the profile
  recorded: a request that generates many more tokens raises its own ratio, which makes later
  decisions more careful, not less. The server's budget planner reads budgets through it.
* **The latency guard** of an online run (``controller.latency_guard``): its outcome model's
  per-request quantile times the stage ratios measured here, the slack, the drift and the tail
  factor. Where an online controller has one, its grids are the guard's.

:meth:`MachineCost.grid` gives one request's :class:`CostGrid` at a budget, :meth:`MachineCost.observe`
records what a request cost (the scale's ratio, the guard's drift and tail).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Protocol

import torch

from controller.cost import LatencyScale, guard_config
from pipeline.errors import CtrlError
from pipeline.knobs import Config


@dataclass(frozen=True)
class GuardGrid:
    """A request's view of the guard over a controller's knob values, each (C, K, B): ``allowed``,
    ``expected_ms`` (what it is expected to take now; inf where unknown: the tail factor's
    reference) and ``base_ms`` (before slack, drift and tail: the drift factor's reference), both
    given back to :meth:`controller.latency_guard.LatencyGuard.observe` with the measured latency."""

    allowed: torch.Tensor
    expected_ms: torch.Tensor
    base_ms: torch.Tensor

    @property
    def crops_allowed(self) -> torch.Tensor:
        """(C,) the crops values with at least one allowed configuration: stage 1's choices."""
        return self.allowed.flatten(1).any(1)


@dataclass(frozen=True)
class CostGrid:
    """One request's cost of each configuration the model prices, on this machine now.

    configs: the configurations priced; base_ms: (A,) each one's cost before the machine's factors
    (the profile's milliseconds, or the guard's prediction times its configuration ratio);
    factor_of: what multiplies a configuration's base cost now (the latency scale of that
    configuration, or the guard's slack x drift x tail), asked only for the configurations a
    decision reads; budget_ms: what the request may take, in the expectation's units; source:
    ``profile`` or ``guard`` (what :meth:`MachineCost.observe` feeds)."""

    configs: tuple[Config, ...]
    base_ms: torch.Tensor
    factor_of: Callable[[Config], float]
    budget_ms: float
    source: str

    @property
    def expected_ms(self) -> torch.Tensor:
        """(A,) what each configuration is expected to take now."""
        return self.base_ms * torch.tensor([self.factor_of(c) for c in self.configs], dtype=self.base_ms.dtype)

    def index(self, config: Config) -> int | None:
        try:
            return self.configs.index(tuple(int(v) for v in config))
        except ValueError:
            return None

    def base(self, config: Config) -> float:
        """The configuration's base cost (inf where it is not priced)."""
        i = self.index(config)
        return math.inf if i is None else float(self.base_ms[i])

    def expected(self, config: Config) -> float:
        """The configuration's expected cost now (inf where it is not priced)."""
        i = self.index(config)
        return math.inf if i is None else float(self.base_ms[i] * self.factor_of(self.configs[i]))

    def held(self, chosen: Config) -> Config:
        """``chosen`` held to the budget (:func:`controller.cost.guard_config`: kept where it fits or is not
        priced, else the dearest at its crops that fits, else the fastest there)."""
        return guard_config(tuple(chosen), dict(zip(self.configs, self.base_ms.tolist())), self.factor_of,
                            self.budget_ms)

    def over(self, values: Sequence[Sequence[int]]) -> GuardGrid:
        """The grid over a controller's knob values (crops, top-K, blocks), each (C, K, B): inf where a
        configuration is not priced; allowed where expected to fit the budget, the fastest expected
        where none does."""
        values = tuple(tuple(int(x) for x in v) for v in values)
        priced, cells = _cells(self.configs, values)
        base = torch.full(tuple(len(v) for v in values), math.inf, dtype=self.base_ms.dtype)
        expected = base.clone()
        base.view(-1)[cells] = self.base_ms[priced]
        expected.view(-1)[cells] = self.expected_ms[priced]
        allowed = expected <= self.budget_ms
        if not allowed.any():
            allowed = expected == expected.min()
        return GuardGrid(allowed, expected, base)


@lru_cache(maxsize=64)
def _cells(configs: tuple[Config, ...], values: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The priced configurations among ``values`` and their flat cells in the (C, K, B) grid, worked out
    once per pair (every request asks)."""
    known = [(i, (values[0].index(c) * len(values[1]) + values[1].index(k)) * len(values[2]) + values[2].index(b))
             for i, (c, k, b) in enumerate(configs) if c in values[0] and k in values[1] and b in values[2]]
    if not known:
        msg = "the cost model prices none of the controller's configurations (another action space)"
        raise CtrlError(msg)
    return torch.tensor([i for i, _ in known]), torch.tensor([cell for _, cell in known])


class RequestGuard(Protocol):
    """What the cost model reads of an online run's latency guard (``controller.latency_guard.LatencyGuard``)."""

    #: the machine's speed when the guard was fitted (None: no drift factor)
    fit_median: float | None

    def drift(self) -> float: ...

    def grid(self, lang: torch.Tensor, tiling_crops: torch.Tensor | None, budget_ms: float,
             prompt_tokens: float = math.nan) -> CostGrid: ...

    def observe(self, base_ms: float, measured_ms: float, expected_ms: float | None = None) -> None: ...


class MachineCost:
    """The machine's cost of every configuration for one request (module docstring).

    scale: the latency scale (measured on the requests served, or pinned); its reference latencies
    are the configurations' profile medians. guard: an online run's latency guard, whose grids
    replace the profile's (None: none)."""

    def __init__(self, scale: LatencyScale, guard: RequestGuard | None = None) -> None:
        self.scale = scale
        self.guard = guard

    @property
    def reference_ms(self) -> dict[Config, float]:
        """Each configuration's median latency in the profile's training split (empty: unknown)."""
        return self.scale.reference_ms

    def with_scale(self, scale: LatencyScale) -> MachineCost:
        """The same cost model read through another latency scale (a server's pinned or measured one)."""
        return MachineCost(scale, self.guard)

    def grid(self, lang: torch.Tensor | None, tiling_crops: torch.Tensor | None, budget_ms: float, *,
             request_ms: Mapping[Config, float] | None = None, prompt_tokens: float = math.nan,
             batch_factor_of: Callable[[Config], float] | None = None) -> CostGrid:
        """One request's :class:`CostGrid` at ``budget_ms``: the guard's (``lang`` (Dl,), ``tiling_crops``
        (C,) and ``prompt_tokens`` are its inputs) where there is one; else the profile's medians, with
        ``request_ms`` (this request's own predicted cost per configuration, profile ms) read in their
        place where given, times the latency scale of each configuration (budget in served ms).
        ``batch_factor_of``: per configuration, how much longer than alone the request would take in the
        batch it joins (a server's continuous batching), a further factor of every configuration."""
        if self.guard is not None:
            grid = self.guard.grid(lang, tiling_crops, budget_ms, prompt_tokens)
        else:
            base = dict(self.scale.reference_ms)
            if request_ms:
                base.update(request_ms)
            grid = CostGrid(tuple(base), torch.tensor(list(base.values()), dtype=torch.float64), self.scale.of,
                            float(budget_ms), "profile")
        if batch_factor_of is None:
            return grid
        machine = grid.factor_of
        return replace(grid, factor_of=lambda config: machine(config) * batch_factor_of(config))

    def observe(self, grid: CostGrid | None, config: Config, *, model_ms: float, measured_ms: float,
                insertion_position: int = 0) -> float | None:
        """One request served at ``config``: its model time (vision, prefill, decoding) and its measured
        latency (stage 1 to the last token). The scale records model time over the configuration's
        median where the request ran the layout the profile timed (insertion position 0); the guard
        records the measured latency against the grid it decided by. The scale's ratio, or None where
        it did not count."""
        ratio = None
        if insertion_position == 0:
            ratio = self.scale.observe(tuple(config), model_ms)
        if grid is not None and grid.source == "guard" and self.guard is not None:
            self.guard.observe(grid.base(config), measured_ms, grid.expected(config))
        return ratio
