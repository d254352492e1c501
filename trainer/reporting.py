"""Training metrics where people look at them: TensorBoard, MLflow, Weights & Biases, and a PNG.

``metrics.parquet`` stays the record of a run. A :class:`Reporter` mirrors each metrics row as
it is logged, under the names TRL's GRPO trainer uses where one exists (``reward``,
``reward_std``, ``kl``, ``loss``, ``learning_rate``), plus the violation rate, the validation
expected reward and, at the end, the per-budget evaluation. ``--report-to`` picks the backend;
the three are optional extras (``pip install 'ctrl[tensorboard]'``, ``[mlflow]``, ``[wandb]``)
and a missing one is a one-line error before training starts.

:func:`plot_training_curves` draws the curves of a run's metrics (``training_curves.png``
beside ``evaluation.png``), whatever the backend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import CtrlError
from pipeline.workspace import atomic_path

#: the values of ``--report-to``
REPORT_TO = ("none", "tensorboard", "mlflow", "wandb")

#: a metrics column -> the name it is reported under
REPORTED_NAMES = {
    "loss": "loss",
    "reward/mean": "reward",
    "reward_std": "reward_std",
    "kl": "kl",
    "learning_rate": "learning_rate",
    "violation_rate": "violation_rate",
    "grad_norm": "grad_norm",
    "clip_ratio": "clip_ratio",
    "accuracy": "accuracy",
    "latency_ms_mean": "latency_ms",
    "val/expected_reward": "eval/expected_reward",
    "val/expected_accuracy": "eval/expected_accuracy",
    "val/expected_violation_rate": "eval/expected_violation_rate",
}

#: the package each backend needs, and the extra that installs it
_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def check_report_to(report_to: str) -> None:
    """Refuse an unknown backend, or one whose package is not installed, with one line."""
    if report_to not in REPORT_TO:
        msg = f"--report-to must be one of {', '.join(REPORT_TO)}, got {report_to!r}"
        raise ValueError(msg)
    if report_to == "none":
        return
    try:
        __import__(_PACKAGES[report_to])
    except ImportError:
        msg = (f"--report-to {report_to} needs the {_PACKAGES[report_to]} package\n"
               f"Hint: pip install '{_PACKAGES[report_to]}' (or the project's extra: pip install -e '.[{report_to}]').")
        raise CtrlError(msg) from None


def reported_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's reported metrics under their reported names (finite numbers only). An offline
    epoch row reports its validation metrics only: its other columns average the step rows."""
    out = {}
    epoch_row = row.get("kind") == "epoch"
    for column, name in REPORTED_NAMES.items():
        if epoch_row and not column.startswith("val/"):
            continue
        value = row.get(column)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        out[name] = float(value)
    return out


def evaluation_scalars(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, int, float]]:
    """(name, budget in whole ms, value) per decider and budget of an evaluation: its accuracy
    (``evaluation/<decider>/accuracy``) and violation rate; the budget is the step axis."""
    out = []
    for r in rows:
        budget = int(round(float(r["budget_ms"])))
        for column in ("accuracy", "violation_rate"):
            value = r.get(column)
            if isinstance(value, int | float) and math.isfinite(value):
                out.append((f"evaluation/{r['decider']}/{column}", budget, float(value)))
    return out


