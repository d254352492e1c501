"""Every command that runs a model, on a MolmoE checkpoint directory (the tiny one with the real
layout): profile -> ingest -> extract-features -> train --offline -> train --online (two-stage
rollouts on the native runtime) -> evaluate of that online run, through the ctrl command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from pipeline.catalog import run_query
from pipeline.workspace import Workspace
from runtime.molmoe_processor import PROMPT_TEMPLATE, load_molmo_tokenizer
from testbed.dataset import read_dataset
from testbed.task import generate_dataset

runner = CliRunner()
CONFIGS = "6/8/16,2/4/12,1/8/14"


def ctrl(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, f"ctrl {' '.join(args)}: {result.output}"
    return result.stdout


@pytest.fixture(scope="module")
def ran(tiny_molmoe_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("molmoe-commands")
    dataset, ws, prof = root / "ds", root / "ws", root / "prof"
    generate_dataset(dataset, num_samples=10, seed=5)
    model = str(tiny_molmoe_dir)
    ctrl("profile", "--model", model, "--dataset", str(dataset), "--configs", CONFIGS, "--num-samples", "10",
         "--max-new-tokens", "2", "--out", str(prof))
    ctrl("ingest", str(prof), "-w", str(ws))
    ctrl("extract-features", "--model", model, "--images", str(dataset / "images"), "-w", str(ws))
    ctrl("train", "--offline", "-w", str(ws), "--num-epochs", "1", "--cross-fit-folds", "0", "--run-id", "offline")
    ctrl("train", "--online", "--model", model, "--images", str(dataset / "images"), "-w", str(ws), "--steps", "1",
         "--samples-per-step", "1", "--group-size", "2", "--max-new-tokens", "2", "--no-evaluate",
         "--calibration-samples", "2", "--guard-samples", "2", "--run-id", "online")
    return {"ws": ws, "dataset": dataset, "model": tiny_molmoe_dir}


def test_profile_counts_text_tokens_only(ran):
    ws = Workspace(ran["ws"])
    rows = run_query(ws, "SELECT DISTINCT m.num_text_tokens, s.question FROM measurements m JOIN samples s "
                         "USING (dataset, sample_key) WHERE m.experiment = 'exp6'").to_pylist()
    tokenizer = load_molmo_tokenizer(ran["model"])
    assert len({r["num_text_tokens"] for r in rows}) >= 2  # questions of different lengths
    for row in rows:
        # " User: <q> Assistant:" alone: no BOS, no image start/end/column tokens
        text = tokenizer.encode(PROMPT_TEMPLATE.format(question=row["question"]), add_special_tokens=False)
        assert row["num_text_tokens"] == len(text)


def test_features_and_runs_are_those_of_the_checkpoint(ran):
    ws = Workspace(ran["ws"])
    dims = run_query(ws, "SELECT DISTINCT len(feature) AS n FROM image_features WHERE feature IS NOT NULL "
                         "UNION ALL SELECT DISTINCT len(feature) FROM lang_features").to_pylist()
    assert {d["n"] for d in dims} == {64}  # the tiny checkpoint's d_model
    online = json.loads((ws.runs_dir / "online" / "config.json").read_text())
    assert online["phase"] == "online" and online["calibration_samples"] == 2
    assert 0 < online["budget_min_ms"] < online["budget_max_ms"]  # calibrated on the checkpoint
    rollouts = run_query(ws, "SELECT count(*) AS n, min(latency_total_ms) AS t, min(num_text_tokens) AS text "
                             "FROM rollouts WHERE run_id = 'online'").to_pylist()[0]
    assert rollouts["n"] == 2 and rollouts["t"] > 0 and 5 < rollouts["text"] < 40
    # the latency guard, measured on the checkpoint: every profiled configuration on both samples
    from controller.latency_guard import load_run_guard

    guard = load_run_guard(ws.runs_dir / "online")
    assert guard is not None and guard.requests == 2 * len(CONFIGS.split(",")) and guard.slack > 0


def test_evaluate_the_online_run(ran):
    out = ctrl("evaluate", "online", "-w", str(ran["ws"]), "--max-samples", "1")
    assert "controller" in out and "offline_start" in out
    assert (Workspace(ran["ws"]).runs_dir / "online" / "evaluation.parquet").is_file()


def test_dataset_is_the_one_profiled(ran):
    assert len(read_dataset(ran["dataset"]).samples) == 10


@pytest.fixture(scope="module")
def ran_bf16(ran: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    """The same workspace and checkpoint with the weights held in bfloat16."""
    root = tmp_path_factory.mktemp("molmoe-bf16")
    model, ws, dataset = str(ran["model"]), ran["ws"], ran["dataset"]
    ctrl("extract-features", "--model", model, "--images", str(dataset / "images"), "-w", str(ws), "--dtype",
         "bfloat16")
    ctrl("profile", "--model", model, "--dataset", str(dataset), "--configs", "2/4/12", "--num-samples", "1",
         "--max-new-tokens", "2", "--out", str(root / "prof"), "--dtype", "bfloat16")
    ctrl("train", "--online", "--fresh", "--model", model, "--images", str(dataset / "images"), "-w", str(ws),
         "--steps", "1", "--samples-per-step", "1", "--group-size", "2", "--max-new-tokens", "2", "--no-evaluate",
         "--calibration-samples", "2", "--run-id", "online-bf16", "--dtype", "bfloat16")
    return {**ran, "prof_bf16": root / "prof"}


def test_bf16_features_are_cached_apart_from_float32_ones(ran_bf16):
    ws = Workspace(ran_bf16["ws"])
    rows = run_query(ws, "SELECT model_fingerprint, count(*) AS n, avg(list_sum(feature)) AS s FROM lang_features "
                         "GROUP BY 1").to_pylist()
    assert len(rows) == 2 and rows[0]["n"] == rows[1]["n"] == 10
    online = json.loads((ws.runs_dir / "online-bf16" / "config.json").read_text())
    assert online["dtype"] == "bfloat16" and online["model_fingerprint"] in {r["model_fingerprint"] for r in rows}
    online32 = json.loads((ws.runs_dir / "online" / "config.json").read_text())
    assert online32["dtype"] == "float32" and online32["model_fingerprint"] != online["model_fingerprint"]


def test_a_bf16_profile_records_its_dtype_and_is_another_run_than_float32(ran_bf16, tmp_path):
    rank_file = next(ran_bf16["prof_bf16"].rglob("exp6_latency_*_rank0.json"))
    block = json.loads(rank_file.read_text())["config"]["ctrl_profile"]
    assert block["dtype"] == "bfloat16" and block["device"] == "cpu"
    # profiling the float32 run's directory again in bfloat16 would mix two precisions: refused
    prof32 = tmp_path / "prof32"
    args = ["profile", "--model", str(ran_bf16["model"]), "--dataset", str(ran_bf16["dataset"]), "--configs",
            "2/4/12", "--num-samples", "1", "--max-new-tokens", "2", "--out", str(prof32)]
    ctrl(*args)
    refused = runner.invoke(app, [*args, "--dtype", "bfloat16"])
    assert refused.exit_code == 1 and "written by a different profiling run" in refused.output


def test_evaluate_a_bf16_online_run_in_its_dtype(ran_bf16):
    out = ctrl("evaluate", "online-bf16", "-w", str(ran_bf16["ws"]), "--max-samples", "1")
    assert "controller" in out
