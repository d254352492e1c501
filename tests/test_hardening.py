"""Values that cannot work are refused before any work, with one line naming the value."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from features.config import check_image_pattern
from pipeline.errors import CtrlError
from small_disk import on_small_disk, small_disk_available
from trainer.config import OfflineTrainConfig

runner = CliRunner()


@pytest.mark.parametrize(("pattern", "message"), [
    ("{foo}.jpg", "uses {foo}; the fields are {image_id}, {dataset}, {split}"),
    ("{0}", "uses {0}; the fields are"),
    ("{}", "uses {}; the fields are"),
    ("{image_id", "is not a valid pattern"),
])
def test_an_image_pattern_with_other_fields_is_refused(pattern, message):
    with pytest.raises(CtrlError, match="^" + re.escape(f"--image-pattern {pattern!r} {message}")):
        check_image_pattern(pattern)
    check_image_pattern("{dataset}/{image_id}.jpg")


def test_extract_features_refuses_a_bad_pattern_in_one_line(tmp_path):
    result = runner.invoke(app, ["extract-features", "-w", str(tmp_path / "ws"), "--image-pattern", "{foo}.jpg"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[0] == (
        "error: --image-pattern '{foo}.jpg' uses {foo}; the fields are {image_id}, {dataset}, {split}")


@pytest.mark.parametrize("value", [math.inf, math.nan, -5.0, 0.0])
def test_a_budget_range_end_that_is_not_a_finite_positive_number_is_named(value):
    message = rf"^`budget_max_ms` must be a finite number of milliseconds > 0, got {value!r}$"
    with pytest.raises(ValueError, match=message):
        OfflineTrainConfig(budget_min_ms=50.0, budget_max_ms=value)


@pytest.mark.parametrize(("args", "value"), [
    (["train", "--seed", "1e23"], "'1e23'"),
    (["train", "--num-epochs", "0"], "'0'"),
    (["serve", "--port", "http"], "'http'"),
    (["predict", "--budget-ms", "fast"], "'fast'"),
])
def test_an_option_value_that_does_not_convert_is_named_in_its_error(args, value):
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    [line] = result.stderr.strip().splitlines()
    assert f"Invalid value for '{args[1]}'" in line and f"(got {value})" in line, result.output


@pytest.mark.parametrize("value", [math.nan, math.inf, -5.0, 0.0])
def test_predict_names_a_budget_that_is_not_a_finite_positive_number(tmp_path, value):
    from controller.predict import predict

    with pytest.raises(CtrlError, match=re.escape(f"finite numbers of milliseconds > 0, got [250.0, {value!r}]")):
        predict(tmp_path / "ws", "latest", [250.0, value], tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()


def test_train_with_an_infinite_budget_writes_no_run(tmp_path):
    result = runner.invoke(app, ["train", "--offline", "-w", str(tmp_path / "ws"), "--budget-min-ms", "50",
                                 "--budget-max-ms", "inf"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: `budget_max_ms` must be a finite number of milliseconds > 0, got inf")
    assert not (tmp_path / "ws" / "runs").exists()


def test_too_many_parser_processes_are_refused_before_any_start(tmp_path):
    import os

    result = runner.invoke(app, ["ingest", str(tmp_path), "-w", str(tmp_path / "ws"), "--num-workers", "100000"])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: --num-workers 100000 is more parser processes than ctrl starts (at most "
                                    f"{4 * (os.cpu_count() or 1)}: 4 per core of this machine)")
    assert not (tmp_path / "ws").exists()


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs on this system")
def test_a_fifo_or_a_device_named_like_an_image_is_never_opened(tmp_path):
    import os
    import threading

    from runtime.images import open_image

    fifo = tmp_path / "img-1.jpg"
    os.mkfifo(fifo)
    device = tmp_path / "img-2.jpg"
    device.symlink_to("/dev/zero")
    results = {}
    worker = threading.Thread(target=lambda: results.update(fifo=open_image(fifo), device=open_image(device)),
                              daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "open_image blocked on a FIFO"
    assert results == {"fifo": None, "device": None}


def test_export_never_replaces_an_existing_file_without_force(tmp_path, embedded_runtime):
    from conftest import build_feature_workspace
    from synthetic import SyntheticSpec

    _, ws = build_feature_workspace(tmp_path, embedded_runtime, SyntheticSpec(num_samples=30))
    trained = runner.invoke(app, ["train", "--offline", "-w", str(ws.root), "--num-epochs", "1", "--cross-fit-folds",
                                  "0", "--no-table-fallback", "--warm-start-steps", "5", "--run-id", "r"])
    assert trained.exit_code == 0, trained.output
    source = tmp_path / "module.py"
    source.write_text("print('my source file')\n")
    refused = runner.invoke(app, ["export", "r", "-w", str(ws.root), "--out", str(source)])
    assert refused.exit_code == 1
    assert refused.stderr.startswith(f"error: {source}: exists; refusing to replace it")
    assert source.read_text() == "print('my source file')\n"
    replaced = runner.invoke(app, ["export", "r", "-w", str(ws.root), "--out", str(source), "--force"])
    assert replaced.exit_code == 0, replaced.output
    assert source.read_bytes()[:2] == b"PK"  # a TorchScript archive now


def test_more_folds_than_samples_is_refused_before_training(tmp_path, embedded_runtime):
    from conftest import build_feature_workspace
    from synthetic import SyntheticSpec

    _, ws = build_feature_workspace(tmp_path, embedded_runtime, SyntheticSpec(num_samples=30))
    result = runner.invoke(app, ["train", "--offline", "-w", str(ws.root), "--cross-fit-folds", "100000"])
    assert result.exit_code == 1
    assert re.match(r"error: --cross-fit-folds 100000 is more folds than the \d+ samples the networks train on",
                    result.stderr)
    assert not ws.runs_dir.exists() or not any(ws.runs_dir.iterdir())


def test_folds_that_the_hash_leaves_empty_are_refused_before_training(tmp_path, embedded_runtime):
    from conftest import build_feature_workspace
    from pipeline import run_query
    from synthetic import SyntheticSpec
    from trainer.crossfit import fold_of

    _, ws = build_feature_workspace(tmp_path, embedded_runtime, SyntheticSpec(num_samples=30))
    samples = [(r["dataset"], r["sample_key"]) for r in run_query(ws, "SELECT dataset, sample_key FROM samples")
               .to_pylist()]
    # the fewest folds, no more than the samples, of which the hash leaves one empty
    folds = next(k for k in range(2, len(samples) + 1) if len({fold_of(d, key, k) for d, key in samples}) < k)
    empty = sorted(set(range(folds)) - {fold_of(d, key, folds) for d, key in samples})
    result = runner.invoke(app, ["train", "--offline", "-w", str(ws.root), "--cross-fit-folds", str(folds)])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: --cross-fit-folds {folds}: fold(s) {', '.join(map(str, empty))} of the "
                                    f"{len(samples)} samples would hold no sample"), result.stderr
    assert not ws.runs_dir.exists() or not any(ws.runs_dir.iterdir())


@pytest.mark.parametrize("option", [("--hidden-dim", "100000000"), ("--batch-size", "1000000000"),
                                    ("--group-size", "10000000")])
def test_options_whose_memory_cannot_fit_are_refused_before_they_allocate(tmp_path, embedded_runtime, option):
    from conftest import build_feature_workspace
    from synthetic import SyntheticSpec

    _, ws = build_feature_workspace(tmp_path, embedded_runtime, SyntheticSpec(num_samples=30))
    result = runner.invoke(app, ["train", "--offline", "-w", str(ws.root), *option])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert re.match(r"error: these options need about [\d,.]+ GiB per training step \(hidden_dim \d+, batch_size \d+ "
                    r"x num_budgets_per_sample \d+ groups of group_size \d+\), and [\d,.]+ GiB are available$",
                    lines[0]), lines
    assert lines[1].startswith("Hint: lower --hidden-dim, --batch-size or --group-size")
    assert not ws.runs_dir.exists() or not any(ws.runs_dir.iterdir())


@pytest.mark.skipif(not small_disk_available(), reason="cannot mount a tmpfs in a private namespace here")
def test_a_full_disk_during_training_is_one_line_leaves_no_temporary_file_and_resumes(tmp_path, embedded_runtime):
    from conftest import build_feature_workspace
    from synthetic import SyntheticSpec

    _, ws = build_feature_workspace(tmp_path, embedded_runtime, SyntheticSpec(num_samples=30))
    # 4 MiB holds the first epoch (outcome model, last.pt 2.4 MB with the optimizer, best.pt 0.6 MB) but
    # not the second last.pt beside the first until the rename
    train = (f"$CTRL train --offline -w {ws.root} --num-epochs 3 --cross-fit-folds 0 --no-table-fallback "
             "--warm-start-steps 5 --run-id full")
    epochs = ("SELECT epoch, count(*) AS n FROM metrics WHERE run_id = 'full' AND kind = 'epoch' GROUP BY 1 "
              "ORDER BY 1")
    full, left, _, resumed, counted, done = on_small_disk(ws.runs_dir, "4m", [
        train, f"find {ws.runs_dir / 'full'}", "grow 64m", f"$CTRL train --offline -w {ws.root} --resume full",
        f'$CTRL query "{epochs}" -w {ws.root} --format csv',
        f'$CTRL query "SELECT status, epochs_done FROM runs WHERE run_id = \'full\'" -w {ws.root} --format csv'])
    lines = full.splitlines()
    assert lines[-1] == "exit 1" and "Traceback" not in full, full
    assert re.fullmatch(r"error: \S+/runs/full/checkpoints/last\.pt: No space left on device", lines[0]), full
    assert lines[1] == ("Hint: free space or fix permissions, then: ctrl train --offline --resume full (the last "
                        "finished epoch is checkpointed)."), full
    names = [Path(p).name for p in left.splitlines()[:-1]]
    assert "last.pt" in names and not [n for n in names if n.startswith(".") or "tmp" in n], left
    assert resumed.splitlines()[-1] == "exit 0", resumed
    assert "run full: best epoch" in resumed, resumed
    # the resume trained epochs 2 and 3 only: each epoch (0: the policy before training) is recorded once
    assert counted.splitlines() == ['"epoch","n"', "0,1", "1,1", "2,1", "3,1", "exit 0"], counted
    assert done.splitlines() == ['"status","epochs_done"', '"completed",3', "exit 0"], done


@pytest.mark.skipif(not small_disk_available(), reason="cannot mount a tmpfs in a private namespace here")
def test_a_full_disk_during_extraction_is_one_line_leaves_no_temporary_file_and_resumes(tmp_path):
    from conftest import run_ingest
    from pipeline import Workspace
    from synthetic import SyntheticSpec, generate_tree

    # 300 samples are two chunks (256 + 44); 128 KiB holds the first chunk's files (116 KiB in pages), not both
    tree = generate_tree(SyntheticSpec(datasets=("coco_2014_vqa",), num_samples=300, max_crops=(2, 10),
                                       top_k=(4, 12), num_active_blocks=(12, 16)), tmp_path / "data")
    ws = Workspace(tmp_path / "ws")
    assert run_ingest([tree.exp5_dir, tree.exp6_dir], ws).exit_code == 0
    extract = f"$CTRL extract-features -w {ws.root} --images {tree.images_dir}"
    full, left, _, resumed = on_small_disk(ws.features_dir, "128k", [
        extract, f"find {ws.features_dir} -mindepth 2", "grow 16m", extract])
    lines = full.splitlines()
    assert lines[-1] == "exit 1" and "Traceback" not in full, full
    assert re.fullmatch(r"error: \S+/features/[0-9a-f]+/chunk-00001: .*No space left on device", lines[0]), full
    assert lines[1].startswith("Hint: free space")
    assert sorted(Path(p).name for p in left.splitlines()[:-1]) == [
        "chunk-00000", "image_features.parquet", "image_tilings.parquet", "lang_features.parquet", "lookup.json",
        "sha256.json"], left
    assert resumed.splitlines()[-1] == "exit 0", resumed
    assert "features for 300 samples" in resumed and "44 computed, 256 already cached" in resumed, resumed


@pytest.mark.skipif(not small_disk_available(), reason="cannot mount a tmpfs in a private namespace here")
def test_a_full_disk_during_online_training_is_one_line_and_the_resumed_run_records_each_step_once(
        tmp_path, embedded_runtime):
    from conftest import build_feature_workspace
    from synthetic import SyntheticSpec

    tree, ws = build_feature_workspace(tmp_path, embedded_runtime, SyntheticSpec(num_samples=30))
    # 3 MiB holds step 1 (last.pt 2.2 MB, a rollout file) but not step 2's last.pt beside it until the rename;
    # no held-out checks, whose start.pt and best.pt would fill it before step 1's last.pt
    train = (f"$CTRL train --online -w {ws.root} --images {tree.images_dir} --steps 3 --run-id full "
             "--samples-per-step 2 --group-size 3 --max-new-tokens 3 --budget-min-ms 30 --budget-max-ms 300 "
             "--checkpoint-every 1 --no-evaluate --reward-mode soft --seed 7 --fresh --check-every 0")
    steps = "SELECT step, count(*) AS n FROM rollouts WHERE run_id = 'full' GROUP BY step ORDER BY step"
    full, _, resumed, counted = on_small_disk(ws.runs_dir, "3m", [
        train, "grow 64m", f"$CTRL train --online -w {ws.root} --resume full",
        f'$CTRL query "{steps}" -w {ws.root} --format csv'])
    lines = full.splitlines()
    assert lines[-1] == "exit 1" and "Traceback" not in full, full
    assert re.fullmatch(r"error: \S+/runs/full/checkpoints/last\.pt: No space left on device", lines[0]), full
    assert lines[1] == ("Hint: free space or fix permissions, then: ctrl train --online --resume full (from its "
                        "last checkpoint)."), full
    assert resumed.splitlines()[-1] == "exit 0" and "online run full: 3 steps" in resumed, resumed
    # step 2 ran twice (its checkpoint failed the first time): its rollouts are there once
    assert counted.splitlines() == ['"step","n"', "1,6", "2,6", "3,6", "exit 0"], counted
