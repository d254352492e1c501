"""``ctrl train --offline``: GRPO on the recorded configuration groups (``docs/origin_format.md`` §7.6).

Every sample of exp5/exp6 was recorded under every configuration, so a group of G sampled
configurations per (sample, budget) is scored by lookup, not by running the model. One run:

1. **start or resume** (:class:`OfflineTrainer`): the run directory (``trainer.runs``), the
   policy fitted to the static lookup table (``warm_start``), the KL reference, the optimizer;
   a resumed run restores all of it, RNG states included, from ``checkpoints/last.pt``;
2. **epochs of steps**: sample groups, add the violation multipliers' price, take a GRPO step,
   update the multipliers (:meth:`OfflineTrainer.step`);
3. **after each epoch**: the exact validation expected reward, ``best.pt`` when it improved,
   ``last.pt``, ``metrics.parquet`` and ``run.parquet``;
4. **finish**: the table fallback of the best checkpoint (``trainer.fallback``) and the test
   evaluation against the baselines (:func:`evaluate_run`).

Logged metrics (``metrics.parquet``, schema ``pipeline.schema.METRICS``; step rows per
optimizer step, epoch rows = means and sums): ``loss``; ``reward/mean`` and its terms;
``groups`` and ``zero_variance_groups`` (dropped: no signal); ``kl``; ``clip_ratio``;
``grad_norm`` (before clipping); epoch rows only: ``val/expected_reward`` (the exact
sum_a pi(a|x) r(x, a) on the val split over the budget grid: the honest measure of progress),
``val/expected_accuracy``, ``val/expected_violation_rate``; ``wall_time_s``.
"""

from __future__ import annotations

import copy
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import polars as pl
import torch

from pipeline.errors import CtrlError
from pipeline.schema import METRICS, REWARD_TERMS
from pipeline.workspace import Workspace
from trainer.baselines import (
    Decider,
    FamilyLookupTableDecider,
    LargestDecider,
    LookupTableDecider,
    OracleDecider,
    RandomDecider,
)
from trainer.config import OfflineTrainConfig
from trainer.constraint import ViolationConstraint
from trainer.crossfit import deployed_data, fit_cross_fitted_fallback, fold_data, fold_run_dir, load_folds
from trainer.data import OfflineData, budget_grid, default_budget_range, load_offline_data
from trainer.evaluate import evaluate_deciders, write_evaluation
from trainer.fallback import PolicyDecider, TableFallback, attach_fallback, fit_table_fallback, read_fallback
from trainer.grpo import policy_loss, rows_log_probs, sample_groups
from trainer.outcome import OUTCOME_FILE, OutcomeConfig, OutcomeDecider, OutcomeModel, fit_outcome_model
from trainer.policy import ControllerPolicy, PolicyConfig, budget_normalization_range, expected_reward
from trainer.runs import RunDir, resolve_checkpoint, rows_frame, write_table_atomic


@dataclass
class RunResult:
    """What :func:`train_offline` produced."""

    run_id: str
    run_dir: Path
    best_checkpoint: Path
    last_checkpoint: Path
    best_epoch: int
    best_val_expected_reward: float
    initial_val_expected_reward: float
    metrics: pl.DataFrame
    evaluation: pl.DataFrame | None = None  # None with disable_evaluation


# -- the pieces of a run ----------------------------------------------------------------------

def _split(data: OfflineData, name: str) -> OfflineData:
    part = data.subset(name)
    if len(part) == 0:
        msg = (f"the {name} split is empty ({len(data)} samples in total)\n"
               "Hint: the split is 80/10/10 by sample; ingest more samples.")
        raise CtrlError(msg)
    return part


