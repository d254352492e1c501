"""The held-out checks of an online run: the paired gain and its interval, which controller the run
keeps (and serves), the stop rule, and resuming with what the checks kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import build_offline_workspace


@pytest.fixture(scope="module")
def check_ws(tmp_path_factory, embedded_runtime):
    """A small workspace (ingested + features) and an offline run to continue from."""
    return build_offline_workspace(tmp_path_factory.mktemp("online-check"), embedded_runtime, 40)[1]


def _config(ws, **kw):
    from online.config import OnlineTrainConfig

    base = dict(workspace=ws.root, steps=2, samples_per_step=1, group_size=3, max_new_tokens=2,
                budget_min_ms=30.0, budget_max_ms=300.0, checkpoint_every=1, run_id=None, evaluate=False,
                check_every=1, check_samples=3, check_budgets=2, patience=0)
    return OnlineTrainConfig(**{**base, **kw})


def _result(step: int, gain: float):
    from online.check import CheckResult

    return CheckResult(step=step, gain=gain, gain_low=gain - 0.1, gain_high=gain + 0.1, late_share=0.0,
                       start_late_share=0.0, requests=6, same_choice=0, seconds=0.01)


# -- the numbers --------------------------------------------------------------------------------

def test_paired_gain_averages_per_sample_and_resamples_samples_whole():
    from online.check import paired_gain

    latest = np.array([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    start = np.array([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    gain, low, high = paired_gain(latest, start)
    # per sample: +0.5, +0.5, 0 -> a mean of 1/3; any resample's mean lies in [0, 0.5]
    assert gain == pytest.approx(1 / 3)
    assert 0.0 <= low < gain < high <= 0.5
    same = paired_gain(np.ones((4, 3)), np.zeros((4, 3)))
    assert same == pytest.approx((1.0, 1.0, 1.0))  # every sample gains 1: no spread
    worse = paired_gain(np.zeros((5, 1)), np.array([[1.0], [1.0], [0.0], [0.0], [0.0]]))
    assert worse[0] == pytest.approx(-0.4) and worse[1] < -0.4 < worse[2] <= 0.0


def test_the_kept_controller_changes_only_for_a_larger_positive_gain(embedded_runtime, check_ws):
    from online.check import KeptController
    from online.data import load_online_samples
    from online.train import build_controller

    samples = load_online_samples(check_ws, embedded_runtime.fingerprint)
    controller, _, _ = build_controller(_config(check_ws), check_ws, embedded_runtime, samples, (30.0, 300.0))
    kept = KeptController(controller.with_fixed_insertion(1))
    steps_kept = []
    for step, gain in ((1, -0.1), (2, 0.0), (3, 0.05), (4, 0.02), (5, 0.08), (6, 0.08)):
        kept.consider(_result(step, gain), controller)
        steps_kept.append((kept.step, kept.since))
    # a loss or a tie keeps the start; then only a gain above the kept one's replaces it
    assert steps_kept == [(0, 1), (0, 2), (3, 0), (3, 1), (5, 0), (5, 1)]
    assert kept.gain == pytest.approx(0.08) and (kept.gain_low, kept.gain_high) == pytest.approx((-0.02, 0.18))
    assert not kept.exhausted(2) and kept.exhausted(1) and not kept.exhausted(0)
    # a copy: training the latest further leaves the kept controller as it was
    with torch.no_grad():
        controller.latency_proj.bias.add_(1.0)
    assert not torch.equal(kept.controller.latency_proj.bias, controller.latency_proj.bias)


def test_a_fixed_insertion_position_is_what_stage_1_picks_and_survives_a_checkpoint(embedded_runtime, check_ws,
                                                                                    tmp_path):
    from online.data import load_online_samples
    from online.train import build_controller
    from pipeline.errors import CtrlError
    from trainer.two_stage import TwoStageController

    samples = load_online_samples(check_ws, embedded_runtime.fingerprint)
    controller, _, _ = build_controller(_config(check_ws), check_ws, embedded_runtime, samples, (30.0, 300.0))
    with torch.no_grad():  # an insertion head that prefers the last position
        controller.insertion_head[-1].bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 9.0]))
    lang = samples.lang[:4]
    assert (controller.stage1(lang, 100.0).insertion_log_probs.argmax(-1) == 4).all()
    pinned = controller.with_fixed_insertion(1)
    probs = pinned.stage1(lang, 100.0).insertion_log_probs.exp()
    assert torch.equal(probs, torch.tensor([[1.0, 0, 0, 0, 0]] * 4))
    # everything else is the controller's own
    assert torch.equal(pinned.stage1(lang, 100.0).crops_log_probs, controller.stage1(lang, 100.0).crops_log_probs)
    pinned.save(tmp_path / "pinned.pt")
    again = TwoStageController.load(tmp_path / "pinned.pt", embedded_runtime.fingerprint)
    assert again.two_stage.fixed_insertion_position == 1
    assert torch.equal(again.stage1(lang, 100.0).insertion_log_probs.exp(), probs)
    with pytest.raises(CtrlError, match="fixed insertion position 7"):
        controller.with_fixed_insertion(7)


# -- in a run -----------------------------------------------------------------------------------

def test_a_run_checks_on_validation_samples_and_serves_the_kept_controller(embedded_runtime, check_ws, monkeypatch):
    import pyarrow.parquet as pq

    from online.data import load_online_samples
    from online.rollout import RolloutExecutor
    from online.train import train_online
    from serve.deciders import find_controller
    from trainer.data import split_of
    from trainer.runs import RunDir
    from trainer.two_stage import TwoStageController

    samples = load_online_samples(check_ws, embedded_runtime.fingerprint)
    calls = []
    original = RolloutExecutor.run_groups

    def recording(self, groups, *args, **kwargs):
        if kwargs.get("decisions") is not None and kwargs["decisions"].greedy:
            calls.append((groups[0][0], groups[0][1], kwargs["controller"]))
        return original(self, groups, *args, **kwargs)

    monkeypatch.setattr(RolloutExecutor, "run_groups", recording)
    result = train_online(_config(check_ws, run_id="checked", steps=2), runtime=embedded_runtime)
    run = RunDir(result.run_dir)
    # two checks (every step), each 3 validation samples x 2 budgets (the range's ends); the first runs
    # both controllers on each pair, the second runs the start again only where the choices differ
    first, second = result.checks
    assert first.same_choice == 0 and len(calls) == 3 * 2 * 2 + 3 * 2 + (6 - second.same_choice)
    assert {split_of(samples.dataset[s], samples.sample_key[s]) for s, _, _ in calls} == {"val"}
    assert {b for _, b, _ in calls} == {30.0, 300.0}
    start = [c for _, _, c in calls[:12] if c.two_stage.fixed_insertion_position == 1]
    assert len(start) == 6  # half of each check's requests are the start's, pinned at position 1
    steps = pq.read_table(run.online_steps_path).to_pylist()
    for row, check in zip(steps, result.checks):
        assert row["check_gain"] == pytest.approx(check.gain) and row["check_requests"] == 6
        assert row["check_same_choice"] == check.same_choice
        assert row["check_gain_low"] <= row["check_gain"] <= row["check_gain_high"]
        assert row["time_check_s"] > 0 and 0.0 <= row["check_late_share"] <= 1.0
    # the rule, applied to the recorded gains by hand: a step is kept when its gain is positive and
    # above every earlier one's
    expected, best = [], 0.0
    for row in steps:
        if row["check_gain"] > best:
            best, kept_step = row["check_gain"], row["step"]
        expected.append(kept_step if best > 0 else 0)
    assert [row["kept_step"] for row in steps] == expected
    # the run's controller is the kept one: best.pt, what serve and evaluate load
    assert run.controller_checkpoint == run.best_checkpoint and result.checkpoint == run.best_checkpoint
    assert find_controller(check_ws, "checked").path == run.best_checkpoint
    saved = torch.load(run.best_checkpoint, weights_only=True)
    assert saved["kept_step"] == expected[-1]
    kept = TwoStageController.load(run.best_checkpoint, embedded_runtime.fingerprint)
    start_file = TwoStageController.load(run.start_checkpoint, embedded_runtime.fingerprint)
    assert start_file.two_stage.fixed_insertion_position == 1
    if expected[-1] == 0:
        assert kept.two_stage.fixed_insertion_position == 1
    else:
        assert kept.two_stage.fixed_insertion_position is None


def test_a_pair_where_the_latest_chooses_as_the_start_runs_once(embedded_runtime, check_ws, monkeypatch):
    from online.check import HeldOutCheck
    from online.data import load_online_samples
    from online.rollout import RolloutExecutor
    from online.train import build_controller

    samples = load_online_samples(check_ws, embedded_runtime.fingerprint)
    controller, _, _ = build_controller(_config(check_ws), check_ws, embedded_runtime, samples, (30.0, 300.0))
    start = controller.with_fixed_insertion(1)
    runs = []
    original = RolloutExecutor.run_groups

    def counting(self, groups, *args, **kwargs):
        runs.append(kwargs["controller"])
        return original(self, groups, *args, **kwargs)

    monkeypatch.setattr(RolloutExecutor, "run_groups", counting)
    executor = RolloutExecutor(embedded_runtime, controller, samples, max_new_tokens=2)
    try:
        check = HeldOutCheck(start, samples.rows("val")[:2], [40.0, 200.0])
        first = check.run(executor, start.with_fixed_insertion(1), 1)
        assert len(runs) == 8 and first.same_choice == 0
        # the same choices again: one run per pair, and a gain of exactly 0
        again = check.run(executor, start.with_fixed_insertion(1), 2)
        assert len(runs) == 8 + 4 and again.same_choice == 4
        assert (again.gain, again.gain_low, again.gain_high) == (0.0, 0.0, 0.0)
        assert again.late_share == again.start_late_share
        # a controller that inserts at another position never chooses as the start: both run
        other = start.with_fixed_insertion(2)
        moved = check.run(executor, other, 3)
        assert len(runs) == 12 + 8 and moved.same_choice == 0
        assert sum(c is start for c in runs[12:]) == 4
    finally:
        executor.close()


def test_checks_off_serve_the_last_step(embedded_runtime, check_ws):
    import pyarrow.parquet as pq

    from online.train import train_online
    from trainer.runs import RunDir

    result = train_online(_config(check_ws, run_id="unchecked", steps=1, check_every=0), runtime=embedded_runtime)
    run = RunDir(result.run_dir)
    assert result.kept is None and result.checks == [] and not run.best_checkpoint.exists()
    assert run.controller_checkpoint == run.last_checkpoint == result.checkpoint
    (row,) = pq.read_table(run.online_steps_path).to_pylist()
    assert row["check_gain"] is None and row["kept_step"] is None


def test_the_run_stops_when_checks_stop_paying_and_a_resume_keeps_what_they_kept(embedded_runtime, check_ws,
                                                                               monkeypatch):
    from online.check import HeldOutCheck
    from online.train import train_online
    from trainer.runs import RunDir
    from trainer.two_stage import TwoStageController

    gains = {1: 0.2, 2: -0.1, 3: 0.0, 4: 0.3, 5: -0.2}
    checked = {}

    def scripted(self, executor, latest, step):
        checked[step] = {k: v.detach().clone() for k, v in latest.state_dict().items()}
        return _result(step, gains[step])

    monkeypatch.setattr(HeldOutCheck, "run", scripted)
    events = []
    first = train_online(_config(check_ws, run_id="patient", steps=5, patience=2), progress=events.append,
                         runtime=embedded_runtime)
    # kept at step 1, then two checks without a better one: the run stops after step 3 of 5
    assert first.stopped_early and first.steps["step"].to_list() == [1, 2, 3]
    assert first.kept.step == 1 and first.kept.since == 2
    assert [e["step"] for e in events if e["phase"] == "stop"] == [3]
    # each check is announced before it runs (the progress bar says what the run is doing)
    assert [(e["step"], e["pairs"]) for e in events if e["phase"] == "checking"] == [(1, 6), (2, 6), (3, 6)]
    checks = [e for e in events if e["phase"] == "check"]
    assert [(e["step"], e["kept_step"], e["since"]) for e in checks] == [(1, 1, 0), (2, 1, 1), (3, 1, 2)]
    run = RunDir(first.run_dir)

    def best_pt() -> dict:
        return TwoStageController.load(run.best_checkpoint, embedded_runtime.fingerprint).state_dict()

    assert torch.load(run.best_checkpoint, weights_only=True)["kept_step"] == 1
    assert all(torch.equal(v, checked[1][k]) for k, v in best_pt().items())  # the controller step 1's check saw
    # resumed with patience off: the kept controller and its count come back from last.pt
    resumed = train_online(_config(check_ws, steps=5, resume="patient"), runtime=embedded_runtime)
    assert resumed.steps["step"].to_list() == [1, 2, 3, 4, 5] and not resumed.stopped_early
    assert resumed.steps["kept_step"].to_list() == [1, 1, 1, 4, 4]
    assert resumed.kept.step == 4 and resumed.kept.gain == pytest.approx(0.3)
    assert torch.load(run.best_checkpoint, weights_only=True)["kept_step"] == 4
    assert all(torch.equal(v, checked[4][k]) for k, v in best_pt().items())


def test_the_cli_reports_each_check_and_what_was_kept(embedded_runtime, check_ws):
    from typer.testing import CliRunner

    from cli import app

    args = ["train", "--online", "-w", str(check_ws.root), "--steps", "2", "--samples-per-step", "1", "--group-size",
            "2", "--max-new-tokens", "2", "--budget-min-ms", "30", "--budget-max-ms", "300", "--run-id", "checked-cli",
            "--check-every", "2", "--check-samples", "2", "--check-budgets", "1", "--no-evaluate"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    assert "step 2: held-out gain over the start " in done.stderr and "on 2 paired requests" in done.stderr
    assert "kept: " in done.stdout
