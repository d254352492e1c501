"""``ctrl train --online``: GRPO with the real model in the loop (``docs/origin_format.md`` §7.3-7.7).

Each step draws ``samples_per_step`` training samples, each with a budget drawn uniformly from
the budget range; per (sample, budget) group the controller samples ``group_size`` knob
settings, the model runs them (``online.rollout``), the answers are scored
(``runtime.scoring``), the measured latencies and scores become rewards (``trainer.reward``,
the same definition as offline: one request's total latency, here with the controller's own
time inside), and the controller takes one GRPO step with group-relative advantages
(``trainer.grpo.group_advantages``). One run (:class:`OnlineTrainer`):

1. **start or resume**: the run directory (``trainer.runs``: config.json with phase "online",
   run.parquet, online_steps.parquet, rollouts/step-NNNNNN.parquet, checkpoints/last.pt,
   start.pt, best.pt), the budget range of this machine (``online.calibrate``, unless given)
   and the controller: an offline run's policy continued, an online run's controller, or a
   fresh one;
2. **steps**: rollouts, rewards, one GRPO update (:meth:`OnlineTrainer.step`); every
   ``check_every`` steps the held-out check (``online.check``: the latest controller against
   the start, paired on validation samples; the better one is kept as ``best.pt``), stopping
   once ``patience`` checks in a row kept nothing new; every ``checkpoint_every`` steps and
   after each check ``last.pt``, ``online_steps.parquet`` and ``run.parquet`` (and ``best.pt``
   when the kept controller changed);
3. **finish**: the measured evaluation of the kept controller on the test split (``online.evaluate``).

Each step's randomness is a function of (seed, step), so a resumed run draws what an
uninterrupted one would have.

Distributed (``torchrun``; gloo on CPU, nccl on CUDA): every rank samples the same stage-1
choices, runs the members m with m % world_size == rank, the rollouts are all-gathered so
every rank computes the same advantages, and DDP averages the gradients. Rank 0 writes.
"""

from __future__ import annotations

import copy
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import polars as pl
import torch

from controller.latency_guard import GUARD_FILE, LatencyGuard, load_run_guard
from online.calibrate import budget_reference, calibrate_budget_range, calibration_rows
from online.check import CheckResult, HeldOutCheck, KeptController
from online.config import OnlineTrainConfig
from online.data import OnlineSamples, load_online_samples
from online.evaluate import evaluate_online_run
from online.guard import measure_latency_guard
from online.rollout import Rollout, RolloutExecutor, StepRollouts, rollout_rows
from pipeline import knobs
from pipeline.errors import CtrlError
from pipeline.schema import ONLINE_STEPS, REWARD_TERMS, ROLLOUTS
from pipeline.workspace import Workspace
from runtime import ModelRuntime, load_runtime
from runtime.distributed import init_distributed_from_env
from runtime.precision import dtype_name
from runtime.timing import cpu_threads
from trainer.data import ActionSpace, load_offline_data
from trainer.grpo import group_advantages
from trainer.policy import ControllerPolicy, PolicyConfig, budget_normalization_range
from trainer.reporting import check_report_to, make_reporter, plot_training_curves
from trainer.reward import RewardConfig, compute_reward
from trainer.runs import RunDir, new_run_id, resolve_checkpoint, rows_frame, write_table_atomic
from trainer.two_stage import TwoStageConfig, TwoStageController, set_budget_range


@dataclass
class OnlineRunResult:
    run_id: str
    run_dir: Path
    checkpoint: Path
    steps: pl.DataFrame  # online_steps
    budget_range_ms: tuple[float, float]
    controller: TwoStageController | None = None  # the trained controller (this rank's copy)
    evaluation: pl.DataFrame | None = None  # the final evaluation (rank 0, with evaluate)
    kept: KeptController | None = None  # what the held-out checks kept (None: no checks)
    checks: list[CheckResult] = field(default_factory=list)  # this call's checks
    stopped_early: bool = False  # the patience ran out before ``steps``


def seeded(*parts: int) -> torch.Generator:
    """A generator seeded from integers: every step's randomness is a function of (seed, step),
    so a resumed run draws exactly what the uninterrupted one would have."""
    value = 0
    for p in parts:
        value = (value * 1_000_003 + int(p)) % (2**63 - 1)
    return torch.Generator().manual_seed(value)


