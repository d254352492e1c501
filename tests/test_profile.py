"""``ctrl profile``: a measured knob sweep of the embedded model written as exp5/exp6 trees that
``ctrl ingest`` reads with stable keys, real prefill and vision times, per-rank files and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image, ImageDraw
from typer.testing import CliRunner

from conftest import run_ingest
from pipeline import Workspace, run_query

CONFIGS = [(2, 4, 12), (6, 8, 16)]
CONFIGS_ARG = "2/4/12,6/8/16"
NUM_SAMPLES = 3
MAX_NEW_TOKENS = 3


def make_dataset(root: Path, n: int = 4, name: str = "tiny_vqa") -> Path:
    """A tiny dataset directory: coloured shapes of varied sizes and aspect ratios."""
    from testbed.dataset import VqaSample, write_dataset

    (root / "images").mkdir(parents=True, exist_ok=True)
    colours = ["red", "blue", "green", "yellow"]
    samples = []
    for i in range(n):
        colour = colours[i % len(colours)]
        img = Image.new("RGB", (220 + 90 * i, 180 + 20 * (i % 2)), (240, 240, 240))
        ImageDraw.Draw(img).rectangle([20, 20, 120 + 30 * i, 140], fill=colour)
        img.save(root / "images" / f"img{i}.png")
        samples.append(VqaSample(f"{name}-q{i}", f"img{i}", f"What colour is the large shape in picture {i}?",
                                 (colour, colour, colour), "colour"))
    write_dataset(root, name, "validation", samples)
    return root


def run(dataset: Path, out: Path, runtime, **kwargs):
    from profiler.sweep import ProfileConfig, profile_model

    config = ProfileConfig(datasets=[dataset], configs=kwargs.pop("configs", CONFIGS), out_dir=out,
                           num_samples=kwargs.pop("num_samples", NUM_SAMPLES), max_new_tokens=MAX_NEW_TOKENS, **kwargs)
    return profile_model(config, runtime=runtime)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, embedded_runtime):
    """One dataset profiled with world size 1 and with world size 2."""
    root = tmp_path_factory.mktemp("profile")
    dataset = make_dataset(root / "tiny")
    one = run(dataset, root / "w1", embedded_runtime)
    two = run(dataset, root / "w2", embedded_runtime, world_size=2)
    return root, dataset, one, two


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_layout(profiled):
    root, _, one, two = profiled
    for out, world in ((root / "w1", 1), (root / "w2", 2)):
        exp5, exp6 = out / "exp5_accuracy_tiny-vqa", out / "exp6_latency_tiny-vqa"
        names5 = {p.name for p in exp5.iterdir()}
        names6 = {p.name for p in exp6.iterdir()}
        for c, k, b in CONFIGS:
            assert f"exp5_accuracy_results_crops{c}_topk{k}_blocks{b}.json" in names5
            assert f"exp6_latency_crops{c}_topk{k}_blocks{b}.json" in names6
            for r in range(world):
                assert f"exp5_accuracy_results_crops{c}_topk{k}_blocks{b}_rank{r}.json" in names5
                assert f"exp6_latency_crops{c}_topk{k}_blocks{b}_rank{r}.json" in names6
        assert "exp5_accuracy_results.json" in names5 and "exp6_latency_results.json" in names6
        assert len(names5) == len(names6) == len(CONFIGS) * (world + 1) + 1
        assert not [p for p in out.rglob("*") if p.name.startswith(".") or p.suffix == ".tmp"]
    assert one.measured == two.measured == len(CONFIGS) * NUM_SAMPLES

    # every per-sample record of both experiments carries the full metadata and its configuration
    merged6 = load(root / "w2" / "exp6_latency_tiny-vqa" / "exp6_latency_crops6_topk8_blocks16.json")
    assert merged6["config"]["note"] and merged6["config"]["ctrl_profile_version"] == 1
    assert [r["dataset_index"] for r in merged6["per_sample_latencies"]] == list(range(NUM_SAMPLES))
    for record in merged6["per_sample_latencies"] + merged6["per_sample_predictions"]:
        assert {"example_id", "image_id", "question", "answers"} <= set(record["metadata"])
        assert (record["max_crops"], record["top_k"], record["num_active_blocks"]) == (6, 8, 16)
    lat = merged6["per_sample_latencies"][0]
    # text tokens only: the prompt is the image block (start + 16 tokens + end per image array) then the text
    assert lat["num_vision_tokens"] == 16 * (lat["num_crops"] + 1)
    assert lat["num_total_tokens"] == lat["num_vision_tokens"] + 2 * (lat["num_crops"] + 1) + lat["num_language_tokens"]
    assert len(lat["T_decode_steps_ms"]) == lat["num_output_tokens"] - 1
    parts = lat["T_embed_ms"] + lat["T_prefill_ms"] + lat["T_prefill_head_ms"] + lat["T_decode_ms"]
    assert parts == pytest.approx(lat["T_total_ms"], rel=1e-6)
    assert 0 < lat["T_vision_ms"] < lat["T_embed_ms"]
    rank1 = load(root / "w2" / "exp6_latency_tiny-vqa" / "exp6_latency_crops6_topk8_blocks16_rank1.json")
    assert [r["dataset_index"] for r in rank1["per_sample_latencies"]] == [1]
    assert rank1["config"]["rank"] == 1 and "note" not in rank1["config"]


def test_ingest_reads_the_profile(profiled, tmp_path):
    root, _, _, _ = profiled
    ws = Workspace(tmp_path / "ws")
    report = run_ingest([root / "w1"], ws)
    assert report.exit_code == 0 and not report.errors
    rows = run_query(ws, "SELECT * FROM measurements ORDER BY experiment, sample_key, max_crops").to_pylist()
    assert len(rows) == 2 * NUM_SAMPLES * len(CONFIGS)
    keys = {e: {(r["sample_key"], r["max_crops"], r["top_k"], r["num_active_blocks"])
                for r in rows if r["experiment"] == e}
            for e in ("exp5", "exp6")}
    assert keys["exp5"] == keys["exp6"] and len(keys["exp6"]) == NUM_SAMPLES * len(CONFIGS)
    assert {k[0] for k in keys["exp6"]} == {f"ex:tiny_vqa-q{i}" for i in range(NUM_SAMPLES)}
    exp5 = {(r["sample_key"], r["max_crops"]): r for r in rows if r["experiment"] == "exp5"}
    for r in (r for r in rows if r["experiment"] == "exp6"):
        assert r["latency_prefill_ms"] is not None and r["latency_prefill_ms"] > 0
        assert r["latency_vision_ms"] is not None and r["latency_vision_ms"] > 0
        assert not r["flag_prefill_invalid"] and not r["flag_text_tokens_derived"] and not r["flag_decode_missing"]
        assert not r["flag_partial_config"] and r["num_crops"] >= 1
        assert 1 <= r["num_output_tokens"] <= MAX_NEW_TOKENS
        assert (r["latency_decode_ms"] > 0) == (r["num_output_tokens"] > 1)
        assert r["latency_total_ms"] > r["latency_prefill_ms"] + r["latency_vision_ms"]
        assert r["num_text_tokens"] > 0 and r["num_vision_tokens"] > 0
        assert r["source_kind"] == "exp6_merged"
        twin = exp5[(r["sample_key"], r["max_crops"])]
        assert (twin["score"], twin["pred"]) == (r["score"], r["pred"])  # the same generations
    samples = run_query(ws, "SELECT sample_key, example_id, image_id, question, answers FROM samples").to_pylist()
    assert len(samples) == NUM_SAMPLES and all(s["question"] and s["answers"] and s["image_id"] for s in samples)
    configs = run_query(ws, "SELECT * FROM configs WHERE experiment = 'exp6'").to_pylist()
    assert len(configs) == len(CONFIGS) and all(c["recorded_latency_vision_ms_mean"] > 0 for c in configs)
    files = run_query(ws, "SELECT status, count(*) AS n FROM files GROUP BY 1").to_pylist()
    assert files == [{"status": "ok", "n": 2 * (2 * len(CONFIGS) + 1)}]


def test_world_size_two_matches_world_size_one(profiled, tmp_path):
    root, _, _, _ = profiled
    tables = {}
    for world in ("w1", "w2"):
        ws = Workspace(tmp_path / world)
        assert run_ingest([root / world], ws).exit_code == 0
        tables[world] = run_query(ws, "SELECT experiment, sample_key, max_crops, top_k, num_active_blocks, score, "
                                      "pred, num_output_tokens, num_vision_tokens, num_text_tokens, num_crops, "
                                      "active_block_indices, source_kind FROM measurements ORDER BY ALL").to_pylist()
    assert tables["w1"] == tables["w2"]
    for world in ("w1", "w2"):  # merged files are identical apart from latencies and the world size
        out = root / world
        doc = load(out / "exp5_accuracy_tiny-vqa" / "exp5_accuracy_results_crops2_topk4_blocks12.json")
        tables[world] = ([(s["dataset_index"], s["score"], s["pred"], s["metadata"]) for s in doc["all_samples"]],
                         doc["summary"])
    assert tables["w1"] == tables["w2"]


def test_resume_skips_complete_configurations(profiled, embedded_runtime, tmp_path):
    import shutil

    root, dataset, _, _ = profiled
    out = tmp_path / "resume"
    shutil.copytree(root / "w2", out)
    again = run(dataset, out, embedded_runtime, world_size=2)
    assert again.measured == 0 and again.datasets[0].skipped_configs == CONFIGS
    # lose the merged files of one configuration and one of its rank files: only that rank is measured again
    exp5, exp6 = out / "exp5_accuracy_tiny-vqa", out / "exp6_latency_tiny-vqa"
    (exp5 / "exp5_accuracy_results_crops2_topk4_blocks12.json").unlink()
    (exp6 / "exp6_latency_crops2_topk4_blocks12.json").unlink()
    (exp6 / "exp6_latency_crops2_topk4_blocks12_rank1.json").write_text('{"summary": [')  # truncated by a crash
    again = run(dataset, out, embedded_runtime, world_size=2)
    assert again.measured == 1 and again.datasets[0].skipped_configs == [(6, 8, 16)]
    merged = load(exp6 / "exp6_latency_crops2_topk4_blocks12.json")
    assert [r["dataset_index"] for r in merged["per_sample_latencies"]] == list(range(NUM_SAMPLES))
    # another sample set in the same directory is refused, not mixed in
    from pipeline.errors import CtrlError

    with pytest.raises(CtrlError, match="different profiling run"):
        run(dataset, out, embedded_runtime, world_size=2, num_samples=2)


def test_the_execution_path_is_part_of_a_profiles_identity(profiled, embedded_runtime, tmp_path):
    import shutil

    from pipeline.errors import CtrlError

    root, dataset, _, _ = profiled
    out = tmp_path / "paths"
    shutil.copytree(root / "w1", out)
    exp6 = out / "exp6_latency_tiny-vqa"
    merged = load(exp6 / "exp6_latency_crops2_topk4_blocks12.json")["config"]["ctrl_profile"]
    assert merged["execution"] == {"compiled": True, "attention_dtype": "float32"}  # the fast path on a CPU
    rank = load(exp6 / "exp6_latency_crops2_topk4_blocks12_rank0.json")["config"]["ctrl_profile"]
    assert rank["cuda_graphs"] is False
    saved = embedded_runtime.fast is not None
    embedded_runtime.set_execution(False)
    try:
        with pytest.raises(CtrlError, match="execution path"):  # not resumed into by the eager path
            run(dataset, out, embedded_runtime)
        # files that record no path were written before it was recorded, by the eager path
        for path in out.rglob("*.json"):
            doc = load(path)
            block = doc.get("config", {}).get("ctrl_profile") if isinstance(doc.get("config"), dict) else None
            if isinstance(block, dict):
                block.pop("execution", None)
                path.write_text(json.dumps(doc))
        assert run(dataset, out, embedded_runtime).measured == 0
    finally:
        embedded_runtime.set_execution(saved)


def test_parse_configs():
    from pipeline.errors import CtrlError
    from profiler.sweep import parse_configs

    balanced, name = parse_configs("balanced")
    assert name == "balanced" and len(balanced) == 27
    assert {c for c, _, _ in balanced} == {2, 6, 10} and {b for _, _, b in balanced} == {12, 14, 16}
    assert len(parse_configs("full")[0]) == 75
    assert parse_configs(" 2/4/12, 6/8/16 ,2/4/12") == ([(2, 4, 12), (6, 8, 16)], "custom")
    for bad in ("2/4", "2/4/x", "", "2/0/12", "balance"):
        with pytest.raises(CtrlError, match="--configs"):
            parse_configs(bad)


def test_cli(profiled, embedded_runtime, tmp_path, monkeypatch):
    from cli import app

    _, dataset, _, _ = profiled
    monkeypatch.setattr("profiler.sweep.load_runtime", lambda *a, **k: embedded_runtime)
    runner = CliRunner()
    out = tmp_path / "cli"
    args = ["profile", "--dataset", str(dataset), "--configs", "2/4/12", "--num-samples", "1", "--max-new-tokens", "2",
            "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "1 generations measured" in result.stdout and f"ctrl ingest {out}" in result.stdout
    assert (out / "exp6_latency_tiny-vqa" / "exp6_latency_crops2_topk4_blocks12.json").is_file()
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "0 generations measured" in again.stdout and "1 done earlier" in again.stdout

    def fails(*extra: str, dataset_dir: Path = dataset) -> str:
        res = runner.invoke(app, ["profile", "--dataset", str(dataset_dir), "--out", str(tmp_path / "x"), *extra])
        assert res.exit_code == 1 and "Traceback" not in res.output, res.output
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        return res.stderr

    assert "bad entry '2/4'" in fails("--configs", "2/4")
    assert "no such directory" in fails(dataset_dir=tmp_path / "nope")
    broken = make_dataset(tmp_path / "broken", n=2, name="broken")
    (broken / "images" / "img1.png").unlink()
    assert "1 of 2 images missing" in fails(dataset_dir=broken)
    assert "top_k must be in 1..64" in fails("--configs", "2/65/12")


def test_testbed_model_must_be_trained_first(monkeypatch, tmp_path):
    from pipeline.errors import CtrlError
    from runtime import load_runtime

    monkeypatch.setenv("CTRL_CACHE_DIR", str(tmp_path))  # an empty cache: nothing is trained implicitly
    with pytest.raises(CtrlError, match="--model testbed: the trained testbed is not in the cache; "
                                        "run `ctrl testbed train`"):
        load_runtime("testbed")
    assert list(tmp_path.iterdir()) == []


def test_parser_honours_the_profile_marker(tmp_path):
    """The same exp6 file: without the marker the origin's defects are flagged (D1, D10 of docs/origin_format.md); with
    ``config.ctrl_profile_version`` the recorded prefill, vision time and text-only counts are kept."""
    from origin_files import exp6_config_doc, exp6_name, write
    from pipeline.errors import IngestError
    from pipeline.parse import parse_file

    def parse(doc: dict, name: str) -> list[dict]:
        path = write(tmp_path / name / exp6_name(2, 4, 12, rank=0), doc)
        return parse_file(path, path.read_bytes()).measurements.to_pylist()

    doc = exp6_config_doc(2, 4, 12, [0, 1], merged=False)
    for lat in doc["per_sample_latencies"]:
        lat.update(T_vision_ms=12.5, num_crops=2)
    origin = parse(doc, "origin")
    assert all(r["flag_prefill_invalid"] and r["latency_prefill_ms"] is None and r["latency_vision_ms"] is None
               and r["flag_text_tokens_derived"] and r["num_text_tokens"] == 40 for r in origin)
    doc["config"]["ctrl_profile_version"] = 1
    fixed = parse(doc, "fixed")
    assert all(not r["flag_prefill_invalid"] and r["latency_prefill_ms"] == 6.5 == r["latency_prefill_raw_ms"]
               and r["latency_vision_ms"] == 12.5 and r["num_crops"] == 2 and not r["flag_text_tokens_derived"]
               and r["num_text_tokens"] == 3 * 144 + 40 for r in fixed)
    assert [r["sample_key"] for r in fixed] == [r["sample_key"] for r in origin]
    doc["config"]["ctrl_profile_version"] = "one"
    with pytest.raises(IngestError, match="ctrl_profile_version"):
        parse(doc, "bad")


def _torchrun_worker(rank: int, dataset: str, out: str, model_dir: str) -> None:
    from profiler.sweep import ProfileConfig, profile_model

    config = ProfileConfig(datasets=[Path(dataset)], model=model_dir, configs=CONFIGS, out_dir=Path(out),
                           num_samples=NUM_SAMPLES, max_new_tokens=MAX_NEW_TOKENS)
    report = profile_model(config)
    Path(out, f"measured-rank{rank}.json").write_text(json.dumps(report.measured))


def test_torchrun_processes_measure_their_ranks_and_rank0_merges(profiled, embedded_runtime, tmp_path):
    """Two processes (as torchrun starts them): each measures its own rank files; rank 0 merges
    them into the same records as the simulated world size 2."""
    from torchrun import run_ranks

    root, dataset, _, _ = profiled
    run_ranks(_torchrun_worker, (str(dataset), str(tmp_path / "out"), str(embedded_runtime.path)))
    # rank r measured its share only: samples r, r+2, ... of every configuration
    assert [json.loads((tmp_path / "out" / f"measured-rank{r}.json").read_text()) for r in (0, 1)] == [
        2 * len(CONFIGS), 1 * len(CONFIGS)]
    name = "exp5_accuracy_results_crops2_topk4_blocks12.json"
    merged = load(tmp_path / "out" / "exp5_accuracy_tiny-vqa" / name)
    simulated = load(root / "w2" / "exp5_accuracy_tiny-vqa" / name)
    def records(doc: dict) -> list:
        return [(s["dataset_index"], s["rank"], s["score"], s["pred"], s["metadata"]) for s in doc["all_samples"]]

    assert records(merged) == records(simulated)
    assert merged["config"]["world_size"] == 2 and merged["config"]["ctrl_profile"]["complete"] is True
    assert (tmp_path / "out" / "exp6_latency_tiny-vqa" / "exp6_latency_results.json").is_file()


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_archive_round_trip_is_byte_identical(profiled, tmp_path):
    from profiler.archive import pack_profile, unpack_profile

    root, _, _, _ = profiled
    for world in ("w1", "w2"):
        archive = tmp_path / f"{world}.parquet"
        rows = pack_profile(root / world, archive)
        assert rows == NUM_SAMPLES * len(CONFIGS)
        report = unpack_profile(archive, tmp_path / f"{world}-unpacked")
        original, unpacked = _tree_bytes(root / world), _tree_bytes(tmp_path / f"{world}-unpacked")
        assert report.files == len(original) and report.datasets == ["tiny_vqa"]
        assert unpacked.keys() == original.keys()
        assert [name for name in original if unpacked[name] != original[name]] == []


def test_archive_refuses_foreign_trees(profiled, tmp_path):
    from pipeline.errors import CtrlError
    from profiler.archive import pack_profile, unpack_profile

    root, _, _, _ = profiled
    with pytest.raises(CtrlError, match="not a ctrl profile output directory"):
        pack_profile(tmp_path, tmp_path / "a.parquet")
    tree = tmp_path / "edited"
    import shutil

    shutil.copytree(root / "w1", tree)
    rank = tree / "exp6_latency_tiny-vqa" / "exp6_latency_crops2_topk4_blocks12_rank0.json"
    doc = load(rank)
    del doc["config"]["ctrl_profile_version"]
    rank.write_text(json.dumps(doc))
    with pytest.raises(CtrlError, match="exp6_latency_crops2_topk4_blocks12_rank0.json: .*not a complete ctrl profile"):
        pack_profile(tree, tmp_path / "b.parquet")
    shutil.copy(root / "w1" / rank.relative_to(tree), rank)  # back to the original
    summary = tree / "exp5_accuracy_tiny-vqa" / "exp5_accuracy_results_crops2_topk4_blocks12_rank0.json"
    doc = load(summary)
    doc["summary"][0]["accuracy"] = 0.123  # edited by hand: the archive would not give it back
    summary.write_text(json.dumps(doc, indent=2) + "\n")
    with pytest.raises(CtrlError, match="exp5_accuracy_results_crops2_topk4_blocks12_rank0.json: not reproducible"):
        pack_profile(tree, tmp_path / "c.parquet")
    plain = tmp_path / "plain.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1]}), plain)
    with pytest.raises(CtrlError, match="plain.parquet: not a ctrl profile archive"):
        unpack_profile(plain, tmp_path / "out")


def test_results_files_hold_a_record_per_line(tmp_path):
    from profiler.tree import write_json

    doc = {"summary": [{"top_k": 8, "latency_total_ms": {"P50": 1.5}}],
           "per_sample_latencies": [{"sample_id": 0, "T_total_ms": 2.25}, {"sample_id": 1, "T_total_ms": 3.0}],
           "config": {"dataset_name": "docvqa", "active_block_indices": [0, 1, 15], "ctrl_profile": {}},
           "empty": []}
    write_json(tmp_path / "r.json", doc)
    assert (tmp_path / "r.json").read_text() == """{
  "summary": [
    {"top_k": 8, "latency_total_ms": {"P50": 1.5}}
  ],
  "per_sample_latencies": [
    {"sample_id": 0, "T_total_ms": 2.25},
    {"sample_id": 1, "T_total_ms": 3.0}
  ],
  "config": {
    "dataset_name": "docvqa",
    "active_block_indices": [0, 1, 15],
    "ctrl_profile": {}
  },
  "empty": []
}
"""
    with pytest.raises(ValueError, match="not JSON compliant"):
        write_json(tmp_path / "nan.json", {"per_sample_latencies": [{"T_total_ms": float("nan")}]})
    assert not (tmp_path / "nan.json").exists()


def test_a_generation_that_captured_a_graph_is_timed_again(embedded_runtime, tmp_path):
    """With CUDA graphs a sample of a new shape captures inside its generation (a one-time 0.1-0.3 s
    on a GPU): its latency is measured on a second generation instead. Graphs with the rerun backend
    stand in for a GPU's (runtime.cuda_graphs)."""
    from runtime.cuda_graphs import GraphCache, RerunBackend
    from runtime.fast_decoder import CpuFormulation, CudaFormulation
    from testbed.dataset import VqaSample, write_dataset

    dataset = tmp_path / "shapes"
    (dataset / "images").mkdir(parents=True)
    samples = []
    for i, size in enumerate([(64, 64), (1200, 160), (160, 1200)]):  # 1 crop, then two wide tilings
        Image.new("RGB", size, (200, 40 * i, 40)).save(dataset / "images" / f"img{i}.png")
        samples.append(VqaSample(f"shapes-q{i}", f"img{i}", "What colour is it?", ("red",) * 3, "colour"))
    write_dataset(dataset, "shapes", "validation", samples)
    decoder = embedded_runtime.fast
    decoder.use(CudaFormulation(decoder, grouped=True), GraphCache(RerunBackend()), GraphCache(RerunBackend()))
    calls: list[tuple[int, bool]] = []  # (prompt tokens, whether the call captured)
    generate = embedded_runtime.generate

    def counted(inputs, max_new_tokens):
        before = embedded_runtime.graph_captures
        result = generate(inputs, max_new_tokens)
        calls.append((int(inputs.input_ids.shape[1]), embedded_runtime.graph_captures > before))
        return result

    embedded_runtime.generate = counted
    try:
        run(dataset, tmp_path / "out", embedded_runtime, configs=[(6, 8, 16)], num_samples=3, warmup=1)
    finally:
        del embedded_runtime.generate
        decoder.use(CpuFormulation(decoder))
    measured = calls[1:]  # after the configuration's warm-up
    assert any(captured for _, captured in measured), "no sample of a new shape: the test checks nothing"
    # every generation that captured is followed by one of the same prompt that did not: the timed one
    for (tokens, captured), (next_tokens, next_captured) in zip(measured, measured[1:]):
        if captured:
            assert next_tokens == tokens and not next_captured
    assert not measured[-1][1]
    assert len(measured) == 3 + sum(captured for _, captured in measured)


