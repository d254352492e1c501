"""What an offline run records besides its weights: the config it runs with (config.json), where it
stands (:class:`Progress`, kept in ``last.pt``), its ``runs`` row (run.parquet) and what
``train_offline`` returns (:class:`RunResult`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import polars as pl

from pipeline.errors import CtrlError
from trainer.config import OfflineTrainConfig
from trainer.data import OfflineData, budget_grid, default_budget_range
from trainer.runs import RunDir

__all__ = ["Progress", "RunResult", "check_resume", "epoch_summary", "resolve_config", "run_row"]


@dataclass
class RunResult:
    """What :func:`trainer.offline.train_offline` produced."""

    run_id: str
    run_dir: Path
    best_checkpoint: Path
    last_checkpoint: Path
    best_epoch: int
    best_val_expected_reward: float
    initial_val_expected_reward: float
    metrics: pl.DataFrame
    evaluation: pl.DataFrame | None = None  # None with disable_evaluation


@dataclass
class Progress:
    """What ``last.pt`` records besides the weights: where the run stands."""

    epoch: int = 0  # the last finished epoch (0: none)
    step: int = 0
    best: float = -math.inf
    best_epoch: int = 0
    initial: float = math.nan
    rows: list[dict[str, Any]] = field(default_factory=list)
    created_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    def state(self) -> dict[str, Any]:
        """The entries of ``last.pt`` that :meth:`from_state` reads back."""
        return {"metrics": self.rows, "epoch": self.epoch, "step": self.step, "best": self.best,
                "best_epoch": self.best_epoch, "initial": self.initial, "created_at": self.created_at.isoformat()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Progress:
        return cls(epoch=state["epoch"], step=state["step"], best=state["best"], best_epoch=state["best_epoch"],
                   initial=state["initial"], rows=state["metrics"],
                   created_at=datetime.fromisoformat(state["created_at"]))


def resolve_config(config: OfflineTrainConfig, data: OfflineData) -> OfflineTrainConfig:
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


def check_resume(run: RunDir, resolved: OfflineTrainConfig) -> OfflineTrainConfig:
    """The saved config with the new num_epochs and report_to; any other difference is refused."""
    saved = run.read_config()
    new = resolved.to_json()
    ignore = {"resume", "run_id", "num_epochs", "workspace", "report_to"}
    differ = sorted(k for k in saved if k not in ignore and saved[k] != new.get(k))
    if differ:
        detail = ", ".join(f"{k}: {saved[k]!r} -> {new.get(k)!r}" for k in differ)
        msg = (f"cannot resume {run.run_id}: options differ from its config.json ({detail})\n"
               "Hint: resume with only --resume (and optionally --num-epochs), or start a new run.")
        raise CtrlError(msg)
    return OfflineTrainConfig.from_json({**saved, "num_epochs": resolved.num_epochs, "resume": None,
                                         "workspace": new["workspace"], "report_to": resolved.report_to})


def epoch_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means of the epoch's step metrics; sums of the group counts."""
    skip = ("kind", "step", "epoch", "run_id", "wall_time_s")
    out = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k not in skip}
    out.update(groups=sum(r["groups"] for r in rows), zero_variance_groups=sum(r["zero_variance_groups"] for r in rows))
    return out


def run_row(p: Progress, config: OfflineTrainConfig, data: OfflineData, workspace: Path, num_train: int,
            num_val: int) -> dict[str, Any]:
    """The ``runs`` row at the start (or resumption) of a run; updated at checkpoints and at the end."""
    return {"created_at": p.created_at, "finished_at": None, "status": "running", "num_epochs": config.num_epochs,
            "epochs_done": p.epoch, "steps": p.step, "best_epoch": p.best_epoch,
            "best_val_expected_reward": None if p.best == -math.inf else p.best,
            "initial_val_expected_reward": None if math.isnan(p.initial) else p.initial,
            "loss_type": config.loss_type, "seed": config.seed, "model_fingerprint": data.model_fingerprint,
            "workspace": str(workspace), "num_train_samples": num_train, "num_val_samples": num_val,
            "num_test_samples": len(data) - num_train - num_val, "num_actions": len(data.action_space),
            "budget_min_ms": config.budget_min_ms, "budget_max_ms": config.budget_max_ms, "wall_time_s": 0.0}
