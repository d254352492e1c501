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
                                  "--reward-mode", "hard", "--fallback-confidence", "0.8", "--cross-fit-folds", "2",
                                  "--hidden-dim", "48"],
                            catch_exceptions=False)
    assert trained.exit_code == 0, trained.output
    assert "run cli-run" in trained.stdout and "lut_p95" in trained.stdout
    assert "next: `ctrl predict --run cli-run" in trained.stdout  # where to look next
    assert "ctrl query \"FROM evaluations WHERE run_id = 'cli-run'\"" in trained.stdout
    assert (ws.runs_dir / "cli-run" / "evaluation.png").exists()
    from trainer.fallback import read_fallback
    from trainer.policy import ControllerPolicy

    config = json.loads((ws.runs_dir / "cli-run" / "config.json").read_text())
    assert config["fallback_confidence"] == 0.8 and config["hidden_dim"] == 48
    assert ControllerPolicy.load(ws.runs_dir / "cli-run" / "checkpoints" / "best.pt").lang_proj[0].out_features == 48
    fallback = read_fallback(ws.runs_dir / "cli-run" / "checkpoints" / "best.pt")
    assert fallback.confidence == 0.8
    # "auto": the table is preferred where it reads the question's family (the sample data records families)
    assert fallback.describe() in trained.stdout and "(80% confidence, table preferred)" in trained.stdout
    assert "lut_by_question table at" in trained.stdout
    # training ends with the short summary (per budget: who answered, the controller, the best static
    # configuration, lut_p95, the best table); the full table of every decider is `ctrl evaluate`'s
    assert "summary (every sample, out of fold" in trained.stdout and "best static configuration" in trained.stdout
    assert "oracle" not in trained.stdout and "every decider: `ctrl evaluate cli-run`" in trained.stdout

    evaluated = runner.invoke(app, ["evaluate", "latest", "-w", w, "--budget-ms", "250", "--budget-ms", "400"])
    assert evaluated.exit_code == 0, evaluated.output
    assert "oracle" in evaluated.stdout and "controller" in evaluated.stdout and "best_static" in evaluated.stdout
    beside = ws.runs_dir / "cli-run" / "evaluations" / "budgets-250-400"
    assert f"written: {beside / 'evaluation.parquet'}" in " ".join(evaluated.stdout.split())
    assert pl.read_parquet(beside / "evaluation.parquet")["budget_ms"].unique().sort().to_list() == [250.0, 400.0]

    # the run's own record (its 8-budget grid) stays what the evaluations view shows
    views = runner.invoke(app, ["query", "-w", w, "--format", "json", """
        SELECT (SELECT count(*) FROM runs) AS runs, (SELECT count(*) FROM metrics) > 0 AS has_metrics,
               (SELECT count(DISTINCT budget_ms) FROM evaluations WHERE run_id = 'cli-run') AS budgets"""])
    assert json.loads(views.stdout) == [{"runs": 1, "has_metrics": True, "budgets": 8}]

    # the run files follow their declared schemas (pipeline.schema.RUN_TABLES, documented in docs/schema.md)
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
                             "num_active_blocks", "probability", "source", "answered_by", "question_group",
                             "expected_latency_ms", "latency_quantile_ms", "cost_basis"]
    # the deployed cost model's prediction at the chosen configuration: its quantile bounds its median
    assert (frame["latency_quantile_ms"] >= frame["expected_latency_ms"]).all()
    assert set(frame["cost_basis"]) <= {"request", "configuration"}
    # who answered: the network, or the fallback's table by name; the question's family as the table reads it
    assert set(frame["answered_by"]) <= {"controller", "lut_by_question", "lut_p95"}
    assert ((frame["source"] == "controller") == (frame["answered_by"] == "controller")).all()
    assert frame["question_group"].null_count() == 0
    assert frame.height == 2 * 60 and frame["probability"].is_between(0, 1, closed="right").all()


def test_predict_needs_exactly_one_source(ws, tmp_path):
    both = runner.invoke(app, ["predict", "-w", str(ws.root), "--budget-ms", "200", "--out", str(tmp_path / "x.csv")])
    assert both.exit_code == 1 and "exactly one of --run" in both.stderr


