"""``ctrl train --offline``: GRPO on the recorded configuration groups (``docs/origin_format.md`` §7.6).

Every sample of exp5/exp6 was recorded under every configuration, so a group of G sampled
configurations per (sample, budget) is scored by lookup, not by running the model. One run
(:class:`OfflineTrainer`: its constructor resolves the config and the run directory and writes
nothing; :meth:`OfflineTrainer.train` does the rest):

1. **start or resume**: the run directory (``trainer.runs``) and its config.json; a new run fits
   the outcome model (``trainer.outcome``, saved as ``outcome.pt``), then warm-starts the policy
   on a decider's choices (``trainer.warm_start``), which becomes the KL reference; a resumed
   run restores the policy, the reference, the optimizer and the RNG states from
   ``checkpoints/last.pt``;
2. **epochs of steps**: sample groups, add the violation multipliers' price, take a GRPO step,
   update the multipliers (:meth:`OfflineTrainer.step`);
3. **after each epoch**: the exact validation expected reward, ``best.pt`` when it improved,
   ``last.pt``, ``metrics.parquet`` and ``run.parquet``;
4. **finish**: the fold networks of a cross-fitted run (``trainer.crossfit``), the table fallback
   of the best checkpoint (``trainer.fallback``) and the evaluation against the baselines
   (``trainer.evaluate.evaluate_run``).

Logged metrics (``metrics.parquet``, schema ``pipeline.schema.METRICS``; step rows per
optimizer step, epoch rows = means and sums): ``loss``; ``reward/mean`` and its terms;
``groups`` and ``zero_variance_groups`` (dropped: no signal); ``kl``; ``clip_ratio``;
``grad_norm`` (before clipping); epoch rows only: ``val/expected_reward`` (the exact
sum_a pi(a|x) r(x, a) on the val split over the budget grid: the honest measure of progress),
``val/expected_accuracy``, ``val/expected_violation_rate``; ``wall_time_s``.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import CtrlError
from pipeline.schema import METRICS, REWARD_TERMS
from pipeline.workspace import Workspace, write_bytes_atomic
from trainer.config import OfflineTrainConfig, check_training_memory
from trainer.constraint import ViolationConstraint
from trainer.crossfit import check_folds, deployed_data, fit_cross_fitted_fallback, load_folds, train_folds
from trainer.data import (
    OfflineData,
    budget_grid,
    hold_out_dataset,
    load_offline_data,
    nonempty_split,
    training_targets,
)
from trainer.evaluate import evaluate_run
from trainer.fallback import attach_fallback, fallback_table, fit_table_fallback
from trainer.grpo import policy_loss, sample_groups
from trainer.outcome import OUTCOME_FILE, OutcomeConfig, OutcomeDecider, OutcomeModel, fit_outcome_model
from trainer.policy import ControllerPolicy, expected_reward
from trainer.reporting import Reporter, check_report_to, make_reporter, plot_training_curves
from trainer.request_cost import (
    REQUEST_COST_CHECK,
    REQUEST_COST_FILE,
    RequestCostConfig,
    RequestCostModel,
    cost_quality,
    fit_request_cost_out_of_fold,
)
from trainer.request_table import RequestTableDecider
from trainer.run_record import Progress, RunResult, check_resume, epoch_summary, resolve_config, run_row
from trainer.runs import RunDir, atomic_torch_save, rows_frame, write_table_atomic
from trainer.warm_start import build_policy, warm_start


class OfflineTrainer:
    """One offline run: the constructor resolves its config and directory (it reads the data and
    writes nothing), :meth:`train` starts or resumes the run and trains it."""

    # set when training starts (:meth:`train`)
    policy: ControllerPolicy
    ref_policy: ControllerPolicy | None
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    constraint: ViolationConstraint

    def __init__(self, config: OfflineTrainConfig, progress: Callable[[dict], None] | None = None, *,
                 data: OfflineData | None = None, run_dir: Path | None = None) -> None:
        self.workspace = Workspace(config.workspace)
        self.notify = progress or (lambda event: None)
        resume = RunDir.resolve(self.workspace, config.resume) if config.resume else None
        # with a held-out dataset the run learns from the others, and is evaluated on it
        self.full_data = data if data is not None else load_offline_data(self.workspace, config.model_fingerprint)
        if config.ignore_family_labels:
            self.full_data = self.full_data.without_family_labels()
        self.data = (hold_out_dataset(self.full_data, config.holdout_dataset)[1] if config.holdout_dataset
                     else self.full_data)
        nonempty_split(self.data, "test")  # cross-fitted or not, the data must have held-out samples
        # cross-fitted: the deployed network also learns from the test split (the folds judge it)
        trained_on = deployed_data(self.data) if config.cross_fit_folds else self.data
        check_training_memory(config, len(self.data.action_space),
                              self.data.lang_features.shape[1] + self.data.image_features.shape[1])
        if config.cross_fit_folds > len(trained_on):  # each fold must hold out at least one sample
            msg = (f"--cross-fit-folds {config.cross_fit_folds} is more folds than the {len(trained_on)} samples "
                   "the networks train on\nHint: use at most that many, or 0 for one split.")
            raise CtrlError(msg)
        if config.cross_fit_folds:
            check_folds(trained_on, config.cross_fit_folds)
        train, val = nonempty_split(trained_on, "train"), nonempty_split(trained_on, "val")
        config = resolve_config(config, self.data)
        self.config = check_resume(resume, config) if resume is not None else config
        check_report_to(self.config.report_to)  # before the run directory: a missing package leaves no run
        if resume is not None:
            self.run = resume
        elif run_dir is not None:  # a fold of a cross-fit: its parent run owns the directory
            self.run = RunDir(run_dir)
        else:
            self.run = RunDir.new(self.workspace, config.run_id)
        self.config.run_id = self.run.run_id
        self.train_recorded = train  # the recorded scores (without a cross-fit, the fallback table is fitted on them)
        # model selection on the same, less noisy, targets as training
        self.train_split = training_targets(train, self.config.score_target)
        self.val_split = training_targets(val, self.config.score_target)
        self.val_budgets = budget_grid(self.config.budget_min_ms, self.config.budget_max_ms,
                                       self.config.num_val_budgets)
        # a resumed run without a finished epoch (it stopped in epoch 1) starts over
        self.resuming = resume is not None and self.run.last_checkpoint.exists()
        self.progress = Progress()
        self.last_val: float | None = None  # the last epoch's validation expected reward
        self.is_fold = run_dir is not None
        self.reporter = Reporter()  # the run's --report-to backend once training starts; folds report nothing
        self.request_cost: RequestCostModel | None = None  # the train split's (``_request_cost_model``)

    # -- the start: a new run's outcome model and warm start, or a resumed run's state
    def _fit_outcome_model(self) -> OutcomeModel:
        """The outcome model of the train split, saved as ``outcome.pt``: the evaluation decider
        ``outcome`` and, with ``warm_start_target="outcome"``, the decider the warm start fits."""
        config = self.config
        if not self.is_fold:
            self.notify({"phase": "fit", "model": "outcome model"})
        outcome = fit_outcome_model(self.train_split, self.val_split,
                                    OutcomeConfig(quantile=config.outcome_quantile, seed=config.seed,
                                                  use_tilings=config.outcome_tilings,
                                                  latency_neighbours=config.outcome_latency_neighbours))
        outcome.save(self.run.path / OUTCOME_FILE)
        return outcome

    def _request_cost_model(self) -> RequestCostModel:
        """The per-request cost model of the train split (fitted once per run); the train rows' out-of-fold
        predictions join ``train_split`` (``request_latency_ms``), which a policy with ``request_cost_input``
        trains on."""
        if self.request_cost is None:
            self.notify({"phase": "fit", "model": "request cost model"})
            self.request_cost, out_of_fold = fit_request_cost_out_of_fold(self.train_recorded,
                                                                          RequestCostConfig(seed=self.config.seed))
            self.train_split = replace(self.train_split, request_latency_ms=out_of_fold)
        return self.request_cost

    def _fit_request_cost(self) -> None:
        """The per-request cost model of the train split, checked on the val split's latencies and saved
        as ``request_cost.pt`` with its check (``request_cost.json``): what the run's request table and
        ``ctrl export`` build on is fitted again on the deployed data; this file says how well it predicts."""
        model = self._request_cost_model()
        quality = cost_quality(model, self.val_split)
        atomic_torch_save(model.to_state(), self.run.path / REQUEST_COST_FILE)
        check = {"median_abs_error": quality.median_abs_error, "coverage": quality.coverage,
                 "quantile": quality.quantile, "num_measurements": quality.num_measurements,
                 "unmodelled": model.unmodelled}
        write_bytes_atomic(self.run.path / REQUEST_COST_CHECK, (json.dumps(check, indent=2) + "\n").encode())

    def _warm_start(self, outcome: OutcomeModel) -> None:
        """Fit the policy to the start decider's choices (``warm_start_target``: ``outcome``'s or the table's)."""
        start = OutcomeDecider(outcome) if self.config.warm_start_target == "outcome" else None
        warm_start(self.policy, self.train_split, self.config, start)

    def _optimisation(self) -> None:
        """The KL reference (the policy as it starts), the optimizer, the sampling RNG, the multipliers."""
        self.ref_policy = self._reference_policy()
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.config.lr,
                                           weight_decay=self.config.weight_decay)
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self.constraint = ViolationConstraint(self.val_budgets, self.config.violation_target, self.config.violation_lr,
                                              self.config.violation_max_multiplier)

    def _reference_policy(self) -> ControllerPolicy | None:
        if self.config.kl_beta <= 0:
            return None
        ref = copy.deepcopy(self.policy).eval()
        ref.requires_grad_(False)
        return ref

    def _restore(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["state_dict"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        if self.ref_policy is not None:
            self.ref_policy.load_state_dict(state["ref_state_dict"])
        self.constraint.values = state["violation_multipliers"].double()
        self.progress = Progress.from_state(state)
        self.last_val = self.progress.rows[-1]["val/expected_reward"]
        self.started -= self.progress.rows[-1]["wall_time_s"]  # wall time continues from the interrupted run

    # -- the loop
    def train(self) -> RunResult:
        """Start (or resume) the run, train its epochs, then its folds, fallback and evaluation."""
        self.started = time.perf_counter()
        self.run.write_config(self.config.to_json())
        cost = self._request_cost_model() if self.config.request_cost_input else None
        self.policy = build_policy(self.config, self.train_split, cost)
        if not self.resuming:
            self._warm_start(self._fit_outcome_model())
            if not self.is_fold:
                self._fit_request_cost()
        self._optimisation()
        if self.resuming:
            self._restore(self.run.load_last())
        self.run_row = run_row(self.progress, self.config, self.data, self.workspace.root, len(self.train_split),
                               len(self.val_split))
        self._write_run_row()
        if not self.is_fold:
            self.reporter = make_reporter(self.config.report_to, self.run.run_id, self.run.path, self.workspace.root,
                                          self.config.to_json())
        try:
            if self.progress.epoch == 0:
                self._evaluate_initial_policy()
            for epoch in range(self.progress.epoch + 1, self.config.num_epochs + 1):
                self._train_epoch(epoch)
                self._checkpoint(epoch)
            write_table_atomic(self.progress.rows, METRICS, self.run.metrics_path)
            if not self.is_fold:
                plot_training_curves(self.progress.rows, self.run.path / "training_curves.png",
                                     f"run {self.run.run_id}")
            if self.config.cross_fit_folds:
                train_folds(self.run.path, self.config, self.data, _train_fold, self.notify)
            if not self.config.disable_table_fallback:
                self._attach_fallback()
            evaluation = None
            if not self.config.disable_evaluation:
                num_epochs = self.config.num_epochs
                self.notify({"phase": "evaluate", "epoch": num_epochs, "num_epochs": num_epochs})
                evaluation = evaluate_run(self.workspace, self.run.path, data=self.full_data)
                if evaluation is not None:  # a test may stand in for the evaluation
                    self.reporter.log_evaluation(evaluation.to_dicts())
        except BaseException as err:  # record why the run stopped, then let the error through
            self._finish_run_row("interrupted" if isinstance(err, KeyboardInterrupt) else "failed")
            raise
        finally:
            self.reporter.close()
        self._finish_run_row("completed")
        p = self.progress
        return RunResult(run_id=self.run.run_id, run_dir=self.run.path, best_checkpoint=self.run.best_checkpoint,
                         last_checkpoint=self.run.last_checkpoint, best_epoch=p.best_epoch,
                         best_val_expected_reward=p.best, initial_val_expected_reward=p.initial,
                         metrics=rows_frame(p.rows, METRICS), evaluation=evaluation)

    def _evaluate_initial_policy(self) -> None:
        """Epoch 0: the initial policy, the reference for "improved"."""
        v = self._validate()
        p = self.progress
        p.initial = p.best = v["expected_reward"]
        self._log({"kind": "epoch", "step": 0, "epoch": 0, **{f"val/{k}": x for k, x in v.items()}})
        self._save_best(0)

    def _train_epoch(self, epoch: int) -> None:
        config, p = self.config, self.progress
        self.policy.train()
        rows = []
        order = torch.randperm(len(self.train_split), generator=self.generator)
        for start in range(0, len(self.train_split), config.batch_size):
            index = order[start:start + config.batch_size].repeat_interleave(config.num_budgets_per_sample)
            lo, hi = config.budget_min_ms, config.budget_max_ms
            budgets = lo + (hi - lo) * torch.rand(len(index), generator=self.generator)
            p.step += 1
            row = {"kind": "step", "step": p.step, "epoch": epoch, **self.step(index, budgets)}
            self._log(row)
            rows.append(row)
            self._notify("train", epoch, row["loss"], row["reward/mean"], self.last_val)
        v = self._validate()
        self._log({"kind": "epoch", "step": p.step, "epoch": epoch, **epoch_summary(rows),
                   **{f"val/{k}": x for k, x in v.items()}})
        if v["expected_reward"] > p.best:
            p.best, p.best_epoch = v["expected_reward"], epoch
            self._save_best(epoch)

    def step(self, index: torch.Tensor, budgets: torch.Tensor) -> dict[str, float]:
        """Sample one batch of groups, take ``num_iterations`` gradient steps on it; the step's metrics."""
        config = self.config
        latency = self.train_split.latency_ms[index]
        if config.latency_jitter > 0:
            # a recorded latency is one run's draw: judged against fresh draws around it, a sample
            # that happened to run fast cannot be learned as a fast sample
            noise = torch.randn(latency.shape, generator=self.generator, dtype=latency.dtype)
            latency = latency * torch.exp(config.latency_jitter * noise)
        groups = sample_groups(self.policy, self.train_split, index, budgets, config.group_size, config.reward,
                               self.generator, latency_ms=latency)
        if self.constraint.target is not None:
            # the multiplier's price of a violation joins the reward (and its logged violation term)
            extra = self.constraint.penalty(budgets)[:, None] * groups.violated.float()
            groups.rewards = groups.rewards - extra
            groups.parts = {**groups.parts, "reward": groups.rewards, "viol_pen": groups.parts["viol_pen"] + extra}
            self.constraint.update(budgets, groups.expected_violation)
        for _ in range(config.num_iterations):
            out = policy_loss(self.policy, self.train_split, groups, loss_type=config.loss_type,
                              scale_rewards=config.scale_rewards, clip_epsilon=config.clip_epsilon,
                              kl_beta=config.kl_beta, ref_policy=self.ref_policy)
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), config.max_grad_norm or math.inf)
            self.optimizer.step()
        violated = None if groups.violated is None else float(groups.violated.float().mean())
        return {"loss": float(out.loss.detach()), "reward/mean": float(groups.rewards.mean()),
                "reward_std": float(groups.rewards.std()), "violation_rate": violated,
                "learning_rate": float(self.optimizer.param_groups[0]["lr"]),
                **{f"reward/{t}": float(groups.parts[t].mean()) for t in REWARD_TERMS},
                "groups": out.num_groups, "zero_variance_groups": out.num_zero_variance_groups,
                "kl": out.kl, "clip_ratio": out.clip_ratio, "grad_norm": float(norm)}

    # -- bookkeeping
    def _validate(self) -> dict[str, float]:
        return expected_reward(self.policy, self.val_split, self.val_budgets, self.config.reward, details=True)

    def _log(self, row: dict[str, Any]) -> None:
        self.progress.rows.append({"run_id": self.run.run_id, **row, "wall_time_s": time.perf_counter() - self.started})
        self.reporter.log(row, row["step"])
        if row["kind"] == "epoch":
            self.last_val = row["val/expected_reward"]

    def _notify(self, phase: str, epoch: int, loss: float, reward: float, val: float | None) -> None:
        steps_per_epoch = math.ceil(len(self.train_split) / self.config.batch_size)
        self.notify({"phase": phase, "epoch": epoch, "num_epochs": self.config.num_epochs, "step": self.progress.step,
                     "total_steps": steps_per_epoch * self.config.num_epochs, "loss": loss, "reward": reward,
                     "val_expected_reward": val, "best_val_expected_reward": self.progress.best})

    def _save_best(self, epoch: int) -> None:
        self.policy.save(self.run.best_checkpoint, extra={
            "run_id": self.run.run_id, "epoch": epoch, "val_expected_reward": self.progress.best,
            "violation_multipliers": self.constraint.values.tolist()})

    def _checkpoint(self, epoch: int) -> None:
        """After an epoch: ``last.pt`` (everything a resume needs), the metrics and the run row."""
        p = self.progress
        p.epoch = epoch
        self.run.save_last({
            "violation_multipliers": self.constraint.values, "state_dict": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "ref_state_dict": self.ref_policy.state_dict() if self.ref_policy is not None else None,
            **p.state()})
        write_table_atomic(p.rows, METRICS, self.run.metrics_path)
        self._write_run_row(epochs_done=epoch, steps=p.step, best_epoch=p.best_epoch, best_val_expected_reward=p.best,
                            initial_val_expected_reward=p.initial, wall_time_s=time.perf_counter() - self.started)
        last = p.rows[-1]
        self._notify("epoch", epoch, last["loss"], last["reward/mean"], last["val/expected_reward"])

    @property
    def table_data(self) -> OfflineData:
        """The samples the deployed fallback table is fitted on: cross-fitted, every sample the run
        learns from (the folds' own tables stand in for it in the fallback rule and the evaluation,
        so no judgement reads a table fitted on the samples it judges); else the train split (the
        test split stays unseen). A per-family table chooses measurably better from every sample
        than from 80 % of them (docs/results.md)."""
        return self.data if self.config.cross_fit_folds else self.train_recorded

    def _attach_fallback(self) -> None:
        if self.config.cross_fit_folds:
            models = load_folds(self.run.path, self.data, self.config.cross_fit_folds)
            deployed_table = fallback_table(self.table_data, self.config.fallback_table, self.val_budgets,
                                            self.config.reward, self.config.seed)
            deployed_request = RequestTableDecider.fit(self.table_data, RequestCostConfig(seed=self.config.seed))
            fallback = fit_cross_fitted_fallback(models, training_targets(self.data, self.config.score_target),
                                                 self.val_budgets, self.config.reward, deployed_table,
                                                 self.config.fallback_confidence, self.config.fallback_prefers,
                                                 seed=self.config.seed, deployed_request=deployed_request,
                                                 request_table=self.config.fallback_request_table)
        else:
            best = ControllerPolicy.load(self.run.best_checkpoint)
            fallback = fit_table_fallback(best, self.train_recorded, self.val_split, self.val_budgets,
                                          self.config.reward, confidence=self.config.fallback_confidence,
                                          prefers=self.config.fallback_prefers, table=self.config.fallback_table,
                                          seed=self.config.seed, request_table=self.config.fallback_request_table)
        attach_fallback(self.run.best_checkpoint, fallback)

    def _write_run_row(self, **changes: Any) -> None:
        self.run_row.update(changes)
        self.run.write_run_row(self.run_row, "offline")

    def _finish_run_row(self, status: str) -> None:
        self._write_run_row(status=status, finished_at=datetime.now(timezone.utc),
                            wall_time_s=time.perf_counter() - self.started)


def train_offline(config: OfflineTrainConfig, progress: Callable[[dict], None] | None = None, *,
                  data: OfflineData | None = None) -> RunResult:
    """Train the controller on ``config.workspace``'s recorded groups; see the module docstring.

    ``progress(dict)`` is called after every step (``phase="train"``: epoch, step, total_steps,
    loss, reward, val_expected_reward of the last epoch, best_val_expected_reward), after every
    epoch (``phase="epoch"``), before the outcome and request cost models are fitted (``phase="fit"``:
    model) and before the final evaluation (``phase="evaluate"``).
    ``data``: an in-memory ``OfflineData`` to train on instead of the workspace's (benchmarks);
    the run directory is still written under ``config.workspace``.
    """
    return OfflineTrainer(config, progress, data=data).train()


def _train_fold(config: OfflineTrainConfig, data: OfflineData, run_dir: Path,
                progress: Callable[[dict], None]) -> RunResult:
    """One fold network of a cross-fit (``trainer.crossfit.train_folds``)."""
    return OfflineTrainer(config, progress, data=data, run_dir=run_dir).train()
