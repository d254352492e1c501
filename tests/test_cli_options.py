"""cli.options: a command's options built from the config fields they set."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import typer
import typer.main
from typer.testing import CliRunner

from cli.options import config_parameters, with_parameters
from online.progress import online_progress
from pipeline.options import WORKSPACE_CLI, option
from trainer.progress import offline_progress


@dataclass
class _Toy:
    paths: list[Path] = option(help="Inputs.", argument=True)
    workspace: Path | None = option(None, help="Where.", **WORKSPACE_CLI)
    steps: int = option(3, help="How many.", min=1)
    warmup: bool = option(True, help="Warm up.")
    strict: bool = option(False, help="Stop early.", flags=("--strict",))
    mode: Literal["a", "b"] = option("a", help="Which mode.")
    dtype: str = option("auto", help="Weights.", choices=("auto", "float32"))
    internal: int = option(0, help="Not a command-line option.", cli=False)


def _command(**kwargs: Any) -> tuple[typer.Typer, list[dict]]:
    app = typer.Typer(add_completion=False)
    seen: list[dict] = []

    @app.command()
    @with_parameters(config_parameters(_Toy, **kwargs))
    def run(**options: Any) -> None:
        seen.append(options)

    return app, seen


def test_every_option_comes_from_its_field():
    app, seen = _command()
    params = {p.name: p for p in typer.main.get_command(app).params}
    assert set(params) == {"paths", "workspace", "steps", "warmup", "strict", "mode", "dtype"}  # not `internal`
    assert params["paths"].param_type_name == "argument" and params["paths"].required
    assert params["workspace"].opts == ["--workspace", "-w"] and params["workspace"].envvar == "CTRL_WORKSPACE"
    assert params["warmup"].opts == ["--warmup"] and params["warmup"].secondary_opts == ["--no-warmup"]
    assert params["strict"].opts == ["--strict"] and not params["strict"].secondary_opts
    assert params["steps"].default == 3 and params["steps"].help == "How many."

    result = CliRunner().invoke(app, ["x", "y", "--steps", "5", "--no-warmup", "--strict", "--mode", "b",
                                      "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert seen == [{"paths": [Path("x"), Path("y")], "workspace": None, "steps": 5, "warmup": False,
                     "strict": True, "mode": "b", "dtype": "float32"}]  # a choice arrives as its value
    assert type(seen[0]["dtype"]) is str
    assert CliRunner().invoke(app, ["x", "--steps", "0"]).exit_code != 0  # min=1, checked as it is read
    refused = CliRunner().invoke(app, ["x", "--dtype", "int8"])
    assert refused.exit_code != 0 and "'int8' is not one of" in refused.output


def test_not_given_options_default_to_none_and_may_be_renamed():
    app, seen = _command(names=["count", "warmup"], field_of={"count": "steps"}, not_given=True,
                         overrides={"count": {"min": 2}}, help_of=lambda name: f"help of {name}")
    params = {p.name: p for p in typer.main.get_command(app).params}
    assert params["count"].opts == ["--count"] and params["count"].default is None
    assert params["count"].help == "help of count"
    assert CliRunner().invoke(app, ["--count", "1"]).exit_code != 0  # the override's bound
    assert CliRunner().invoke(app, []).exit_code == 0 and seen[-1] == {"count": None, "warmup": None}


def test_progress_events_read_as_the_terminal_shows_them():
    step = online_progress({"phase": "step", "step": 3, "steps": 20, "reward/mean": 0.4567, "accuracy": 0.5,
                            "latency_ms_mean": 123.4, "violation_rate": 0.25})
    assert (step.completed, step.total, step.line) == (3, 20, None)
    assert step.info == "reward 0.457 acc 0.500 latency 123 ms viol 25%"
    check = online_progress({"phase": "check", "step": 10, "gain": 0.012, "gain_low": -0.003, "gain_high": 0.027,
                             "requests": 48, "late_share": 0.1, "start_late_share": 0.125, "kept_step": 10,
                             "since": 0, "patience": 2})
    assert check.info is None and check.line == (
        "step 10: held-out gain over the start +0.012 [-0.003, +0.027] on 48 paired requests, late 10% "
        "(start 12%); kept: step 10")
    assert online_progress({"phase": "rollouts"}) is None
    guarded = online_progress({"phase": "guarded", "stage_ratios": {"vision": 1.0, "prefill": 3.3}, "slack": 1.12,
                               "requests": 216, "predictor": "request_cost",
                               "spread": {"request_cost": 1.4, "outcome": 1.9}})
    assert guarded.line == ("latency guard: vision x1.00, prefill x3.30 against the profile, slack x1.12 (216 requests)"
                            "; predicted by the request cost model (p95/p50 outcome x1.90, request cost x1.40)")
    epoch = offline_progress({"phase": "train", "step": 7, "total_steps": 70, "epoch": 1, "loss": 0.5,
                              "reward": 0.25, "val_expected_reward": None})
    assert (epoch.completed, epoch.total) == (7, 70)
    assert epoch.info == "epoch 1 loss 0.5000 reward 0.250 val E[r] -"
    assert offline_progress({"phase": "fit", "model": "request cost model"}).info == "fitting the request cost model"