def _resolve(config: OfflineTrainConfig, data: OfflineData) -> OfflineTrainConfig:
    """The config with data-derived fields filled in: what config.json records."""
    lo, hi = default_budget_range(data)
    lo = config.budget_min_ms if config.budget_min_ms is not None else lo
    hi = config.budget_max_ms if config.budget_max_ms is not None else hi
    if not hi > lo:
        msg = (f"budget range [{lo}, {hi}] ms is empty (one end set, the other from the data)\n"
               "Hint: pass both --budget-min-ms and --budget-max-ms.")
        raise CtrlError(msg)
    eval_budgets = config.eval_budgets or [round(b, 1) for b in budget_grid(lo, hi, config.num_val_budgets)]
    return OfflineTrainConfig.from_json({**config.to_json(), "budget_min_ms": float(lo), "budget_max_ms": float(hi),
                                         "model_fingerprint": data.model_fingerprint, "eval_budgets": eval_budgets,
                                         "resume": None})


def _check_resume(run: RunDir, resolved: OfflineTrainConfig) -> OfflineTrainConfig:
    """The saved config with the new num_epochs; any other difference is refused."""
    saved = run.read_config()
    new = resolved.to_json()
    ignore = {"resume", "run_id", "num_epochs", "workspace"}
    differ = sorted(k for k in saved if k not in ignore and saved[k] != new.get(k))
    if differ:
        detail = ", ".join(f"{k}: {saved[k]!r} -> {new.get(k)!r}" for k in differ)
        msg = (f"cannot resume {run.run_id}: options differ from its config.json ({detail})\n"
               "Hint: resume with only --resume (and optionally --num-epochs), or start a new run.")
        raise CtrlError(msg)
    return OfflineTrainConfig.from_json({**saved, "num_epochs": resolved.num_epochs, "resume": None,
                                         "workspace": new["workspace"]})


def build_policy(config: OfflineTrainConfig, train: OfflineData) -> ControllerPolicy:
    """A fresh policy for ``train``'s features and action space (weights from ``config.seed``)."""
    lo, hi = budget_normalization_range(config.budget_min_ms, config.budget_max_ms, config.budget_margin)
    policy_config = PolicyConfig(lang_feature_dim=train.lang_features.shape[1],
                                 image_feature_dim=train.image_features.shape[1], budget_min_ms=lo, budget_max_ms=hi,
                                 hidden_dim=config.hidden_dim, dropout=config.dropout, use_tilings=config.use_tilings,
                                 image_feature=train.image_feature)
    torch.manual_seed(config.seed)  # initial weights depend on the seed only
    policy = ControllerPolicy(policy_config, train.action_space, train.model_fingerprint)
    policy.set_feature_normalization(train.image_features, train.image_present, train.lang_features, train.tiling_crops)
    return policy


def training_targets(data: OfflineData, score_target: str = "mean") -> OfflineData:
    """A copy of ``data`` whose ``score`` is what the rewards of training are computed from:
    ``"mean"``, the mean of the exp5 and exp6 scores where both were recorded
    (``OfflineData.mean_score``, two independent runs: half the outcome noise), else the
    recorded score; ``"recorded"``, the groups view's ``score`` (exp6 where present)."""
    out = data.clone()
    out.score = data.scores(score_target).clone()
    return out


