"""data/generate.py: the shipped sample data is the committed profile archive of the trained
testbed, unpacked next to its regenerated images, and `ctrl ingest` reads it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import run_ingest
from pipeline import Workspace, run_query

SCRIPT = Path(__file__).resolve().parents[1] / "data" / "generate.py"


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location("data_generate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sample_data_is_stamped_and_ingests(generate, tmp_path, capsys):
    out = tmp_path / "data"
    assert generate.main(["--out", str(out)]) == 0
    assert "testbed samples and their profile" in capsys.readouterr().out
    before = {p: p.stat().st_mtime_ns for p in (out / "exp6").rglob("*.json")}
    assert generate.main(["--out", str(out)]) == 0
    assert "up to date" in capsys.readouterr().out
    assert before == {p: p.stat().st_mtime_ns for p in (out / "exp6").rglob("*.json")}
    assert not list(out.glob(".unpack*"))
    assert len((out / ".generated").read_text().strip()) == 64  # sha256 of archive and generator

    archive = pq.read_table(generate.ARCHIVE)
    dataset = json.loads((out / "testbed" / "dataset.json").read_text())
    images = {p.stem for p in (out / "testbed" / "images").iterdir()}
    assert len(dataset["samples"]) == generate.NUM_SAMPLES and {s["image_id"] for s in dataset["samples"]} <= images

    ws = Workspace(tmp_path / "ws")
    report = run_ingest([out / "exp5", out / "exp6"], ws)
    assert report.exit_code == 0 and not report.errors
    counts = run_query(ws, "SELECT experiment, count(*) AS n, count(DISTINCT sample_key) AS samples "
                           "FROM measurements GROUP BY 1 ORDER BY 1").to_pylist()
    profiled = len(set(archive.column("lat:dataset_index").to_pylist()))
    assert counts == [{"experiment": e, "n": archive.num_rows, "samples": profiled} for e in ("exp5", "exp6")]
    # the profiled questions are the regenerated ones: same ids, questions and answers
    rows = run_query(ws, "SELECT example_id, question, answers FROM samples ORDER BY example_id").to_pylist()
    by_id = {s["example_id"]: s for s in dataset["samples"]}
    assert rows and all(by_id[r["example_id"]]["question"] == r["question"] for r in rows)
    assert all(list(by_id[r["example_id"]]["answers"]) == list(r["answers"]) for r in rows)


def test_synthetic_tree_option(generate, tmp_path, capsys):
    out = tmp_path / "synthetic"
    assert generate.main(["--out", str(out), "--synthetic"]) == 0
    assert "synthetic tree" in capsys.readouterr().out
    assert generate.main(["--out", str(out), "--synthetic"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} >= {"exp5", "exp6", "images", ".generated"}


def test_the_stamp_check_of_both_generators(generate, tmp_path):
    """Up to date only with every directory there and the stamp naming this fingerprint: another
    archive or generator (a stale stamp), a crash before the stamp, or a directory gone regenerate."""
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    assert not generate._up_to_date(tmp_path, ("a", "b"), "f00d")  # no stamp yet
    (tmp_path / ".generated").write_text("f00d\n")
    assert generate._up_to_date(tmp_path, ("a", "b"), "f00d")
    assert not generate._up_to_date(tmp_path, ("a", "b"), "beef")
    assert not generate._up_to_date(tmp_path, ("a", "b", "c"), "f00d")
