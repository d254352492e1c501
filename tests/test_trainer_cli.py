"""ctrl train --offline / evaluate / predict through the CLI, and the run views in DuckDB."""

from __future__ import annotations

import json

import polars as pl
import pytest
from typer.testing import CliRunner

from cli import app
from conftest import build_feature_workspace
from pipeline import Workspace

runner = CliRunner()


@pytest.fixture(scope="module")
def ws(tmp_path_factory, embedded_runtime) -> Workspace:
    from synthetic import SyntheticSpec

    return build_feature_workspace(tmp_path_factory.mktemp("cli-trainer"), embedded_runtime,
                                   SyntheticSpec(num_samples=30))[1]


def test_train_evaluate_predict(ws, tmp_path):
    w = str(ws.root)
    trained = runner.invoke(app, ["train", "--offline", "-w", w, "--num-epochs", "2", "--run-id", "cli-run",
                                  "--reward-mode", "hard", "--fallback-confidence", "0.8"], catch_exceptions=False)
    assert trained.exit_code == 0, trained.output
    assert "run cli-run" in trained.stdout and "lut_p95" in trained.stdout
    assert (ws.runs_dir / "cli-run" / "evaluation.png").exists()
    from trainer.fallback import read_fallback

    assert json.loads((ws.runs_dir / "cli-run" / "config.json").read_text())["fallback_confidence"] == 0.8
    fallback = read_fallback(ws.runs_dir / "cli-run" / "checkpoints" / "best.pt")
    assert fallback.confidence == 0.8
    assert fallback.describe() in trained.stdout and "(80% confidence)" in trained.stdout

    evaluated = runner.invoke(app, ["evaluate", "latest", "-w", w, "--budget-ms", "250", "--budget-ms", "400"])
    assert evaluated.exit_code == 0, evaluated.output
    assert "oracle" in evaluated.stdout and "controller" in evaluated.stdout

    views = runner.invoke(app, ["query", "-w", w, "--format", "json", """
        SELECT (SELECT count(*) FROM runs) AS runs, (SELECT count(*) FROM metrics) > 0 AS has_metrics,
               (SELECT count(DISTINCT budget_ms) FROM evaluations WHERE run_id = 'cli-run') AS budgets"""])
    assert json.loads(views.stdout) == [{"runs": 1, "has_metrics": True, "budgets": 2}]

    # the run files follow their declared schemas (pipeline.schema.RUN_TABLES, documented in the README)
    import pyarrow.parquet as pq

    from pipeline.schema import RUN_TABLES
    from pipeline.workspace import check_table_schema

    for name, filename in (("runs", "run.parquet"), ("metrics", "metrics.parquet"),
                           ("evaluations", "evaluation.parquet")):
        path = ws.runs_dir / "cli-run" / filename
        check_table_schema(pq.read_schema(path), RUN_TABLES[name], path)

    out = tmp_path / "decisions.csv"
    predicted = runner.invoke(app, ["predict", "--run", "cli-run", "-w", w, "--budget-ms", "200", "--budget-ms", "300",
                                    "--out", str(out)])
    assert predicted.exit_code == 0, predicted.output
    frame = pl.read_csv(out)
    assert frame.columns == ["sample_key", "dataset", "example_id", "budget_ms", "max_crops", "top_k",
                             "num_active_blocks", "probability", "source"]
    assert frame.height == 2 * 60 and frame["probability"].is_between(0, 1, closed="right").all()


def test_predict_needs_exactly_one_source(ws, tmp_path):
    both = runner.invoke(app, ["predict", "-w", str(ws.root), "--budget-ms", "200", "--out", str(tmp_path / "x.csv")])
    assert both.exit_code == 1 and "exactly one of --run" in both.stderr
