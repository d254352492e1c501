"""Fault injection: bad files, special files and odd paths end in one recorded error per file
(or the right result), never a traceback, a hang or a lost table."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import run_ingest, shard
from origin_files import exp6_config_doc, exp6_name, write
from pipeline import QueryError, Workspace, run_query
from small_disk import on_small_disk, small_disk_available

EXP6 = Path("exp6") / "exp6_latency_coco-2014-vqa"


def clean_counts(tree: Path, tmp_path: Path) -> dict:
    ws = Workspace(tmp_path / "clean")
    report = run_ingest([tree], ws)
    assert not report.errors
    return run_query(ws, "SELECT (SELECT count(*) FROM measurements) AS m, (SELECT count(*) FROM samples) AS s"
                     ).to_pylist()[0]


def bad_copy(tree: Path, name: str, edit) -> Path:
    """A merged exp6 file for a configuration the tree lacks (4/4/12), edited by ``edit`` (a doc -> doc
    function, or the raw text to write)."""
    doc = exp6_config_doc(4, 4, 12, shard(0) + shard(1), merged=True)
    path = tree / "bad" / name
    edited = edit(doc) if callable(edit) else edit
    if not isinstance(edited, str):
        write(path, edited)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(edited)
    return path


def set_world_size(doc: dict) -> dict:
    doc["config"]["world_size"] = 10**12
    return doc


def set_num_samples(doc: dict) -> dict:
    doc["summary"][0]["num_samples"] = 10**12
    return doc


def second_config(doc: dict) -> str:
    """The file names ``config`` twice; a last-wins parser would take the second, other, world size."""
    return json.dumps(doc)[:-1] + ', "config": {"world_size": 3}}'


def repeated_pred(doc: dict) -> str:
    return json.dumps(doc).replace('"pred": ', '"pred": "a: b", "pred": ', 1)


def lone_surrogate_pred(doc: dict) -> str:
    doc["per_sample_predictions"][0]["pred"] = "SURROGATE"
    return json.dumps(doc).replace("SURROGATE", "\\ud800")


@pytest.mark.parametrize(("case", "edit", "reason"), [
    ("world_size", set_world_size, "config.world_size: 1000000000000 is outside 1..65536"),
    ("num_samples", set_num_samples, "summary[0].num_samples: 1000000000000 is outside 0..2147483647"),
    ("surrogate", lone_surrogate_pred, "cannot parse"),
    ("second config", second_config, "duplicate key 'config': an object names it twice"),
    ("repeated pred", repeated_pred, "duplicate key 'pred'"),
    ("deep", "[" * 100_000 + "]" * 100_000, ""),
])
def test_one_bad_file_is_recorded_and_the_rest_ingested(small_tree, tmp_path, case, edit, reason):
    expected = clean_counts(small_tree, tmp_path)
    bad = bad_copy(small_tree, exp6_name(4, 4, 12), edit)
    ws = Workspace(tmp_path / "ws")
    report = run_ingest([small_tree], ws)
    assert [Path(f.path).name for f in report.errors] == [bad.name], report.errors
    assert report.errors[0].error.startswith(f"{bad.name}: ") and reason in report.errors[0].error
    assert "\n" not in report.errors[0].error
    assert report.changed
    counts = run_query(ws, "SELECT (SELECT count(*) FROM measurements) AS m, (SELECT count(*) FROM samples) AS s"
                       ).to_pylist()[0]
    assert counts == expected
    recorded = run_query(ws, f"SELECT status FROM files WHERE path = '{bad}'").to_pylist()
    assert recorded == [{"status": "error"}]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_special_files_are_refused_not_read(small_tree, tmp_path):
    fifo = tmp_path / "results.json"
    os.mkfifo(fifo)  # opening it for reading would block forever
    report = run_ingest([small_tree, fifo, Path("/dev/zero")], Workspace(tmp_path / "ws"))
    errors = {Path(f.path).name: f.error for f in report.errors}
    assert errors == {"results.json": "results.json: not a regular file (a FIFO)",
                      "zero": "zero: not a regular file (a character device)"}
    assert report.changed and len([f for f in report.files if f.status == "ok"]) == 9


def test_a_file_name_that_is_not_utf8_does_not_stop_the_ingest(small_tree, tmp_path):
    expected = clean_counts(small_tree, tmp_path)
    odd = os.fsencode(small_tree / "bad") + b"/results-\xff.json"
    os.makedirs(os.fsencode(small_tree / "bad"), exist_ok=True)
    with open(odd, "wb") as fh:
        fh.write(b"{}")
    ws = Workspace(tmp_path / "ws")
    report = run_ingest([small_tree], ws)
    assert not report.errors
    skipped = [f for f in report.files if f.status == "skipped"]
    assert [Path(f.path).name for f in skipped] == ["results-\\xff.json"]
    assert run_query(ws, "SELECT count(*) AS m FROM measurements").to_pylist()[0]["m"] == expected["m"]
    # and the next ingest of the same tree finds nothing changed
    again = run_ingest([small_tree], ws)
    assert not again.changed and {f.status for f in again.files} == {"unchanged", "skipped"}


def test_a_directory_symlink_inside_a_tree_is_followed_once(small_tree, tmp_path):
    outside = tmp_path / "elsewhere"
    shutil.move(small_tree / "exp6", outside)
    (small_tree / "exp6").symlink_to(outside, target_is_directory=True)
    (outside / "loop").symlink_to(small_tree, target_is_directory=True)  # a cycle back to the root
    report = run_ingest([small_tree], Workspace(tmp_path / "ws"))
    names = sorted(Path(f.path).name for f in report.files)
    assert len(names) == 9 and len(set(names)) == 9  # 4 exp6 files through the link, each once
    assert sum(1 for n in names if n.startswith("exp6_")) == 4 and not report.errors


def set_latency(value: float):
    def edit(doc: dict) -> dict:
        doc["per_sample_latencies"][2]["T_total_ms"] = value
        return doc
    return edit


def set_times(total: float, decode: float):
    def edit(doc: dict) -> dict:
        doc["per_sample_latencies"][2].update(T_total_ms=total, T_decode_ms=decode)
        return doc
    return edit


def set_rank(rank: int, world_size: int):
    def edit(doc: dict) -> dict:
        doc["config"].update(rank=rank, world_size=world_size)
        return doc
    return edit


def set_score(value: float):
    def edit(doc: dict) -> dict:
        doc["per_sample_predictions"][1]["score"] = value
        return doc
    return edit


def set_blocks(blocks: list[int]):
    def edit(doc: dict) -> dict:
        doc["config"]["active_block_indices"] = blocks
        return doc
    return edit


def set_split(value):
    def edit(doc: dict) -> dict:
        doc["config"]["split"] = value
        return doc
    return edit


@pytest.mark.parametrize(("edit", "error"), [
    (set_latency(-50.0), "per_sample_latencies[2].T_total_ms: -50.0 is outside [0.0, 3600000.0]"),
    (set_latency(1e308), "per_sample_latencies[2].T_total_ms: 1e+308 is outside [0.0, 3600000.0]"),
    (set_latency(float("inf")), "per_sample_latencies[2].T_total_ms: inf is outside [0.0, 3600000.0]"),
    (set_score(-3), "per_sample_predictions[1].score: -3.0 is outside [0.0, 1.0]"),
    (set_score(7), "per_sample_predictions[1].score: 7.0 is outside [0.0, 1.0]"),
    (set_blocks([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 99]),
     "config.active_block_indices: block 99 is outside 0..15 (num_total_blocks)"),
    (set_blocks([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10]), "config.active_block_indices: block 10 is listed twice"),
    (set_split(7), "config.split: expected a string, got 7"),
    (set_times(27.0, 5000.0), "per_sample_latencies[2].T_decode_ms: 5000.0 ms is longer than the request's "
                              "T_total_ms 27.0 ms"),
    (set_times(0.0, 21.0), "per_sample_latencies[2].T_decode_ms: 21.0 ms is longer than the request's "
                           "T_total_ms 0.0 ms"),
    (set_rank(5, 2), "config.rank: rank 5 does not exist in a world of 2"),
])
def test_values_that_cannot_be_true_fail_their_file_naming_the_field(small_tree, tmp_path, edit, error):
    bad = bad_copy(small_tree, exp6_name(4, 4, 12), edit)
    report = run_ingest([small_tree], Workspace(tmp_path / "ws"))
    assert [(Path(f.path).name, f.error) for f in report.errors] == [(bad.name, f"{bad.name}: {error}")]
    assert len([f for f in report.files if f.status == "ok"]) == 9


def test_an_image_declaring_a_huge_size_is_unreadable_not_a_crash(tmp_path):
    import struct
    import zlib

    from runtime.images import open_image

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", 40000, 40000, 8, 2, 0, 0, 0)  # 1.6 G pixels, RGB
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b""))
    assert bomb.stat().st_size < 100
    assert open_image(bomb) is None


# -- damage that the next ingest repairs ---------------------------------------------------------

def _gen(ws: Workspace) -> Path:
    return ws.tables_dir / (ws.root / "CURRENT").read_text().strip()


def scribble_table(ws: Workspace) -> None:
    path = _gen(ws) / "measurements.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = os.urandom(64)
    data[-12:] = b"\x00" * 12  # and the footer
    path.write_bytes(bytes(data))


def delete_table(ws: Workspace) -> None:
    (_gen(ws) / "configs.parquet").unlink()


def truncate_manifest(ws: Workspace) -> None:
    path = _gen(ws) / "files.parquet"
    path.write_bytes(path.read_bytes()[:100])


def bad_state(ws: Workspace) -> None:
    (_gen(ws) / "state.json").write_text("{not json")


def current_names_a_missing_generation(ws: Workspace) -> None:
    (ws.root / "CURRENT").write_text("gen-000099\n")


def empty_current(ws: Workspace) -> None:
    (ws.root / "CURRENT").write_text("")


def escaping_current(ws: Workspace) -> None:
    (ws.root / "CURRENT").write_text("../../..\n")


def delete_a_fragment(ws: Workspace) -> None:
    next(ws.fragments_dir.rglob("*.measurements.arrow")).unlink()


def garbage_catalog(ws: Workspace) -> None:
    ws.catalog_path.write_bytes(b"garbage" * 100)


def delete_catalog(ws: Workspace) -> None:
    ws.catalog_path.unlink()


def directory_for_catalog(ws: Workspace) -> None:
    ws.catalog_path.unlink()
    ws.catalog_path.mkdir()
    (ws.catalog_path / "notes.txt").write_text("someone's file")


@pytest.mark.parametrize("damage", [scribble_table, delete_table, truncate_manifest, bad_state,
                                    current_names_a_missing_generation, empty_current, escaping_current,
                                    delete_a_fragment, garbage_catalog, delete_catalog, directory_for_catalog])
def test_damage_is_reported_and_the_next_ingest_repairs_it(small_tree, tmp_path, damage):
    from pipeline.health import check_workspace

    ws = Workspace(tmp_path / "ws")
    assert not run_ingest([small_tree], ws).errors
    query = ("SELECT (SELECT count(*) FROM measurements) AS m, (SELECT count(*) FROM samples) AS s, "
             "(SELECT count(*) FROM configs) AS c, (SELECT count(*) FROM files) AS f")
    expected = run_query(ws, query).to_pylist()
    assert check_workspace(ws) == []
    damage(ws)
    problems = check_workspace(ws)
    assert len(problems) >= 1 and all(p.repair.startswith("ctrl ingest") for p in problems), problems
    report = run_ingest([small_tree], ws)
    assert report.repaired and not report.errors
    assert check_workspace(ws) == []
    assert run_query(ws, query).to_pylist() == expected
    # the catalog file agrees too
    import duckdb

    con = duckdb.connect(str(ws.catalog_path), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM measurements").fetchone()[0] == expected[0]["m"]
    finally:
        con.close()
    # and new files can still be added
    write(small_tree / "more" / exp6_name(4, 4, 12), exp6_config_doc(4, 4, 12, shard(0) + shard(1), merged=True))
    more = run_ingest([small_tree], ws)
    assert more.changed and not more.errors and not more.repaired
    # nothing ctrl did not write is deleted, and no temporary file is left
    assert sorted(p.name for p in ws.root.iterdir() if p.name.startswith(("ctrl.duckdb", ".ctrl"))) == (
        ["ctrl.duckdb", "ctrl.duckdb.not-a-catalog"] if damage is directory_for_catalog else ["ctrl.duckdb"])
    if damage is directory_for_catalog:
        assert (ws.root / "ctrl.duckdb.not-a-catalog" / "notes.txt").read_text() == "someone's file"


def test_a_catalog_left_on_the_old_generation_is_rebuilt(small_tree, tmp_path):
    ws = Workspace(tmp_path / "ws")
    run_ingest([small_tree], ws)
    old_catalog = ws.catalog_path.read_bytes()
    write(small_tree / "more" / exp6_name(4, 4, 12), exp6_config_doc(4, 4, 12, shard(0) + shard(1), merged=True))
    run_ingest([small_tree], ws)
    ws.catalog_path.write_bytes(old_catalog)  # as if killed between the generation swap and the catalog rewrite
    from pipeline.health import catalog_problem

    assert catalog_problem(ws).startswith("describes gen-000001, CURRENT is gen-000002")
    report = run_ingest([small_tree], ws)
    assert not report.changed and len(report.repaired) == 1 and catalog_problem(ws) is None


def test_doctor_names_a_damaged_feature_chunk_and_exits_1(small_tree, tmp_path):
    from typer.testing import CliRunner

    from cli import app

    ws = Workspace(tmp_path / "ws")
    run_ingest([small_tree], ws)
    runner = CliRunner()
    clean = runner.invoke(app, ["doctor", "-w", str(ws.root)])
    assert clean.exit_code == 0 and "check out" in clean.stdout
    chunk = ws.features_dir / "0123456789abcdef" / "chunk-00000"
    chunk.mkdir(parents=True)
    (chunk / "lang_features.parquet").write_bytes(b"not parquet")
    result = runner.invoke(app, ["doctor", "-w", str(ws.root)])
    assert result.exit_code == 1
    assert f"damaged: {chunk}: image_features.parquet is missing (repair: ctrl extract-features" in result.stderr


def _processes_with(tag: str) -> list[int]:
    """Pids whose environment carries ``tag`` (the processes a test started, and their children)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if tag.encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def _command_line(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "(ended)"


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_a_killed_ingest_leaves_no_parser_processes(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    import uuid

    from synthetic import SyntheticSpec, generate_tree

    tree = generate_tree(SyntheticSpec(num_samples=600), tmp_path / "tree")
    tag = f"CTRL_FAULT_TAG={uuid.uuid4().hex}"
    env = {**os.environ, tag.split("=")[0]: tag.split("=")[1]}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "ingest", str(tree.exp5_dir), str(tree.exp6_dir),
                             "-w", str(tmp_path / "ws"), "--num-workers", "2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + 60
    # ingest, its resource tracker, the forkserver and two parser workers
    while len(_processes_with(tag)) < 5 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    # no pause: killed while the workers still import, before any code of theirs could arm itself
    assert proc.poll() is None and len(_processes_with(tag)) >= 5, "ingest finished before the workers started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while _processes_with(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: _command_line(pid) for pid in _processes_with(tag)}
    assert left == {}


def test_a_full_disk_during_ingest_frees_the_new_parse_cache_and_keeps_the_tables(small_tree, tmp_path, monkeypatch):
    import errno

    import pipeline.ingestion as ingestion

    ws = Workspace(tmp_path / "ws")
    run_ingest([small_tree], ws)
    before = run_query(ws, "SELECT count(*) AS m FROM measurements").to_pylist()
    cached = sorted(p.name for p in ws.fragments_dir.rglob("*") if p.is_file())
    write(small_tree / "more" / exp6_name(4, 4, 12), exp6_config_doc(4, 4, 12, shard(0) + shard(1), merged=True))

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(ws.tables_dir / ".tmp-x"))

    monkeypatch.setattr(ingestion, "build_tables", full)
    with pytest.raises(OSError, match="No space left"):
        run_ingest([small_tree], ws)
    # the new file's parse was cached before the build failed: it is freed, the live tables stay
    assert sorted(p.name for p in ws.fragments_dir.rglob("*") if p.is_file()) == cached
    assert run_query(ws, "SELECT count(*) AS m FROM measurements").to_pylist() == before
    monkeypatch.undo()
    assert run_ingest([small_tree], ws).changed


@pytest.mark.parametrize(("content", "shown"), [("", "''"), ("../../..", "'../../..'")])
def test_a_current_that_names_no_generation_is_one_line(small_tree, tmp_path, content, shown):
    from pipeline.errors import WorkspaceError

    ws = Workspace(tmp_path / "ws")
    assert not run_ingest([small_tree], ws).errors
    (ws.root / "CURRENT").write_text(content)
    with pytest.raises(WorkspaceError, match=rf"CURRENT does not name a generation \(gen-NNNNNN\), it holds {shown}"):
        run_query(ws, "SELECT count(*) FROM measurements")


def test_a_workspace_inside_the_input_tree_is_never_ingested(small_tree, tmp_path):
    expected = clean_counts(small_tree, tmp_path)
    ws = Workspace(small_tree / "workspace")  # `ctrl ingest .` run from the results directory
    first = run_ingest([small_tree], ws)
    assert not first.errors and first.changed
    (ws.root / "stray.json").write_text("{}")  # a JSON file of the workspace's own is not input either
    again = run_ingest([small_tree], ws)
    assert not again.errors and not again.changed  # settled: the second run finds nothing new
    assert run_query(ws, "SELECT (SELECT count(*) FROM measurements) AS m, (SELECT count(*) FROM samples) AS s"
                     ).to_pylist()[0] == expected
    paths = run_query(ws, "SELECT path FROM files").column("path").to_pylist()
    assert paths and not any(p.startswith(str(ws.root.resolve())) for p in paths)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_special_entries_inside_a_directory_are_bad_files_not_skipped(small_tree, tmp_path):
    odd = small_tree / "odd"
    odd.mkdir()
    os.mkfifo(odd / "fifo.json")
    (odd / "zero.json").symlink_to("/dev/zero")
    (odd / "gone.json").symlink_to(tmp_path / "nowhere.json")
    locked = odd / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        report = run_ingest([small_tree], Workspace(tmp_path / "ws"))
    finally:
        locked.chmod(0o755)
    errors = {Path(f.path).name: f.error for f in report.errors}
    assert errors["fifo.json"] == "fifo.json: not a regular file (a FIFO)"
    assert errors["zero.json"] == "zero.json: not a regular file (a character device)"
    assert errors["gone.json"] == "gone.json: cannot read: No such file or directory"
    if os.geteuid() != 0:  # root lists any directory
        assert errors["locked"] == "locked: not a regular file (a directory that cannot be listed: Permission denied)"
    assert len([f for f in report.files if f.status == "ok"]) == 9


def _scribble(path: Path, at: int = 64) -> None:
    """Same size, other bytes: what bit rot or a same-size edit leaves."""
    data = bytearray(path.read_bytes())
    for i in range(at, min(len(data) - 16, at + 64)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_same_size_edit_of_a_table_or_a_cached_parse_is_found_by_its_checksum(small_tree, tmp_path):
    from pipeline.health import check_workspace

    ws = Workspace(tmp_path / "ws")
    assert not run_ingest([small_tree], ws).errors
    expected = run_query(ws, "SELECT count(*) AS n, sum(latency_total_ms) AS s FROM measurements").to_pylist()
    table = ws.require_generation() / "measurements.parquet"
    _scribble(table, at=len(table.read_bytes()) // 3)
    problems = check_workspace(ws)
    assert [(p.path, p.problem) for p in problems] == [
        (table, "content differs from what its ingest wrote (SHA-256)")]
    with pytest.raises(QueryError,
                       match=r"content differs from what its ingest wrote \(SHA-256\)\nHint: `ctrl doctor`"):
        run_query(ws, "SELECT count(*) FROM measurements")
    report = run_ingest([small_tree], ws)
    assert report.repaired and not report.errors
    fragment = next(ws.fragments_dir.rglob("*.measurements.arrow"))
    _scribble(fragment, at=len(fragment.read_bytes()) // 2)
    problems = check_workspace(ws)
    assert len(problems) == 1 and "differs from what was written (SHA-256)" in problems[0].problem
    assert run_ingest([small_tree], ws).repaired  # parsed again from the input, not carried into the tables
    assert check_workspace(ws) == []
    assert run_query(ws, "SELECT count(*) AS n, sum(latency_total_ms) AS s FROM measurements").to_pylist() == expected


def test_a_damaged_run_file_leaves_that_run_out_of_the_views_not_the_others(small_tree, tmp_path):
    from pipeline.health import check_workspace
    from pipeline.schema import METRICS
    from trainer.runs import write_table_atomic

    ws = Workspace(tmp_path / "ws")
    assert not run_ingest([small_tree], ws).errors
    for run in ("good", "bad"):
        rows = [{"run_id": run, "kind": "step", "step": s, "epoch": 1, "loss": 0.5 / s} for s in range(1, 200)]
        write_table_atomic(rows, METRICS, ws.runs_dir / run / "metrics.parquet")
    assert run_query(ws, "SELECT run_id, count(*) AS n FROM metrics GROUP BY 1 ORDER BY 1").to_pylist() == [
        {"run_id": "bad", "n": 199}, {"run_id": "good", "n": 199}]
    damaged = ws.runs_dir / "bad" / "metrics.parquet"
    _scribble(damaged, at=len(damaged.read_bytes()) // 3)
    assert run_query(ws, "SELECT run_id, count(*) AS n FROM metrics GROUP BY 1").to_pylist() == [
        {"run_id": "good", "n": 199}]
    problems = check_workspace(ws)
    assert [(p.path, p.problem) for p in problems] == [
        (ws.runs_dir / "bad", "metrics.parquet differs from what was written (SHA-256)")]


def test_a_garbage_rollout_file_leaves_the_measurements_and_every_other_view_readable(small_tree, tmp_path):
    ws = Workspace(tmp_path / "ws")
    assert not run_ingest([small_tree], ws).errors
    expected = run_query(ws, "SELECT count(*) AS n FROM measurements").to_pylist()
    garbage = ws.runs_dir / "r1" / "rollouts" / "step-000001.parquet"
    garbage.parent.mkdir(parents=True)
    garbage.write_bytes(os.urandom(4096))
    assert run_query(ws, "SELECT count(*) AS n FROM measurements").to_pylist() == expected
    assert run_query(ws, "SELECT count(*) AS n FROM samples").to_pylist()[0]["n"] > 0


def test_an_oversized_file_is_refused_before_it_is_read(small_tree, tmp_path, monkeypatch):
    import pipeline.ingestion as ingestion

    limit = max(f.stat().st_size for f in small_tree.rglob("*.json")) + 1  # the real limit is 1 GiB
    monkeypatch.setattr(ingestion, "MAX_INPUT_BYTES", limit)
    padded = small_tree / "bad" / "padded.json"
    padded.parent.mkdir(parents=True, exist_ok=True)
    with open(padded, "wb") as fh:  # sparse: spaces would do the same
        fh.write(b"{}")
        fh.truncate(limit + 4096)
    report = run_ingest([small_tree], Workspace(tmp_path / "ws"), num_workers=1)
    errors = {Path(f.path).name: f.error for f in report.errors}
    assert errors == {"padded.json": f"padded.json: {limit + 4096:,} bytes, more than an input file may have "
                                     f"({limit:,}); not read"}
    assert len([f for f in report.files if f.status == "ok"]) == 9


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Linux /proc)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_parser_process_killed_mid_ingest_fails_no_run(small_tree, tmp_path):
    import signal
    import threading
    import time

    big = small_tree / "big"
    for i in range(6):  # slow enough to parse that workers are busy when they are killed
        write(big / f"a{i}" / exp6_name(4, 4, 12), exp6_config_doc(4, 4, 12, shard(0) * 400 + shard(1) * 400,
                                                                   merged=True))
    outcome = {}

    def ingest() -> None:
        try:
            outcome["report"] = run_ingest([small_tree], Workspace(tmp_path / "ws"), num_workers=2)
        except BaseException as err:  # handed to the assertion below
            outcome["error"] = err

    ingest_thread = threading.Thread(target=ingest, daemon=True)
    ingest_thread.start()
    killed = 0
    deadline = time.monotonic() + 60
    while ingest_thread.is_alive() and time.monotonic() < deadline and not killed:
        servers = [p for p in _descendants(os.getpid())
                   if b"forkserver" in _cmdline(p)]
        workers = [w for server in servers for w in _descendants(server)]  # forked by the server: the parsers
        for pid in workers[:1]:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        time.sleep(0.05)
    ingest_thread.join(timeout=120)
    assert not ingest_thread.is_alive() and killed == 1
    assert "error" not in outcome, outcome.get("error")
    report = outcome["report"]
    assert all(f.status == "ok" for f in report.files), [f.error for f in report.errors]
    assert len(report.files) == 15


def test_a_submit_racing_a_broken_pool_is_retried_like_a_dead_parser(small_tree, tmp_path, monkeypatch):
    """CPython's executor can answer a submit racing a worker's death with an OSError (EBADF) instead of
    BrokenProcessPool: ingestion retries the unfinished files as it does after a death, and still raises an
    OSError from a pool that is not broken."""
    import errno
    from concurrent.futures import ProcessPoolExecutor

    import pipeline.ingestion as ingestion

    def racing(fail_when_broken: bool):
        class RacingPool(ProcessPoolExecutor):
            submits = 0

            def submit(self, *args, **kwargs):
                type(self).submits += 1
                if type(self).submits == 3:  # the third submit meets the pool breaking under it
                    if fail_when_broken:
                        self._broken = "a child process terminated abruptly"
                    raise OSError(errno.EBADF, "Bad file descriptor")
                return super().submit(*args, **kwargs)
        return RacingPool

    monkeypatch.setattr(ingestion, "ProcessPoolExecutor", racing(True))
    report = run_ingest([small_tree], Workspace(tmp_path / "ws"), num_workers=2)
    assert all(f.status == "ok" for f in report.files), [f.error for f in report.errors]
    assert len(report.files) == 9
    monkeypatch.setattr(ingestion, "ProcessPoolExecutor", racing(False))
    with pytest.raises(OSError, match="Bad file descriptor"):
        run_ingest([small_tree], Workspace(tmp_path / "ws2"), num_workers=2)


def test_a_file_name_with_control_characters_is_escaped_in_every_message(small_tree, tmp_path):
    from typer.testing import CliRunner

    from cli import app

    odd = small_tree / "bad" / "two\nlines\t.json"
    odd.parent.mkdir(parents=True, exist_ok=True)
    odd.write_text("{not json")
    report = run_ingest([small_tree], Workspace(tmp_path / "ws"))
    [error] = report.errors
    assert error.path.endswith("two\\x0alines\\x09.json") and "\n" not in error.error
    assert error.error.startswith("two\\x0alines\\x09.json: invalid JSON")
    result = CliRunner().invoke(app, ["ingest", str(small_tree), "-w", str(tmp_path / "ws2")])
    bad_lines = [line for line in result.stderr.splitlines() if "two" in line]
    assert len(bad_lines) == 1 and "two\\x0alines\\x09.json" in bad_lines[0]


@pytest.mark.skipif(not small_disk_available(), reason="cannot mount a tmpfs in a private namespace here")
def test_a_real_full_disk_during_ingest_is_one_line_naming_the_file_and_the_next_run_resumes(small_tree, tmp_path):
    ws = tmp_path / "ws"
    ingest = f"$CTRL ingest {small_tree} -w {ws}"
    full, left, _, again, doctor = on_small_disk(ws, "16k", [
        ingest, f"find {ws} -type f", "grow 16m", ingest, f"$CTRL doctor -w {ws}"])
    lines = full.splitlines()
    assert lines[-1] == "exit 1" and "Traceback" not in full, full
    assert re.fullmatch(rf"error: {re.escape(str(ws))}/\S+: No space left on device", lines[0]), full
    assert lines[1].startswith("Hint: free space or fix permissions, then: run the command again")
    assert not [p for p in left.splitlines()[:-1] if ".tmp" in p or Path(p).name.startswith(".") and
                Path(p).name != ".lock"], left
    assert again.splitlines()[-1] == "exit 0" and "ingested 9 files (9 ok)" in again, again
    assert doctor.splitlines()[-1] == "exit 0", doctor
