"""The held-out check of an online run: is the latest controller better than the one it started from?

Online steps are noisy: a few hundred rollouts can make a controller worse at some budgets before
they make it better (docs/results.md, "Adapting to another machine"). So every ``check_every``
steps the run measures its latest controller and its start *paired* on validation samples the
steps never train on (``trainer.data.split_of``: "val"; the test split stays for the final
evaluation): each (sample, budget) runs both back to back on the training executor, greedy, as
the final evaluation (``online.evaluate``) does. The measure is accuracy within budget (an answer over
budget counts as wrong), the paired gain is latest minus start with a 95 % bootstrap interval
over samples (a sample's budgets resampled together). Where the run measured a latency guard
(``controller.latency_guard``), both controllers decide under it, as the run serves them.

:class:`KeptController` holds what the run serves: the start until a check finds a controller
whose gain over the start is positive and above the kept one's, then that controller (a copy).
The run stops once ``patience`` checks in a row kept nothing new: more steps stopped paying.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from controller.latency_guard import LatencyGuard
from online.evaluate import greedy_rollout
from online.rollout import Rollout, RolloutExecutor
from trainer.data import budget_grid
from trainer.two_stage import TwoStageController

#: bootstrap resamples of the paired gain's interval
BOOTSTRAP_RESAMPLES = 2000


@dataclass(frozen=True)
class CheckResult:
    """One held-out check: the latest controller against the start on ``requests`` paired requests."""

    step: int
    gain: float  # mean accuracy within budget, latest minus start
    gain_low: float  # 95 % bootstrap interval of the gain
    gain_high: float
    late_share: float  # share of the latest controller's answers over budget
    start_late_share: float
    requests: int  # (sample, budget) pairs measured, each with both controllers
    same_choice: int  # pairs where the latest chose the start's configuration: one run stood for both
    seconds: float  # wall time of the check


def paired_gain(within: np.ndarray, start_within: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``within - start_within`` ((samples, budgets) arrays of 0/score values) and its 95 %
    bootstrap interval, resampling samples with all their budgets."""
    per_sample = (np.asarray(within, dtype=np.float64) - np.asarray(start_within, dtype=np.float64)).mean(axis=1)
    n = len(per_sample)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = per_sample[rng.integers(0, n, size=(BOOTSTRAP_RESAMPLES, n))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return float(per_sample.mean()), float(low), float(high)


class HeldOutCheck:
    """The latest controller against ``start`` on ``rows`` x ``budgets`` (see the module docstring)."""

    def __init__(self, start: TwoStageController, rows: list[int], budgets: list[float], seed: int = 0,
                 guard: LatencyGuard | None = None) -> None:
        if not rows or not budgets:
            msg = "a held-out check needs at least one sample and one budget"
            raise ValueError(msg)
        self.start, self.rows, self.budgets, self.seed = start, list(rows), [float(b) for b in budgets], seed
        self.guard = guard  # both controllers decide under it, as the run serves them
        self._start_runs: dict[tuple[int, float], Rollout] = {}  # the start's first run of each pair

    @classmethod
    def on_range(cls, start: TwoStageController, rows: list[int], budget_range: tuple[float, float],
                 num_budgets: int, seed: int = 0, guard: LatencyGuard | None = None) -> HeldOutCheck:
        """Budgets evenly spaced over the run's range, both ends included (as the final evaluation's)."""
        return cls(start, rows, [round(b, 1) for b in budget_grid(*budget_range, num_budgets)], seed, guard)

    def run(self, executor: RolloutExecutor, latest: TwoStageController, step: int) -> CheckResult:
        """Measure ``latest`` and the start paired; leaves ``latest`` in training mode.

        The start's greedy choices never change, so its first measurement of each (sample, budget)
        is remembered: where the latest controller chooses the same configuration, the answer is
        the same and the latency the same in distribution, so its one run stands for both (a
        difference of exactly 0); only where the choices differ does the start run again, right
        after it. Late in a run most choices have moved, early most have not: the check costs
        between one and two runs per pair.
        """
        tick = time.perf_counter()
        was_training = latest.training  # each run below puts its controller in eval mode
        within = {name: np.zeros((len(self.rows), len(self.budgets))) for name in ("latest", "start")}
        late = {name: 0 for name in within}
        same_choice = 0
        try:
            with torch.no_grad():
                # sample by sample, each sample's budgets back to back, as the final evaluation
                for i, sample in enumerate(self.rows):
                    for j, budget in enumerate(self.budgets):
                        known = self._start_runs.get((sample, budget))
                        if known is None:  # the first check: both, the order alternating
                            if (i * len(self.budgets) + j) % 2:
                                known = greedy_rollout(executor, self.start, sample, budget, guard=self.guard)
                                mine = greedy_rollout(executor, latest, sample, budget, guard=self.guard)
                            else:
                                mine = greedy_rollout(executor, latest, sample, budget, guard=self.guard)
                                known = greedy_rollout(executor, self.start, sample, budget, guard=self.guard)
                            self._start_runs[(sample, budget)] = known
                            theirs = known
                        else:
                            mine = greedy_rollout(executor, latest, sample, budget, guard=self.guard)
                            if _choice(mine) == _choice(known):
                                theirs, same_choice = mine, same_choice + 1
                            else:
                                theirs = greedy_rollout(executor, self.start, sample, budget, guard=self.guard)
                        for name, r in (("latest", mine), ("start", theirs)):
                            over = r.latency_total_ms > budget
                            within[name][i, j] = 0.0 if over else r.score
                            late[name] += int(over)
        finally:
            latest.train(was_training)
        gain, low, high = paired_gain(within["latest"], within["start"], seed=self.seed + step)
        requests = len(self.rows) * len(self.budgets)
        return CheckResult(step=step, gain=gain, gain_low=low, gain_high=high, late_share=late["latest"] / requests,
                           start_late_share=late["start"] / requests, requests=requests, same_choice=same_choice,
                           seconds=time.perf_counter() - tick)


def _choice(r: Rollout) -> tuple[int, int, int, int]:
    """What decides a request's answer and cost: its configuration and insertion position."""
    return (r.max_crops, r.insertion_position, r.top_k, r.num_active_blocks)


@dataclass
class KeptController:
    """The controller a run serves and what the checks said of it.

    ``step`` 0 is the start; ``gain`` is the kept controller's paired gain over the start when it
    was kept (0 for the start); ``since`` counts the checks since it was kept.
    """

    controller: TwoStageController
    step: int = 0
    gain: float = 0.0
    gain_low: float = 0.0
    gain_high: float = 0.0
    since: int = 0

    def consider(self, result: CheckResult, latest: TwoStageController) -> bool:
        """Keep a copy of ``latest`` when ``result`` says it beats the start by more than the kept
        controller did; True when it was kept."""
        if result.gain > self.gain:  # the start's gain is 0: only a positive gain replaces it
            self.controller = copy.deepcopy(latest).eval()
            self.step, self.gain, self.gain_low, self.gain_high, self.since = (
                result.step, result.gain, result.gain_low, result.gain_high, 0)
            return True
        self.since += 1
        return False

    def exhausted(self, patience: int) -> bool:
        """True when ``patience`` (> 0) checks in a row kept nothing new."""
        return patience > 0 and self.since >= patience

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps to rebuild it (:meth:`restore`)."""
        return {"step": self.step, "gain": self.gain, "gain_low": self.gain_low, "gain_high": self.gain_high,
                "since": self.since, "fixed_insertion_position": self.controller.two_stage.fixed_insertion_position,
                "state_dict": {k: v.detach().cpu() for k, v in self.controller.state_dict().items()}}

    @classmethod
    def restore(cls, state: dict[str, Any], like: TwoStageController) -> KeptController:
        """The kept controller of a checkpoint's :meth:`state`, built on ``like``'s modules."""
        controller = like.with_fixed_insertion(state["fixed_insertion_position"]) \
            if state["fixed_insertion_position"] is not None else copy.deepcopy(like)
        controller.load_state_dict(state["state_dict"])
        return cls(controller.eval(), step=int(state["step"]), gain=float(state["gain"]),
                   gain_low=float(state["gain_low"]), gain_high=float(state["gain_high"]), since=int(state["since"]))
