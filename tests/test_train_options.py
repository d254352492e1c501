"""`ctrl train`'s options: help and default from the config fields, per phase; other-phase options refused."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import cli
from cli import app
from online.config import OnlineTrainConfig
from online.train_options import PHASES, TRAIN_OPTIONS, train_config, train_option_help
from pipeline.errors import CtrlError
from pipeline.options import option_help
from trainer.config import OfflineTrainConfig

runner = CliRunner()


def train_params() -> dict:
    import typer.main

    return {p.name: p for p in typer.main.get_command(app).commands["train"].params}


def test_every_train_option_takes_help_and_default_from_its_config_field():
    params = train_params()
    assert set(params) - {"offline", "help"} == set(TRAIN_OPTIONS)
    for name, option in TRAIN_OPTIONS.items():
        if name == "workspace":  # every command's shared -w option
            continue
        assert params[name].default is None, name  # "not given": the phase's config default applies
        assert params[name].help == train_option_help(name)
        assert params[name].help.startswith(option_help(PHASES[option.phases()[0]], option.field)), name
    # what a user reads, written out
    assert params["lr"].help == "AdamW learning rate. (default: offline 0.001; online 0.0003)"
    assert params["hidden_dim"].help.endswith("(offline only; default: 128)")
    assert params["steps"].help.endswith("(online only; default: 20)")
    assert params["no_table_fallback"].help.endswith("(offline only; default: off)")
    assert params["group_size"].help.endswith("(default: 5)")


def test_the_online_lr_is_the_online_configs(monkeypatch, tmp_path):
    built = []  # (phase, config) of every call, in order
    monkeypatch.setattr(cli.train, "_train_online", lambda config: built.append(("online", config)))
    monkeypatch.setattr(cli.train, "_train_offline", lambda config: built.append(("offline", config)))
    for phase in ("--online", "--offline"):
        result = runner.invoke(app, ["train", phase, "-w", str(tmp_path)])
        assert result.exit_code == 0, result.output
    assert [(phase, config.lr) for phase, config in built] == [("online", 3e-4), ("offline", 1e-3)]
    assert OnlineTrainConfig().lr == 3e-4 and OfflineTrainConfig().lr == 1e-3
    given = runner.invoke(app, ["train", "--online", "-w", str(tmp_path), "--lr", "0.02"])
    assert given.exit_code == 0 and built[-1][0] == "online" and built[-1][1].lr == 0.02
    assert train_config("online", {"lr": 0.02}).lr == 0.02


@pytest.mark.parametrize(("args", "message"), [
    (["--online", "--hidden-dim", "32"], "--hidden-dim applies to `ctrl train --offline` only, not --online"),
    (["--online", "--no-table-fallback"], "--no-table-fallback applies to `ctrl train --offline` only, not --online"),
    (["--offline", "--steps", "40"], "--steps applies to `ctrl train --online` only, not --offline"),
    (["--offline", "--from", "r1"], "--from applies to `ctrl train --online` only, not --offline"),
    (["--offline", "--no-evaluate"], "--evaluate applies to `ctrl train --online` only, not --offline"),
])
def test_an_option_of_the_other_phase_is_refused_with_one_line(tmp_path, args, message):
    result = runner.invoke(app, ["train", *args, "-w", str(tmp_path)])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"error: {message}" and lines[1].startswith("Hint:") and len(lines) == 2
    assert not (tmp_path / "runs").exists()


def test_converted_options():
    offline = train_config("offline", {"reward_mode": "soft", "violation_target": 0.0, "no_table_fallback": True,
                                       "use_tilings": False, "report_to": "tensorboard"})
    assert offline.reward.mode == "soft" and offline.violation_target is None
    assert offline.disable_table_fallback is True and offline.use_tilings is False
    assert offline.report_to == "tensorboard"
    online = train_config("online", {"online_evaluate": False, "images": "imgs", "from_run": "r1"})
    assert (online.evaluate, str(online.images_dir), online.from_run, online.reward) == (False, "imgs", "r1", None)
    with pytest.raises(ValueError, match="`report_to` must be one of none, tensorboard, mlflow, wandb"):
        train_config("offline", {"report_to": "tb"})
    with pytest.raises(CtrlError, match=r"^--num-epochs applies to `ctrl train --offline` only, not --online\n"):
        train_config("online", {"num_epochs": 3})


def test_latest_is_the_newest_run_with_a_checkpoint_of_the_phases_a_command_takes(tmp_path):
    import json
    import os

    from pipeline import Workspace
    from trainer.runs import RunDir, latest_run

    ws = Workspace(tmp_path / "ws")

    def run(run_id: str, phase: str, checkpoint: str | None, started: int) -> None:
        path = ws.runs_dir / run_id
        (path / "checkpoints").mkdir(parents=True)
        config = path / "config.json"
        config.write_text(json.dumps({"phase": phase} if phase == "online" else {}))
        if checkpoint:
            (path / "checkpoints" / checkpoint).write_bytes(b"x")
        os.utime(config, ns=(started * 10**9, started * 10**9))

    run("a-offline", "offline", "best.pt", 1)
    run("b-online", "online", "last.pt", 2)
    run("c-offline-no-epoch-yet", "offline", None, 3)
    run("d-online-no-step-yet", "online", None, 4)
    assert latest_run(ws).run_id == "b-online"  # evaluate, serve
    assert RunDir.resolve(ws, "latest", ("offline", "online")).run_id == "b-online"
    assert RunDir.resolve(ws, "latest").run_id == "a-offline"  # predict, export, train --online --from
    empty = Workspace(tmp_path / "empty")
    with pytest.raises(CtrlError, match="has no offline or online run with a checkpoint yet\nHint: ctrl train"):
        latest_run(empty)


def test_a_run_config_written_before_the_fast_path_rename_still_loads():
    from online.config import OnlineTrainConfig

    old = OnlineTrainConfig.from_json({"compile": False, "device": "cpu", "threads": 2})
    assert (old.fast_path, old.threads) == (False, 2)
    assert "compile" not in old.to_json() and old.to_json()["fast_path"] is False


def test_every_command_that_loads_the_model_takes_its_execution_options_help_from_one_place():
    from dataclasses import fields

    from features.extract import FeatureConfig
    from online.config import OnlineTrainConfig
    from pipeline.execution import EXECUTION_HELP
    from profiler.sweep import ProfileConfig
    from serve.config import ServeConfig

    for config in (ServeConfig, OnlineTrainConfig, ProfileConfig, FeatureConfig):
        declared = {f.name: f.metadata.get("help") for f in fields(config) if f.name in EXECUTION_HELP}
        assert {"device", "dtype"} <= set(declared), config
        for name, text in declared.items():
            assert text.startswith(EXECUTION_HELP[name]), (config, name)
