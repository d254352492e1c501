"""Tests of the synthetic exp5/exp6 tree generator (synthetic); D1 .. are the origin defects of
docs/origin_format.md §9."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pipeline.knobs import TOKENS_PER_CROP, exp_active_blocks
from synthetic import (
    SyntheticSpec,
    balanced_combinations,
    exp5_batch_size,
    generate_tree,
    image_filename,
    rank_shards,
)
from synthetic.truth import build_dataset, select_tiling

# 2-value lists -> 8 configurations: small and fast, still varied
SMALL = dict(max_crops=(2, 10), top_k=(4, 12), num_active_blocks=(12, 16))
ALL_DATASETS = ("coco_2014_vqa", "text_vqa", "okvqa", "science_qa_img", "tally_qa", "coco_caption", "doc_qa", "st_qa")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def ds_dir(root: Path, exp: str, ds: str) -> Path:
    base = "exp5_accuracy" if exp == "exp5" else "exp6_latency"
    return root / exp / f"{base}_{ds.replace('_', '-')}"


def ident(meta: dict) -> object:
    """A per-sample identity for tests (the ingest has its own sample keys)."""
    return meta.get("example_id", (meta.get("image_id"), meta.get("caption_id"), meta.get("question")))


@pytest.fixture(scope="module")
def tree_w3(tmp_path_factory: pytest.TempPathFactory):
    """11 samples on 3 GPUs: padding duplicates, an empty and a lost-merge config."""
    spec = SyntheticSpec(datasets=("coco_2014_vqa",), num_samples=11, world_size=3, exp5_batch_size=4,
                         empty_configs=((10, 4, 16),), lost_merge_configs=((2, 12, 12),), **SMALL)
    return generate_tree(spec, tmp_path_factory.mktemp("w3"))


@pytest.fixture(scope="module")
def tree_all(tmp_path_factory: pytest.TempPathFactory):
    spec = SyntheticSpec(datasets=ALL_DATASETS, num_samples=9, exp6_num_samples=5, world_size=2, **SMALL)
    return generate_tree(spec, tmp_path_factory.mktemp("all"))


def test_same_spec_gives_byte_identical_files(tmp_path: Path) -> None:
    spec = SyntheticSpec(datasets=("text_vqa", "coco_caption"), num_samples=7, world_size=2, **SMALL)
    a, b = generate_tree(spec, tmp_path / "a"), generate_tree(spec, tmp_path / "b")
    rel_a = [p.relative_to(tmp_path / "a") for p in a.files]
    assert rel_a == [p.relative_to(tmp_path / "b") for p in b.files]
    assert all((tmp_path / "a" / r).read_bytes() == (tmp_path / "b" / r).read_bytes() for r in rel_a)
    other = generate_tree(dataclasses.replace(spec, seed=1), tmp_path / "c")
    assert any((tmp_path / "a" / r).read_bytes() != (other.out_dir / r).read_bytes() for r in rel_a
               if r.suffix == ".json")


@pytest.mark.parametrize("indent", [2, None])
def test_files_are_exactly_what_json_dump_writes(tmp_path: Path, indent: int | None) -> None:
    spec = SyntheticSpec(datasets=("science_qa_img", "coco_caption", "doc_qa"), num_samples=6, indent=indent,
                         empty_configs=((2, 4, 12),), write_images=False, **SMALL)
    tree = generate_tree(spec, tmp_path)
    for path in tree.files:
        text = path.read_text()
        assert json.dumps(json.loads(text), indent=indent) == text, path


def test_refuses_to_overwrite_without_flag(tmp_path: Path) -> None:
    spec = SyntheticSpec(datasets=("okvqa",), num_samples=3, experiments=("exp5",), write_images=False, **SMALL)
    generate_tree(spec, tmp_path)
    with pytest.raises(FileExistsError):
        generate_tree(spec, tmp_path)
    generate_tree(spec, tmp_path, overwrite=True)


def names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


@pytest.mark.parametrize("world_size", [1, 2])
def test_file_names_and_kinds_per_world_size(tmp_path: Path, world_size: int) -> None:
    spec = SyntheticSpec(datasets=("coco_2014_vqa",), num_samples=5, world_size=world_size, write_images=False, **SMALL)
    tree = generate_tree(spec, tmp_path)
    cfgs = balanced_combinations(SMALL["max_crops"], SMALL["top_k"], SMALL["num_active_blocks"])
    assert tree.configs == cfgs and len(cfgs) == 8
    e5 = {f"exp5_accuracy_results_crops{c}_topk{k}_blocks{b}.json" for c, k, b in cfgs}
    e6_rank = {f"exp6_latency_crops{c}_topk{k}_blocks{b}_rank0.json" for c, k, b in cfgs}
    e6_merged = {f"exp6_latency_crops{c}_topk{k}_blocks{b}.json" for c, k, b in cfgs}
    if world_size == 1:
        assert names(ds_dir(tmp_path, "exp5", "coco_2014_vqa")) == e5 | {"exp5_accuracy_results.json"}
        assert names(ds_dir(tmp_path, "exp6", "coco_2014_vqa")) == e6_rank | {"exp6_latency_results.json"}
        inc = load(ds_dir(tmp_path, "exp5", "coco_2014_vqa") / sorted(e5)[0])
        assert inc["config"]["rank"] == 0 and "note" not in inc["config"] and "start_time" in inc["summary"][0]
        final6 = load(ds_dir(tmp_path, "exp6", "coco_2014_vqa") / "exp6_latency_results.json")
        assert all("duration_seconds" in s and "start_time" in s for s in final6["summary"])
    else:
        rank5 = {n.replace(".json", "_rank0.json") for n in e5}
        assert names(ds_dir(tmp_path, "exp5", "coco_2014_vqa")) == e5 | rank5 | {"exp5_accuracy_results.json"}
        assert names(ds_dir(tmp_path, "exp6", "coco_2014_vqa")) == e6_rank | e6_merged | {"exp6_latency_results.json"}
        merged = load(ds_dir(tmp_path, "exp5", "coco_2014_vqa") / sorted(e5)[0])
        assert merged["config"]["note"] == "Merged results from all ranks"
        assert set(merged["config"]) & {"rank", "batch_size_used", "config_index", "sampling_strategy"} == set()
        assert set(merged["summary"][0]) == {"max_crops", "top_k", "num_active_blocks", "accuracy",
                                             "num_samples", "std"}
        final5 = load(ds_dir(tmp_path, "exp5", "coco_2014_vqa") / "exp5_accuracy_results.json")
        assert all("start_time" not in s for s in final5["summary"])  # lost by the merge
    rank_name = sorted(e5)[0] if world_size == 1 else sorted(e5)[0].replace(".json", "_rank0.json")
    rank = load(ds_dir(tmp_path, "exp5", "coco_2014_vqa") / rank_name)
    assert list(rank["summary"][0]) == ["max_crops", "top_k", "num_active_blocks", "accuracy", "num_samples", "std",
                                       "duration_seconds", "duration_minutes", "duration_hours", "start_time",
                                       "end_time"]
    assert {"batch_size_used", "world_size", "rank", "config_index", "sampling_strategy"} <= set(rank["config"])


def test_distributed_sampler_shards() -> None:
    assert rank_shards(5, 1) == [[0, 1, 2, 3, 4]]
    assert rank_shards(7, 3) == [[0, 3, 6], [1, 4, 0], [2, 5, 1]]
    assert rank_shards(1, 4) == [[0], [0], [0], [0]]


def test_rank0_files_hold_exactly_rank0_shard(tree_w3) -> None:
    truth = tree_w3.truth["coco_2014_vqa"]
    shard0 = rank_shards(11, 3)[0]
    want = [truth.metadata[i]["example_id"] for i in shard0]
    for c, k, b in tree_w3.configs:
        if (c, k, b) == (10, 4, 16):
            continue  # empty config
        r5 = load(ds_dir(tree_w3.out_dir, "exp5", "coco_2014_vqa")
                  / f"exp5_accuracy_results_crops{c}_topk{k}_blocks{b}_rank0.json")
        assert [s["metadata"]["example_id"] for s in r5["all_samples"]] == want
        bs = r5["config"]["batch_size_used"]
        assert bs == exp5_batch_size(4, c, k, b)
        assert [s["sample_id"] for s in r5["all_samples"]] == [j % bs for j in range(len(shard0))]  # batch position
        r6 = load(ds_dir(tree_w3.out_dir, "exp6", "coco_2014_vqa")
                  / f"exp6_latency_crops{c}_topk{k}_blocks{b}_rank0.json")
        assert [p["metadata"]["example_id"] for p in r6["per_sample_predictions"]] == want
        assert [s["sample_id"] for s in r6["per_sample_latencies"]] == list(range(len(shard0)))


def test_merged_files_contain_padding_duplicates(tree_w3) -> None:
    merged = load(ds_dir(tree_w3.out_dir, "exp5", "coco_2014_vqa") / "exp5_accuracy_results_crops2_topk4_blocks12.json")
    ids = [s["metadata"]["example_id"] for s in merged["all_samples"]]
    truth = tree_w3.truth["coco_2014_vqa"]
    assert len(ids) == 12 == merged["summary"][0]["num_samples"]  # 11 padded to 12
    assert [ident for ident, n in Counter(ids).items() if n > 1] == [truth.metadata[0]["example_id"]]
    # rank order: rank 0's shard first, then rank 1, then rank 2
    order = [i for shard in rank_shards(11, 3) for i in shard]
    assert ids == [truth.metadata[i]["example_id"] for i in order]
    m6 = load(ds_dir(tree_w3.out_dir, "exp6", "coco_2014_vqa") / "exp6_latency_crops2_topk4_blocks12.json")
    assert len(m6["per_sample_latencies"]) == 12
    assert [s["sample_id"] for s in m6["per_sample_latencies"]] == [0, 1, 2, 3] * 3  # rank-local, collide


def test_empty_and_lost_merge_configs(tree_w3) -> None:
    d5, d6 = ds_dir(tree_w3.out_dir, "exp5", "coco_2014_vqa"), ds_dir(tree_w3.out_dir, "exp6", "coco_2014_vqa")
    for path in (d5 / "exp5_accuracy_results_crops10_topk4_blocks16_rank0.json",
                 d5 / "exp5_accuracy_results_crops10_topk4_blocks16.json"):
        doc = load(path)
        assert math.isnan(doc["summary"][0]["accuracy"]) and doc["summary"][0]["num_samples"] == 0
        assert doc["all_samples"] == []
        assert "NaN" in path.read_text()
    e6 = load(d6 / "exp6_latency_crops10_topk4_blocks16.json")
    assert math.isnan(e6["summary"][0]["accuracy"]) and e6["per_sample_latencies"] == e6["per_sample_predictions"] == []
    assert e6["summary"][0]["latency_total_ms"] == {}
    # lost merge: only the rank-0 file, and nothing in the final aggregate
    assert (d5 / "exp5_accuracy_results_crops2_topk12_blocks12_rank0.json").exists()
    assert not (d5 / "exp5_accuracy_results_crops2_topk12_blocks12.json").exists()
    assert (d6 / "exp6_latency_crops2_topk12_blocks12_rank0.json").exists()
    assert not (d6 / "exp6_latency_crops2_topk12_blocks12.json").exists()
    for final in (load(d5 / "exp5_accuracy_results.json"), load(d6 / "exp6_latency_results.json")):
        keys = [(s["max_crops"], s["top_k"], s["num_active_blocks"]) for s in final["summary"]]
        assert (2, 12, 12) not in keys and (10, 4, 16) in keys and len(keys) == 7
        assert final["config"]["num_combinations"] == 8


def test_final_exp5_chunks_match_summary(tree_w3) -> None:
    final = load(ds_dir(tree_w3.out_dir, "exp5", "coco_2014_vqa") / "exp5_accuracy_results.json")
    assert len(final["all_samples"]) == sum(s["num_samples"] for s in final["summary"])
    assert all("max_crops" not in s for s in final["all_samples"])  # no configuration labels
    pos = 0
    for s in final["summary"]:
        chunk = final["all_samples"][pos:pos + s["num_samples"]]
        pos += s["num_samples"]
        if chunk:
            assert np.mean([x["score"] for x in chunk]) == pytest.approx(s["accuracy"])
            assert np.std([x["score"] for x in chunk]) == pytest.approx(s["std"])
    assert set(final["config"]) == {"dataset_name", "split", "batch_size", "max_new_tokens", "max_crops_list",
                                    "top_k_list", "num_active_blocks_list", "sampling_strategy", "num_combinations",
                                    "world_size"}


def test_exp6_records(tree_w3) -> None:
    d6 = ds_dir(tree_w3.out_dir, "exp6", "coco_2014_vqa")
    for c, k, b in tree_w3.configs:
        for suffix in ("_rank0", ""):
            path = d6 / f"exp6_latency_crops{c}_topk{k}_blocks{b}{suffix}.json"
            if not path.exists():
                continue
            doc = load(path)
            lats, preds = doc["per_sample_latencies"], doc["per_sample_predictions"]
            assert len(lats) == len(preds) == doc["summary"][0]["num_samples"]
            assert all(p["sample_id"] == 0 for p in preds)
            assert doc["config"]["active_block_indices"] == list(exp_active_blocks(b))
            if suffix:
                assert doc["summary"][0]["active_block_indices"] == list(exp_active_blocks(b))
            for lat, pred in zip(lats, preds):
                assert (lat["max_crops"], lat["top_k"], lat["num_active_blocks"]) == (c, k, b)
                assert lat["accuracy"] == pred["score"]
                assert lat["num_total_tokens"] == lat["num_vision_tokens"] + lat["num_language_tokens"]  # D10
                assert lat["num_language_tokens"] > lat["num_vision_tokens"]  # includes image placeholders
                assert 1 <= lat["num_output_tokens"] <= 16
                if lat["num_output_tokens"] > 1:  # D1: one decode step's blocks, far below prefill
                    assert lat["T_prefill_ms"] < lat["T_decode_ms"] / (lat["num_output_tokens"] - 1)
                else:
                    assert lat["T_decode_ms"] == 0.0
                assert 80 < lat["T_total_ms"] < 700
            if lats:
                totals = [x["T_total_ms"] for x in lats]
                stats = doc["summary"][0]["latency_total_ms"]
                assert list(stats) == ["P50", "P95", "P99", "mean", "std", "min", "max"]
                assert stats["P95"] == pytest.approx(float(np.percentile(totals, 95)))
                assert stats["std"] == pytest.approx(float(np.std(totals)))
    final = load(d6 / "exp6_latency_results.json")
    assert len(final["all_samples"]) == sum(s["num_samples"] for s in final["summary"])
    assert all("metadata" not in s and "max_crops" in s for s in final["all_samples"])


def test_exp6_num_samples_takes_first_part_of_each_shard(tree_all) -> None:
    doc = load(ds_dir(tree_all.out_dir, "exp6", "okvqa") / "exp6_latency_crops2_topk4_blocks12.json")
    truth = tree_all.truth["okvqa"]
    got = [p["metadata"]["example_id"] for p in doc["per_sample_predictions"]]
    # 5 // 2 = 2 per rank: rank 0 -> 0, 2; rank 1 -> 1, 3
    assert got == [truth.metadata[i]["example_id"] for i in (0, 2, 1, 3)]
    exp5 = load(ds_dir(tree_all.out_dir, "exp5", "okvqa") / "exp5_accuracy_results_crops2_topk4_blocks12.json")
    assert exp5["summary"][0]["num_samples"] == 10  # all 9 samples + 1 padding duplicate


def test_per_metric_dict_layouts(tree_all) -> None:
    def first(ds: str) -> dict:
        return load(ds_dir(tree_all.out_dir, "exp5", ds) / "exp5_accuracy_results.json")["all_samples"][0]
    for ds in ("coco_2014_vqa", "text_vqa", "okvqa", "doc_qa", "st_qa", "tally_qa"):
        assert list(first(ds)) == ["sample_id", "score", "pred", "answers", "metadata"]
    assert list(first("science_qa_img")) == ["sample_id", "score", "pred", "answer_idx", "predicted_idx", "options",
                                             "metadata"]
    assert list(first("coco_caption")) == ["sample_id", "pred", "captions", "metadata", "score", "coco_metrics"]
    # the origin's keys, then ``family`` (the question template family; not an origin key)
    assert list(first("coco_2014_vqa")["metadata"]) == ["image_id", "example_id", "answers", "question", "family"]
    meta = first("text_vqa")["metadata"]
    assert isinstance(meta["image_id"], str) and len(meta["image_id"]) == 16 and isinstance(meta["example_id"], int)
    assert list(first("okvqa")["metadata"]) == ["example_id", "answers", "question", "family"]
    assert set(first("science_qa_img")["metadata"]) == {"question", "options", "answer_idx", "family"}
    assert list(first("tally_qa")["metadata"]) == ["image_id", "answers", "family"]
    assert list(first("coco_caption")["metadata"]) == ["image_id", "caption_id", "captions", "family"]
    assert (load(ds_dir(tree_all.out_dir, "exp5", "tally_qa") / "exp5_accuracy_results.json")["config"]["split"]
            == "test")
    coco = tree_all.truth["coco_2014_vqa"].metadata
    assert all(m["example_id"] // 1000 == m["image_id"] for m in coco)
    assert len({m["image_id"] for m in coco}) < len(coco)  # some images carry several questions


def test_scores_are_consistent_with_answers(tree_all) -> None:
    for ds in ("coco_2014_vqa", "text_vqa", "okvqa"):
        for s in load(ds_dir(tree_all.out_dir, "exp5", ds) / "exp5_accuracy_results.json")["all_samples"]:
            assert s["score"] == min(s["answers"].count(s["pred"]) / 3.0, 1)  # molmo vqa_score
    for s in load(ds_dir(tree_all.out_dir, "exp5", "science_qa_img") / "exp5_accuracy_results.json")["all_samples"]:
        assert s["score"] == float(s["predicted_idx"] == s["answer_idx"])
    for s in load(ds_dir(tree_all.out_dir, "exp5", "tally_qa") / "exp5_accuracy_results.json")["all_samples"]:
        assert s["score"] == float(s["pred"] in s["answers"])
    caps = load(ds_dir(tree_all.out_dir, "exp6", "coco_caption") / "exp6_latency_results.json")["all_samples"]
    assert all(s["accuracy"] == 0.0 for s in caps)  # batch-size-1 CIDEr (D19)


def test_images_one_per_distinct_image(tree_all) -> None:
    from PIL import Image

    files = {p.name for p in tree_all.images_dir.iterdir()}
    expected = set()
    for ds in ALL_DATASETS:
        t = tree_all.truth[ds]
        expected |= {image_filename(ds, i) for i in t.image_ids}
    assert files == expected
    coco = tree_all.truth["coco_2014_vqa"]
    assert f"COCO_val2014_{coco.image_ids[0]:012d}.jpg" in files
    sizes = [(tree_all.images_dir / f).stat().st_size for f in files]
    assert max(sizes) < 12_000
    with Image.open(tree_all.images_dir / image_filename("coco_2014_vqa", coco.image_ids[0])) as img:
        w, h = img.size
    assert (max(w, h) == tree_all.spec.image_max_side
            and w / h == pytest.approx(coco.image_size[0, 0] / coco.image_size[0, 1], rel=0.05))
    assert len({s.image_file for s in tree_all.samples}) == len(files)


def test_tiling_rule() -> None:
    rows, cols = select_tiling(np.array([480, 768, 200, 480]), np.array([640, 1024, 1800, 640]), 10)
    assert (rows[0], cols[0]) == (2, 3)  # upscaling is possible: least upscaling
    assert rows[1] * cols[1] == 9  # every candidate downscales: the largest scale
    assert (rows[2], cols[2]) == (1, 8)  # 1x8 already upscales slightly; 1x10 would upscale more
    r2, c2 = select_tiling(np.array([480]), np.array([640]), 2)
    assert (r2[0], c2[0]) == (1, 2)
    t = build_dataset("text_vqa", 60, 0)
    for c in (2, 6, 10):
        assert (t.vision_tokens(c) <= (t.num_crops(c) + 1) * TOKENS_PER_CROP).all()
    assert len(set(t.num_crops(10).tolist())) > 1  # crop counts differ per image


def test_accuracy_and_latency_depend_on_knobs(tree_all) -> None:
    for ds in ("coco_2014_vqa", "text_vqa"):
        t = build_dataset(ds, 300, 0)
        assert t.expected_score(10, 12, 16).mean() > t.expected_score(2, 4, 12).mean() + 0.2
        assert t.expected_latency(10, 12, 16).mean() > t.expected_latency(2, 4, 12).mean() + 80
        # crops matter for high-detail samples, hardly for low-detail ones
        gain = t.expected_score(10, 8, 16) - t.expected_score(2, 8, 16)
        hi, lo = t.detail > 0.7, t.detail < 0.3
        if hi.any() and lo.any():
            assert gain[hi].mean() > gain[lo].mean() + 0.1
    tab = tree_all.outcome_table("coco_2014_vqa")
    assert tab["accuracy"].shape == (9, 8) and tab["latency_ms"].shape == (9, 8)
    assert tree_all.expected_accuracy("coco_2014_vqa", 0, 10, 12, 16) == pytest.approx(tab["accuracy"][0, -1])


def test_best_config_under_mid_budget_differs_across_samples() -> None:
    spec = SyntheticSpec(datasets=("text_vqa",), num_samples=200)
    t = build_dataset("text_vqa", 200, spec.seed)
    cfgs = balanced_combinations(spec.max_crops, spec.top_k, spec.num_active_blocks)
    acc = np.stack([t.expected_score(*c) for c in cfgs], axis=1)
    lat = np.stack([t.expected_latency(*c) for c in cfgs], axis=1)
    budget = float(np.median(lat))
    best = np.where(lat <= budget, acc, -1).argmax(axis=1)
    chosen = [cfgs[i] for i in best]
    assert len(set(chosen)) >= 3
    crops_hi = np.mean([c[0] for c, d in zip(chosen, t.detail) if d > 0.8])
    crops_lo = np.mean([c[0] for c, d in zip(chosen, t.detail) if d < 0.5])
    assert crops_hi > crops_lo


def test_record_count_and_generated_tree(tree_w3) -> None:
    n = 0
    for path in (p for p in tree_w3.files if p.suffix == ".json"):
        doc = load(path)
        n += sum(len(doc.get(k, [])) for k in ("all_samples", "per_sample_latencies", "per_sample_predictions"))
    assert n == tree_w3.num_records == sum(tree_w3.record_counts.values())
    assert len(tree_w3.samples) == 11 and tree_w3.images_dir is not None
    tab = tree_w3.outcome_table("coco_2014_vqa")
    assert tree_w3.best_config("coco_2014_vqa", 0, 1e9) == tree_w3.configs[int(tab["accuracy"][0].argmax())]
    assert tree_w3.best_config("coco_2014_vqa", 0, 1.0) is None


#: (text in the question, family) per template; first match wins. TallyQA and caption metadata carry no question.
TEMPLATE_FAMILIES = {
    "coco_2014_vqa": [("What color is the", "color"), ("How many", "count"), ("Is there a", "presence"),
                      ("holding?", "holding"), ("Where was this picture taken?", "place"),
                      ("What sport is being played?", "sport")],
    "text_vqa": [("What brand is the", "brand"), ("What is written on the", "written_text"),
                 ("What number is on the", "number"), ("What time is shown on the clock?", "clock_time"),
                 ("What is the title of the book?", "book_title")],
    "okvqa": [("used for?", "use"), ("Which country is famous for this food?", "food_origin"),
              ("What family does this animal belong to?", "animal_family"), ("In which decade", "decade")],
    "doc_qa": [("mentioned in the document?", "document_field")],
    "st_qa": [("What is the name of the", "store_name")],
    "science_qa_img": [("farthest", "farthest_state"), ("adapted to survive", "adaptation"),
                       ("expected ratio of offspring", "offspring_ratio"), ("have in common", "common_property")],
}


def test_metadata_records_the_question_template_family() -> None:
    for ds in ALL_DATASETS:
        metadata = build_dataset(ds, 300, seed=5).metadata
        assert [m["family"] for m in build_dataset(ds, 300, seed=5).metadata] == [m["family"] for m in metadata]
        families = [m["family"] for m in metadata]
        if ds == "tally_qa":
            assert set(families) == {"tally_count"}
            continue
        if ds == "coco_caption":
            assert set(families) == {"caption"}
            continue
        rules = TEMPLATE_FAMILIES[ds]
        assert set(families) == {family for _, family in rules}  # every template occurs in 300 samples
        for m in metadata:
            if m["question"].startswith("Figure:"):  # ScienceQA's hint-only question (D18) hides the template
                continue
            assert m["family"] == next(family for text, family in rules if text in m["question"]), m["question"]


def test_written_records_carry_the_family(tree_all) -> None:
    order = [i for shard in rank_shards(9, 2) for i in shard]  # merged file: rank 0's shard, then rank 1's
    for ds in ALL_DATASETS:
        truth = tree_all.truth[ds].metadata
        doc = load(ds_dir(tree_all.out_dir, "exp5", ds) / "exp5_accuracy_results_crops2_topk4_blocks12.json")
        assert [s["metadata"]["family"] for s in doc["all_samples"]] == [truth[i]["family"] for i in order]


def test_family_weights_shape_the_question_mix_and_labels_can_be_left_out() -> None:
    from collections import Counter

    default = build_dataset("coco_2014_vqa", 400, seed=5).metadata
    # weights that name none of the dataset's families keep the default stream
    assert build_dataset("coco_2014_vqa", 400, seed=5, family_weights={"decade": 3.0}).metadata == default
    counts = Counter(m["family"] for m in build_dataset("coco_2014_vqa", 400, seed=5,
                                                        family_weights={"count": 10.0, "sport": 0.0}).metadata)
    assert counts["sport"] == 0 and counts["count"] > 0.5 * 400  # 10 of 15 weights: about two thirds
    unlabelled = build_dataset("coco_2014_vqa", 400, seed=5, write_family=False).metadata
    assert all("family" not in m for m in unlabelled)
    # the same samples otherwise: the family shows only in the question's words
    assert [m["question"] for m in unlabelled] == [m["question"] for m in default]
    with pytest.raises(ValueError, match="family weights of coco_2014_vqa"):
        build_dataset("coco_2014_vqa", 10, seed=5, family_weights={f: 0.0 for f in
                                                                   ("color", "count", "presence", "holding", "place",
                                                                    "sport")})


def test_the_stamp_of_a_spec_without_the_new_fields_is_unchanged() -> None:
    import hashlib
    import json
    from dataclasses import asdict

    from synthetic import GENERATOR_VERSION, SyntheticSpec, spec_fingerprint

    base = SyntheticSpec()
    # the payload of the fields a spec had before (a workspace generated then stays up to date)
    before = {k: v for k, v in asdict(base).items()
              if k not in ("family_weights", "write_family", "image_scale", "image_sizes", "prompt_context")}
    payload = json.dumps({"version": GENERATOR_VERSION, **before}, sort_keys=True)
    assert spec_fingerprint(base) == hashlib.sha256(payload.encode()).hexdigest()
    assert spec_fingerprint(base) != spec_fingerprint(SyntheticSpec(write_family=False))
    assert spec_fingerprint(base) != spec_fingerprint(SyntheticSpec(family_weights=(("count", 2.0),)))
