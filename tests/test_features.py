"""ctrl extract-features with the real embedded model on a small generated tree with images."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import run_ingest
from pipeline import Workspace, run_query
from synthetic import SyntheticSpec, generate_tree
from torchrun import run_ranks

SMALL = dict(max_crops=(2, 10), top_k=(4, 12), num_active_blocks=(12, 16))


@pytest.fixture(scope="module")
def runtime(embedded_runtime):
    return embedded_runtime


@pytest.fixture
def feature_ws(tmp_path) -> tuple[Workspace, Path]:
    tree = generate_tree(SyntheticSpec(datasets=("coco_2014_vqa", "text_vqa"), num_samples=10, **SMALL),
                         tmp_path / "data")
    ws = Workspace(tmp_path / "ws")
    assert run_ingest([tree.exp5_dir, tree.exp6_dir], ws).exit_code == 0
    return ws, tree.images_dir


@pytest.fixture
def vision_calls(runtime):
    """Counts forward calls of the vision tower while the test runs."""
    calls = [0]
    handle = runtime.vision_module.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    yield calls
    handle.remove()


def test_features_for_every_sample_and_views(runtime, feature_ws):
    from features import FeatureConfig, extract_features

    ws, images = feature_ws
    report = extract_features(FeatureConfig(workspace=ws.root, images_dir=images, batch_size=4, chunk_size=8),
                              runtime=runtime)
    assert report.num_samples == 20 and report.computed == 20 and report.cached == 0
    assert report.missing_images == [] and report.unreadable_images == []
    img = pl.from_arrow(run_query(ws, "SELECT * FROM image_features ORDER BY dataset, sample_key"))
    lang = pl.from_arrow(run_query(ws, "SELECT * FROM lang_features"))
    assert img.height == lang.height == 20
    assert (img["image_status"] == "ok").all() and img["model_fingerprint"].unique().to_list() == [runtime.fingerprint]
    assert {len(v) for v in img["feature"].to_list()} == {runtime.image_feature_dim}
    assert {len(v) for v in lang["feature"].to_list()} == {runtime.lang_feature_dim}
    tilings = pl.from_arrow(run_query(ws, "SELECT * FROM image_tilings"))
    assert tilings.height == 20 * 15
    row = img.row(0, named=True)
    sample_tilings = tilings.filter((pl.col("sample_key") == row["sample_key"]) & (pl.col("dataset") == row["dataset"]))
    assert (sample_tilings.filter(pl.col("max_crops") == row["reference_max_crops"])["num_crops"].item()
            == row["num_crops"])
    assert (sample_tilings["num_crops"] <= sample_tilings["max_crops"]).all()


def test_both_image_features_come_from_one_vision_pass(runtime, feature_ws, vision_calls):
    """``feature``: all tokens at the reference crops; ``global_feature``: the global crop's tokens,
    which the vision module gives for the global image alone; one vision call per batch."""
    import torch
    from PIL import Image

    from features import FeatureConfig, extract_features

    ws, images = feature_ws
    report = extract_features(FeatureConfig(workspace=ws.root, images_dir=images, batch_size=4, chunk_size=8),
                              runtime=runtime)
    assert report.computed == 20 and vision_calls[0] == 5  # 20 samples in batches of 4
    rows = run_query(ws, "SELECT image_path, reference_max_crops, feature, global_feature FROM image_features "
                         "ORDER BY dataset, sample_key").to_pylist()
    assert {len(r["global_feature"]) for r in rows} == {runtime.image_feature_dim}
    for r in rows[:3]:
        image = Image.open(r["image_path"]).convert("RGB")
        alone = runtime.preprocess(image, "", 1).images[:1]  # the global image, the same at any max_crops
        with torch.inference_mode():
            expected = runtime.vision_module(alone)[0].mean(0)
        torch.testing.assert_close(torch.tensor(r["global_feature"]), expected, rtol=1e-5, atol=1e-6)
        reference = runtime.image_features([runtime.preprocess(image, "", r["reference_max_crops"])])[0]
        torch.testing.assert_close(torch.tensor(r["feature"]), reference, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(torch.tensor(r["feature"]), expected, atol=1e-3)


def test_chunks_without_the_global_feature_are_recomputed_without_force(runtime, feature_ws):
    """A chunk an older ctrl wrote (no global_feature) is named by ctrl doctor, refused by the
    readers with the hint to run extract-features, and computed again by it without --force."""
    from features import FeatureConfig, extract_features
    from online.data import load_online_samples
    from pipeline import CtrlError
    from pipeline.catalog import build_catalog
    from pipeline.health import check_workspace, feature_chunk_problem
    from trainer.data import load_offline_data

    ws, images = feature_ws
    config = FeatureConfig(workspace=ws.root, images_dir=images, batch_size=4, chunk_size=8)
    assert extract_features(config, runtime=runtime).computed == 20
    before = run_query(ws, "SELECT sample_key, global_feature FROM image_features ORDER BY 1").to_pylist()
    chunks = sorted(ws.features_dir.glob("*/chunk-*"))

    def make_old(chunk: Path) -> None:
        table = pq.read_table(chunk / "image_features.parquet")
        pq.write_table(table.drop_columns(["global_feature"]), chunk / "image_features.parquet")
        build_catalog(ws)

    def stale(n: int) -> str:
        return (rf"^{n} cached image features of model {runtime.fingerprint[:16]} have no global_feature \(written "
                r"by an older ctrl\)\nHint: run `ctrl extract-features` with the same --model and --images")

    make_old(chunks[0])
    why = "image_features.parquet was written by an older ctrl (no column global_feature)"
    assert feature_chunk_problem(chunks[0]) == why
    assert [(p.path, p.problem) for p in check_workspace(ws)] == [(chunks[0], why)]
    for read in (lambda: load_offline_data(ws), lambda: load_online_samples(ws, runtime.fingerprint)):
        with pytest.raises(CtrlError, match=stale(8)):
            read()
    assert extract_features(config, runtime=runtime).computed == 8
    for chunk in sorted(ws.features_dir.glob("*/chunk-*")):  # every chunk old: the view has no such column
        make_old(chunk)
    with pytest.raises(CtrlError, match=stale(20)):
        load_offline_data(ws)
    again = extract_features(config, runtime=runtime)
    assert again.computed == 20 and again.cached == 0
    assert check_workspace(ws) == []
    assert run_query(ws, "SELECT sample_key, global_feature FROM image_features ORDER BY 1").to_pylist() == before
    assert load_offline_data(ws).image_present.all()


def test_second_run_does_no_forward_pass(runtime, feature_ws, vision_calls):
    from features import FeatureConfig, extract_features

    ws, images = feature_ws
    config = FeatureConfig(workspace=ws.root, images_dir=images, batch_size=4, chunk_size=8)
    first = extract_features(config, runtime=runtime)
    before = run_query(ws, "SELECT sample_key, feature FROM image_features ORDER BY dataset, sample_key").to_pylist()
    calls = vision_calls
    calls[0] = 0
    second = extract_features(config, runtime=runtime)
    assert first.computed == 20 and second.computed == 0 and second.cached == 20
    assert second.forward_batches == 0 and calls[0] == 0
    forced = extract_features(FeatureConfig(workspace=ws.root, images_dir=images, batch_size=4, chunk_size=8,
                                            force=True), runtime=runtime)
    assert forced.computed == 20 and calls[0] > 0
    after = run_query(ws, "SELECT sample_key, feature FROM image_features ORDER BY dataset, sample_key").to_pylist()
    assert after == before  # recomputation is deterministic


def test_interrupted_run_resumes(runtime, feature_ws):
    from features import FeatureConfig, extract_features

    ws, images = feature_ws
    config = FeatureConfig(workspace=ws.root, images_dir=images, batch_size=4, chunk_size=8)
    seen = [0]

    def interrupt(n: int) -> None:
        seen[0] += n
        if seen[0] > 8:  # after the first chunk was written, during the second
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        extract_features(config, runtime=runtime, progress=interrupt)
    resumed = extract_features(config, runtime=runtime)
    assert resumed.cached == 8 and resumed.computed == 12
    keys = run_query(ws, "SELECT count(*) AS n, count(DISTINCT (dataset, sample_key)) AS k "
                         "FROM lang_features").to_pylist()[0]
    assert keys == {"n": 20, "k": 20}


def test_missing_and_unreadable_images_are_reported(runtime, feature_ws):
    from features import FeatureConfig, extract_features

    ws, images = feature_ws
    files = sorted(images.iterdir())
    files[0].unlink()
    files[1].write_bytes(b"not an image")
    report = extract_features(FeatureConfig(workspace=ws.root, images_dir=images), runtime=runtime)
    assert report.computed == 20 and report.missing_images and report.unreadable_images
    rows = run_query(ws, "SELECT image_status, feature IS NULL AS null_feature FROM image_features").to_pylist()
    assert ({(r["image_status"], r["null_feature"]) for r in rows}
            == {("ok", False), ("missing", True), ("unreadable", True)})


def test_images_looked_up_elsewhere_are_found_on_the_next_run(runtime, feature_ws, tmp_path):
    from features import FeatureConfig, extract_features

    ws, images = feature_ws
    empty = tmp_path / "no-images-here"
    empty.mkdir()

    def run(images_dir: Path):
        config = FeatureConfig(workspace=ws.root, images_dir=images_dir, batch_size=4, chunk_size=8)
        return extract_features(config, runtime=runtime)

    first = run(empty)
    assert first.computed == 20 and len(first.missing_images) > 0
    statuses = run_query(ws, "SELECT DISTINCT image_status FROM image_features").to_pylist()
    assert statuses == [{"image_status": "missing"}]
    # the same lookup again: cached, nothing recomputed
    again = run(empty)
    assert again.computed == 0 and again.cached == 20
    # another images directory: the samples whose image was missing are computed again, and found
    right = run(images)
    assert right.computed == 20 and right.missing_images == []
    assert list(ws.features_dir.glob("*/.*")) == []  # the dropped chunks leave nothing behind
    rows = run_query(ws, "SELECT image_status, count(*) AS n, count(DISTINCT (dataset, sample_key)) AS k "
                         "FROM image_features GROUP BY 1").to_pylist()
    assert rows == [{"image_status": "ok", "n": 20, "k": 20}]


def test_a_deleted_chunk_is_computed_again(runtime, feature_ws):
    from features import FeatureConfig, extract_features

    ws, images = feature_ws
    config = FeatureConfig(workspace=ws.root, images_dir=images, batch_size=4, chunk_size=8)
    assert extract_features(config, runtime=runtime).computed == 20
    chunks = sorted(p for p in ws.features_dir.glob("*/chunk-*"))
    assert len(chunks) == 3
    shutil.rmtree(chunks[0])  # the first of three: a new chunk must not take a name still in use
    again = extract_features(config, runtime=runtime)
    assert again.computed == 8 and again.cached == 12
    # a damaged chunk (random bytes over one of its tables) leaves the cache and is computed again
    damaged = sorted(p for p in ws.features_dir.glob("*/chunk-*"))[0] / "image_features.parquet"
    damaged.write_bytes(b"\x00garbage" * 50)
    repaired = extract_features(config, runtime=runtime)
    assert repaired.computed == 8 and repaired.cached == 12
    keys = run_query(ws, "SELECT count(*) AS n, count(DISTINCT (dataset, sample_key)) AS k "
                         "FROM lang_features").to_pylist()[0]
    assert keys == {"n": 20, "k": 20}
    # the same size, other bytes inside (bit rot): its checksum finds it, doctor names it, and it is computed again
    from pipeline.health import check_workspace

    chunk = sorted(p for p in ws.features_dir.glob("*/chunk-*"))[1]
    table = chunk / "lang_features.parquet"
    data = bytearray(table.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 32):
        data[i] ^= 0x5A
    table.write_bytes(bytes(data))
    assert [(p.path, p.problem) for p in check_workspace(ws)] == [
        (chunk, "lang_features.parquet differs from what was written (SHA-256)")]
    rotted = extract_features(config, runtime=runtime)
    assert rotted.computed == 8 and rotted.cached == 12 and check_workspace(ws) == []


def test_cli_extract_features(runtime, feature_ws, monkeypatch):
    from cli import app

    ws, images = feature_ws
    monkeypatch.setattr("features.extract.load_runtime", lambda *a, **k: runtime)
    result = CliRunner().invoke(app, ["extract-features", "-w", str(ws.root), "--images", str(images),
                                      "--batch-size", "8"])
    assert result.exit_code == 0, result.output
    assert "features for 20 samples" in result.stdout and "20 computed" in result.stdout
    status = CliRunner().invoke(app, ["query", "-w", str(ws.root), "SELECT count(*) AS n FROM lang_features",
                                      "--format", "json"])
    assert json.loads(status.stdout) == [{"n": 20}]
    summary = json.loads(CliRunner().invoke(app, ["status", "-w", str(ws.root), "--json"]).stdout)
    assert summary["features"] == [{"model": runtime.fingerprint[:16], "samples": 20, "images_ok": 20,
                                    "images_missing": 0}]


def test_fully_cached_run_never_loads_the_model(runtime, feature_ws, monkeypatch):
    from features import FeatureConfig, extract_features

    ws, images = feature_ws
    config = FeatureConfig(workspace=ws.root, images_dir=images)
    extract_features(config, runtime=runtime)

    def refuse(*args, **kwargs):
        msg = "the model was loaded although every feature is cached"
        raise AssertionError(msg)

    monkeypatch.setattr("features.extract.load_runtime", refuse)
    report = extract_features(config)  # fingerprint from the model directory alone
    assert report.cached == 20 and report.computed == 0 and report.fingerprint == runtime.fingerprint


# -- torchrun ---------------------------------------------------------------------------------

def _torchrun_worker(rank: int, ws_root: str, images: str, model_dir: str, out: str, fail_after: int) -> None:
    """One rank of ``extract-features``; writes its report or its error (a hang shows as a timeout).
    With ``fail_after`` > 0, rank 1 raises in its batch number ``fail_after``."""
    import features.extract
    from features import FeatureConfig, extract_features

    if rank == 1 and fail_after:
        compute, calls = features.extract._compute_batch, [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == fail_after:
                msg = "CUDA out of memory"
                raise RuntimeError(msg)
            return compute(*args, **kwargs)

        features.extract._compute_batch = failing
    config = FeatureConfig(workspace=Path(ws_root), images_dir=Path(images), model=model_dir, batch_size=4,
                           chunk_size=6)
    try:
        report = extract_features(config)
        result = {"computed": report.computed, "cached": report.cached, "forward_batches": report.forward_batches}
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _run_two_ranks(ws: Workspace, images: Path, model_dir: Path, out: Path, fail_after: int = 0) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    run_ranks(_torchrun_worker, (str(ws.root), str(images), str(model_dir), str(out), fail_after))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _cache(ws: Workspace) -> dict[str, pa.Table]:
    """Every file of the feature cache (chunk/table -> its rows)."""
    return {str(p.relative_to(ws.features_dir)): pq.read_table(p) for p in sorted(ws.features_dir.rglob("*.parquet"))}


def test_two_ranks_write_the_single_process_cache(runtime, feature_ws, tmp_path):
    """Two processes (as torchrun starts them, gloo) share the batches and rank 0 writes: a rank
    that fails stops both with its error, the finished chunks stay, and the resumed run leaves
    the cache one process writes (the same chunks, rows and values)."""
    from features import FeatureConfig, extract_features

    ws, images = feature_ws
    twin = Workspace(tmp_path / "twin")
    shutil.copytree(ws.root, twin.root)
    single = extract_features(FeatureConfig(workspace=ws.root, images_dir=images, batch_size=4, chunk_size=6),
                              runtime=runtime)
    assert single.computed == 20
    # chunks of 6, 6, 6, 2 in rounds of two chunks; in each round rank 0 computes batches 0, 2, ...
    # and rank 1 batches 1, 3, ...: rank 1 fails in its third batch, in the second round
    failed = _run_two_ranks(twin, images, runtime.path, tmp_path / "failed", fail_after=3)
    assert failed == [{"error": "RankFailedError: rank 1 of 2 failed: RuntimeError: CUDA out of memory"},
                      {"error": "RuntimeError: CUDA out of memory"}]
    assert sorted({name.split("/")[1] for name in _cache(twin)}) == ["chunk-00000", "chunk-00001"]
    resumed = _run_two_ranks(twin, images, runtime.path, tmp_path / "resumed")
    assert resumed[0]["computed"] == 8 and resumed[0]["cached"] == 12
    assert resumed[1]["computed"] == 2  # its share: batch 1 of the chunks of 6 and 2
    mine, theirs = _cache(ws), _cache(twin)
    assert sorted(theirs) == sorted(mine) and len(mine) == 4 * 3
    for name, table in mine.items():
        assert theirs[name].equals(table), name


@pytest.mark.parametrize(("options", "message"), [
    (dict(batch_size=0), r"^batch_size must be >= 1, got 0$"),
    (dict(batch_size=8, chunk_size=4), r"^chunk_size \(4\) must be >= batch_size \(8\)$"),
    (dict(device="gpu"), r"^device must be cpu or cuda, got 'gpu'$"),
    (dict(device="cuda1"), r"^device must be cpu or cuda, got 'cuda1'$"),
    (dict(images_dir=Path("/nonexistent/images")), r"^--images /nonexistent/images is not a directory$"),
])
def test_feature_options_are_checked_with_one_line(options, message):
    from features import FeatureConfig
    from pipeline.errors import CtrlError

    with pytest.raises(CtrlError, match=message):
        FeatureConfig(**options)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_feature_devices_accepted_without_a_gpu(device):
    from features import FeatureConfig

    assert FeatureConfig(device=device, batch_size=4, chunk_size=4).device == device


def test_each_torchrun_rank_takes_its_own_gpu(monkeypatch):
    from runtime import ModelLoadError
    from runtime.distributed import local_device

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert local_device("cuda") == "cuda" and local_device("cuda:1") == "cuda:1"  # one process: as given
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_device("cuda") == "cuda:1" and local_device("cpu") == "cpu"
    with pytest.raises(ModelLoadError, match="--device cuda:0 under torchrun with 2 ranks would put every rank"):
        local_device("cuda:0")
