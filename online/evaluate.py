"""Measured evaluation of an online run: the model runs every decision, here.

For an online run, ``ctrl evaluate RUN`` runs the test split (``trainer.data.split_of``) at a
grid of budgets with greedy decisions (the most probable choice at each stage) and measures
what happens, for two deciders:

* ``controller``: the run's controller (the one its held-out checks kept, ``best.pt``; the last
  checkpoint of a run without checks);
* ``offline_start``: the controller the run started from — its parent offline policy with the
  new online terms at zero and the insertion position fixed at 1 (every block count allowed),
  i.e. the offline policy deployed as is. Absent for runs started ``--fresh``.

Where the run measured a latency guard (``controller.latency_guard``), both decide under it, as the run serves.

The deciders are measured *paired*: each (sample, budget) runs every decider back to back
(the order rotating from request to request, sample by sample) on one executor, so machine
drift between minutes shifts all deciders alike. Per (decider, budget): accuracy (the dataset metric on the
generated answers), mean and p95 of the measured total latency, violation rate (latency >
budget), accuracy within budget (answers over budget count as 0), mean reward (the run's
reward) and the chosen-configuration histogram ("C/K/B@p"). Written like the offline
evaluation: ``evaluation.parquet`` (view ``evaluations``; ``expected_reward`` is null: there is
no exact expectation when outcomes are measured) and ``evaluation.png``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import torch

from controller.latency_guard import LatencyGuard, load_run_guard
from online.config import OnlineTrainConfig
from online.data import load_online_samples
from online.rollout import Decisions, Rollout, RolloutExecutor
from pipeline.errors import CtrlError
from pipeline.workspace import Workspace
from runtime import ModelRuntime, load_runtime
from runtime.timing import cpu_threads
from trainer.data import budget_grid
from trainer.evaluate import evaluation_frame, outcome_metrics, write_evaluation
from trainer.policy import ControllerPolicy
from trainer.reward import RewardConfig, compute_reward
from trainer.runs import RunDir, resolve_checkpoint
from trainer.two_stage import TwoStageController, set_budget_range


@dataclass(frozen=True)
class Guarded:
    """A controller whose greedy decisions a latency guard holds (``controller.latency_guard``)."""

    controller: TwoStageController
    guard: LatencyGuard


#: a decider measured with the model: (name, controller or guarded controller, fixed insertion index
#: or None), or (name, knob indices (crops, insertion, top-K, blocks), None): a static
#: configuration, run as is on every request
BatchDecider = tuple[str, TwoStageController | Guarded | tuple[int, int, int, int], int | None]


def evaluate_online_run(workspace: Workspace | str | Path | None, run: str | Path,
                        budgets_ms: list[float] | None = None, *, num_budgets: int = 5, max_samples: int | None = None,
                        runtime: ModelRuntime | None = None,
                        progress: Callable[[int, int], None] | None = None) -> pl.DataFrame:
    """Evaluate an online run on the test split with the model (see module doc); writes the files."""
    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    run = RunDir.resolve(ws, run)
    config = OnlineTrainConfig.from_json(run.read_config())
    if not run.controller_checkpoint.exists():
        msg = f"{run.last_checkpoint} does not exist: the run saved no checkpoint yet"
        raise CtrlError(msg)
    runtime = runtime if runtime is not None else load_runtime(config.model, config.execution, config.importance_scores)
    controller = TwoStageController.load(run.controller_checkpoint, runtime.fingerprint)
    lo, hi = float(config.budget_min_ms), float(config.budget_max_ms)
    budgets = [float(b) for b in budgets_ms] if budgets_ms else [round(b, 1) for b in budget_grid(lo, hi, num_budgets)]
    guard = load_run_guard(run.path)
    deciders: list[BatchDecider] = [("controller", controller if guard is None else Guarded(controller, guard), None)]
    start = _offline_start(ws, config, runtime, controller)
    if start is not None:
        deciders.append(("offline_start", start if guard is None else Guarded(start, guard),
                         start.insertion_positions.index(1)))
    with cpu_threads(config.threads, runtime.device):
        outcomes = run_paired(ws, config, runtime, deciders, budgets, max_samples, progress)
    frame = evaluation_frame([_metrics_row(name, budget, out, config.reward)
                              for (name, budget), out in outcomes.items()])
    write_evaluation(run.path, frame, run.run_id)
    return frame


def _offline_start(ws: Workspace, config: OnlineTrainConfig, runtime: ModelRuntime,
                   controller: TwoStageController) -> TwoStageController | None:
    """The parent offline policy deployed as is (new terms at zero), on the run's budget range; None
    for runs started fresh or from an online run."""
    if config.parent_run_id is None:
        return None
    parent = RunDir.resolve(ws, config.parent_run_id)
    if parent.phase != "offline":
        return None
    policy = ControllerPolicy.load(resolve_checkpoint(ws, parent.path), runtime.fingerprint)
    start = TwoStageController(policy, controller.two_stage)
    set_budget_range(start.policy, controller.policy.config.budget_min_ms, controller.policy.config.budget_max_ms)
    return start


def run_paired(ws: Workspace, config: OnlineTrainConfig, runtime: ModelRuntime, deciders: list[BatchDecider],
               budgets: list[float], max_samples: int | None,
               progress: Callable[[int, int], None] | None) -> dict[tuple[str, float], list[Rollout]]:
    """Every decider's rollouts per budget on the test split (the first ``max_samples``), measured
    paired (see the module docstring); ``config`` gives the images, token cap and warm-up."""
    samples = load_online_samples(ws, runtime.fingerprint, config.images_dir)
    test = samples.rows("test") or samples.rows("val")
    if not test:
        msg = f"workspace {ws.root}: no samples in the test split"
        raise CtrlError(msg)
    test = test[:max_samples] if max_samples else test
    first = deciders[0][1]
    executor = RolloutExecutor(runtime, first.controller if isinstance(first, Guarded) else first, samples,
                               config.max_new_tokens, config.warmup)
    try:
        return measure_paired(executor, deciders, test, budgets, progress)
    finally:
        executor.close()


def measure_paired(executor: RolloutExecutor, deciders: list[BatchDecider], rows: list[int], budgets: list[float],
                   progress: Callable[[int, int], None] | None = None) -> dict[tuple[str, float], list[Rollout]]:
    """Greedy rollouts of every decider at every (sample, budget) of ``rows`` x ``budgets``, the
    deciders back to back per request, their order rotating from request to request.

    Sample by sample, each sample's budgets back to back: a slow spell of a shared machine then
    falls on a few samples at every budget, not on one budget's whole column."""
    total, done = len(deciders) * len(budgets) * len(rows), 0
    # (decider, budget) in decider order: the frame's row order; each list in the order of ``rows``
    outcomes: dict[tuple[str, float], list[Rollout]] = {(name, b): [] for name, _, _ in deciders for b in budgets}
    request = 0
    for sample in rows:
        for budget in budgets:
            shift = request % len(deciders)  # the order rotates from request to request
            request += 1
            for name, ctrl, insertion in deciders[shift:] + deciders[:shift]:
                if isinstance(ctrl, Guarded):
                    out = greedy_rollout(executor, ctrl.controller, sample, budget, insertion, ctrl.guard)
                elif isinstance(ctrl, TwoStageController):
                    out = greedy_rollout(executor, ctrl, sample, budget, insertion)
                else:
                    out = static_rollout(executor, ctrl, sample, budget)
                outcomes[(name, budget)].append(out)
                done += 1
            if progress:
                progress(done, total)
    return outcomes