def warm_start(policy: ControllerPolicy, train: OfflineData, config: OfflineTrainConfig,
               start: Decider | None = None) -> None:
    """Fit the policy to ``start``'s choices (default: the ``lut_p95`` table of ``train``) before GRPO.

    ``config.warm_start_steps`` Adam steps of cross-entropy to a target distribution over each
    sample's allowed configurations: ``warm_start_weight`` on the decider's choice at the
    sampled budget, the rest uniform (so GRPO still samples every configuration). Budgets are
    uniform over the training range, seeded by ``config.seed``.
    """
    if config.warm_start_steps == 0:
        return
    table = start if start is not None else LookupTableDecider(train)
    generator = torch.Generator().manual_seed(config.seed + 1)
    optimizer = torch.optim.Adam(policy.parameters(), lr=config.lr)
    lo, hi = config.budget_min_ms, config.budget_max_ms
    batch = config.batch_size * config.num_budgets_per_sample
    policy.train()
    for _ in range(config.warm_start_steps):
        index = torch.randint(len(train), (batch,), generator=generator)
        budgets = lo + (hi - lo) * torch.rand(batch, generator=generator)
        rows = train.select(index)
        choice = table.decide(rows, budgets)
        allowed = rows.mask.float()
        target = (1.0 - config.warm_start_weight) * allowed / allowed.sum(1, keepdim=True)
        target[torch.arange(batch), choice] += config.warm_start_weight
        log_probs = rows_log_probs(policy, train, index, budgets)
        loss = -(target * torch.where(rows.mask, log_probs, 0.0)).sum(1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _epoch_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means of the epoch's step metrics; sums of the group counts."""
    skip = ("kind", "step", "epoch", "run_id", "wall_time_s")
    out = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k not in skip}
    out.update(groups=sum(r["groups"] for r in rows), zero_variance_groups=sum(r["zero_variance_groups"] for r in rows))
    return out


# -- the run -----------------------------------------------------------------------------------

@dataclass
class _Progress:
    """What ``last.pt`` records besides the weights: where the run stands."""

    epoch: int = 0  # the last finished epoch (0: none)
    step: int = 0
    best: float = -math.inf
    best_epoch: int = 0
    initial: float = math.nan
    rows: list[dict[str, Any]] = field(default_factory=list)
    created_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))