# -- batched profiles --------------------------------------------------------------------------

def test_a_batched_profile_gives_batch_ones_answers_and_times_a_seeded_subset(profiled, embedded_runtime, tmp_path):
    from pipeline.errors import CtrlError
    from profiler.archive import pack_profile

    root, dataset, _, _ = profiled
    out = tmp_path / "b2"
    report = run(dataset, out, embedded_runtime, num_samples=4, batch_size=3, latency_samples=2, latency_seed=5,
                 world_size=2)
    assert report.measured == 4 * len(CONFIGS)
    alone = run(dataset, tmp_path / "b1", embedded_runtime, num_samples=4)
    exp5, exp6 = out / "exp5_accuracy_tiny-vqa", out / "exp6_latency_tiny-vqa"
    for c, k, b in CONFIGS:
        batched = load(exp5 / f"exp5_accuracy_results_crops{c}_topk{k}_blocks{b}.json")
        name = f"exp5_accuracy_results_crops{c}_topk{k}_blocks{b}.json"
        single = load(tmp_path / "b1" / "exp5_accuracy_tiny-vqa" / name)
        assert [(s["dataset_index"], s["text"]) for s in batched["all_samples"]] == [
            (s["dataset_index"], s["text"]) for s in single["all_samples"]]
        assert batched["config"]["batch_size"] == 3
        assert batched["config"]["ctrl_profile"]["latency_samples"] == 2
        timed = load(exp6 / f"exp6_latency_crops{c}_topk{k}_blocks{b}.json")
        indices = [r["dataset_index"] for r in timed["per_sample_latencies"]]
        # random.Random(5).sample(range(4), 2), sorted
        assert indices == [2, 3]
        assert timed["config"]["batch_size"] == 1
        assert [p["dataset_index"] for p in timed["per_sample_predictions"]] == indices
    # ingest reads it: exp6 rows for the subset only, exp5 for every sample
    ws = Workspace(tmp_path / "ws")
    assert run_ingest([out], ws).exit_code == 0
    counts = run_query(ws, "SELECT experiment, count(*) AS n FROM measurements GROUP BY 1 ORDER BY 1").to_pylist()
    assert counts == [{"experiment": "exp5", "n": 4 * len(CONFIGS)}, {"experiment": "exp6", "n": 2 * len(CONFIGS)}]
    # resumed: nothing measured again; another batch size is another run's directory
    assert run(dataset, out, embedded_runtime, num_samples=4, batch_size=3, latency_samples=2, latency_seed=5,
               world_size=2).measured == 0
    with pytest.raises(CtrlError, match="batch size or latency samples"):
        run(dataset, out, embedded_runtime, num_samples=4, batch_size=2, latency_samples=2, latency_seed=5,
            world_size=2)
    with pytest.raises(CtrlError, match="the archive holds batch-1 profiles only"):
        pack_profile(out, tmp_path / "p.parquet")
    assert alone.measured == 4 * len(CONFIGS)