def step_groups(train_rows: list[int], step: int, samples_per_step: int, seed: int,
                budget_range: tuple[float, float]) -> list[tuple[int, float]]:
    """The (sample, budget) groups of a step: epochs over a seeded permutation of the train rows."""
    n = len(train_rows)
    groups = []
    budgets = torch.rand(samples_per_step, generator=seeded(seed, 2, step))
    lo, hi = budget_range
    for j in range(samples_per_step):
        i = (step - 1) * samples_per_step + j
        perm = torch.randperm(n, generator=seeded(seed, 1, i // n))
        groups.append((train_rows[int(perm[i % n])], float(lo + (hi - lo) * budgets[j])))
    return groups


def build_controller(config: OnlineTrainConfig, workspace: Workspace, runtime: ModelRuntime, samples: OnlineSamples,
                     budget_range: tuple[float, float]) -> tuple[TwoStageController, RewardConfig, str | None]:
    """The controller to train (from an offline/online run, or fresh), its reward and parent run id."""
    two_stage = TwoStageConfig(hidden_size=runtime.hidden_size, token_scale=runtime.embedding_rms(),
                               num_layers=runtime.num_layers)
    reward = config.reward
    parent = None if config.fresh else _parent_run(workspace, config.from_run or "latest")
    if parent is not None:
        if parent.phase == "online":
            controller = TwoStageController.load(parent.last_checkpoint, runtime.fingerprint)
        else:
            policy = ControllerPolicy.load(resolve_checkpoint(workspace, parent.path), runtime.fingerprint)
            with torch.random.fork_rng():  # the new online heads: the same for the same seed
                torch.manual_seed(config.seed)
                controller = TwoStageController(policy, two_stage)
        saved_reward = parent.read_config().get("reward")
        if reward is None and isinstance(saved_reward, dict):
            reward = RewardConfig.from_json(saved_reward)
    else:
        controller = TwoStageController(_fresh_policy(config, runtime, samples, budget_range), two_stage)
    set_budget_range(controller.policy, *budget_normalization_range(*budget_range))
    # the calibration runs this controller before the trainer would move it
    controller.to(runtime.device)
    return controller, reward or RewardConfig(mode="hard"), None if parent is None else parent.run_id


def start_controller(controller: TwoStageController, parent_phase: str | None) -> TwoStageController:
    """What a run's held-out checks compare with: the offline parent deployed as is (insertion at
    position 1, as ``online.evaluate``'s offline start), else the controller as it starts."""
    if parent_phase == "offline" and 1 in controller.insertion_positions:
        return controller.with_fixed_insertion(1).eval()
    return copy.deepcopy(controller).eval()


def _parent_run(workspace: Workspace, from_run: str) -> RunDir:
    try:
        return RunDir.resolve(workspace, from_run)
    except CtrlError as err:
        if from_run != "latest":
            raise
        msg = (f"workspace {workspace.root} has no offline run to continue from\n"
               "Hint: run `ctrl train --offline` first, or pass --fresh.")
        raise CtrlError(msg) from err


def _fresh_policy(config: OnlineTrainConfig, runtime: ModelRuntime, samples: OnlineSamples,
                  budget_range: tuple[float, float]) -> ControllerPolicy:
    """An untrained policy over the balanced sweep, normalised on the train split's features."""
    torch.manual_seed(config.seed)
    lo, hi = budget_normalization_range(*budget_range)
    policy_config = PolicyConfig(lang_feature_dim=samples.lang.shape[1], image_feature_dim=samples.image.shape[1],
                                 budget_min_ms=lo, budget_max_ms=hi)
    sweep = itertools.product(knobs.BALANCED_MAX_CROPS, knobs.BALANCED_TOP_K, knobs.BALANCED_NUM_ACTIVE_BLOCKS)
    policy = ControllerPolicy(policy_config, ActionSpace(tuple(sweep)), runtime.fingerprint)
    train = samples.rows("train") or list(range(len(samples)))
    policy.set_feature_normalization(samples.image[train], samples.image_present[train], samples.lang[train])
    return policy


def rollout_row(r: Rollout, samples: OnlineSamples, run_id: str, step: int, world_size: int,
                num_layers: int) -> dict[str, Any]:
    """A rollout as a ``rollouts`` row (measurements columns + online columns)."""
    return {
        "experiment": "online", "dataset": samples.dataset[r.sample], "split": samples.split[r.sample],
        "sample_key": samples.sample_key[r.sample], "max_crops": r.max_crops, "top_k": r.top_k,
        "num_active_blocks": r.num_active_blocks, "tier": None, "num_crops": r.num_crops,
        "num_total_blocks": num_layers, "active_block_indices": list(r.active_blocks),
        "score": r.score, "pred": r.pred, "latency_total_ms": r.latency_total_ms,
        "latency_prefill_ms": r.latency_prefill_ms, "latency_decode_ms": r.latency_decode_ms,
        "latency_vision_ms": r.latency_vision_ms, "latency_prefill_raw_ms": None,
        "num_vision_tokens": r.num_vision_tokens, "num_text_tokens": r.num_text_tokens,
        "num_output_tokens": r.num_output_tokens, "world_size": world_size,
        "source_file": f"runs/{run_id}/rollouts/step-{step:06d}.parquet", "source_kind": "online", "num_copies": 1,
        "flag_prefill_invalid": False, "flag_prefill_partial": False, "flag_text_tokens_derived": False,
        "flag_decode_missing": False, "flag_partial_config": False, "flag_copies_disagree": False,
        "run_id": run_id, "step": step, "group_index": r.group, "member": r.member, "rank": r.rank,
        "insertion_position": r.insertion_position, "budget_ms": r.budget_ms,
        "latency_controller_ms": r.latency_controller_ms, "latency_stage1_ms": r.latency_stage1_ms,
        "latency_stage2_ms": r.latency_stage2_ms, "latency_decode_step_ms": list(r.decode_step_ms),
        "reward": None, "violated": bool(r.latency_total_ms > r.budget_ms), "log_prob": r.log_prob,
        "generated_text": r.text, "latency_modeled": r.latency_modeled,
    }


class OnlineTrainer:
    """One online run: start or resume (the constructor), then :meth:`train`."""

    def __init__(self, config: OnlineTrainConfig, progress: Callable[[dict], None] | None = None,
                 runtime: ModelRuntime | None = None) -> None:
        self.started = time.perf_counter()
        self.created_at = datetime.now(timezone.utc)
        self.notify = progress or (lambda event: None)
        self.dist = init_distributed_from_env(config.device)
        if config.samples_per_step * config.group_size < self.dist.world_size:
            msg = (f"{config.samples_per_step} groups x {config.group_size} rollouts per step leave some of the "
                   f"{self.dist.world_size} ranks without work\nHint: raise --samples-per-step or --group-size.")
            raise CtrlError(msg)
        self.workspace = Workspace(config.workspace)
        check_report_to(config.report_to)  # before the run directory: a missing package leaves no run
        state = None
        if config.resume is not None:
            config, self.run, state = self._resume(config)
        else:
            self.run = RunDir.new(self.workspace, self.dist.broadcast(config.run_id or new_run_id()))
        self.runtime = runtime if runtime is not None else load_runtime(config.model, config.execution,
                                                                        config.importance_scores)
        self.samples = load_online_samples(self.workspace, self.runtime.fingerprint, config.images_dir)
        self.train_rows = self.samples.rows("train") or list(range(len(self.samples)))
        if state is not None:
            self.config = config
            self.controller = TwoStageController.load(self.run.last_checkpoint, self.runtime.fingerprint)
            self.budget_range = (float(config.budget_min_ms), float(config.budget_max_ms))
            self.reward = config.reward
            self.parent = config.parent_run_id
            self.guard = load_run_guard(self.run.path)
        else:
            self._start(config)
        self.controller.to(self.runtime.device)
        self.controller.train()
        self.rollout_rows = rollout_rows(self.config.rollout_batch, self.runtime)
        # every parameter takes part in the loss, which DDP requires
        self.model = torch.nn.parallel.DistributedDataParallel(self.controller) if self.dist.active else self.controller
        self.optimizer = torch.optim.AdamW(self.controller.parameters(), lr=self.config.lr,
                                           weight_decay=self.config.weight_decay)
        self.rows: list[dict[str, Any]] = []
        self.start_step = 1
        if state is not None:
            self._restore(state)
        self._saved_kept_step: int | None = None  # the kept step best.pt holds
        self.check, self.kept = self._held_out_check(state)

    def _resume(self, config: OnlineTrainConfig) -> tuple[OnlineTrainConfig, RunDir, dict[str, Any]]:
        """The saved run: its config (with this call's per-call options), directory and last state."""
        run = RunDir.resolve(self.workspace, config.resume)
        if run.phase != "online":
            msg = (f"--resume {run.run_id}: not an online run\nHint: offline runs resume with "
                   "`ctrl train --offline --resume`; `--from RUN` starts an online run from one.")
            raise CtrlError(msg)
        per_call = {k: getattr(config, k) for k in OnlineTrainConfig.PER_CALL}
        saved = OnlineTrainConfig.from_json({**run.read_config(), **per_call, "resume": str(run.path)})
        if not run.last_checkpoint.exists():
            msg = f"{run.last_checkpoint} does not exist: the run saved no checkpoint yet\nHint: start it again."
            raise CtrlError(msg)
        return saved, run, run.load_last()

    def _start(self, config: OnlineTrainConfig) -> None:
        """A new run: the budget range (calibrated unless given), the controller, config.json."""
        if config.budget_min_ms is None:
            self.budget_range = self.dist.broadcast(self._calibrate(config))
        else:
            self.budget_range = (float(config.budget_min_ms), float(config.budget_max_ms))
        self.controller, self.reward, self.parent = build_controller(config, self.workspace, self.runtime,
                                                                     self.samples, self.budget_range)
        self.config = OnlineTrainConfig.from_json({
            **config.to_json(), "budget_min_ms": self.budget_range[0], "budget_max_ms": self.budget_range[1],
            "reward": self.reward.to_json(), "parent_run_id": self.parent,
            "model_fingerprint": self.runtime.fingerprint, "dtype": dtype_name(self.runtime.dtype),
            "run_id": self.run.run_id, "resume": None})
        if self.dist.rank == 0:
            self.run.write_config(self.config.to_json())
            parent_phase = RunDir.resolve(self.workspace, self.parent).phase if self.parent else None
            start_controller(self.controller, parent_phase).save(self.run.start_checkpoint)
            self._measure_guard(self.config)
        self.dist.barrier()
        self.guard = load_run_guard(self.run.path)

    def _calibrate(self, config: OnlineTrainConfig) -> tuple[float, float]:
        # a provisional controller, only to run forced configurations
        provisional, _, parent_id = build_controller(config, self.workspace, self.runtime, self.samples, (1.0, 2.0))
        reference = None
        if parent_id is not None:
            parent = RunDir.resolve(self.workspace, parent_id)
            if parent.phase == "offline":
                reference = budget_reference(self.workspace, self.runtime, self.samples, parent.read_config())
        executor = RolloutExecutor(self.runtime, provisional, self.samples, config.max_new_tokens, config.warmup)
        try:
            rows = calibration_rows(self.train_rows, config.calibration_samples, config.seed)
            self.notify({"phase": "calibrate", "samples": len(rows)})
            return calibrate_budget_range(executor, provisional, rows, reference)
        finally:
            executor.close()

    def _measure_guard(self, config: OnlineTrainConfig) -> LatencyGuard | None:
        """Fit and save the run's latency guard (``online.guard``) where the run continues an offline
        run with an outcome model and ``guard_samples`` > 0; else None."""
        if config.guard_samples == 0 or self.parent is None:
            return None
        parent = RunDir.resolve(self.workspace, self.parent)
        if parent.phase != "offline":
            return None
        provisional, _, _ = build_controller(config, self.workspace, self.runtime, self.samples, (1.0, 2.0))
        data = load_offline_data(self.workspace, self.runtime.fingerprint)
        rows = calibration_rows(self.train_rows, config.guard_samples, config.seed + 1)
        executor = RolloutExecutor(self.runtime, provisional, self.samples, config.max_new_tokens, config.warmup)
        try:
            self.notify({"phase": "guard", "samples": len(rows)})
            guard = measure_latency_guard(executor, provisional, rows, self.workspace, parent.path, data,
                                          progress=lambda done, total: self.notify(
                                              {"phase": "guard_progress", "done": done, "total": total}))
        finally:
            executor.close()
        if guard is not None:
            guard.save(self.run.path / GUARD_FILE)
            self.notify({"phase": "guarded", **guard.summary()})
        return guard

    def _restore(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.rows = list(state["metrics_rows"])
        self.start_step = int(state["step"]) + 1
        self.created_at = datetime.fromisoformat(state["created_at"])
        if self.dist.rank == 0:  # rollouts written after the checkpoint are redone
            for step, path in self.run.rollout_steps():
                if step >= self.start_step:
                    path.unlink()

    def _held_out_check(self, state: dict[str, Any] | None) -> tuple[HeldOutCheck | None, KeptController | None]:
        """The run's held-out check and kept controller (a resumed run's as it saved them); (None,
        None) without checks, said once through the progress callback when the run wants them."""
        config = self.config
        if config.check_every == 0:
            return None, None
        val = self.samples.rows("val")
        reason = ("the workspace has no validation samples" if not val else
                  f"{self.run.start_checkpoint} is missing (a run started without held-out checks)"
                  if not self.run.start_checkpoint.exists() else None)
        if reason is not None:
            self.notify({"phase": "no_checks", "reason": reason})
            return None, None
        order = torch.randperm(len(val), generator=seeded(config.seed, 5))
        rows = [val[int(i)] for i in order[: config.check_samples]]
        start = TwoStageController.load(self.run.start_checkpoint, self.runtime.fingerprint).to(self.runtime.device)
        check = HeldOutCheck.on_range(start, rows, self.budget_range, config.check_budgets, seed=config.seed,
                                      guard=self.guard)
        if state is not None and state.get("kept") is not None:
            kept = KeptController.restore(state["kept"], self.controller)
            if self.dist.rank == 0:  # best.pt may be newer than the step the run resumes from
                self._save_kept(kept)
        else:
            kept = KeptController(copy.deepcopy(start))
        return check, kept

    # -- the loop
    def train(self) -> OnlineRunResult:
        config = self.config
        self.run_row = {"parent_run_id": self.parent, "created_at": self.created_at, "status": "running",
                        "steps": self.start_step - 1, "loss_type": "grpo", "seed": config.seed,
                        "model_fingerprint": self.runtime.fingerprint, "workspace": str(self.workspace.root),
                        "num_train_samples": len(self.train_rows), "budget_min_ms": self.budget_range[0],
                        "budget_max_ms": self.budget_range[1]}
        self._write_run_row()
        executor = RolloutExecutor(self.runtime, self.controller, self.samples, config.max_new_tokens, config.warmup)
        reporter = make_reporter(config.report_to if self.dist.rank == 0 else "none", self.run.run_id, self.run.path,
                                 self.workspace.root, config.to_json())
        step = self.start_step - 1
        checks: list[CheckResult] = []
        stopped_early = False
        try:
            for step in range(self.start_step, config.steps + 1):
                row = self.step(step, executor)
                result = self._check(step, executor, row)
                reporter.log(row, step)
                stopped_early = result is not None and step < config.steps and self.kept.exhausted(config.patience)
                if step % config.checkpoint_every == 0 or step == config.steps or result is not None:
                    tick = time.perf_counter()
                    self._checkpoint(step)
                    row["time_bookkeeping_s"] += time.perf_counter() - tick  # the checkpoint is bookkeeping too
                self.notify({"phase": "step", "step": step, "steps": config.steps, **row})
                if result is not None:
                    checks.append(result)
                    self.notify({"phase": "check", **asdict(result), "kept_step": self.kept.step,
                                 "kept_gain": self.kept.gain, "kept_gain_low": self.kept.gain_low,
                                 "kept_gain_high": self.kept.gain_high, "since": self.kept.since,
                                 "patience": config.patience})
                if stopped_early:
                    self.notify({"phase": "stop", "step": step, "steps": config.steps, "kept_step": self.kept.step,
                                 "patience": config.patience})
                    break
        except BaseException as err:
            self._write_run_row(status="interrupted" if isinstance(err, KeyboardInterrupt) else "failed",
                                finished_at=datetime.now(timezone.utc), wall_time_s=self._elapsed())
            reporter.close()
            raise
        finally:
            executor.close()
        if self.dist.rank == 0:
            write_table_atomic(self.rows, ONLINE_STEPS, self.run.online_steps_path)
            plot_training_curves(self.rows, self.run.path / "training_curves.png", f"online run {self.run.run_id}")
        self._write_run_row(status="completed", steps=step, finished_at=datetime.now(timezone.utc),
                            wall_time_s=self._elapsed())
        evaluation = None
        if config.evaluate and self.dist.rank == 0:
            self.notify({"phase": "evaluate"})
            evaluation = evaluate_online_run(self.workspace, self.run.path, max_samples=config.eval_max_samples,
                                             runtime=self.runtime)
            reporter.log_evaluation(evaluation.to_dicts())
        reporter.close()
        self.dist.barrier()
        return OnlineRunResult(run_id=self.run.run_id, run_dir=self.run.path, checkpoint=self.run.controller_checkpoint,
                               steps=rows_frame(self.rows, ONLINE_STEPS) if self.rows else pl.DataFrame(),
                               budget_range_ms=self.budget_range, controller=self.controller, evaluation=evaluation,
                               kept=self.kept, checks=checks, stopped_early=stopped_early)

    def step(self, step: int, executor: RolloutExecutor) -> dict[str, Any]:
        """Run the step's rollouts, reward them and take one GRPO update; the step's metrics row."""
        config, dist = self.config, self.dist
        groups = step_groups(self.train_rows, step, config.samples_per_step, config.seed, self.budget_range)
        first_group = (step - 1) * config.samples_per_step
        local = executor.run_groups(groups, config.group_size, seeded(config.seed, 3, step),
                                    seeded(config.seed, 4, step, dist.rank), dist.rank, dist.world_size,
                                    first_group=first_group, batch_rows=self.rollout_rows,
                                    timed_generator=seeded(config.seed, 6, step, dist.rank))
        tick = time.perf_counter()
        gathered, num_prefixes = self._gather(local, step)
        parts = self._rewards(gathered)
        rewards = parts["reward"].reshape(len(groups), config.group_size)
        advantages, valid = group_advantages(rewards, config.scale_rewards)
        bookkeeping = time.perf_counter() - tick

        tick = time.perf_counter()
        loss, grad_norm = self._update(local, advantages, valid, first_group, executor.tiling_crops)
        update = time.perf_counter() - tick

        tick = time.perf_counter()
        # each rank's loss is scaled by world_size for DDP's gradient averaging: their mean is the loss
        total_loss = sum(dist.all_gather(loss)) / dist.world_size
        row = {"run_id": self.run.run_id, "step": step, "loss": total_loss,
               "reward/mean": float(parts["reward"].mean()), "reward_std": float(parts["reward"].std()),
               "learning_rate": float(self.optimizer.param_groups[0]["lr"]),
               **{f"reward/{t}": float(parts[t].mean()) for t in REWARD_TERMS}, **_rollout_means(gathered),
               "groups": len(groups), "zero_variance_groups": int((~valid).sum()), "rollouts": len(gathered),
               "prefixes": num_prefixes, "grad_norm": grad_norm, "time_model_s": local.model_s,
               "time_controller_s": local.controller_s, "time_update_s": update,
               "rollouts_modeled": sum(bool(r["latency_modeled"]) for r in gathered),
               "latency_model_error": (statistics.median(local.latency_model_errors) if local.latency_model_errors
                                       else None)}
        if dist.rank == 0:
            write_table_atomic(gathered, ROLLOUTS, self.run.rollouts_path(step))
        row["time_bookkeeping_s"] = bookkeeping + time.perf_counter() - tick
        row["wall_time_s"] = self._elapsed()
        self.rows.append(row)
        return row

    def _check(self, step: int, executor: RolloutExecutor, row: dict[str, Any]) -> CheckResult | None:
        """The held-out check after ``step`` when one is due (every ``check_every`` steps and after
        the last): rank 0 measures, every rank keeps the same; its columns go into ``row``."""
        if self.check is None:
            return None
        config = self.config
        if step % config.check_every != 0 and step != config.steps:
            row["kept_step"] = self.kept.step
            return None
        self.notify({"phase": "checking", "step": step, "pairs": len(self.check.rows) * len(self.check.budgets)})
        result = self.check.run(executor, self.controller, step) if self.dist.rank == 0 else None
        result = self.dist.broadcast(result)
        self.kept.consider(result, self.controller)
        row.update({"check_gain": result.gain, "check_gain_low": result.gain_low, "check_gain_high": result.gain_high,
                    "check_late_share": result.late_share, "check_start_late_share": result.start_late_share,
                    "check_requests": result.requests, "check_same_choice": result.same_choice,
                    "time_check_s": result.seconds, "kept_step": self.kept.step})
        return result

    def _gather(self, local: StepRollouts, step: int) -> tuple[list[dict[str, Any]], int]:
        """Every rank's rollouts of the step as ``rollouts`` rows, in (group, member) order; and the prefixes run."""
        mine = [rollout_row(r, self.samples, self.run.run_id, step, self.dist.world_size, self.runtime.num_layers)
                for r in local.rollouts]
        by_rank = self.dist.all_gather((mine, len(local.prefix_embeds)))
        gathered = sorted((row for rows, _ in by_rank for row in rows), key=lambda r: (r["group_index"], r["member"]))
        return gathered, sum(n for _, n in by_rank)

    def _rewards(self, gathered: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """The reward parts of the gathered rollouts (also written into their rows)."""
        knob_values = [[float(r["max_crops"]), float(r["top_k"]), float(r["num_active_blocks"])] for r in gathered]
        parts = compute_reward(torch.tensor([r["score"] for r in gathered]),
                               torch.tensor([r["latency_total_ms"] for r in gathered]),
                               torch.tensor([r["budget_ms"] for r in gathered]), torch.tensor(knob_values), self.reward)
        for i, r in enumerate(gathered):
            r["reward"] = float(parts["reward"][i])
        return parts

    def _update(self, local: StepRollouts, advantages: torch.Tensor, valid: torch.Tensor, first_group: int,
                tiling_crops: torch.Tensor) -> tuple[float, float]:
        """One GRPO step on this rank's rollouts (log-probs recomputed with the latency tokens); (loss, grad norm)."""
        config, device = self.config, self.runtime.device
        log_probs = self.model(local.batch(self.samples, device, tiling_crops), self.runtime.latency_token)
        own = torch.tensor([[r.group - first_group, r.member] for r in local.rollouts], dtype=torch.long)
        own_adv = advantages[own[:, 0], own[:, 1]].to(device)
        own_valid = valid[own[:, 0]].to(device)
        denom = max(int(valid.sum()) * config.group_size, 1)
        # DDP averages gradients over ranks: scale so the result is the mean over all valid members
        loss = -(own_adv * log_probs * own_valid).sum() * self.dist.world_size / denom
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.controller.parameters(), config.max_grad_norm or float("inf"))
        self.optimizer.step()
        return float(loss.detach()), float(grad_norm)

    # -- bookkeeping
    def _checkpoint(self, step: int) -> None:
        """``last.pt``, the kept controller's ``best.pt`` and the files that must match them (rank 0)."""
        if self.dist.rank == 0:
            if self.kept is not None and self.kept.step != self._saved_kept_step:
                self._save_kept(self.kept)
            self.controller.save(self.run.last_checkpoint, extra={
                "optimizer": self.optimizer.state_dict(), "step": step, "metrics_rows": self.rows,
                "created_at": self.created_at.isoformat(),
                "kept": self.kept.state() if self.kept is not None else None})
            # the metrics file always matches the checkpoint (a resumed run rewrites it consistently)
            write_table_atomic(self.rows, ONLINE_STEPS, self.run.online_steps_path)
            self._write_run_row(steps=step, wall_time_s=self._elapsed())

    def _save_kept(self, kept: KeptController) -> None:
        """``best.pt``; written again only when the kept controller changes."""
        kept.controller.save(self.run.best_checkpoint, extra={"kept_step": kept.step, "gain": kept.gain,
                                                              "gain_low": kept.gain_low,
                                                              "gain_high": kept.gain_high})
        self._saved_kept_step = kept.step

    def _write_run_row(self, **changes: Any) -> None:
        self.run_row.update(changes)
        if self.dist.rank == 0:
            self.run.write_run_row(self.run_row, "online")

    def _elapsed(self) -> float:
        return time.perf_counter() - self.started


def _rollout_means(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The step's accuracy, latency, violation rate and controller time over its rollouts."""
    def mean(key: str) -> float:
        return float(torch.tensor([float(r[key]) for r in rows]).mean())

    return {"accuracy": mean("score"), "latency_ms_mean": mean("latency_total_ms"), "violation_rate": mean("violated"),
            "controller_ms_mean": mean("latency_controller_ms")}


def train_online(config: OnlineTrainConfig, progress: Callable[[dict], None] | None = None, *,
                 runtime: ModelRuntime | None = None) -> OnlineRunResult:
    """Run (or resume) an online training run; returns its directory and per-step metrics."""
    with cpu_threads(config.threads, config.device):
        return OnlineTrainer(config, progress, runtime).train()


__all__ = ["OnlineRunResult", "OnlineTrainConfig", "OnlineTrainer", "build_controller", "rollout_row",
           "step_groups", "train_online"]
