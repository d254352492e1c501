"""Ingest of generated origin trees: the shipped sample data, all dataset styles, fault injection."""

from __future__ import annotations

import polars as pl
import pytest

from conftest import run_ingest
from pipeline import Workspace, build_sample_key, run_query
from synthetic import SyntheticSpec, generate_tree

ALL_DATASETS = ("coco_2014_vqa", "text_vqa", "okvqa", "science_qa_img", "tally_qa", "coco_caption", "doc_qa", "st_qa")
SMALL = dict(max_crops=(2, 10), top_k=(4, 12), num_active_blocks=(12, 16))


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory):
    """The tree data/generate.py ships (SyntheticSpec defaults), ingested once."""
    root = tmp_path_factory.mktemp("sample")
    tree = generate_tree(SyntheticSpec(), root / "data")
    ws = Workspace(root / "ws")
    report = run_ingest([tree.exp5_dir, tree.exp6_dir], ws, num_workers=2)
    return tree, ws, report


def test_sample_data_ingests_cleanly(sample_data):
    tree, ws, report = sample_data
    assert report.exit_code == 0 and report.count("ok") == len([f for f in tree.files if f.suffix == ".json"]) == 220
    n = tree.spec.num_samples
    m = ws.read_table("measurements")
    counts = m.group_by("experiment", "dataset").len().sort("experiment", "dataset")
    assert counts["len"].to_list() == [27 * n] * 4
    assert not m["flag_partial_config"].any() and not m["flag_copies_disagree"].any()
    assert ws.read_table("samples").height == 2 * n
    assert ws.read_table("configs").height == 4 * 27


def test_sample_keys_match_the_generators_metadata(sample_data):
    tree, ws, _ = sample_data
    expected = {(s.dataset, build_sample_key(s.dataset, s.metadata)[0]) for s in tree.samples}
    got = set(ws.read_table("samples").select("dataset", "sample_key").iter_rows())
    assert got == expected


def test_recorded_and_recomputed_figures_agree(sample_data):
    _, ws, _ = sample_data
    c = ws.read_table("configs")
    exp6 = c.filter(pl.col("experiment") == "exp6")
    # world_size 2 and 150 samples: no padding, so the recorded summaries are exactly reproducible
    assert (exp6["recorded_num_samples"] == exp6["num_samples"]).all()
    assert ((exp6["recorded_accuracy"] - exp6["accuracy"]).abs() < 1e-9).all()
    assert ((exp6["recorded_latency_total_ms_p50"] - exp6["latency_total_ms_p50"]).abs() < 1e-6).all()


def test_groups_show_the_trade_off_the_generator_built_in(sample_data):
    tree, ws, _ = sample_data
    rows = run_query(ws, """
        SELECT max_crops, top_k, num_active_blocks, avg(score) AS accuracy, median(latency_total_ms) AS p50
        FROM groups GROUP BY ALL""").to_pylist()
    by_config = {(r["max_crops"], r["top_k"], r["num_active_blocks"]): r for r in rows}
    assert len(by_config) == 27
    assert by_config[(10, 12, 16)]["accuracy"] > by_config[(2, 4, 12)]["accuracy"]
    assert by_config[(10, 12, 16)]["p50"] > by_config[(2, 4, 12)]["p50"]


def test_every_dataset_style_and_injected_fault(tmp_path):
    spec = SyntheticSpec(datasets=ALL_DATASETS, num_samples=9, world_size=3, exp5_batch_size=4, write_images=False,
                         lost_merge_configs=((2, 12, 12),), empty_configs=((10, 4, 16),), **SMALL)
    tree = generate_tree(spec, tmp_path / "tree")
    ws = Workspace(tmp_path / "ws")
    report = run_ingest([tmp_path / "tree"], ws)
    assert report.exit_code == 0, [f.error for f in report.errors]
    samples = ws.read_table("samples")
    assert samples.group_by("dataset").len().sort("dataset")["len"].to_list() == [9] * len(ALL_DATASETS)
    sources = dict(samples.group_by("dataset").agg(pl.col("key_source").first()).iter_rows())
    assert sources["science_qa_img"] == "question_hash" and sources["tally_qa"] == "image"
    assert sources["coco_caption"] == "image_caption" and sources["coco_2014_vqa"] == "example_id"
    c = ws.read_table("configs")
    lost = c.filter((pl.col("max_crops") == 2) & (pl.col("top_k") == 12) & (pl.col("num_active_blocks") == 12))
    assert lost["flag_partial_config"].all() and (lost["num_samples"] == 3).all()  # rank 0's shard of 9 on 3 GPUs
    empty = c.filter((pl.col("max_crops") == 10) & (pl.col("top_k") == 4) & (pl.col("num_active_blocks") == 16))
    assert empty["flag_summary_nan"].all() and (empty["num_samples"] == 0).all()
    assert tree.num_records > 0