def test_batch_size_one_writes_todays_files(profiled, embedded_runtime, tmp_path):
    """--batch-size 1 with every sample timed records nothing new: the files of a run without the options."""
    root, dataset, _, _ = profiled
    out = tmp_path / "same"
    run(dataset, out, embedded_runtime, batch_size=1, latency_samples=NUM_SAMPLES, latency_seed=3)
    doc = load(out / "exp6_latency_tiny-vqa" / "exp6_latency_crops2_topk4_blocks12.json")
    assert not {"batch_size", "latency_samples", "latency_seed"} & set(doc["config"]["ctrl_profile"])
    # a latency subset at batch size 1 times those samples of the same generations
    sub = tmp_path / "sub"
    run(dataset, sub, embedded_runtime, latency_samples=1)
    doc5 = load(sub / "exp5_accuracy_tiny-vqa" / "exp5_accuracy_results_crops2_topk4_blocks12.json")
    doc6 = load(sub / "exp6_latency_tiny-vqa" / "exp6_latency_crops2_topk4_blocks12.json")
    assert len(doc5["all_samples"]) == NUM_SAMPLES and len(doc6["per_sample_latencies"]) == 1
    assert doc5["config"]["batch_size"] == 1


def test_an_interrupted_batched_profile_resumes(profiled, embedded_runtime, tmp_path):
    from profiler.sweep import ProfileConfig, profile_model

    root, dataset, _, _ = profiled
    out = tmp_path / "cut"
    config = ProfileConfig(datasets=[dataset], configs=CONFIGS, out_dir=out, num_samples=NUM_SAMPLES,
                           max_new_tokens=MAX_NEW_TOKENS, batch_size=2)

    def stop_in_the_second_configuration(n: int, label: str) -> None:
        if "crops6" in label and "latency" in label:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        profile_model(config, runtime=embedded_runtime, progress=stop_in_the_second_configuration)
    again = profile_model(config, runtime=embedded_runtime)
    # the first configuration's rank file was complete: only the second is generated again
    assert again.datasets[0].skipped_configs == [] and again.measured == NUM_SAMPLES
    fresh = run(dataset, tmp_path / "whole", embedded_runtime, batch_size=2)
    for name in ("exp5_accuracy_tiny-vqa/exp5_accuracy_results_crops6_topk8_blocks16.json",
                 "exp5_accuracy_tiny-vqa/exp5_accuracy_results_crops2_topk4_blocks12.json"):
        assert [s["text"] for s in load(out / name)["all_samples"]] == [
            s["text"] for s in load(tmp_path / "whole" / name)["all_samples"]]
    assert fresh.measured == NUM_SAMPLES * len(CONFIGS)
