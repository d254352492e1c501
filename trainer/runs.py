"""Training runs on disk: one directory per run under ``workspace/runs/``, offline or online.

``workspace/runs/<run_id>/`` (run_id = ``YYYYmmdd-HHMMSS-<6 hex>`` unless given)::

    config.json                    the resolved training config; ``phase`` says offline or online
    run.parquet                    one row (view ``runs``)
    metrics.parquet                offline: one row per step and per epoch (view ``metrics``)
    online_steps.parquet           online: one row per step (view ``online_steps``)
    rollouts/step-NNNNNN.parquet   online: every rollout (views ``rollouts`` and ``measurements``)
    checkpoints/best.pt            offline: the policy with the best validation expected reward;
                                   online: the controller kept by the held-out checks
    checkpoints/last.pt            the training state to resume from
    checkpoints/start.pt           online: the controller the run started from (the checks' baseline)
    evaluation.parquet, .png       the evaluation (view ``evaluations``)

:class:`RunDir` owns these paths and the files that are common to both phases; the trainers
own what goes into them. Every Parquet file carries ``run_id``, so the DuckDB views over
``runs/*/`` join them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.errors import CtrlError, describe
from pipeline.schema import RUNS, TableSchema
from pipeline.workspace import Workspace, atomic_path, os_error_naming, record_checksum, write_bytes_atomic

Phase = Literal["offline", "online"]
CONFIG_FILE = "config.json"


#: a run id names one directory inside ``runs/``: no separators, no leading dot, no ``..``
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_run_id(run_id: str) -> str:
    """``run_id`` if it can name a run directory inside ``runs/``, else a CtrlError saying why."""
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id) or ".." in run_id or run_id == "latest":
        msg = (f"run id {run_id!r} is not allowed: letters, digits, '.', '_' and '-' (up to 128, starting with a "
               "letter or digit, no '..', not 'latest'), so that a run stays inside the workspace's runs/")
        raise CtrlError(msg)
    return run_id


def new_run_id() -> str:
    """``YYYYmmdd-HHMMSS-<6 hex>`` (UTC): sorts by start time, unique across processes."""
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def atomic_torch_save(obj: object, path: Path) -> Path:
    """``torch.save`` to a temporary file, fsync, then rename: a crash never leaves half a checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
    except RuntimeError as e:
        # a write that fails inside torch.save (a full disk) surfaces as the zip writer's
        # RuntimeError about file positions; the OSError behind it is the real reason
        cause = e.__context__
        if isinstance(cause, OSError):
            raise os_error_naming(cause, path) from None
        raise
    return path


def rows_table(rows: list[dict[str, Any]], schema: TableSchema) -> pa.Table:
    """``rows`` as an Arrow table of ``schema`` (missing keys are null, extra keys dropped)."""
    columns = schema.column_names
    return pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows], schema=schema.arrow_schema())


def rows_frame(rows: list[dict[str, Any]], schema: TableSchema) -> pl.DataFrame:
    """``rows`` as a polars frame of ``schema``."""
    return pl.from_arrow(rows_table(rows, schema))  # type: ignore[return-value]


