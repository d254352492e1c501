"""The latency guard: which configurations a request may run at its budget on this machine.

An offline policy learnt which configuration fits a budget from latencies recorded on another
machine. Where this machine stretches the stages unevenly (a slower prefill, a dearer decode
step), configurations change their order of cost, and the policy keeps choosing ones that no
longer fit: the budget range's calibration (``online.calibrate``) rescales the budgets, not the
order. The guard learns the order again, cheaply, and holds every greedy decision to it:

1. **Measure** (``online.guard``, at the start of an online run) every configuration of the
   parent run's action space once on ``guard_samples`` training samples (at insertion position
   1, the offline layout), with the stage timings the profile recorded (vision, prefill, decode).
2. **Stage ratios**: per stage, its measured milliseconds summed over those requests over the
   recorded ones of the same (sample, configuration). **Configuration ratios**: a
   configuration's recorded latency rescaled stage by stage, over its recorded latency (train
   split means): ``1 + sum_s (ratio_s - 1) * stage_s / total``. A machine with a prefill three
   times as slow makes the configurations with many crops dearer than the rest.
3. **Per request**, the expected latency of each configuration is a latency quantile of the parent
   run's (per sample, from the question and the image's tiling, known before the vision pass: its
   request cost model, ``trainer.request_cost``, or its outcome model, ``trainer.outcome``, whichever
   predicts the guard's measured requests more tightly: the smaller ratio of the 95th to the 50th
   percentile of measured / predicted) times the configuration's ratio times one **slack**: the
   ``GUARD_QUANTILE`` quantile of measured / predicted over the guard's requests. The slack
   holds what the ratios leave out (the online request's own cost, the machine's tail, the
   prediction's error), so that on the measured requests the guard's expectation is met at that
   quantile.
4. **Drift**: each request the guard decided records its measured latency over its configuration's
   expectation before the slack; the median over the last ``DRIFT_WINDOW`` of them, over the same
   median at the fit, multiplies every expectation (:meth:`LatencyGuard.drift`), so that a guard
   fitted while a shared machine ran fast does not allow, when it slows, what no longer fits.
5. **Tail**: the drift follows the machine's median, and the slack holds the tail of the spell
   it was fitted in; a slow spell's tail is longer. Each decided request also says whether it ran
   over the expectation it was decided by, and a **tail factor** follows (a quantile tracker,
   ``controller.cost.QuantileTracker``: its logarithm rises by ``TAIL_STEP`` x ``GUARD_QUANTILE`` on
   each request over, falls by ``TAIL_STEP`` x (1 - ``GUARD_QUANTILE``) on each within), so that over
   any long enough run of decided requests about 1 - ``GUARD_QUANTILE`` of them run over, whatever the machine does.
6. **Decide**: a greedy decision chooses its crops among the crops values with a configuration
   expected to fit, and top-K and block count among those at its crops; where none fits, the
   configuration expected to be fastest (the budget is below what this machine does).

Training rollouts are sampled unguarded: the guard is what a decision is held to on this machine,
the policy's distributions stay what GRPO learns. Both deciders of a paired comparison (the held-out
checks, ``ctrl evaluate``) run with the run's guard, so it measures the controllers, not the guard;
``ctrl serve`` holds an online run's controller to the run's guard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from controller.cost import QuantileTracker, RecentWindow
from controller.machine import CostGrid, GuardGrid
from pipeline.catalog import run_query
from pipeline.errors import CtrlError
from pipeline.knobs import Config
from pipeline.workspace import Workspace
from trainer.data import OfflineData
from trainer.outcome import OutcomeModel
from trainer.request_cost import RequestCostModel
from trainer.runs import atomic_torch_save
from trainer.two_stage import TwoStageController

#: the guard of an online run, in its run directory
GUARD_FILE = "latency_guard.pt"
GUARD_FORMAT = 2
#: the predictors a guard can read a request's latency from, by the name its file records
PREDICTORS: dict[str, Any] = {"outcome": OutcomeModel, "request_cost": RequestCostModel}
#: the predictors that read a request's prompt length
READS_PROMPT = frozenset({"request_cost"})
#: the share of the guard's measured requests whose expectation must be met (the slack's quantile)
GUARD_QUANTILE = 0.95
#: the timed stages whose ratios the guard measures (``measurements`` columns ``latency_<stage>_ms``)
STAGES = ("vision", "prefill", "decode")
#: the guarded requests whose measured / expected ratios make the drift factor, and the fewest that do
DRIFT_WINDOW, DRIFT_MIN = 64, 8
#: the tail factor's step (on its logarithm), and the range it stays in (a budget below what the
#: machine does must not wind it up without end)
TAIL_STEP, TAIL_RANGE = 0.05, (0.67, 3.0)


def stage_ratios(measured: np.ndarray, recorded: np.ndarray) -> np.ndarray:
    """(S,) per stage, measured over recorded milliseconds summed over the rows ((R, S) arrays) where
    every stage of both is known; 1.0 for a stage with no recorded time (nothing to compare)."""
    measured, recorded = np.asarray(measured, dtype=np.float64), np.asarray(recorded, dtype=np.float64)
    ok = np.isfinite(measured).all(1) & np.isfinite(recorded).all(1)
    there = recorded[ok].sum(0)
    return np.where(there > 0, measured[ok].sum(0) / np.where(there > 0, there, 1.0), 1.0)


def config_ratios(ratios: np.ndarray, stage_mean_ms: np.ndarray, total_mean_ms: np.ndarray) -> np.ndarray:
    """(A,) each configuration's latency here over its recorded latency when each stage is rescaled by its
    ratio and the rest of the recorded latency kept: ``1 + sum_s (ratio_s - 1) * stage_s / total``
    (``stage_mean_ms`` (A, S), ``total_mean_ms`` (A,): recorded means); 1.0 where unknown."""
    stage_mean_ms = np.nan_to_num(np.asarray(stage_mean_ms, dtype=np.float64), nan=0.0)
    total = np.asarray(total_mean_ms, dtype=np.float64)
    extra = (stage_mean_ms * (np.asarray(ratios, dtype=np.float64) - 1.0)[None]).sum(1)
    ok = np.isfinite(total) & (total > 0)
    return np.where(ok, 1.0 + extra / np.where(ok, total, 1.0), 1.0)


def guard_slack(measured_ms: np.ndarray, expected_ms: np.ndarray, quantile: float = GUARD_QUANTILE) -> float:
    """The factor by which ``expected_ms`` must grow for ``quantile`` of the requests to meet it: the
    quantile of measured / expected over the requests where both are known and positive."""
    measured, expected = np.asarray(measured_ms, dtype=np.float64), np.asarray(expected_ms, dtype=np.float64)
    ok = np.isfinite(measured) & np.isfinite(expected) & (expected > 0) & (measured > 0)
    if not ok.any():
        msg = "the latency guard has no request with both a measured and an expected latency"
        raise CtrlError(msg)
    return float(np.quantile(measured[ok] / expected[ok], quantile))


class LatencyPredictor(Protocol):
    """What the guard reads a request's latency from (``trainer.outcome.OutcomeModel``,
    ``trainer.request_cost.RequestCostModel``)."""

    action_space: Any

    def latency_before_vision(self, lang: torch.Tensor, tiling_crops: torch.Tensor | None) -> torch.Tensor:
        """(N, A) a latency quantile per configuration; a predictor that reads the prompt's length takes
        ``prompt_tokens=`` (N,) too (:data:`READS_PROMPT`)."""

    def to_state(self) -> dict: ...


@dataclass
class LatencyGuard:
    """The expected latency of every configuration for a request on this machine, and which fit.

    predictor: what predicts a request's latency quantile at every configuration before the vision
        pass, in machine A's milliseconds: the parent offline run's request cost model or its outcome
        model (:data:`PREDICTORS`; ``predictor_name`` says which);
    config_ratio: (A,) per configuration of ``predictor.action_space``, this machine's / A's;
    slack: the factor that makes the expectation hold on ``GUARD_QUANTILE`` of the measured requests;
    stage_ratios: per stage of ``STAGES``, this machine's / A's; requests: the requests measured;
    model_s: their measured latencies summed (s), the guard's cost in model time;
    tail_step: the tail factor's step (``TAIL_STEP``; 0 keeps it at 1);
    fit_median: the median of measured / base expectation (prediction times configuration ratio)
        over those requests: the machine's speed when the guard was fitted, which :meth:`drift`
        compares the requests decided since with (None: no drift factor);
    spread: per predictor measured, the 95th over the 50th percentile of measured / base expectation
        on the guard's requests (how tightly it predicts this machine; the guard reads the tightest).
    """

    predictor: LatencyPredictor
    config_ratio: torch.Tensor
    slack: float
    stage_ratios: dict[str, float]
    requests: int
    model_s: float = 0.0
    fit_median: float | None = None
    predictor_name: str = "outcome"
    spread: dict[str, float] = field(default_factory=dict)
    tail_step: float = field(default=TAIL_STEP, repr=False, compare=False)
    _recent: RecentWindow = field(default_factory=lambda: RecentWindow(DRIFT_WINDOW), init=False, repr=False,
                                  compare=False)
    _tail: QuantileTracker = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the requests over their expectation, held at 1 - GUARD_QUANTILE of those decided
        self._tail = QuantileTracker(1.0 - GUARD_QUANTILE, step=self.tail_step, bounds=TAIL_RANGE)

    @property
    def actions(self) -> tuple[Config, ...]:
        return self.predictor.action_space.actions

    @property
    def reads_prompt_tokens(self) -> bool:
        """Whether its predictor reads the prompt's length (a request's ``prompt_tokens``)."""
        return self.predictor_name in READS_PROMPT

    def base_ms(self, lang: torch.Tensor, tiling_crops: torch.Tensor | None,
                prompt_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """(N, A) the predictor's quantile times each configuration's ratio, for N requests
        (``lang`` (N, Dl), ``tiling_crops`` (N, C) or None): the expectation before slack, drift and tail."""
        if self.reads_prompt_tokens:
            return self.predictor.latency_before_vision(lang, tiling_crops, prompt_tokens) * self.config_ratio
        return self.predictor.latency_before_vision(lang, tiling_crops) * self.config_ratio

    def expected_ms(self, lang: torch.Tensor, tiling_crops: torch.Tensor | None) -> torch.Tensor:
        """(N, A) expected latency here (ms) of each configuration: :meth:`base_ms` times
        :meth:`factor`."""
        return self.base_ms(lang, tiling_crops) * self.factor()

    def factor(self) -> float:
        """What multiplies a base expectation now: the slack, the drift factor and the tail factor."""
        return self.slack * self.drift() * self.tail()

    def tail(self) -> float:
        """The tail factor: 1.0 until :meth:`observe` sees requests run over their expectation more
        or less often than 1 - ``GUARD_QUANTILE`` of the time; within ``TAIL_RANGE``."""
        return self._tail.value

    def drift(self) -> float:
        """How much slower (> 1) or faster the machine runs now than when the guard was fitted: the
        median of measured / base expectation over the last ``DRIFT_WINDOW`` requests :meth:`observe`
        saw, over the fit's median; 1.0 before ``DRIFT_MIN`` of them. A shared machine's speed moves
        by a third within minutes, and a guard fitted in a fast spell would allow, in a slow one,
        configurations that no longer fit."""
        if self.fit_median is None or len(self._recent) < DRIFT_MIN:
            return 1.0
        return self._recent.median() / self.fit_median

    def observe(self, base_ms: float, measured_ms: float, expected_ms: float | None = None) -> None:
        """Record one decided request: the base expectation (:meth:`base_ms`) of the configuration it
        ran, its measured latency and, for the tail factor, the expectation it was decided by
        (:meth:`knob_grid`'s ``expected_ms``); each ignored unless finite and positive."""
        if not (0 < measured_ms < float("inf")):
            return
        if 0 < base_ms < float("inf"):
            self._recent.append(measured_ms / base_ms)
        if expected_ms is not None and 0 < expected_ms < float("inf"):
            self._tail.observe(measured_ms > expected_ms)

    def grid(self, lang: torch.Tensor, tiling_crops: torch.Tensor | None, budget_ms: float,
             prompt_tokens: float = math.nan) -> CostGrid:
        """One request's cost of each of the guard's configurations (``lang`` (Dl,), ``tiling_crops`` (C,)
        or None, its prompt's text tokens): :meth:`base_ms` and, as the factor of every one, :meth:`factor`
        now."""
        base = self.base_ms(lang[None] if lang.dim() == 1 else lang,
                            None if tiling_crops is None
                            else (tiling_crops[None] if tiling_crops.dim() == 1 else tiling_crops),
                            torch.tensor([float(prompt_tokens)]))[0].float()
        factor = self.factor()
        return CostGrid(self.actions, base, lambda _config: factor, float(budget_ms), "guard")

    def knob_grid(self, controller: TwoStageController, lang: torch.Tensor, tiling_crops: torch.Tensor | None,
                  budget_ms: float, prompt_tokens: float = math.nan) -> GuardGrid:
        """For one request, over ``controller``'s knob values (C, K, B): the configurations expected to
        fit ``budget_ms`` (only the fastest expected one where none does), and the expectations."""
        values = (controller.max_crops_values, controller.top_k_values, controller.num_active_blocks_values)
        return self.grid(lang, tiling_crops, budget_ms, prompt_tokens).over(values)

    def summary(self) -> dict[str, Any]:
        """What a person reads of the guard (progress line, docs): its ratios, slack and size."""
        return {"stage_ratios": dict(self.stage_ratios), "slack": self.slack, "requests": self.requests,
                "model_s": self.model_s, "predictor": self.predictor_name, "spread": dict(self.spread),
                "config_ratio_range": [float(self.config_ratio.min()), float(self.config_ratio.max())]}

    def save(self, path: Path) -> Path:
        return atomic_torch_save({"format": GUARD_FORMAT, "predictor_name": self.predictor_name,
                                  "predictor": self.predictor.to_state(), "spread": dict(self.spread),
                                  "config_ratio": self.config_ratio, "slack": self.slack,
                                  "stage_ratios": dict(self.stage_ratios), "requests": self.requests,
                                  "model_s": self.model_s, "fit_median": self.fit_median}, path)

    @classmethod
    def load(cls, path: Path) -> LatencyGuard:
        state = torch.load(path, weights_only=True)
        version = state.get("format")
        if version not in (1, GUARD_FORMAT):
            msg = f"{path}: latency guard format {version!r}, this version reads 1 and {GUARD_FORMAT}"
            raise CtrlError(msg)
        # format 1 predicted with the outcome model alone
        name = state.get("predictor_name", "outcome")
        predictor = PREDICTORS[name].from_state(state["predictor"] if version == GUARD_FORMAT else state["outcome"])
        return cls(predictor, state["config_ratio"].float(), float(state["slack"]),
                   {k: float(v) for k, v in state["stage_ratios"].items()}, int(state["requests"]),
                   float(state["model_s"]), state.get("fit_median"), name,
                   {k: float(v) for k, v in state.get("spread", {}).items()})


def load_run_guard(run_path: Path) -> LatencyGuard | None:
    """The guard an online run measured (None: the run has none)."""
    path = Path(run_path) / GUARD_FILE
    return LatencyGuard.load(path) if path.exists() else None


def recorded_stage_ms(workspace: Workspace, data: OfflineData) -> np.ndarray:
    """(S, N, A) recorded milliseconds of each of ``STAGES`` in ``data``'s layout: the mean over a
    cell's measurements, NaN where a stage was not recorded."""
    table = run_query(workspace, "SELECT dataset, sample_key, max_crops, top_k, num_active_blocks, "
                                 + ", ".join(f"avg(latency_{s}_ms) AS {s}" for s in STAGES)
                                 + " FROM measurements WHERE latency_total_ms IS NOT NULL GROUP BY ALL").to_pylist()
    row_of = {key: i for i, key in enumerate(zip(data.dataset, data.sample_key))}
    col_of = {knobs: a for a, knobs in enumerate(data.action_space.actions)}
    out = np.full((len(STAGES), len(row_of), len(col_of)), np.nan)
    for cell in table:
        i = row_of.get((cell["dataset"], cell["sample_key"]))
        a = col_of.get((cell["max_crops"], cell["top_k"], cell["num_active_blocks"]))
        if i is not None and a is not None:
            out[:, i, a] = [np.nan if cell[s] is None else cell[s] for s in STAGES]
    return out


def guarded_stage2(top_k_log_probs: torch.Tensor, blocks_log_probs: torch.Tensor, allowed: torch.Tensor,
                   expected_ms: torch.Tensor) -> tuple[int, int]:
    """The greedy (top-K, blocks) indices at the chosen crops among the ``allowed`` (K, B) pairs: the most
    probable allowed pair the insertion position permits (finite log-probabilities); where none is,
    the permitted pair with the smallest ``expected_ms`` (K, B)."""
    joint = top_k_log_probs[:, None] + blocks_log_probs[None, :]
    permitted = torch.isfinite(joint)
    candidates = allowed & permitted
    if candidates.any():
        flat = int(joint.masked_fill(~candidates, float("-inf")).flatten().argmax())
    else:
        flat = int(expected_ms.masked_fill(~permitted, float("inf")).flatten().argmin())
    return flat // joint.shape[1], flat % joint.shape[1]
