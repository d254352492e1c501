"""Measuring an online run's latency guard on this machine (``controller.latency_guard`` says what it
is and how decisions keep to it): every configuration once on a few training samples, against the
latencies and stage times the profile recorded, and against the parent run's two predictors of a
request's latency (its request cost model and its outcome model): the guard reads the tighter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from controller.latency_guard import (
    READS_PROMPT,
    STAGES,
    LatencyGuard,
    LatencyPredictor,
    config_ratios,
    guard_slack,
    recorded_stage_ms,
    stage_ratios,
)
from online.data import OnlineSamples
from online.rollout import Rollout, RolloutExecutor
from pipeline.errors import CtrlError
from pipeline.knobs import Config
from pipeline.workspace import Workspace
from trainer.data import OfflineData
from trainer.outcome import OUTCOME_FILE, OutcomeModel
from trainer.request_cost import REQUEST_COST_FILE, RequestCostModel
from trainer.two_stage import TwoStageController


def _mean(values: np.ndarray) -> float:
    """The mean of the finite values, NaN where there are none."""
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if len(finite) else float("nan")


def measure_latency_guard(executor: RolloutExecutor, controller: TwoStageController, rows: list[int],
                          workspace: Workspace, parent_path: Path, data: OfflineData,
                          progress: Any = None) -> LatencyGuard | None:
    """Run every configuration of the parent run's action space once on ``rows`` and fit the guard
    (module docstring). None where the parent run has neither predictor (nothing to predict from).

    ``data``: the workspace's offline data (recorded latencies and stage times, its train split);
    ``progress(done, total)`` after each configuration."""
    predictors = parent_predictors(Path(parent_path))
    if not predictors:
        return None
    for name, (path, predictor) in predictors.items():
        if tuple(predictor.action_space.max_crops_values) != tuple(controller.max_crops_values):
            msg = (f"{path}: max_crops values {list(predictor.action_space.max_crops_values)}, the controller's "
                   f"{list(controller.max_crops_values)}: the {name.replace('_', ' ')} model belongs to another "
                   "action space")
            raise CtrlError(msg)
    space_path, space_of = next(iter(predictors.values()))  # both predictors share the action space
    samples: OnlineSamples = executor.samples
    stages = recorded_stage_ms(workspace, data)  # (S, N, A)
    col_of = {knobs: a for a, knobs in enumerate(data.action_space.actions)}
    row_of = {key: i for i, key in enumerate(zip(data.dataset, data.sample_key))}
    train = [i for i, split in enumerate(data.split) if split == "train"] or list(range(len(data)))
    position = controller.insertion_positions.index(1) if 1 in controller.insertion_positions else 0
    actions = [a for a in space_of.action_space.actions if a in col_of and a[0] in controller.max_crops_values
               and a[1] in controller.top_k_values and a[2] in controller.num_active_blocks_values
               and bool(controller.blocks_valid[position, controller.num_active_blocks_values.index(a[2])])]
    if not actions:
        msg = f"{space_path}: none of its configurations is in the workspace's recorded data"
        raise CtrlError(msg)
    runs: list[tuple[Rollout, Config]] = []
    for done, (crops, top_k, blocks) in enumerate(actions, 1):
        force = (controller.max_crops_values.index(crops), position, controller.top_k_values.index(top_k),
                 controller.num_active_blocks_values.index(blocks))
        runs.extend((r, (crops, top_k, blocks)) for r in executor.run_fixed(rows, force))
        if progress is not None:
            progress(done, len(actions))
    measured = np.array([[np.nan if getattr(r, f"latency_{s}_ms") is None else getattr(r, f"latency_{s}_ms")
                          for s in STAGES] for r, _ in runs])
    recorded = np.full_like(measured, np.nan)
    for j, (r, knobs) in enumerate(runs):
        i = row_of.get((samples.dataset[r.sample], samples.sample_key[r.sample]))
        if i is not None:
            recorded[j] = stages[:, i, col_of[knobs]]
    ratios = stage_ratios(measured, recorded)
    columns = [col_of.get(a) for a in space_of.action_space.actions]
    stage_mean = np.full((len(columns), len(STAGES)), np.nan)
    total_mean = np.full(len(columns), np.nan)
    latency = data.latency_ms.numpy()
    for a, col in enumerate(columns):
        if col is not None:
            stage_mean[a] = [_mean(stages[s, train, col]) for s in range(len(STAGES))]
            total_mean[a] = _mean(latency[train, col])
    ratio = torch.tensor(config_ratios(ratios, stage_mean, total_mean), dtype=torch.float32)
    rows_run = torch.tensor([r.sample for r, _ in runs])
    index = {a: k for k, a in enumerate(space_of.action_space.actions)}
    total = np.array([r.latency_total_ms for r, _ in runs])
    expected, spread = {}, {}
    for name, (_, predictor) in predictors.items():
        predicted = (predictor.latency_before_vision(samples.lang[rows_run], executor.tiling_crops[rows_run],
                                                     samples.prompt_tokens[rows_run]) if name in READS_PROMPT
                     else predictor.latency_before_vision(samples.lang[rows_run], executor.tiling_crops[rows_run]))
        expected[name] = np.array([float(predicted[j, index[knobs]] * ratio[index[knobs]])
                                   for j, (_, knobs) in enumerate(runs)])
        spread[name] = guard_slack(total, expected[name]) / guard_slack(total, expected[name], 0.5)
    chosen = min(spread, key=lambda name: (spread[name], name))
    return LatencyGuard(predictors[chosen][1], ratio, guard_slack(total, expected[chosen]),
                        dict(zip(STAGES, ratios.tolist())), len(runs), float(total.sum()) / 1000,
                        guard_slack(total, expected[chosen], 0.5), chosen, spread)


def parent_predictors(parent_path: Path) -> dict[str, tuple[Path, LatencyPredictor]]:
    """The parent offline run's predictors of a request's latency that it saved, by name: its request
    cost model (``request_cost.pt``) and its outcome model (``outcome.pt``), both over its action space."""
    found: dict[str, tuple[Path, LatencyPredictor]] = {}
    if (parent_path / REQUEST_COST_FILE).exists():
        path = parent_path / REQUEST_COST_FILE
        found["request_cost"] = (path, RequestCostModel.from_state(torch.load(path, weights_only=True)))
    if (parent_path / OUTCOME_FILE).exists():
        found["outcome"] = (parent_path / OUTCOME_FILE, OutcomeModel.load(parent_path / OUTCOME_FILE))
    if len(found) == 2 and found["request_cost"][1].action_space != found["outcome"][1].action_space:
        del found["request_cost"]  # not the run's own action space: the outcome model is
    return found