def write_table_atomic(rows: list[dict[str, Any]], schema: TableSchema, path: Path) -> None:
    """Write ``rows`` as a Parquet file of ``schema``, atomically, and record its SHA-256 beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        pq.write_table(rows_table(rows, schema), tmp)
    record_checksum(path)


def write_frame_atomic(frame: pl.DataFrame, path: Path) -> Path:
    """Write a polars frame as .parquet or .csv (by suffix) via a temporary file and a rename."""
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".csv"):
        msg = f"output {str(path)!r} must end in .parquet or .csv\nHint: e.g. --out decisions.parquet"
        raise CtrlError(msg)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        frame.write_parquet(tmp) if suffix == ".parquet" else frame.write_csv(tmp)
    return path


@dataclass(frozen=True)
class RunDir:
    """One run's directory (see the module docstring for its files)."""

    path: Path

    # -- locations
    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def best_checkpoint(self) -> Path:
        return self.checkpoints / "best.pt"

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoints / "last.pt"

    @property
    def start_checkpoint(self) -> Path:
        return self.checkpoints / "start.pt"

    @property
    def controller_checkpoint(self) -> Path:
        """The run's controller: an offline run's best epoch; an online run's kept controller
        (``best.pt``), or its last step for a run without held-out checks."""
        if self.phase == "online" and not self.best_checkpoint.exists():
            return self.last_checkpoint
        return self.best_checkpoint

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.parquet"

    @property
    def online_steps_path(self) -> Path:
        return self.path / "online_steps.parquet"

    def rollouts_path(self, step: int) -> Path:
        return self.path / "rollouts" / f"step-{step:06d}.parquet"

    def rollout_steps(self) -> list[tuple[int, Path]]:
        """(step, file) of every rollouts file written so far."""
        return [(int(p.stem.split("-")[1]), p) for p in sorted((self.path / "rollouts").glob("step-*.parquet"))]

    # -- config.json and the phase
    @property
    def exists(self) -> bool:
        return self.config_path.is_file()

    def read_config(self) -> dict[str, Any]:
        """The saved config (one JSON object); a missing or unreadable file is a user error."""
        try:
            config = json.loads(self.config_path.read_text())
        except (OSError, ValueError) as err:
            msg = f"{self.config_path}: cannot read the run's config ({type(err).__name__}: {err})"
            raise CtrlError(msg) from None
        if not isinstance(config, dict):
            msg = f"{self.config_path}: expected a JSON object, got {type(config).__name__}"
            raise CtrlError(msg)
        return config

    @property
    def phase(self) -> Phase:
        """``"offline"`` or ``"online"`` (offline configs carry no phase); offline when unreadable."""
        try:
            phase = self.read_config().get("phase", "offline")
        except CtrlError:
            return "offline"
        return "online" if phase == "online" else "offline"

    def write_config(self, config: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(self.config_path, (json.dumps(config, indent=2) + "\n").encode())

    # -- files both phases write
    def write_run_row(self, row: dict[str, Any], phase: Phase) -> None:
        """``run.parquet``: the one row of view ``runs`` (columns the phase lacks are null)."""
        write_table_atomic([{**row, "run_id": self.run_id, "phase": phase}], RUNS, self.path / "run.parquet")

    def save_last(self, state: dict[str, Any]) -> Path:
        """Write ``checkpoints/last.pt`` atomically."""
        return atomic_torch_save(state, self.last_checkpoint)

    def load_last(self) -> dict[str, Any]:
        """The state :meth:`save_last` wrote (tensors on the CPU); a missing or damaged file is a
        CtrlError naming it."""
        try:
            state = torch.load(self.last_checkpoint, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            msg = f"{self.last_checkpoint}: missing: the run has no finished epoch to resume from"
            raise CtrlError(msg) from None
        except Exception as err:  # torch raises many kinds for a damaged file
            msg = (f"{self.last_checkpoint}: cannot read the checkpoint ({describe(err)})\n"
                   f"Hint: start the run again under a new --run-id (or delete {self.path}).")
            raise CtrlError(msg) from None
        if not isinstance(state, dict):
            msg = f"{self.last_checkpoint}: not a ctrl checkpoint (a {type(state).__name__})"
            raise CtrlError(msg)
        return state

    # -- finding runs
    @classmethod
    def new(cls, workspace: Workspace, run_id: str | None = None) -> RunDir:
        """The directory of a new run; an invalid id (:func:`check_run_id`) or an existing run of
        that id (any file in its directory) is refused: a run is never overwritten."""
        run = cls(workspace.runs_dir / (check_run_id(run_id) if run_id is not None else new_run_id()))
        if run.path.exists() and (run.exists or any(run.path.iterdir())):
            msg = (f"run {run.run_id} already exists in {workspace.runs_dir}\nHint: --resume {run.run_id} continues "
                   "it; pick another --run-id, or delete that directory to start it again.")
            raise CtrlError(msg)
        return run

    @classmethod
    def resolve(cls, workspace: Workspace, run: str | Path, phases: tuple[Phase, ...] = ("offline",)) -> RunDir:
        """A run from a run id of ``workspace``, the path of a run directory, or ``"latest"``: the most
        recently started run of ``phases`` with a checkpoint (:func:`latest_run`)."""
        if str(run) == "latest":
            return latest_run(workspace, phases)
        path = Path(run).expanduser()
        if path.is_dir() and (path / CONFIG_FILE).exists():
            return cls(path.resolve())
        candidate = workspace.runs_dir / str(run)
        if candidate.is_dir():
            return cls(candidate)
        runs = sorted(p.name for p in workspace.runs_dir.glob("*") if p.is_dir())
        listing = ", ".join(runs[-5:]) if runs else "none"
        msg = (f"run {str(run)!r} not found: neither a run directory nor a run id in {workspace.runs_dir}\n"
               f"Hint: recent runs: {listing}; `ctrl query \"FROM runs\"` lists all.")
        raise CtrlError(msg)


def latest_run(workspace: Workspace, phases: Phase | tuple[Phase, ...] = ("offline", "online")) -> RunDir:
    """What ``latest`` means for every command: the most recently started run (by its config.json's
    modification time) of the phases the command takes, among those with a checkpoint (an offline
    run's best epoch, an online run's kept or last step)."""
    phases = (phases,) if isinstance(phases, str) else tuple(phases)
    runs = [RunDir(p.parent.resolve()) for p in workspace.runs_dir.glob(f"*/{CONFIG_FILE}")]
    runs = [r for r in runs if r.phase in phases
            and r.controller_checkpoint.exists()]
    if not runs:
        kind = " or ".join(phases)
        msg = (f"workspace {workspace.root} has no {kind} run with a checkpoint yet\n"
               f"Hint: ctrl train --{phases[0]}")
        raise CtrlError(msg)
    return max(runs, key=lambda r: r.config_path.stat().st_mtime_ns)


def resolve_checkpoint(workspace: Workspace, run_or_checkpoint: str | Path) -> Path:
    """An offline controller checkpoint from a checkpoint file, a run directory or a run id (its best checkpoint)."""
    path = Path(run_or_checkpoint).expanduser()
    if path.is_file():
        return path.resolve()
    run = RunDir.resolve(workspace, run_or_checkpoint)
    if run.phase == "online":
        msg = (f"{run.run_id} is an online run: its controller needs the model in the loop\n"
               "Hint: predict and export take offline runs; `ctrl evaluate` and `ctrl serve` take online runs too.")
        raise CtrlError(msg)
    if not run.best_checkpoint.exists():
        msg = (f"{run.best_checkpoint} does not exist: the run has not finished an epoch\n"
               "Hint: resume it with `ctrl train --offline --resume RUN`.")
        raise CtrlError(msg)
    return run.best_checkpoint


__all__ = ["Phase", "RunDir", "atomic_torch_save", "check_run_id", "latest_run", "new_run_id", "resolve_checkpoint",
           "rows_frame", "rows_table", "write_frame_atomic", "write_table_atomic"]