class OfflineTrainer:
    """One offline run: start or resume (the constructor), then :meth:`train`."""

    def __init__(self, config: OfflineTrainConfig, progress: Callable[[dict], None] | None = None, *,
                 data: OfflineData | None = None, run_dir: Path | None = None) -> None:
        self.started = time.perf_counter()
        self.workspace = Workspace(config.workspace)
        self.notify = progress or (lambda event: None)
        resume = RunDir.resolve(self.workspace, config.resume) if config.resume else None
        self.data = data if data is not None else load_offline_data(self.workspace, config.model_fingerprint)
        _split(self.data, "test")  # cross-fitted or not, the data must have held-out samples
        # cross-fitted: the deployed network also learns from the test split (the folds judge it)
        trained_on = deployed_data(self.data) if config.cross_fit_folds else self.data
        train, val = _split(trained_on, "train"), _split(trained_on, "val")
        config = _resolve(config, self.data)
        self.config = _check_resume(resume, config) if resume is not None else config
        if resume is not None:
            self.run = resume
        elif run_dir is not None:  # a fold of a cross-fit: its parent run owns the directory
            self.run = RunDir(run_dir)
        else:
            self.run = RunDir.new(self.workspace, config.run_id)
        self.config.run_id = self.run.run_id
        self.run.write_config(self.config.to_json())
        self.train_recorded = train  # the recorded scores: the lookup table of the fallback is built on them
        # model selection on the same, less noisy, targets as training
        self.train_split = training_targets(train, self.config.score_target)
        self.val_split = training_targets(val, self.config.score_target)
        self.val_budgets = budget_grid(self.config.budget_min_ms, self.config.budget_max_ms,
                                       self.config.num_val_budgets)
        self.policy = build_policy(self.config, self.train_split)
        self.progress = _Progress()
        self.last_val: float | None = None  # the last epoch's validation expected reward
        resumable = resume is not None and self.run.last_checkpoint.exists()  # else it stopped in epoch 1: start over
        if not resumable:
            outcome = fit_outcome_model(self.train_split, self.val_split,
                                        OutcomeConfig(quantile=self.config.outcome_quantile, seed=self.config.seed,
                                                      use_tilings=self.config.outcome_tilings))
            outcome.save(self.run.path / OUTCOME_FILE)
            start = OutcomeDecider(outcome) if self.config.warm_start_target == "outcome" else None
            warm_start(self.policy, self.train_split, self.config, start)
        self.ref_policy = self._reference_policy()
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.config.lr,
                                           weight_decay=self.config.weight_decay)
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self.constraint = ViolationConstraint(self.val_budgets, self.config.violation_target, self.config.violation_lr,
                                              self.config.violation_max_multiplier)
        if resumable:
            self._restore(self.run.load_last())

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
        self.progress = _Progress(epoch=state["epoch"], step=state["step"], best=state["best"],
                                  best_epoch=state["best_epoch"], initial=state["initial"], rows=state["metrics"],
                                  created_at=datetime.fromisoformat(state["created_at"]))
        self.last_val = self.progress.rows[-1]["val/expected_reward"]
        self.started -= self.progress.rows[-1]["wall_time_s"]  # wall time continues from the interrupted run

    # -- the loop
    def train(self) -> RunResult:
        self.run_row = self._run_row()
        self._write_run_row()
        try:
            if self.progress.epoch == 0:
                self._evaluate_initial_policy()
            for epoch in range(self.progress.epoch + 1, self.config.num_epochs + 1):
                self._train_epoch(epoch)
                self._checkpoint(epoch)
            write_table_atomic(self.progress.rows, METRICS, self.run.metrics_path)
            if self.config.cross_fit_folds:
                self._train_folds()
            if not self.config.disable_table_fallback:
                self._attach_fallback()
            evaluation = None
            if not self.config.disable_evaluation:
                num_epochs = self.config.num_epochs
                self.notify({"phase": "evaluate", "epoch": num_epochs, "num_epochs": num_epochs})
                evaluation = evaluate_run(self.workspace, self.run.path, data=self.data)
        except BaseException as err:  # record why the run stopped, then let the error through
            self._finish_run_row("interrupted" if isinstance(err, KeyboardInterrupt) else "failed")
            raise
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
        self._log({"kind": "epoch", "step": p.step, "epoch": epoch, **_epoch_summary(rows),
                   **{f"val/{k}": x for k, x in v.items()}})
        if v["expected_reward"] > p.best:
            p.best, p.best_epoch = v["expected_reward"], epoch
            self._save_best(epoch)

    def step(self, index: torch.Tensor, budgets: torch.Tensor) -> dict[str, float]:
        """Sample one batch of groups, take ``num_iterations`` gradient steps on it; the step's metrics."""
        config = self.config
        groups = sample_groups(self.policy, self.train_split, index, budgets, config.group_size, config.reward,
                               self.generator)
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
        return {"loss": float(out.loss.detach()), "reward/mean": float(groups.rewards.mean()),
                **{f"reward/{t}": float(groups.parts[t].mean()) for t in REWARD_TERMS},
                "groups": out.num_groups, "zero_variance_groups": out.num_zero_variance_groups,
                "kl": out.kl, "clip_ratio": out.clip_ratio, "grad_norm": float(norm)}

    # -- bookkeeping
    def _validate(self) -> dict[str, float]:
        return expected_reward(self.policy, self.val_split, self.val_budgets, self.config.reward, details=True)

    def _log(self, row: dict[str, Any]) -> None:
        self.progress.rows.append({"run_id": self.run.run_id, **row, "wall_time_s": time.perf_counter() - self.started})
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
            "metrics": p.rows, "epoch": epoch, "step": p.step, "best": p.best, "best_epoch": p.best_epoch,
            "initial": p.initial, "created_at": p.created_at.isoformat()})
        write_table_atomic(p.rows, METRICS, self.run.metrics_path)
        self._write_run_row(epochs_done=epoch, steps=p.step, best_epoch=p.best_epoch, best_val_expected_reward=p.best,
                            initial_val_expected_reward=p.initial, wall_time_s=time.perf_counter() - self.started)
        last = p.rows[-1]
        self._notify("epoch", epoch, last["loss"], last["reward/mean"], last["val/expected_reward"])

    def _train_folds(self) -> None:
        """The K fold networks of the cross-fit, each in ``folds/fold-<k>`` (a finished fold is kept)."""
        k_total = self.config.cross_fit_folds
        fold_config = OfflineTrainConfig.from_json({**self.config.to_json(), "cross_fit_folds": 0, "run_id": None,
                                                    "resume": None, "disable_table_fallback": True,
                                                    "disable_evaluation": True})
        for k in range(k_total):
            target = fold_run_dir(self.run.path, k)
            if (target / "metrics.parquet").exists() and RunDir(target).best_checkpoint.exists():
                continue
            shutil.rmtree(target, ignore_errors=True)  # an interrupted fold restarts

            def relay(event: dict, fold: int = k + 1) -> None:
                self.notify({"phase": "fold", "fold": fold, "num_folds": k_total, "epoch": event.get("epoch", 0)})

            relay({})
            OfflineTrainer(fold_config, relay, data=fold_data(self.data, k, k_total), run_dir=target).train()

    def _attach_fallback(self) -> None:
        if self.config.cross_fit_folds:
            models = load_folds(self.run.path, self.data, self.config.cross_fit_folds)
            fallback = fit_cross_fitted_fallback(models, training_targets(self.data, self.config.score_target),
                                                 self.val_budgets, self.config.reward,
                                                 LookupTableDecider(self.train_recorded),
                                                 self.config.fallback_confidence)
        else:
            best = ControllerPolicy.load(self.run.best_checkpoint)
            fallback = fit_table_fallback(best, self.train_recorded, self.val_split, self.val_budgets,
                                          self.config.reward, confidence=self.config.fallback_confidence)
        attach_fallback(self.run.best_checkpoint, fallback)

    def _run_row(self) -> dict[str, Any]:
        """The ``runs`` row at the start (or resumption) of the run; updated at checkpoints and at the end."""
        p, data, config = self.progress, self.data, self.config
        num_train, num_val = len(self.train_split), len(self.val_split)
        return {"created_at": p.created_at, "finished_at": None, "status": "running", "num_epochs": config.num_epochs,
                "epochs_done": p.epoch, "steps": p.step, "best_epoch": p.best_epoch,
                "best_val_expected_reward": None if p.best == -math.inf else p.best,
                "initial_val_expected_reward": None if math.isnan(p.initial) else p.initial,
                "loss_type": config.loss_type, "seed": config.seed, "model_fingerprint": data.model_fingerprint,
                "workspace": str(self.workspace.root), "num_train_samples": num_train, "num_val_samples": num_val,
                "num_test_samples": len(data) - num_train - num_val, "num_actions": len(data.action_space),
                "budget_min_ms": config.budget_min_ms, "budget_max_ms": config.budget_max_ms, "wall_time_s": 0.0}

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
    epoch (``phase="epoch"``) and before the final evaluation (``phase="evaluate"``).
    ``data``: an in-memory ``OfflineData`` to train on instead of the workspace's (benchmarks);
    the run directory is still written under ``config.workspace``.
    """
    return OfflineTrainer(config, progress, data=data).train()


# -- evaluation ------------------------------------------------------------------------------------

def evaluate_run(workspace: Workspace | str | Path | None, run: str | Path, budgets_ms: list[float] | None = None,
                 data: OfflineData | None = None) -> pl.DataFrame:
    """``ctrl evaluate RUN``: the run's controller vs the baselines.

    Baselines: outcome (the run's outcome model, ``trainer.outcome``), oracle, lut_p95,
    lut_by_family (the p95 rule per question family, where the samples record one), lut_mean5
    (origin §7.9: mean latency within budget x 1.05), largest, random. A cross-fitted run
    (``cross_fit_folds`` >= 2) is evaluated on every sample, each decided out of fold by the
    networks, outcome models and tables of the fold that did not train on it; otherwise the best
    checkpoint on the test split. Writes ``evaluation.parquet`` (with ``run_id``) and
    ``evaluation.png`` into the run directory and returns the frame (without ``run_id``).
    """
    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    run_dir = RunDir.resolve(ws, run)
    config = OfflineTrainConfig.from_json(run_dir.read_config())
    if data is None:
        data = load_offline_data(ws, config.model_fingerprint)
    checkpoint = resolve_checkpoint(ws, run_dir.path)
    fallback = read_fallback(checkpoint)
    budgets = [float(b) for b in (budgets_ms or config.eval_budgets)]
    if config.cross_fit_folds:
        deciders, evaluated = _cross_fitted_deciders(run_dir.path, data, config, fallback), data
    else:
        policy = ControllerPolicy.load(checkpoint, model_fingerprint=data.model_fingerprint)
        train, evaluated = _split(data, "train"), _split(data, "test")
        # PolicyDecider exposes action_probs, so its rows get the exact expected reward
        controllers = [PolicyDecider(policy, fallback)] + ([PolicyDecider(policy, name="policy")] if fallback else [])
        family = [FamilyLookupTableDecider(train)] if data.family is not None else []
        outcome_file = run_dir.path / OUTCOME_FILE
        outcome = [OutcomeDecider(OutcomeModel.load(outcome_file))] if outcome_file.exists() else []
        deciders = [*controllers, *outcome, OracleDecider(), LookupTableDecider(train), *family,
                    LookupTableDecider(train, statistic="mean", tolerance=0.05), LargestDecider(),
                    RandomDecider(seed=config.seed)]
    frame = evaluate_deciders(evaluated, deciders, budgets, config.reward)
    write_evaluation(run_dir.path, frame)
    return frame


def evaluation_title(run_dir: Path) -> str:
    """The heading of a run's evaluation table: which samples it was computed on."""
    try:
        folds = int(RunDir(Path(run_dir)).read_config().get("cross_fit_folds") or 0)
    except (OSError, ValueError, TypeError):
        folds = 0
    return (f"evaluation (every sample, out of fold: {folds}-fold cross-fit)" if folds
            else "evaluation (test split)")


def _cross_fitted_deciders(run_path: Path, data: OfflineData, config: OfflineTrainConfig,
                           fallback: TableFallback | None) -> list:
    """Every decider of the evaluation, out of fold: fold k's network, tables fitted on fold k's
    training samples, and the deployed fallback's per-budget choice answered by fold k's table."""
    models = load_folds(run_path, data, config.cross_fit_folds)

    def controller(k: int) -> PolicyDecider:
        own = None if fallback is None else replace(fallback, table=LookupTableDecider(models.train[k]).state())
        return PolicyDecider(models.policies[k], own)

    deciders = [models.out_of_fold("controller", controller)]
    if fallback is not None:
        deciders.append(models.out_of_fold("policy", lambda k: PolicyDecider(models.policies[k], name="policy")))
    outcome_files = [fold_run_dir(run_path, k) / OUTCOME_FILE for k in range(config.cross_fit_folds)]
    if all(f.exists() for f in outcome_files):
        deciders.append(models.out_of_fold("outcome", lambda k: OutcomeDecider(OutcomeModel.load(outcome_files[k]))))
    if data.family is not None:
        tables = [models.out_of_fold("lut_p95", lambda k: LookupTableDecider(models.train[k])),
                  models.out_of_fold("lut_by_family", lambda k: FamilyLookupTableDecider(models.train[k]))]
    else:
        tables = [models.out_of_fold("lut_p95", lambda k: LookupTableDecider(models.train[k]))]
    return [*deciders, OracleDecider(), *tables,
            models.out_of_fold("lut_mean5", lambda k: LookupTableDecider(models.train[k], statistic="mean",
                                                                         tolerance=0.05)),
            LargestDecider(), RandomDecider(seed=config.seed)]