def train_small_run(ws: Workspace, run_id: str, epochs: int = 1) -> None:
    """A quick offline run through the CLI (one split, no fallback) that must succeed."""
    result = runner.invoke(app, ["train", "--offline", "-w", str(ws.root), "--num-epochs", str(epochs),
                                 "--cross-fit-folds", "0", "--run-id", run_id, "--no-table-fallback"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("run_id", ["../../escaped", "/tmp/ctrl-absolute-run", ".hidden", "a/b", "latest", "x" * 129])
def test_run_ids_that_would_leave_runs_are_refused(ws, tmp_path, run_id):
    before = sorted(p.name for p in ws.runs_dir.iterdir()) if ws.runs_dir.exists() else []
    result = runner.invoke(app, ["train", "--offline", "-w", str(ws.root), "--num-epochs", "1",
                                 "--cross-fit-folds", "0", "--run-id", run_id])
    assert result.exit_code == 1
    assert result.stderr.strip().startswith(f"error: run id {run_id!r} is not allowed")
    assert len(result.stderr.strip().splitlines()) == 1
    assert (sorted(p.name for p in ws.runs_dir.iterdir()) if ws.runs_dir.exists() else []) == before
    assert not (ws.root.parent.parent / "escaped").exists() and not (ws.root / "escaped").exists()


def test_an_existing_run_is_never_overwritten_and_resume_keeps_its_epochs(ws):
    w = str(ws.root)
    train_small_run(ws, "kept", epochs=2)
    run = ws.runs_dir / "kept"
    saved = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    again = runner.invoke(app, ["train", "--offline", "-w", w, "--num-epochs", "1", "--cross-fit-folds", "0",
                                "--run-id", "kept"])
    assert again.exit_code == 1 and "run kept already exists" in again.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == saved
    # --resume without --num-epochs keeps the run's 2 epochs (not the option's default of 30)
    resumed = runner.invoke(app, ["train", "--offline", "-w", w, "--resume", "kept"])
    assert resumed.exit_code == 0, resumed.output
    row = pl.read_parquet(run / "run.parquet").row(0, named=True)
    assert (row["num_epochs"], row["epochs_done"], row["status"]) == (2, 2, "completed")
    longer = runner.invoke(app, ["train", "--offline", "-w", w, "--resume", "kept", "--num-epochs", "3"])
    assert longer.exit_code == 0, longer.output
    row = pl.read_parquet(run / "run.parquet").row(0, named=True)
    assert (row["num_epochs"], row["epochs_done"]) == (3, 3)


def test_resume_applies_the_options_a_run_may_change_and_refuses_the_others(ws):
    w = str(ws.root)
    train_small_run(ws, "opts")
    run = ws.runs_dir / "opts"
    changed = runner.invoke(app, ["train", "--offline", "-w", w, "--resume", "opts", "--lr", "0.5"])
    assert changed.exit_code == 1
    lines = changed.stderr.strip().splitlines()
    assert lines[0] == ("error: --lr cannot change when resuming run opts (it trained with 0.001, given 0.5); a "
                        "resumed run may change only --num-epochs, --report-to")
    assert lines[1].startswith("Hint:") and len(lines) == 2
    same = runner.invoke(app, ["train", "--offline", "-w", w, "--resume", "opts", "--lr", "0.001",
                               "--cross-fit-folds", "0", "--num-epochs", "2"])
    assert same.exit_code == 0, same.output  # options equal to the run's are accepted; --num-epochs applies
    row = pl.read_parquet(run / "run.parquet").row(0, named=True)
    assert (row["num_epochs"], row["epochs_done"]) == (2, 2)
    online = runner.invoke(app, ["train", "--online", "-w", w, "--resume", "opts"])
    assert online.exit_code == 1 and online.stderr.startswith(
        "error: --resume opts: an offline run, resumed with `ctrl train --offline --resume`")


def test_predict_never_writes_over_the_workspaces_files(ws):
    w = str(ws.root)
    train_small_run(ws, "for-predict")
    table = ws.require_generation() / "measurements.parquet"
    targets = [table, ws.catalog_path, ws.runs_dir / "for-predict" / "new.parquet", ws.features_dir / "x.csv"]
    before = {p: p.read_bytes() for p in targets if p.exists()}
    for target in targets:
        result = runner.invoke(app, ["predict", "--run", "for-predict", "-w", w, "--budget-ms", "200",
                                     "--out", str(target)])
        assert result.exit_code == 1, result.output
        assert result.stderr.startswith(f"error: {target}: refusing to write the predictions over the workspace")
    assert {p: p.read_bytes() for p in targets if p.exists()} == before
    assert not (ws.runs_dir / "for-predict" / "new.parquet").exists() and not (ws.features_dir / "x.csv").exists()
    # a new file at the workspace root is not one of its files
    beside = ws.root / "decisions.parquet"
    ok = runner.invoke(app, ["predict", "--run", "for-predict", "-w", w, "--budget-ms", "200", "--out", str(beside)])
    assert ok.exit_code == 0, ok.output
    assert pl.read_parquet(beside).height == 60


def test_a_damaged_run_gives_one_line_naming_the_file(ws):
    w = str(ws.root)
    train_small_run(ws, "damaged")
    run = ws.runs_dir / "damaged"
    (run / "checkpoints" / "last.pt").write_bytes(b"\x00garbage" * 100)
    resumed = runner.invoke(app, ["train", "--offline", "-w", w, "--resume", "damaged", "--num-epochs", "2"])
    assert resumed.exit_code == 1
    lines = resumed.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: {run / 'checkpoints' / 'last.pt'}: cannot read the checkpoint")
    assert "Traceback" not in resumed.stderr and len(lines) == 2 and lines[1].startswith("Hint:")
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "num_epochs": "many"}))
    bad_config = runner.invoke(app, ["train", "--offline", "-w", w, "--resume", "damaged"])
    assert bad_config.exit_code == 1 and "Traceback" not in bad_config.stderr
    assert bad_config.stderr.startswith(f"error: {run / 'config.json'}: not a valid offline run config")


