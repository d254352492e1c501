"""Measured evaluation of an online run: the model runs every decision, here.

For an online run, ``ctrl evaluate RUN`` runs the test split (``trainer.data.split_of``) at a
grid of budgets with greedy decisions (the most probable choice at each stage) and measures
what happens, for two deciders:

* ``controller``: the run's controller (its last checkpoint);
* ``offline_start``: the controller the run started from — its parent offline policy with the
  new online terms at zero and the insertion position fixed at 1 (every block count allowed),
  i.e. the offline policy deployed as is. Absent for runs started ``--fresh``.

The deciders are measured *paired*: each (sample, budget) runs every decider back to back
(the order rotating from sample to sample) on one executor, so machine drift between minutes
shifts all deciders alike. Per (decider, budget): accuracy (the dataset metric on the
generated answers), mean and p95 of the measured total latency, violation rate (latency >
budget), accuracy within budget (answers over budget count as 0), mean reward (the run's
reward) and the chosen-configuration histogram ("C/K/B@p"). Written like the offline
evaluation: ``evaluation.parquet`` (view ``evaluations``; ``expected_reward`` is null: there is
no exact expectation when outcomes are measured) and ``evaluation.png``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import CtrlError
from pipeline.workspace import Workspace


def evaluate_online_run(workspace: Workspace | str | Path | None, run: str | Path, budgets_ms: list[float] | None = None,
                        *, num_budgets: int = 5, max_samples: int | None = None, runtime: Any = None,
                        progress: Any = None) -> Any:  # -> polars.DataFrame
    """Evaluate an online run on the test split with the model (see module doc); writes the files."""

    from features.model import load_runtime
    from online.train import OnlineTrainConfig
    from trainer.evaluate import write_evaluation
    from trainer.offline import budget_grid, resolve_checkpoint, resolve_run_dir
    from trainer.policy import ControllerPolicy
    from trainer.reward import RewardConfig
    from trainer.two_stage import TwoStageController, set_budget_range

    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    run_dir = resolve_run_dir(ws, run)
    config = OnlineTrainConfig.from_json(json.loads((run_dir / "config.json").read_text()))
    checkpoint = run_dir / "checkpoints" / "last.pt"
    if not checkpoint.exists():
        raise CtrlError(f"{checkpoint} does not exist: the run saved no checkpoint yet")
    runtime = runtime if runtime is not None else load_runtime(config.model, config.device, config.importance_scores)
    controller = TwoStageController.load(checkpoint, runtime.fingerprint)
    reward = config.reward if isinstance(config.reward, RewardConfig) else RewardConfig.from_json(config.reward)
    lo, hi = float(config.budget_min_ms), float(config.budget_max_ms)
    budgets = [float(b) for b in budgets_ms] if budgets_ms else [round(b, 1) for b in budget_grid(lo, hi, num_budgets)]

    deciders: list[tuple[str, TwoStageController, int | None]] = [("controller", controller, None)]
    if config.parent_run_id is not None:
        parent_dir = resolve_run_dir(ws, config.parent_run_id)
        parent_cfg = json.loads((parent_dir / "config.json").read_text())
        if parent_cfg.get("phase", "offline") == "offline":
            policy = ControllerPolicy.load(resolve_checkpoint(ws, parent_dir), runtime.fingerprint)
            start = TwoStageController(policy, controller.two_stage)
            set_budget_range(start.policy, controller.policy.config.budget_min_ms, controller.policy.config.budget_max_ms)
            deciders.append(("offline_start", start, start.insertion_positions.index(1)))

    from online.timing import cpu_threads

    with cpu_threads(config.threads, runtime.device):
        frame = _run_deciders(ws, config, runtime, deciders, budgets, reward, max_samples, progress)
    write_evaluation(run_dir, frame, run_dir.name)
    return frame


def _run_deciders(ws: Workspace, config: Any, runtime: Any, deciders: list, budgets: list[float], reward: Any,
                  max_samples: int | None, progress: Any) -> Any:
    from online.data import load_online_samples
    from online.rollout import RolloutExecutor
    from trainer.evaluate import evaluation_frame, outcome_metrics
    from trainer.reward import compute_reward

    samples = load_online_samples(ws, runtime.fingerprint, config.images_dir)
    test = samples.rows("test") or samples.rows("val")
    if not test:
        raise CtrlError(f"workspace {ws.root}: no samples in the test split")
    test = test[:max_samples] if max_samples else test
    total = len(deciders) * len(budgets) * len(test)
    done = 0
    # Paired measurement: every (sample, budget) runs each decider back to back, in an order that
    # rotates from sample to sample, so a machine that drifts between minutes (this 2-core VM:
    # up to ~30 %) shifts every decider's latencies alike instead of whichever ran later.
    outcomes: dict[tuple[str, float], list] = {(name, budget): [] for name, _, _ in deciders for budget in budgets}
    gen = torch.Generator().manual_seed(0)  # unused by greedy decisions; keeps the call uniform
    executor = RolloutExecutor(runtime, deciders[0][1], samples, config.max_new_tokens, config.warmup)
    try:
        for ctrl in {id(c): c for _, c, _ in deciders}.values():
            ctrl.eval()
        for budget in budgets:
            for i, sample in enumerate(test):
                shift = i % len(deciders)
                for name, ctrl, insertion in deciders[shift:] + deciders[:shift]:
                    out = executor.run_groups([(sample, budget)], 1, gen, gen, greedy=True,
                                              insertion_index=insertion, controller=ctrl).rollouts
                    outcomes[(name, budget)].extend(out)
                    done += 1
                if progress:
                    progress(done, total)
    finally:
        executor.close()
    rows = []
    for name, _, _ in deciders:
        for budget in budgets:
            out = outcomes[(name, budget)]
            latency = torch.tensor([r.latency_total_ms for r in out], dtype=torch.float64)
            score = torch.tensor([r.score for r in out], dtype=torch.float64)
            knobs = torch.tensor([[r.max_crops, r.top_k, r.num_active_blocks] for r in out], dtype=torch.float32)
            r_parts = compute_reward(score.float(), latency.float(), budget, knobs, reward)
            hist = Counter(f"{r.max_crops}/{r.top_k}/{r.num_active_blocks}@{r.insertion_position}" for r in out)
            rows.append({"decider": name, "budget_ms": budget, "num_samples": len(out),
                         **outcome_metrics(score, latency, budget),
                         "reward_mean": float(r_parts["reward"].double().mean()), "expected_reward": None,
                         "config_histogram": json.dumps(dict(sorted(hist.items())))})
    return evaluation_frame(rows)
