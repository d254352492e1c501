"""Documented behaviour of the ctrl commands, each pinned through the command line.

Every test names the claim it pins (README, docs/*.md). Models run for real: the embedded model,
the trained testbed and a tiny random-weight MolmoE checkpoint (``tiny_molmoe_dir``); monkeypatching
only stands in for what a test cannot do otherwise (a Ctrl-C, a kill, a clock that does not drift).
Expected values are written from the documented behaviour, never computed with the code under test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
import torch
from typer.testing import CliRunner

from cli import app
from conftest import build_feature_workspace, run_ingest, shard
from origin_files import exp6_config_doc, exp6_name, write
from pipeline import Workspace
from synthetic import SyntheticSpec

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def copy_workspace(ws: Workspace, dest: Path) -> Workspace:
    """A private copy of a workspace (its catalog rebuilt: views name the copy's files)."""
    from pipeline.catalog import build_catalog

    copy = Workspace(shutil.copytree(ws.root, dest))
    build_catalog(copy)
    return copy


@pytest.fixture(scope="module")
def features_ws(tmp_path_factory, embedded_runtime) -> Workspace:
    """24 samples (12 per dataset), ingested, with features of the embedded model; no runs.
    Tests that write runs work on a copy."""
    return build_feature_workspace(tmp_path_factory.mktemp("behaviour"), embedded_runtime,
                                   SyntheticSpec(num_samples=12))[1]


# -- claim 1: `ctrl train --online --resume RUN` continues exactly where the run stopped --------------

#: a fresh controller, 2 groups of 3 rollouts per step, a checkpoint every step; the soft reward's
#: complexity term makes a group's rewards differ even where the answers score alike
ONLINE = ("--samples-per-step", "2", "--group-size", "3", "--max-new-tokens", "3", "--budget-min-ms", "30",
          "--budget-max-ms", "300", "--checkpoint-every", "1", "--no-evaluate", "--reward-mode", "soft",
          "--lr", "0.01", "--seed", "7", "--fresh")
ROLLOUT_COLUMNS = ["step", "group_index", "member", "sample_key", "budget_ms", "max_crops", "insertion_position",
                   "top_k", "num_active_blocks", "active_block_indices", "generated_text", "score",
                   "latency_total_ms", "reward", "log_prob"]
STEP_COLUMNS = ["step", "loss", "reward/mean", "reward/acc_term", "reward/lat_pen", "reward/viol_pen",
                "reward/complexity", "reward/bonus", "accuracy", "latency_ms_mean", "violation_rate", "groups",
                "zero_variance_groups", "rollouts", "prefixes", "grad_norm"]


def _flatten(value, prefix: str = "") -> dict:
    """A nested state (dicts, lists, tensors) as {path: leaf}."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}/").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flatten(item, f"{prefix}{i}/").items()}
    return {prefix: value}


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_online_resume_gives_the_uninterrupted_run(features_ws, tmp_path, monkeypatch):
    """Claim (docs/online.md): `--resume RUN` continues from the last checkpoint, optimizer
    included, and each step's randomness is a function of (seed, step), so resuming draws what an
    uninterrupted run would have. 3 steps in one go (whole) against 1 step, then `--resume` to 3
    (cut): steps 2-3 sample the same knobs, generate the same answers, earn the same rewards, log
    the same rows, and both end with the same controller and optimizer state. Every timed
    segment reads 1 ms, so wall-clock noise cannot enter the rewards. The resume call gives only
    --resume/--steps: the rest (other seed, lr, group size than the command's defaults) must
    come from the run."""
    from runtime.timing import Clock

    monkeypatch.setattr(Clock, "ms", lambda self, start, end: 1.0)
    ws = copy_workspace(features_ws, tmp_path / "ws")
    w = str(ws.root)
    whole = invoke("train", "--online", "-w", w, "--steps", "3", "--run-id", "whole", *ONLINE)
    assert whole.exit_code == 0, whole.output
    cut = invoke("train", "--online", "-w", w, "--steps", "1", "--run-id", "cut", *ONLINE)
    assert cut.exit_code == 0, cut.output
    resumed = invoke("train", "--online", "-w", w, "--resume", "cut", "--steps", "3", "--no-evaluate")
    assert resumed.exit_code == 0, resumed.output
    assert "online run cut: 3 steps" in resumed.stdout

    def rollouts(run: str, step: int) -> pl.DataFrame:
        return pl.read_parquet(ws.runs_dir / run / "rollouts" / f"step-{step:06d}.parquet").select(ROLLOUT_COLUMNS)

    for step in (2, 3):
        expected = rollouts("whole", step)
        assert expected.height == 6 and expected["reward"].n_unique() > 1  # the update has something to learn
        assert rollouts("cut", step).equals(expected), step
    steps = {run: pl.read_parquet(ws.runs_dir / run / "online_steps.parquet") for run in ("whole", "cut")}
    assert steps["cut"]["step"].to_list() == [1, 2, 3]
    assert steps["cut"].select(STEP_COLUMNS).equals(steps["whole"].select(STEP_COLUMNS))
    saved = {run: torch.load(ws.runs_dir / run / "checkpoints" / "last.pt", weights_only=True)
             for run in ("whole", "cut")}
    assert saved["cut"]["step"] == 3
    for part in ("state_dict", "two_stage", "optimizer"):  # the offline policy, the online modules, AdamW
        a, b = _flatten(saved["whole"][part]), _flatten(saved["cut"][part])
        assert a.keys() == b.keys() and [k for k in a if not _same(a[k], b[k])] == [], part


# -- claim 2: Ctrl-C exits 130 with one line on stderr -------------------------------------------
#
# `ctrl query` and `ctrl ingest` (during the table build) are pinned in tests/test_cli.py.

def test_ctrl_c_during_feature_extraction_exits_130_and_keeps_finished_chunks(tmp_path, monkeypatch, embedded_runtime):
    """Claim: exit 130 on Ctrl-C (docs/cli.md) with the line "finished chunks are kept; the next run
    resumes": interrupted in its second chunk of 4 samples, the first chunk stays, the workspace
    checks out, and the next run computes only the 8 samples left. (``embedded_runtime`` puts the
    embedded model in the session's model cache, which `--model embedded` loads.)"""
    import functools

    import features
    import features.extract
    from synthetic import generate_tree

    tree = generate_tree(SyntheticSpec(datasets=("text_vqa",), num_samples=12), tmp_path / "data")
    ws = Workspace(tmp_path / "ws")
    assert run_ingest([tree.exp5_dir, tree.exp6_dir], ws).exit_code == 0
    monkeypatch.setattr(features, "FeatureConfig", functools.partial(features.FeatureConfig, chunk_size=4))
    compute, batches = features.extract._compute_batch, []

    def interrupted_in_the_second_batch(*args, **kwargs):
        batches.append(1)
        if len(batches) == 2:
            raise KeyboardInterrupt
        return compute(*args, **kwargs)

    monkeypatch.setattr(features.extract, "_compute_batch", interrupted_in_the_second_batch)
    args = ("extract-features", "-w", ws.root, "--images", tree.images_dir, "--batch-size", "4")
    result = invoke(*args)
    assert result.exit_code == 130 and result.stdout == ""
    assert result.stderr == "interrupted: finished chunks are kept; the next run resumes\n"
    monkeypatch.setattr(features.extract, "_compute_batch", compute)
    assert [p.name for p in ws.features_dir.glob("*/*")] == ["chunk-00000"]
    doctor = invoke("doctor", "-w", ws.root)
    assert doctor.exit_code == 0, doctor.output
    resumed = invoke(*args)
    assert resumed.exit_code == 0, resumed.output
    assert "features for 12 samples" in resumed.stdout and "8 computed, 4 already cached" in resumed.stdout


def test_ctrl_c_during_offline_training_exits_130_and_the_finished_epoch_resumes(features_ws, tmp_path, monkeypatch):
    """Claim: exit 130 on Ctrl-C with the line "resume with --resume <run id> (the last finished epoch is
    checkpointed)": interrupted in epoch 2, the run is recorded as interrupted after epoch 1 and
    `--resume` trains epoch 2 only."""
    import trainer.offline
    from trainer.offline import OfflineTrainer

    ws = copy_workspace(features_ws, tmp_path / "ws")
    epoch = OfflineTrainer._train_epoch
    trained, interrupted = [], []

    def interrupted_in_epoch_2(self, number: int) -> None:
        if number == 2 and not interrupted:
            interrupted.append(number)
            raise KeyboardInterrupt
        trained.append(number)
        epoch(self, number)

    monkeypatch.setattr(OfflineTrainer, "_train_epoch", interrupted_in_epoch_2)
    result = invoke("train", "--offline", "-w", ws.root, "--num-epochs", "2", "--cross-fit-folds", "0",
                    "--warm-start-steps", "0", "--no-table-fallback", "--run-id", "cut")
    assert result.exit_code == 130 and result.stdout == ""
    assert result.stderr == "interrupted: resume with --resume cut (the last finished epoch is checkpointed)\n"
    run = ws.runs_dir / "cut"
    row = pl.read_parquet(run / "run.parquet").row(0, named=True)
    assert (row["status"], row["epochs_done"]) == ("interrupted", 1)
    assert invoke("doctor", "-w", ws.root).exit_code == 0
    monkeypatch.setattr(trainer.offline, "evaluate_run", lambda *a, **k: None)  # the final evaluation takes long
    resumed = invoke("train", "--offline", "-w", ws.root, "--resume", "cut")
    assert resumed.exit_code == 0, resumed.output
    assert trained == [1, 2]
    row = pl.read_parquet(run / "run.parquet").row(0, named=True)
    assert (row["status"], row["epochs_done"]) == ("completed", 2)


def test_ctrl_c_during_online_training_exits_130_and_resumes_from_the_checkpoint(features_ws, tmp_path, monkeypatch):
    """Claim: exit 130 on Ctrl-C with the line "continue with --online --resume <run id> (from its last
    checkpoint)": interrupted in step 3 with a checkpoint every step, the resumed run redoes step
    3 and ends with steps 1-4."""
    from online.train import OnlineTrainer

    ws = copy_workspace(features_ws, tmp_path / "ws")
    step = OnlineTrainer.step

    def interrupted_in_step_3(self, number, executor):
        if number == 3:
            raise KeyboardInterrupt
        return step(self, number, executor)

    monkeypatch.setattr(OnlineTrainer, "step", interrupted_in_step_3)
    args = ("train", "--online", "-w", ws.root, "--steps", "4", "--run-id", "cut", *ONLINE)
    result = invoke(*args)
    assert result.exit_code == 130 and result.stdout == ""
    assert result.stderr == "interrupted: continue with --online --resume cut (from its last checkpoint)\n"
    monkeypatch.undo()
    run = ws.runs_dir / "cut"
    assert pl.read_parquet(run / "run.parquet").row(0, named=True)["status"] == "interrupted"
    assert invoke("doctor", "-w", ws.root).exit_code == 0
    resumed = invoke("train", "--online", "-w", ws.root, "--resume", "cut", "--steps", "4", "--no-evaluate")
    assert resumed.exit_code == 0, resumed.output
    assert pl.read_parquet(run / "online_steps.parquet")["step"].to_list() == [1, 2, 3, 4]
    steps = [f"step-00000{i}.parquet" for i in (1, 2, 3, 4)]
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["sha256.json", *steps]
    assert sorted(json.loads((run / "rollouts" / "sha256.json").read_text())) == steps  # each file's checksum


# -- claims 3 and 6: one vision forward per distinct image; --model embedded|testbed|PATH ----------

def interleave_images(tree: Path) -> None:
    """Give question i image 1000 + i % 2 in every file of the tree: in sample order the two
    images alternate (1000, 1001, 1000, 1001, 1000)."""
    for path in tree.rglob("*.json"):
        doc = json.loads(path.read_text())
        for record in [*doc.get("all_samples", []), *doc.get("per_sample_predictions", [])]:
            record["metadata"]["image_id"] = 1000 + (record["metadata"]["example_id"] - 500000) % 2
        path.write_text(json.dumps(doc))


@pytest.fixture
def shared_images_ws(small_tree, tmp_path) -> tuple[Workspace, Path]:
    """The small tree's 5 samples over two images that alternate in sample order, ingested, and
    the two image files."""
    from PIL import Image

    interleave_images(small_tree)
    ws = Workspace(tmp_path / "ws")
    assert run_ingest([small_tree], ws).exit_code == 0
    images = tmp_path / "images"
    images.mkdir()
    for image_id, color in ((1000, (200, 30, 30)), (1001, (30, 30, 200))):
        Image.new("RGB", (160, 120), color).save(images / f"{image_id}.png")
    return ws, images


def test_samples_sharing_an_image_share_one_vision_forward(shared_images_ws, tiny_molmoe_dir):
    """Claim: samples sharing an image are computed next to each other and share one image
    forward per batch (docs/features.md): 5 samples whose 2 images alternate, in batches of 3,
    run the vision backbone twice (batches 1000 x 3 and 1001 x 2; in sample order they would
    need 4). The MolmoE runtime runs it once per request it is given."""
    from torch.nn.modules.module import register_module_forward_hook

    from pipeline.catalog import run_query
    from runtime.molmoe_model import MolmoVisionBackbone

    ws, images = shared_images_ws
    calls = []
    handle = register_module_forward_hook(
        lambda module, args, output: calls.append(1) if isinstance(module, MolmoVisionBackbone) else None)
    try:
        result = invoke("extract-features", "-w", ws.root, "--images", images, "--model", tiny_molmoe_dir,
                        "--batch-size", "3")
    finally:
        handle.remove()
    assert result.exit_code == 0, result.output
    assert "features for 5 samples" in result.stdout and "5 computed" in result.stdout
    assert len(calls) == 2
    rows = run_query(ws, "SELECT image_id, count(*) AS n, count(DISTINCT feature) AS features FROM image_features "
                         "WHERE image_status = 'ok' GROUP BY 1 ORDER BY 1").to_pylist()
    assert rows == [{"image_id": "1000", "n": 3, "features": 1}, {"image_id": "1001", "n": 2, "features": 1}]


def test_model_embedded_and_a_checkpoint_path_record_which_model_made_the_features(shared_images_ws, tiny_molmoe_dir,
                                                                                  embedded_runtime):
    """Claim: `--model embedded|PATH` (README, docs/features.md): the seeded embedded model and a
    MolmoE checkpoint directory both run for real, and each sample's features are stored under
    the fingerprint of the model that computed them; the PATH's features are that checkpoint's."""
    from pipeline.catalog import run_query
    from runtime.embedded import EmbeddedRuntime
    from runtime.embedded_model import build_embedded_model
    from runtime.molmoe import MolmoERuntime

    ws, images = shared_images_ws
    embedded = EmbeddedRuntime(build_embedded_model(seed=0))  # the seeded model, built without --model resolution
    checkpoint = MolmoERuntime(tiny_molmoe_dir)
    assert embedded.fingerprint != checkpoint.fingerprint
    for model, runtime in (("embedded", embedded), (str(tiny_molmoe_dir), checkpoint)):
        result = invoke("extract-features", "-w", ws.root, "--images", images, "--model", model)
        assert result.exit_code == 0, result.output
        assert f"features for 5 samples (model {runtime.fingerprint[:16]}): 5 computed" in result.stdout
    summary = json.loads(invoke("status", "-w", ws.root, "--json").stdout)
    assert sorted(summary["features"], key=lambda r: r["model"]) == sorted(
        [{"model": embedded.fingerprint[:16], "samples": 5, "images_ok": 5, "images_missing": 0},
         {"model": checkpoint.fingerprint[:16], "samples": 5, "images_ok": 5, "images_missing": 0}],
        key=lambda r: r["model"])
    for runtime in (embedded, checkpoint):
        stored = run_query(ws, "SELECT feature FROM lang_features JOIN samples USING (dataset, sample_key) "
                               f"WHERE question = 'question 0?' AND model_fingerprint = '{runtime.fingerprint}'")
        (feature,) = stored.column("feature").to_pylist()
        assert torch.allclose(torch.tensor(feature), runtime.lang_features(["question 0?"])[0])


def test_a_model_path_that_does_not_exist_is_one_line_naming_it(shared_images_ws, tmp_path):
    """Claim: exit 1 is one red line on stderr (README); `--model PATH` of no directory names it."""
    ws, images = shared_images_ws
    missing = tmp_path / "no-such-model"
    result = invoke("extract-features", "-w", ws.root, "--images", images, "--model", missing)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: {missing}: no such model directory (use 'embedded', 'testbed', a local directory or a Hugging Face "
        "id org/name[@revision])"]
    assert not ws.features_dir.exists() or list(ws.features_dir.iterdir()) == []


def test_model_testbed_is_the_trained_testbed_of_the_cache(shared_images_ws, tmp_path, monkeypatch):
    """Claim: `--model testbed` is the trained testbed found in the model cache, never trained
    implicitly (docs/features.md): with an empty cache it is one line pointing to `ctrl testbed
    train`; once that command has put it there, its features are stored under its fingerprint."""
    from runtime.embedded import EmbeddedRuntime

    ws, images = shared_images_ws
    cache = tmp_path / "cache"
    monkeypatch.setenv("CTRL_CACHE_DIR", str(cache))
    absent = invoke("extract-features", "-w", ws.root, "--images", images, "--model", "testbed")
    assert absent.exit_code == 1
    assert len(absent.stderr.splitlines()) == 1
    assert absent.stderr.startswith("error: --model testbed: the trained testbed is not in the cache; run `ctrl "
                                    "testbed train` first")
    assert not any(cache.glob("testbed-*"))  # not trained implicitly
    unpacked = invoke("testbed", "train", "--eval-samples", "0")
    assert unpacked.exit_code == 0, unpacked.output
    (model_dir,) = cache.glob("testbed-v*")
    fingerprint = EmbeddedRuntime(model_dir).fingerprint
    result = invoke("extract-features", "-w", ws.root, "--images", images, "--model", "testbed")
    assert result.exit_code == 0, result.output
    assert f"features for 5 samples (model {fingerprint[:16]}): 5 computed" in result.stdout
    assert [p.name for p in ws.features_dir.iterdir()] == [fingerprint[:16]]


# -- claims 4 and 5: ctrl predict ---------------------------------------------------------------

def train_offline_run(ws: Workspace, run_id: str, seed: int) -> None:
    """A quick offline run (one epoch, no warm start, fallback or evaluation): what predict reads."""
    from trainer import OfflineTrainConfig, train_offline

    train_offline(OfflineTrainConfig(workspace=ws.root, num_epochs=1, batch_size=16, seed=seed, run_id=run_id,
                                     warm_start_steps=0, cross_fit_folds=0, disable_table_fallback=True,
                                     disable_evaluation=True))


def predict(ws: Workspace, out: Path, *source: str):
    return invoke("predict", "-w", ws.root, *source, "--budget-ms", "150", "--budget-ms", "400", "--out", out)


def test_a_checkpoint_predicts_on_another_workspace_of_the_same_model_only(features_ws, embedded_runtime,
                                                                           tiny_molmoe_dir, tmp_path):
    """Claim: `ctrl predict --checkpoint PATH` works on another workspace whose features come from
    the same model (docs/training.md: only the feature model must match), and is refused with one
    error line (and its hint) when that workspace's features come from another model."""
    from features import FeatureConfig, extract_features
    from runtime.molmoe import checkpoint_fingerprint
    from synthetic import generate_tree

    trained = copy_workspace(features_ws, tmp_path / "trained")
    train_offline_run(trained, "a", seed=1)
    checkpoint = trained.runs_dir / "a" / "checkpoints" / "best.pt"
    # another workspace: 4 other samples of one dataset, ingested twice, features of each model
    tree = generate_tree(SyntheticSpec(datasets=("text_vqa",), num_samples=4, seed=5), tmp_path / "other-data")
    same, other = Workspace(tmp_path / "same-model"), Workspace(tmp_path / "other-model")
    for ws in (same, other):
        assert run_ingest([tree.exp5_dir, tree.exp6_dir], ws).exit_code == 0
    extract_features(FeatureConfig(workspace=same.root, images_dir=tree.images_dir), runtime=embedded_runtime)
    made = invoke("extract-features", "-w", other.root, "--images", tree.images_dir, "--model", tiny_molmoe_dir)
    assert made.exit_code == 0, made.output

    result = predict(same, tmp_path / "same.csv", "--checkpoint", checkpoint)
    assert result.exit_code == 0, result.output
    frame = pl.read_csv(tmp_path / "same.csv")
    keys = json.loads(invoke("query", "-w", same.root, "SELECT sample_key FROM samples ORDER BY 1", "--format",
                             "json").stdout)
    assert sorted(set(frame["sample_key"])) == [k["sample_key"] for k in keys] and len(keys) == 4
    assert frame.height == 8 and set(frame["dataset"]) == {"text_vqa"} and set(frame["source"]) == {"controller"}

    refused = predict(other, tmp_path / "other.csv", "--checkpoint", checkpoint)
    assert refused.exit_code == 1 and not (tmp_path / "other.csv").exists()
    lines = refused.stderr.splitlines()
    tiny = checkpoint_fingerprint(tiny_molmoe_dir)[:16]
    assert lines[0] == (f"error: the checkpoint was trained on features of model {embedded_runtime.fingerprint[:16]}, "
                        f"but workspace {other.root} has features of model {tiny} only")
    assert len(lines) == 2 and lines[1].startswith("Hint: run `ctrl extract-features` with the checkpoint's model")


def test_predict_refuses_an_online_run_and_latest_is_the_newest_offline_run(features_ws, tmp_path):
    """Claims (docs/online.md): `ctrl predict --run latest` means the newest *offline* run, and
    predict refuses an online run with one error line (and its hint). Runs are made in the order
    first (offline), second (offline), newest (online, from first)."""
    ws = copy_workspace(features_ws, tmp_path / "ws")
    train_offline_run(ws, "first", seed=1)
    train_offline_run(ws, "second", seed=2)
    online = invoke("train", "--online", "-w", ws.root, "--from", "first", "--steps", "1", "--samples-per-step", "1",
                    "--group-size", "2", "--max-new-tokens", "2", "--budget-min-ms", "30", "--budget-max-ms", "300",
                    "--no-evaluate", "--run-id", "newest")
    assert online.exit_code == 0, online.output

    refused = predict(ws, tmp_path / "online.csv", "--run", "newest")
    assert refused.exit_code == 1 and not (tmp_path / "online.csv").exists()
    lines = refused.stderr.splitlines()
    assert lines[0] == "error: newest is an online run: its controller needs the model in the loop"
    assert len(lines) == 2 and lines[1].startswith("Hint:")

    last = ws.runs_dir / "newest" / "checkpoints" / "last.pt"  # the run's checkpoint file refused alike
    for command in (("predict", "--checkpoint", last, "--budget-ms", "150", "--out", tmp_path / "file.csv"),
                    ("export", last, "--out", tmp_path / "file.pt")):
        refused = invoke(*command, "-w", ws.root)
        assert refused.exit_code == 1 and not any(tmp_path.glob("file.*"))
        lines = refused.stderr.splitlines()
        assert lines[0] == f"error: {last}: the checkpoint of an online run: its controller needs the model in the loop"
        assert len(lines) == 2 and lines[1].startswith("Hint:")

    frames = {}
    for run in ("latest", "first", "second"):
        result = predict(ws, tmp_path / f"{run}.parquet", "--run", run)
        assert result.exit_code == 0, result.output
        frames[run] = pl.read_parquet(tmp_path / f"{run}.parquet")
    assert not frames["first"].equals(frames["second"])  # the two offline runs decide differently
    assert frames["latest"].equals(frames["second"])


# -- claim 7: a crash during the generation swap or the catalog write ------------------------------

class Killed(BaseException):
    """Stands for the process being killed at that point: nothing in ctrl catches it."""


COUNTS = "SELECT (SELECT count(*) FROM measurements) AS m, (SELECT count(*) FROM configs) AS c"
#: the small tree: 5 samples x 2 configurations in exp5 and exp6; with the added file a third exp6 configuration
BEFORE, AFTER = [{"m": 20, "c": 4}], [{"m": 25, "c": 5}]


def query_counts(ws: Workspace) -> list[dict]:
    result = invoke("query", COUNTS, "-w", ws.root, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def catalog_counts(ws: Workspace) -> list[dict]:
    """What a plain DuckDB session over ctrl.duckdb reads."""
    import duckdb

    con = duckdb.connect(str(ws.catalog_path), read_only=True)
    try:
        m, c = con.execute(COUNTS).fetchone()
    finally:
        con.close()
    return [{"m": m, "c": c}]


def ingested_then_a_new_file(small_tree: Path, ws: Workspace) -> None:
    assert invoke("ingest", small_tree, "-w", ws.root).exit_code == 0
    assert query_counts(ws) == BEFORE and catalog_counts(ws) == BEFORE
    write(small_tree / "more" / exp6_name(4, 4, 12), exp6_config_doc(4, 4, 12, shard(0) + shard(1), merged=True))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs Linux /proc")
def test_a_crash_while_current_is_swapped_leaves_the_previous_workspace(small_tree, tmp_path, monkeypatch):
    """Claim: "an interrupted run leaves the previous workspace intact" (docs/ingest.md; the new generation
    is complete before CURRENT is swapped atomically, docs/ingest.md): killed while the new
    CURRENT is being written, queries and the catalog read the previous tables, `ctrl doctor`
    finds nothing wrong, and the next ingest gives the complete result without parsing again."""
    import os

    import pipeline.ingestion
    import pipeline.workspace

    ws = Workspace(tmp_path / "ws")
    ingested_then_a_new_file(small_tree, ws)
    fsync = os.fsync

    def killed_while_writing_current(fd: int) -> None:
        if "CURRENT" in os.readlink(f"/proc/self/fd/{fd}"):
            raise Killed
        fsync(fd)

    monkeypatch.setattr(pipeline.workspace.os, "fsync", killed_while_writing_current)
    with pytest.raises(Killed):
        run_ingest([small_tree], ws)
    monkeypatch.undo()
    assert query_counts(ws) == BEFORE and catalog_counts(ws) == BEFORE
    doctor = invoke("doctor", "-w", ws.root)
    assert doctor.exit_code == 0 and doctor.stderr == "", doctor.output
    parse, parsed = pipeline.ingestion.parse_file, []
    monkeypatch.setattr(pipeline.ingestion, "parse_file", lambda *a: parsed.append(a) or parse(*a))
    again = invoke("ingest", small_tree, "-w", ws.root)
    assert again.exit_code == 0 and "ingested 10 files" in again.stdout, again.output
    assert parsed == []  # "files parsed before the interruption are not parsed again" (docs/ingest.md)
    assert query_counts(ws) == AFTER and catalog_counts(ws) == AFTER
    assert invoke("doctor", "-w", ws.root).exit_code == 0


def test_a_crash_while_the_catalog_is_written_is_reported_and_repaired(small_tree, tmp_path, monkeypatch):
    """Claim: the catalog is rewritten after the swap, and a crash in between is found by `ctrl
    doctor` and repaired by the next ingest (docs/ingest.md): killed before the new
    ctrl.duckdb replaces the old one, `ctrl query` reads the new generation, the old catalog still
    reads the previous one, doctor names the catalog (exit 1) and the next ingest rebuilds it."""
    import os

    import pipeline.catalog

    ws = Workspace(tmp_path / "ws")
    ingested_then_a_new_file(small_tree, ws)
    replace = os.replace

    def killed_before_the_catalog_replace(src, dst) -> None:
        if Path(dst) == ws.catalog_path:
            raise Killed
        replace(src, dst)

    monkeypatch.setattr(pipeline.catalog.os, "replace", killed_before_the_catalog_replace)
    with pytest.raises(Killed):
        run_ingest([small_tree], ws)
    monkeypatch.undo()
    assert query_counts(ws) == AFTER and catalog_counts(ws) == BEFORE
    doctor = invoke("doctor", "-w", ws.root)
    assert doctor.exit_code == 1
    assert doctor.stderr.splitlines()[0] == (
        f"damaged: {ws.catalog_path}: describes gen-000001, CURRENT is gen-000002 (repair: ctrl ingest)")
    assert doctor.stderr.count("damaged:") == 1 and "1 problem(s)" in doctor.stderr
    again = invoke("ingest", small_tree, "-w", ws.root)
    assert again.exit_code == 0 and "nothing changed" in again.stdout, again.output
    assert again.stderr.startswith(f"repaired: {ws.catalog_path}: describes gen-000001, CURRENT is gen-000002")
    assert query_counts(ws) == AFTER and catalog_counts(ws) == AFTER
    assert invoke("doctor", "-w", ws.root).exit_code == 0
