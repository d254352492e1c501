"""Training metrics in TensorBoard (read back with tensorboard's own reader) and the training-curves PNG."""

from __future__ import annotations

import sys

import pytest
from PIL import Image

from pipeline.errors import CtrlError
from trainer.reporting import (
    REPORT_TO,
    Reporter,
    check_report_to,
    evaluation_scalars,
    make_reporter,
    plot_training_curves,
    reported_scalars,
)

ROWS = [
    {"kind": "step", "step": 1, "loss": 0.5, "reward/mean": 0.25, "reward_std": 0.1, "kl": 0.0, "learning_rate": 1e-3,
     "violation_rate": 0.3, "grad_norm": 2.0, "groups": 8},
    {"kind": "step", "step": 2, "loss": 0.25, "reward/mean": 0.5, "reward_std": 0.2, "kl": 0.01, "learning_rate": 1e-3,
     "violation_rate": 0.2, "grad_norm": float("nan")},
    {"kind": "epoch", "step": 2, "val/expected_reward": 0.6, "val/expected_violation_rate": 0.05, "loss": 0.3},
]
EVALUATION = [{"decider": "controller", "budget_ms": 72.04, "accuracy": 0.64, "violation_rate": 0.023},
              {"decider": "lut_p95", "budget_ms": 72.04, "accuracy": 0.61, "violation_rate": float("nan")}]


def test_rows_are_reported_under_trl_names():
    assert reported_scalars(ROWS[0]) == {"loss": 0.5, "reward": 0.25, "reward_std": 0.1, "kl": 0.0,
                                         "learning_rate": 1e-3, "violation_rate": 0.3, "grad_norm": 2.0}
    assert "grad_norm" not in reported_scalars(ROWS[1])  # NaN is not a measurement
    assert reported_scalars(ROWS[2]) == {"eval/expected_reward": 0.6, "eval/expected_violation_rate": 0.05}
    assert evaluation_scalars(EVALUATION) == [("evaluation/controller/accuracy", 72, 0.64),
                                              ("evaluation/controller/violation_rate", 72, 0.023),
                                              ("evaluation/lut_p95/accuracy", 72, 0.61)]


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reporter = make_reporter("tensorboard", "r1", tmp_path / "runs" / "r1", tmp_path, {"lr": 1e-3})
    for row in ROWS:
        reporter.log(row, row["step"])
    reporter.log_evaluation(EVALUATION)
    reporter.close()
    events = EventAccumulator(str(tmp_path / "runs" / "r1" / "tensorboard"))
    events.Reload()
    scalars = {tag: [(e.step, round(e.value, 6)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["reward"] == [(1, 0.25), (2, 0.5)]
    assert scalars["loss"] == [(1, 0.5), (2, 0.25)]
    assert scalars["kl"] == [(1, 0.0), (2, 0.01)]
    assert scalars["learning_rate"] == [(1, 0.001), (2, 0.001)]
    assert scalars["eval/expected_reward"] == [(2, 0.6)]
    assert scalars["evaluation/controller/accuracy"] == [(72, 0.64)]
    assert scalars["grad_norm"] == [(1, 2.0)]


def test_backends_are_checked_before_training(monkeypatch):
    assert REPORT_TO == ("none", "tensorboard", "mlflow", "wandb")
    check_report_to("none")
    with pytest.raises(ValueError, match=r"^--report-to must be one of none, tensorboard, mlflow, wandb, got 'tb'$"):
        check_report_to("tb")
    monkeypatch.setitem(sys.modules, "mlflow", None)  # not installed
    with pytest.raises(CtrlError, match=r"^--report-to mlflow needs the mlflow package\nHint: pip install"):
        check_report_to("mlflow")
    assert type(make_reporter("none", "r1", "unused", "unused", {})) is Reporter


def test_a_backend_that_is_not_installed_leaves_no_run(tmp_path, embedded_runtime, monkeypatch):
    from typer.testing import CliRunner

    from cli import app
    from conftest import build_feature_workspace
    from synthetic import SyntheticSpec

    _, ws = build_feature_workspace(tmp_path, embedded_runtime, SyntheticSpec(num_samples=30))
    monkeypatch.setitem(sys.modules, "mlflow", None)  # not installed
    result = CliRunner().invoke(app, ["train", "--offline", "-w", str(ws.root), "--report-to", "mlflow",
                                      "--run-id", "r1", "--cross-fit-folds", "0"])
    assert result.exit_code == 1 and result.stderr.startswith("error: --report-to mlflow needs the mlflow package")
    assert not (ws.runs_dir / "r1").exists()


def test_training_curves_png(tmp_path):
    path = plot_training_curves(ROWS, tmp_path / "training_curves.png", title="run r1")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 1000  # five panels side by side
    assert plot_training_curves([{"kind": "epoch", "step": None}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_offline_training_reports_to_tensorboard_and_draws_its_curves(tmp_path, embedded_runtime):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conftest import build_feature_workspace
    from synthetic import SyntheticSpec
    from trainer.config import OfflineTrainConfig
    from trainer.offline import train_offline

    _, ws = build_feature_workspace(tmp_path, embedded_runtime, SyntheticSpec(num_samples=30))
    result = train_offline(OfflineTrainConfig(workspace=ws.root, num_epochs=2, run_id="tb", cross_fit_folds=2,
                                              warm_start_steps=5, report_to="tensorboard"))
    run = result.run_dir
    with Image.open(run / "training_curves.png") as image:
        assert image.format == "PNG"
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "reward", "reward_std", "kl", "learning_rate", "violation_rate", "eval/expected_reward",
            "evaluation/controller/accuracy"} <= tags
    steps = result.metrics.filter(result.metrics["kind"] == "step")
    assert [e.step for e in events.Scalars("reward")] == steps["step"].to_list()  # none from the fold networks
    assert [round(e.value, 5) for e in events.Scalars("reward")] == [round(v, 5) for v in steps["reward/mean"]]
    assert {round(e.value, 9) for e in events.Scalars("learning_rate")} == {0.001}
    epochs = result.metrics.filter(result.metrics["kind"] == "epoch")
    assert [e.step for e in events.Scalars("eval/expected_reward")] == epochs["step"].to_list()  # initial + 2
    assert not any((run / "folds").rglob("tensorboard"))