def greedy_rollout(executor: RolloutExecutor, controller: TwoStageController, sample: int, budget: float,
                   insertion_index: int | None = None, guard: LatencyGuard | None = None) -> Rollout:
    """One request decided greedily by ``controller`` (at a fixed insertion position when given; held
    to ``guard`` when given) and run."""
    return _one_request(executor, sample, budget,
                        Decisions(greedy=True, insertion_index=insertion_index, guard=guard), controller)


def static_rollout(executor: RolloutExecutor, force: tuple[int, int, int, int], sample: int, budget: float) -> Rollout:
    """One request run with the knob indices ``force`` whatever the budget (a static configuration)."""
    return _one_request(executor, sample, budget, Decisions(force=force))


def _one_request(executor: RolloutExecutor, sample: int, budget: float, decisions: Decisions,
                 controller: TwoStageController | None = None) -> Rollout:
    gen = torch.Generator().manual_seed(0)  # unused by greedy and forced decisions; keeps the call uniform
    return executor.run_groups([(sample, budget)], 1, gen, gen, controller=controller, decisions=decisions).rollouts[0]


def _metrics_row(name: str, budget: float, out: list[Rollout], reward: RewardConfig) -> dict[str, Any]:
    """The evaluation row of one (decider, budget) from its measured rollouts."""
    latency = torch.tensor([r.latency_total_ms for r in out], dtype=torch.float64)
    score = torch.tensor([r.score for r in out], dtype=torch.float64)
    knobs = torch.tensor([[r.max_crops, r.top_k, r.num_active_blocks] for r in out], dtype=torch.float32)
    r_parts = compute_reward(score.float(), latency.float(), budget, knobs, reward)
    hist = Counter(f"{r.max_crops}/{r.top_k}/{r.num_active_blocks}@{r.insertion_position}" for r in out)
    return {"decider": name, "budget_ms": budget, "num_samples": len(out), **outcome_metrics(score, latency, budget),
            "reward_mean": float(r_parts["reward"].double().mean()), "expected_reward": None,
            "config_histogram": json.dumps(dict(sorted(hist.items())))}