@pytest.fixture(scope="module")
def unlabelled_ws(tmp_path_factory, embedded_runtime):
    """Two datasets whose question families show only in the question's words (no family labels)."""
    from synthetic import SyntheticSpec

    spec = SyntheticSpec(datasets=("text_vqa", "okvqa"), num_samples=150, write_family=False)
    return build_feature_workspace(tmp_path_factory.mktemp("cli-unlabelled"), embedded_runtime, spec)[1]


def test_without_family_labels_the_questions_are_clustered(unlabelled_ws):
    from trainer.fallback import read_fallback

    w = str(unlabelled_ws.root)
    trained = runner.invoke(app, ["train", "--offline", "-w", w, "--num-epochs", "1", "--run-id", "clusters",
                                  "--cross-fit-folds", "2", "--hidden-dim", "32"], catch_exceptions=False)
    assert trained.exit_code == 0, trained.output
    fallback = read_fallback(unlabelled_ws.runs_dir / "clusters" / "checkpoints" / "best.pt")
    table = fallback.lookup_table()
    # "auto" without labels: the cluster table, its clusters named by their questions' leading words
    assert table.name == "lut_by_cluster" and len(table.families) >= 2
    assert all(name.endswith("...") or "... #" in name for name in table.families)
    run = unlabelled_ws.runs_dir / "clusters"
    deciders = set(pl.read_parquet(run / "evaluation.parquet")["decider"])
    assert {"lut_by_cluster", "best_static", "lut_p95"} <= deciders and "lut_by_family" not in deciders
    groups = pl.read_parquet(run / "evaluation_groups.parquet")
    assert set(groups["group_by"]) == {"dataset", "cluster"}
    assert set(groups.filter(pl.col("group_by") == "cluster")["group"]) <= set(table.families)
    shown = runner.invoke(app, ["evaluate", "clusters", "-w", w, "--by", "cluster"])
    assert shown.exit_code == 0, shown.output
    assert "per cluster: accuracy" in shown.stdout
