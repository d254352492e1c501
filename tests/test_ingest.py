"""ctrl ingest end to end on small trees: which copy wins, idempotency, incremental updates,
bad files, --strict, interruption and the workspace lock."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from conftest import CONFIGS, NUM_SAMPLES, run_ingest, shard
from origin_files import exp5_config_doc, exp5_final_doc, exp5_name, exp6_config_doc, exp6_name, write
from pipeline import IngestError, Workspace, WorkspaceLockedError


def tables(ws: Workspace) -> dict[str, pl.DataFrame]:
    return {name: ws.read_table(name) for name in ("samples", "measurements", "configs")}


def test_small_tree_rows_and_precedence(small_tree, workspace):
    report = run_ingest([small_tree], workspace)
    assert report.exit_code == 0 and report.count("ok") == 9 and report.changed
    # rows per table, as `ctrl ingest` prints them: 5 samples x 2 configurations x 2 experiments; 9 files
    assert report.table_rows == {"measurements": 20, "samples": 5, "configs": 4, "files": 9}
    m = workspace.read_table("measurements")
    # each (experiment, sample, config) once: 5 samples x 2 configs x 2 experiments
    assert m.height == 2 * len(CONFIGS) * NUM_SAMPLES
    assert set(m["source_kind"]) == {"exp5_merged", "exp6_merged"}  # merged beats rank-0 and final
    # sample 0: merged (twice: padding) + rank-0 + final (twice) = 5 copies in exp5
    exp5_0 = m.filter((pl.col("experiment") == "exp5") & (pl.col("sample_key") == "ex:500000"))
    assert exp5_0["num_copies"].to_list() == [5, 5]
    assert not m["flag_partial_config"].any()
    samples = workspace.read_table("samples")
    assert samples.height == NUM_SAMPLES and samples["answers"][0].to_list() == ["answer 0"] * 10
    configs = workspace.read_table("configs")
    assert configs.height == 2 * len(CONFIGS)
    exp5 = configs.filter(pl.col("experiment") == "exp5").sort("max_crops")
    # recorded summary counts the padding duplicate, the recomputed one does not
    assert exp5["recorded_num_samples"].to_list() == [6, 6] and exp5["num_samples"].to_list() == [5, 5]


def test_lost_merge_uses_rank0_file_and_flags_it(tmp_path, workspace):
    d = tmp_path / "exp6"
    write(d / exp6_name(2, 4, 12, rank=0), exp6_config_doc(2, 4, 12, shard(0), merged=False, world_size=2))
    run_ingest([d], workspace)
    m = workspace.read_table("measurements")
    assert m.height == len(shard(0)) and m["flag_partial_config"].all()
    assert workspace.read_table("configs")["flag_partial_config"].to_list() == [True]


def test_second_run_changes_nothing(small_tree, workspace):
    first = run_ingest([small_tree], workspace)
    before = tables(workspace)
    second = run_ingest([small_tree], workspace)
    assert not second.changed and second.generation == first.generation
    assert second.count("unchanged") == 9
    for name, frame in tables(workspace).items():
        assert_frame_equal(frame, before[name])


def test_touched_but_identical_file_is_not_reparsed(small_tree, workspace):
    run_ingest([small_tree], workspace)
    f = next(small_tree.rglob("exp5_accuracy_results.json"))
    os.utime(f, ns=(time.time_ns(), time.time_ns()))
    report = run_ingest([small_tree], workspace)
    assert not report.changed and report.count("unchanged") == 9


def test_changed_file_replaces_exactly_its_own_rows(small_tree, workspace):
    run_ingest([small_tree], workspace)
    before = workspace.read_table("measurements")
    merged = next(small_tree.rglob(exp6_name(2, 4, 12)))
    doc = exp6_config_doc(2, 4, 12, shard(0) + shard(1), merged=True)
    for lat in doc["per_sample_latencies"]:
        lat["T_total_ms"] += 1000.0
    write(merged, doc)
    report = run_ingest([small_tree], workspace)
    assert report.changed and report.count("ok") == 1
    after = workspace.read_table("measurements")
    mine = (pl.col("source_file") == str(merged))
    assert (after.filter(mine)["latency_total_ms"] - before.filter(mine)["latency_total_ms"] == 1000.0).all()
    assert_frame_equal(after.filter(~mine), before.filter(~mine))


def test_incremental_equals_full_ingest(small_tree, tmp_path):
    inc, full = Workspace(tmp_path / "inc"), Workspace(tmp_path / "full")
    run_ingest([small_tree / "exp5"], inc)
    run_ingest([small_tree / "exp6"], inc)  # a later call adds to, never drops, earlier data
    run_ingest([small_tree], full)
    for name, frame in tables(inc).items():
        assert_frame_equal(frame, tables(full)[name])


def test_bad_file_is_reported_and_the_rest_ingested(small_tree, workspace):
    bad = small_tree / "exp6" / "exp6_latency_coco-2014-vqa" / exp6_name(10, 12, 16, rank=0)
    bad.write_text('{"summary": [{"max_crops": 10')
    (small_tree / "notes.json").write_text('{"author": "me"}')
    report = run_ingest([small_tree], workspace)
    assert report.exit_code == 1 and [Path(f.path).name for f in report.errors] == [bad.name]
    assert report.count("skipped") == 1 and report.count("ok") == 9
    files = workspace.read_table("files")
    row = files.filter(pl.col("path") == str(bad)).row(0, named=True)
    assert row["status"] == "error" and row["error"].startswith(bad.name + ": invalid JSON")
    assert workspace.read_table("measurements").height == 2 * len(CONFIGS) * NUM_SAMPLES
    # unchanged bad file: still reported on the next run, nothing rebuilt
    again = run_ingest([small_tree], workspace)
    assert again.exit_code == 1 and not again.changed


def test_file_turning_bad_keeps_its_previous_rows(small_tree, workspace):
    run_ingest([small_tree], workspace)
    before = workspace.read_table("measurements")
    f = next(small_tree.rglob(exp5_name(2, 4, 12)))
    f.write_text(f.read_text()[:100])
    report = run_ingest([small_tree], workspace)
    assert report.exit_code == 1 and report.changed
    assert_frame_equal(workspace.read_table("measurements"), before)
    row = workspace.read_table("files").filter(pl.col("path") == str(f)).row(0, named=True)
    assert row["status"] == "error" and row["fragment_sha256"] != row["sha256"]


def test_strict_stops_and_changes_nothing(small_tree, workspace):
    run_ingest([small_tree / "exp5"], workspace)
    before = tables(workspace)
    generation = workspace.current_generation()
    bad = small_tree / "exp6" / "exp6_latency_coco-2014-vqa" / exp6_name(2, 4, 12, rank=0)
    bad.write_text("[")
    with pytest.raises(IngestError, match=bad.name):
        run_ingest([small_tree], workspace, strict=True)
    assert workspace.current_generation() == generation
    for name, frame in tables(workspace).items():
        assert_frame_equal(frame, before[name])


def test_crash_while_building_leaves_previous_workspace_and_resumes(small_tree, workspace, monkeypatch):
    run_ingest([small_tree / "exp5"], workspace)
    before, generation = tables(workspace), workspace.current_generation()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("pipeline.ingestion.build_tables", crash)
    with pytest.raises(KeyboardInterrupt):
        run_ingest([small_tree], workspace)
    assert workspace.current_generation() == generation
    for name, frame in tables(workspace).items():
        assert_frame_equal(frame, before[name])
    assert not list(workspace.tables_dir.glob(".tmp-*"))
    monkeypatch.undo()
    # resume: every file was parsed before the crash, so nothing is parsed again
    calls = []
    import pipeline.ingestion as ingest_module

    real = ingest_module.parse_file
    monkeypatch.setattr(ingest_module, "parse_file", lambda *a: calls.append(a) or real(*a))
    report = run_ingest([small_tree], workspace)
    assert report.changed and calls == []
    assert workspace.read_table("measurements").height == 2 * len(CONFIGS) * NUM_SAMPLES


def _hold_lock(root: str, ready, release) -> None:
    with Workspace(root).lock("test holder"):
        ready.set()
        release.wait(30)


def test_concurrent_ingest_is_refused_with_a_clear_message(small_tree, workspace):
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(workspace.root), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(WorkspaceLockedError, match=r"is locked by test holder \(pid \d+\)"):
            run_ingest([small_tree], workspace)
    finally:
        release.set()
        holder.join(30)
    assert run_ingest([small_tree], workspace).exit_code == 0  # lock released with the process


def test_two_ingests_racing_leave_a_consistent_workspace(small_tree, workspace):
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.starmap(_ingest_in_process, [(str(small_tree), str(workspace.root))] * 2)
    assert sorted(results) in (["locked", "ok"], ["ok", "ok"])
    assert workspace.read_table("measurements").height == 2 * len(CONFIGS) * NUM_SAMPLES


def _ingest_in_process(tree: str, root: str) -> str:
    try:
        run_ingest([Path(tree)], Workspace(root))
    except WorkspaceLockedError:
        return "locked"
    return "ok"


def test_parallel_workers_give_the_same_tables(small_tree, tmp_path):
    one, two = Workspace(tmp_path / "one"), Workspace(tmp_path / "two")
    run_ingest([small_tree], one, num_workers=1)
    run_ingest([small_tree], two, num_workers=2)
    for name, frame in tables(one).items():
        assert_frame_equal(frame, tables(two)[name])


# -- documented rules, each on a tree built for it -------------------------------------------------

EXP5_DIR = ("exp5", "exp5_accuracy_coco-2014-vqa")


def _recorded_num_samples(tmp_path: Path, name: str, kinds: set[str]) -> int:
    """Ingest a tree holding the chosen copies of configuration (2, 4, 12)'s exp5 summary:
    rank-0 (3 samples, its shard), merged (6: two shards with padding), final (5)."""
    d = tmp_path / name / "exp5"
    if "rank0" in kinds:
        write(d / exp5_name(2, 4, 12, rank=0), exp5_config_doc(2, 4, 12, shard(0), merged=False))
    if "merged" in kinds:
        write(d / exp5_name(2, 4, 12), exp5_config_doc(2, 4, 12, shard(0) + shard(1), merged=True))
    if "final" in kinds:
        write(d / "exp5_accuracy_results.json", exp5_final_doc([(2, 4, 12)], list(range(NUM_SAMPLES))))
    ws = Workspace(tmp_path / name / "ws")
    assert not run_ingest([d], ws).errors
    configs = ws.read_table("configs")
    assert configs.height == 1
    return configs["recorded_num_samples"][0]


def test_recorded_summary_precedence_is_merged_then_final_then_rank0(tmp_path):
    assert _recorded_num_samples(tmp_path, "all", {"rank0", "merged", "final"}) == 6
    assert _recorded_num_samples(tmp_path, "no-merge", {"rank0", "final"}) == 5  # final beats the one-shard file
    assert _recorded_num_samples(tmp_path, "merged-rank0", {"rank0", "merged"}) == 6
    assert _recorded_num_samples(tmp_path, "rank0", {"rank0"}) == 3


def test_copies_that_disagree_are_flagged_and_the_winner_kept(tmp_path, workspace):
    d = tmp_path / "exp5"
    write(d / exp5_name(2, 4, 12), exp5_config_doc(2, 4, 12, shard(0) + shard(1), merged=True))
    rank0 = exp5_config_doc(2, 4, 12, shard(0), merged=False)  # samples 0, 2, 4
    rank0["all_samples"][1]["score"] = 1.0  # sample 2: 0.0 in the merged file
    rank0["all_samples"][2]["pred"] = "something else"  # sample 4: same score, different prediction
    write(d / exp5_name(2, 4, 12, rank=0), rank0)
    run_ingest([d], workspace)
    m = workspace.read_table("measurements").sort("sample_key")
    assert m["sample_key"].to_list() == [f"ex:50000{i}" for i in range(5)]
    assert m["flag_copies_disagree"].to_list() == [False, False, True, False, True]
    assert m["num_copies"].to_list() == [3, 1, 2, 1, 2]  # sample 0: twice in the merged file (padding), once in rank 0
    assert m["score"].to_list() == [0.0, 1.0, 0.0, 1.0, 0.0]  # the merged file's copies
    assert m["pred"][4] == "answer 4"


def test_a_file_deleted_from_disk_keeps_its_rows(small_tree, workspace):
    run_ingest([small_tree], workspace)
    before = tables(workspace)
    merged = next(small_tree.rglob(exp6_name(2, 4, 12)))
    merged.unlink()
    run_ingest([small_tree], workspace)
    for name, frame in tables(workspace).items():
        assert_frame_equal(frame, before[name])
    m = workspace.read_table("measurements").filter(pl.col("source_file") == str(merged))
    assert m.height == NUM_SAMPLES
    assert str(merged) in workspace.read_table("files")["path"].to_list()


def test_an_id_written_with_spaces_is_the_same_sample(small_tree, tmp_path, workspace):
    """exp6 writes example_id " 500000 " where exp5 wrote 500000: one sample, both experiments."""
    d = tmp_path / "spaced" / "exp6"
    doc = exp6_config_doc(2, 4, 12, list(range(NUM_SAMPLES)), merged=True)
    for p in doc["per_sample_predictions"]:
        p["metadata"]["example_id"] = f" {p['metadata']['example_id']} "
    write(d / exp6_name(2, 4, 12), doc)
    run_ingest([small_tree / "exp5", d], workspace)
    assert workspace.read_table("samples")["sample_key"].to_list() == [f"ex:50000{i}" for i in range(5)]
    m = workspace.read_table("measurements").filter((pl.col("max_crops") == 2))
    assert m.group_by("sample_key").len().sort("sample_key")["len"].to_list() == [2] * NUM_SAMPLES


def test_a_tree_of_summaries_only_gives_empty_tables_and_its_configs(tmp_path, workspace):
    """A final file whose rows cannot be attributed: no measurement or sample, the recorded summary kept."""
    per_config = exp6_config_doc(2, 4, 12, [0, 1], merged=True)
    final = {"summary": per_config["summary"], "all_samples": per_config["per_sample_latencies"],
             "config": {"dataset_name": "coco_2014_vqa", "split": "validation", "max_crops_list": [2], "world_size": 2}}
    write(tmp_path / "exp6" / "exp6_latency_results.json", final)
    report = run_ingest([tmp_path / "exp6"], workspace)
    assert report.exit_code == 0
    assert workspace.read_table("measurements").height == 0 and workspace.read_table("samples").height == 0
    (row,) = workspace.read_table("configs").to_dicts()
    assert ((row["experiment"], row["max_crops"], row["top_k"], row["num_active_blocks"])
            == ("exp6", 2, 4, 12))
    assert (row["recorded_num_samples"], row["recorded_latency_total_ms_mean"]) == (2, 200.5)
    assert (row["num_samples"], row["accuracy"], row["latency_total_ms_mean"]) == (0, None, None)
