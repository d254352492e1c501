"""Values that cannot work are refused before any work, with one line naming the value."""

from __future__ import annotations

import math
import re

import pytest
from typer.testing import CliRunner

from cli import app
from features.extract import check_image_pattern
from pipeline.errors import CtrlError
from trainer.config import OfflineTrainConfig

runner = CliRunner()


@pytest.mark.parametrize(("pattern", "message"), [
    ("{foo}.jpg", "uses {foo}; the fields are {image_id}, {dataset}, {split}"),
    ("{0}", "uses {0}; the fields are"),
    ("{}", "uses {}; the fields are"),
    ("{image_id", "is not a valid pattern"),
])
def test_an_image_pattern_with_other_fields_is_refused(pattern, message):
    with pytest.raises(CtrlError, match="^" + re.escape(f"--image-pattern {pattern!r} {message}")):
        check_image_pattern(pattern)
    check_image_pattern("{dataset}/{image_id}.jpg")


def test_extract_features_refuses_a_bad_pattern_in_one_line(tmp_path):
    result = runner.invoke(app, ["extract-features", "-w", str(tmp_path / "ws"), "--image-pattern", "{foo}.jpg"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[0] == (
        "error: --image-pattern '{foo}.jpg' uses {foo}; the fields are {image_id}, {dataset}, {split}")


@pytest.mark.parametrize("value", [math.inf, math.nan, -5.0, 0.0])
def test_a_budget_range_end_that_is_not_a_finite_positive_number_is_named(value):
    message = rf"^`budget_max_ms` must be a finite number of milliseconds > 0, got {value!r}$"
    with pytest.raises(ValueError, match=message):
        OfflineTrainConfig(budget_min_ms=50.0, budget_max_ms=value)


@pytest.mark.parametrize(("args", "value"), [
    (["train", "--seed", "1e23"], "'1e23'"),
    (["train", "--num-epochs", "0"], "'0'"),
    (["serve", "--port", "http"], "'http'"),
    (["predict", "--budget-ms", "fast"], "'fast'"),
])
def test_an_option_value_that_does_not_convert_is_named_in_its_error(args, value):
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    flat = " ".join(line.strip("│ ") for line in result.output.splitlines())
    assert f"Invalid value for '{args[1]}'" in flat and f"(got {value})" in flat, result.output


def test_train_with_an_infinite_budget_writes_no_run(tmp_path):
    result = runner.invoke(app, ["train", "--offline", "-w", str(tmp_path / "ws"), "--budget-min-ms", "50",
                                 "--budget-max-ms", "inf"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: `budget_max_ms` must be a finite number of milliseconds > 0, got inf")
    assert not (tmp_path / "ws" / "runs").exists()


def test_too_many_parser_processes_are_refused_before_any_start(tmp_path):
    from pipeline.ingestion import MAX_WORKERS

    result = runner.invoke(app, ["ingest", str(tmp_path), "-w", str(tmp_path / "ws"), "--num-workers", "100000"])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: --num-workers 100000 is more parser processes than ctrl starts (at most "
                                    f"{MAX_WORKERS}: 4 per core of this machine)")
    assert not (tmp_path / "ws").exists()


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs on this system")
def test_a_fifo_or_a_device_named_like_an_image_is_never_opened(tmp_path):
    import os
    import threading

    from runtime.images import open_image

    fifo = tmp_path / "img-1.jpg"
    os.mkfifo(fifo)
    device = tmp_path / "img-2.jpg"
    device.symlink_to("/dev/zero")
    results = {}
    worker = threading.Thread(target=lambda: results.update(fifo=open_image(fifo), device=open_image(device)),
                              daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "open_image blocked on a FIFO"
    assert results == {"fifo": None, "device": None}


def test_export_never_replaces_an_existing_file_without_force(tmp_path, embedded_runtime):
    from conftest import build_feature_workspace
    from synthetic import SyntheticSpec

    _, ws = build_feature_workspace(tmp_path, embedded_runtime, SyntheticSpec(num_samples=30))
    trained = runner.invoke(app, ["train", "--offline", "-w", str(ws.root), "--num-epochs", "1", "--cross-fit-folds",
                                  "0", "--no-table-fallback", "--warm-start-steps", "5", "--run-id", "r"])
    assert trained.exit_code == 0, trained.output
    source = tmp_path / "module.py"
    source.write_text("print('my source file')\n")
    refused = runner.invoke(app, ["export", "r", "-w", str(ws.root), "--out", str(source)])
    assert refused.exit_code == 1
    assert refused.stderr.startswith(f"error: {source}: exists; refusing to replace it")
    assert source.read_text() == "print('my source file')\n"
    replaced = runner.invoke(app, ["export", "r", "-w", str(ws.root), "--out", str(source), "--force"])
    assert replaced.exit_code == 0, replaced.output
    assert source.read_bytes()[:2] == b"PK"  # a TorchScript archive now


def test_more_folds_than_samples_is_refused_before_training(tmp_path, embedded_runtime):
    from conftest import build_feature_workspace
    from synthetic import SyntheticSpec

    _, ws = build_feature_workspace(tmp_path, embedded_runtime, SyntheticSpec(num_samples=30))
    result = runner.invoke(app, ["train", "--offline", "-w", str(ws.root), "--cross-fit-folds", "100000"])
    assert result.exit_code == 1
    assert re.match(r"error: --cross-fit-folds 100000 is more folds than the \d+ samples the networks train on",
                    result.stderr)
    assert not ws.runs_dir.exists() or not any(ws.runs_dir.iterdir())


@pytest.mark.parametrize("option", [("--hidden-dim", "100000000"), ("--batch-size", "1000000000"),
                                    ("--group-size", "10000000")])
def test_options_whose_memory_cannot_fit_are_refused_before_they_allocate(tmp_path, embedded_runtime, option):
    from conftest import build_feature_workspace
    from synthetic import SyntheticSpec

    _, ws = build_feature_workspace(tmp_path, embedded_runtime, SyntheticSpec(num_samples=30))
    result = runner.invoke(app, ["train", "--offline", "-w", str(ws.root), *option])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert re.match(r"error: these options need about [\d,.]+ GiB per training step \(hidden_dim \d+, batch_size \d+ "
                    r"x num_budgets_per_sample \d+ groups of group_size \d+\), and [\d,.]+ GiB are available$",
                    lines[0]), lines
    assert lines[1].startswith("Hint: lower --hidden-dim, --batch-size or --group-size")
    assert not ws.runs_dir.exists() or not any(ws.runs_dir.iterdir())


def test_a_full_disk_during_training_is_one_line_leaves_no_temporary_file_and_resumes(tmp_path, embedded_runtime,
                                                                                     monkeypatch):
    import errno

    import torch

    from conftest import build_feature_workspace
    from synthetic import SyntheticSpec

    _, ws = build_feature_workspace(tmp_path, embedded_runtime, SyntheticSpec(num_samples=30))
    real_save = torch.save
    calls = {"n": 0}

    def full_after_two(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_after_two)
    args = ["train", "--offline", "-w", str(ws.root), "--num-epochs", "3", "--cross-fit-folds", "0",
            "--no-table-fallback", "--warm-start-steps", "5", "--run-id", "full"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "No space left on device" in result.stderr.strip().splitlines()[0]
    run = ws.runs_dir / "full"
    assert not [p for p in run.rglob("*") if p.name.startswith(".") or ".tmp" in p.name]
    monkeypatch.setattr(torch, "save", real_save)
    resumed = runner.invoke(app, ["train", "--offline", "-w", str(ws.root), "--resume", "full"])
    assert resumed.exit_code == 0, resumed.output