class Reporter:
    """No backend (``--report-to none``): every call does nothing."""

    name = "none"

    def log(self, row: Mapping[str, Any], step: int) -> None:
        """Report one metrics row at a training step."""

    def log_evaluation(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Report a finished run's evaluation rows (decider, budget_ms, accuracy, violation_rate, ...)."""

    def close(self) -> None:
        """Flush and release the backend."""


class TensorBoardReporter(Reporter):
    """Event files under ``<run>/tensorboard`` (``tensorboard --logdir <workspace>/runs``)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, row: Mapping[str, Any], step: int) -> None:
        for name, value in reported_scalars(row).items():
            self.writer.add_scalar(name, value, step)

    def log_evaluation(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for name, budget, value in evaluation_scalars(rows):
            self.writer.add_scalar(name, value, budget)

    def close(self) -> None:
        self.writer.close()


class MlflowReporter(Reporter):
    """An MLflow run named after the ctrl run; the tracking URI is MLflow's own setting
    (``MLFLOW_TRACKING_URI``), else a file store ``<workspace>/mlruns``."""

    name = "mlflow"

    def __init__(self, run_id: str, workspace_root: Path, params: Mapping[str, Any]) -> None:
        import os

        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((Path(workspace_root) / "mlruns").resolve().as_uri())
        mlflow.start_run(run_name=run_id)
        mlflow.log_params({k: str(v)[:250] for k, v in params.items()})

    def log(self, row: Mapping[str, Any], step: int) -> None:
        scalars = reported_scalars(row)
        if scalars:
            self.mlflow.log_metrics({k.replace("/", "_"): v for k, v in scalars.items()}, step=step)

    def log_evaluation(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for name, budget, value in evaluation_scalars(rows):
            self.mlflow.log_metric(name.replace("/", "_"), value, step=budget)

    def close(self) -> None:
        self.mlflow.end_run()


class WandbReporter(Reporter):
    """A Weights & Biases run (project from ``WANDB_PROJECT``, default ``ctrl``; ``WANDB_MODE=offline``
    writes it locally) in ``<run>/wandb``."""

    name = "wandb"

    def __init__(self, run_id: str, run_dir: Path, params: Mapping[str, Any]) -> None:
        import os

        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "ctrl"), name=run_id, dir=str(run_dir),
                              config=dict(params))

    def log(self, row: Mapping[str, Any], step: int) -> None:
        scalars = reported_scalars(row)
        if scalars:
            self.run.log(scalars, step=step)

    def log_evaluation(self, rows: Sequence[Mapping[str, Any]]) -> None:
        data = evaluation_scalars(rows)
        if data:
            table = self.wandb.Table(columns=["metric", "budget_ms", "value"], data=[list(d) for d in data])
            self.run.log({"evaluation": table})

    def close(self) -> None:
        self.run.finish()


def make_reporter(report_to: str, run_id: str, run_dir: Path, workspace_root: Path,
                  params: Mapping[str, Any]) -> Reporter:
    """The reporter of ``--report-to`` for one run (``params``: the run's configuration)."""
    check_report_to(report_to)
    if report_to == "tensorboard":
        return TensorBoardReporter(Path(run_dir) / "tensorboard")
    if report_to == "mlflow":
        return MlflowReporter(run_id, workspace_root, params)
    if report_to == "wandb":
        return WandbReporter(run_id, run_dir, params)
    return Reporter()


#: the panels of the training-curves plot: (title, [metrics columns drawn in it])
CURVE_PANELS = (
    ("loss", ["loss"]),
    ("reward", ["reward/mean"]),
    ("KL to the reference", ["kl"]),
    ("violation rate", ["violation_rate", "val/expected_violation_rate"]),
    ("validation expected reward", ["val/expected_reward"]),
)


def plot_training_curves(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path | None:
    """Draw the run's metrics rows against the training step into ``path`` (PNG, written atomically).

    A panel per :data:`CURVE_PANELS` entry with data; ``reward`` is drawn with its standard
    deviation band where ``reward_std`` exists. Returns the path, or None without any step rows.
    """
    # a Figure with its own Agg canvas, not pyplot: the caller's matplotlib backend stays as it is
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def series(column: str) -> tuple[list[float], list[float]]:
        # an offline epoch row repeats the means of its steps: only its validation metrics are drawn
        points = [(float(r["step"]), float(r[column])) for r in rows
                  if isinstance(r.get(column), int | float) and not isinstance(r.get(column), bool)
                  and math.isfinite(r[column]) and r.get("step") is not None
                  and (column.startswith("val/") or r.get("kind") != "epoch")]
        return [p[0] for p in points], [p[1] for p in points]

    panels = [(name, [c for c in columns if series(c)[0]]) for name, columns in CURVE_PANELS]
    panels = [(name, columns) for name, columns in panels if columns]
    if not panels:
        return None
    fig = Figure(figsize=(3.6 * len(panels), 3.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (name, columns) in zip(axes[0], panels):
        for column in columns:
            x, y = series(column)
            style = {"marker": "o", "linestyle": "-"} if column.startswith("val/") else {"linewidth": 1.0}
            ax.plot(x, y, label=column, **style)
            if column == "reward/mean":
                _, std = series("reward_std")
                if len(std) == len(y):
                    ax.fill_between(x, [a - b for a, b in zip(y, std)], [a + b for a, b in zip(y, std)], alpha=0.2)
        ax.set_title(name)
        ax.set_xlabel("step")
        if len(columns) > 1:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(Path(path), suffix=".png") as tmp:  # matplotlib picks the format from the name
        fig.savefig(tmp, dpi=100)
    return Path(path)
