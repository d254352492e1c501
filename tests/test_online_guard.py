"""The latency guard: its ratios and slack from known milliseconds, which configurations it allows,
the guarded greedy decision on the embedded model, and an online run that fits and keeps it."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from controller.latency_guard import LatencyGuard, config_ratios, guard_slack, guarded_stage2, stage_ratios
from pipeline.errors import CtrlError
from trainer.data import ActionSpace
from trainer.outcome import OutcomeConfig, OutcomeModel
from trainer.policy import ControllerPolicy, PolicyConfig
from trainer.two_stage import TwoStageConfig, TwoStageController

CROPS, TOP_K, BLOCKS = (2, 6), (4, 8), (12, 16)
LANG, IMAGE = 5, 3


def test_stage_ratios_sum_each_stage_over_the_requests_where_all_are_known():
    measured = np.array([[10.0, 30.0, 20.0], [12.0, 36.0, 40.0], [np.nan, 99.0, 99.0]])
    recorded = np.array([[10.0, 10.0, 20.0], [10.0, 14.0, 20.0], [10.0, 10.0, 10.0]])
    # the third row has no measured vision time: left out of every stage
    assert stage_ratios(measured, recorded).tolist() == pytest.approx([22 / 20, 66 / 24, 60 / 40])
    # a stage never recorded (all zeros) keeps ratio 1
    assert stage_ratios(np.array([[5.0, 10.0, 10.0]]), np.array([[0.0, 5.0, 10.0]])).tolist() == [1.0, 2.0, 1.0]


def test_a_configuration_ratio_rescales_each_recorded_stage_and_keeps_the_rest():
    ratios = np.array([1.0, 3.0, 1.5])
    stage_mean = np.array([[5.0, 10.0, 20.0], [5.0, 40.0, 20.0], [5.0, np.nan, 20.0]])
    total = np.array([40.0, 70.0, 30.0])
    # 1 + (0 * 5 + 2 * 10 + 0.5 * 20) / 40 = 1.75; 1 + (80 + 10) / 70; an unknown stage adds nothing
    assert config_ratios(ratios, stage_mean, total).tolist() == pytest.approx([1.75, 1 + 90 / 70, 1 + 10 / 30])
    assert config_ratios(ratios, stage_mean, np.array([40.0, np.nan, 0.0])).tolist() == pytest.approx([1.75, 1, 1])


def test_the_slack_is_the_quantile_of_measured_over_expected():
    measured = np.array([90.0, 100.0, 110.0, 120.0, 200.0, np.nan])
    assert guard_slack(measured, np.full(6, 100.0), quantile=0.5) == pytest.approx(1.1)
    assert guard_slack(measured, np.full(6, 100.0), quantile=1.0) == pytest.approx(2.0)
    with pytest.raises(CtrlError, match="no request"):
        guard_slack(np.array([np.nan]), np.array([100.0]))


def _space() -> ActionSpace:
    return ActionSpace(tuple(itertools.product(CROPS, TOP_K, BLOCKS)))


def _outcome(latency_ms: list[float]) -> OutcomeModel:
    """An outcome model predicting the same latency for every request: ``latency_ms`` per action."""
    model = OutcomeModel(LANG + IMAGE + 1, _space(), OutcomeConfig(use_tilings=False))
    with torch.no_grad():
        model.latency_head[-1].weight.zero_()
        model.latency_head[-1].bias.copy_(torch.tensor(latency_ms))
    return model.eval()


def _controller() -> TwoStageController:
    policy = ControllerPolicy(PolicyConfig(lang_feature_dim=LANG, image_feature_dim=IMAGE, budget_min_ms=100.0,
                                           budget_max_ms=300.0), _space())
    return TwoStageController(policy, TwoStageConfig(hidden_size=8, token_scale=1.0, num_layers=16))


# per action, sorted (crops, top_k, blocks): (2,4,12) (2,4,16) (2,8,12) (2,8,16) (6,4,12) (6,4,16) (6,8,12) (6,8,16)
PREDICTED = [50.0, 60.0, 70.0, 80.0, 100.0, 110.0, 120.0, 130.0]


def test_the_guard_allows_the_configurations_expected_to_fit():
    # crops 6 twice as dear here (ratio 2 on its four configurations), the slack 1.1 on everything
    guard = LatencyGuard(_outcome(PREDICTED), torch.tensor([1.0] * 4 + [2.0] * 4), 1.1, {}, 8)
    lang = torch.zeros(LANG)
    grid = guard.knob_grid(_controller(), lang, None, 90.0)
    assert grid.expected_ms[0].flatten().tolist() == pytest.approx([55.0, 66.0, 77.0, 88.0])
    assert grid.expected_ms[1].flatten().tolist() == pytest.approx([220.0, 242.0, 264.0, 286.0])
    assert grid.base_ms[1].flatten().tolist() == pytest.approx([200.0, 220.0, 240.0, 260.0])  # before the slack
    assert grid.allowed[0].flatten().tolist() == [True, True, True, True] and not grid.allowed[1].any()
    grid = guard.knob_grid(_controller(), lang, None, 70.0)
    assert grid.allowed[0].flatten().tolist() == [True, True, False, False] and not grid.allowed[1].any()
    # nothing fits: only the configuration expected to be fastest
    grid = guard.knob_grid(_controller(), lang, None, 10.0)
    assert grid.allowed.flatten().tolist() == [True] + [False] * 7


def test_the_guard_follows_the_machines_speed_on_the_requests_it_decided():
    # fitted when requests took 1.2 times their base expectation
    guard = LatencyGuard(_outcome(PREDICTED), torch.ones(8), 1.0, {}, 8, fit_median=1.2)
    lang = torch.zeros(LANG)
    for _ in range(7):  # the machine now runs half as fast again: 2.4 times the base
        guard.observe(50.0, 120.0)
    assert guard.drift() == 1.0  # too few requests to say
    guard.observe(60.0, 144.0)
    assert guard.drift() == pytest.approx(2.0)
    grid = guard.knob_grid(_controller(), lang, None, 130.0)
    assert grid.expected_ms[0, 0, 0] == pytest.approx(100.0)  # 50 ms base x 1.0 slack x 2.0 drift
    assert grid.allowed[0].flatten().tolist() == [True, True, False, False]
    guard.observe(float("nan"), 10.0)  # not counted
    guard.observe(0.0, 10.0)
    assert guard.drift() == pytest.approx(2.0)
    # a guard without a fitted median never drifts
    still = LatencyGuard(_outcome(PREDICTED), torch.ones(8), 1.0, {}, 8)
    for _ in range(10):
        still.observe(50.0, 500.0)
    assert still.drift() == 1.0


def test_the_tail_factor_steps_on_each_request_over_or_within_its_expectation():
    guard = LatencyGuard(_outcome(PREDICTED), torch.ones(8), 1.0, {}, 8)  # no fitted median: no drift
    guard.observe(50.0, 60.0, 55.0)  # over: the logarithm rises by 0.05 x 0.95
    assert guard.tail() == pytest.approx(math.exp(0.0475))
    guard.observe(50.0, 40.0, 55.0)  # within: it falls by 0.05 x 0.05
    assert guard.tail() == pytest.approx(math.exp(0.045))
    guard.observe(50.0, 500.0)  # no expectation given: the tail stays
    guard.observe(50.0, 500.0, float("inf"))
    assert guard.tail() == pytest.approx(math.exp(0.045))
    grid = guard.knob_grid(_controller(), torch.zeros(LANG), None, 1000.0)
    assert grid.expected_ms[0, 0, 0] == pytest.approx(50.0 * math.exp(0.045))
    assert grid.base_ms[0, 0, 0] == pytest.approx(50.0)
    for _ in range(200):  # a budget no configuration meets does not wind it up without end
        guard.observe(50.0, 5000.0, 50.0)
    assert guard.tail() == pytest.approx(3.0)


@pytest.mark.parametrize("use_drift", [False, True])
def test_the_guard_keeps_its_share_of_requests_over_expectation_when_the_machine_slows(use_drift):
    # measured / base ratios spread evenly over 0.5-1.5, in a scrambled order; the slack fitted at
    # 1.45 (the 95th percentile of that spread); then the machine runs 1.6 times as slowly
    spread = np.random.default_rng(0).permutation(np.linspace(0.5, 1.5, 1000))
    guard = LatencyGuard(_outcome(PREDICTED), torch.ones(8), 1.45, {}, 8, fit_median=1.0 if use_drift else None)

    def share_over(slowdown: float, rounds: int) -> float:
        over = []
        for ratio in np.tile(spread, rounds):
            expected = 50.0 * guard.factor()
            over.append(50.0 * ratio * slowdown > expected)
            guard.observe(50.0, 50.0 * ratio * slowdown, expected)
        return float(np.mean(over[len(over) // 2:]))

    assert share_over(1.0, 2) == pytest.approx(0.05, abs=0.015)
    # without the tail factor (and the drift), 1.45 against 0.8-2.4: about 60 % over
    assert share_over(1.6, 2) == pytest.approx(0.05, abs=0.015)
    assert guard.factor() == pytest.approx(1.6 * 1.45, rel=0.08)


def test_a_guard_survives_its_file(tmp_path):
    guard = LatencyGuard(_outcome(PREDICTED), torch.tensor([1.0] * 4 + [2.0] * 4), 1.1, {"prefill": 3.0}, 8,
                         model_s=4.5, fit_median=0.9)
    for _ in range(10):  # the drift is the process's own: a loaded guard starts without it
        guard.observe(50.0, 100.0)
    again = LatencyGuard.load(guard.save(tmp_path / "guard.pt"))
    lang = torch.randn(3, LANG)
    assert torch.allclose(again.expected_ms(lang, None), guard.expected_ms(lang, None) / guard.drift())
    assert again.summary() == guard.summary() and again.fit_median == 0.9 and again.drift() == 1.0


def test_a_guard_of_the_first_format_reads_its_outcome_model(tmp_path):
    guard = LatencyGuard(_outcome(PREDICTED), torch.tensor([1.0] * 4 + [2.0] * 4), 1.1, {"prefill": 3.0}, 8,
                         model_s=4.5, fit_median=0.9)
    old = {"format": 1, "outcome": guard.predictor.to_state(), "config_ratio": guard.config_ratio, "slack": 1.1,
           "stage_ratios": {"prefill": 3.0}, "requests": 8, "model_s": 4.5, "fit_median": 0.9}
    torch.save(old, tmp_path / "old.pt")
    again = LatencyGuard.load(tmp_path / "old.pt")
    assert again.predictor_name == "outcome" and again.spread == {}
    # the outcome model predicts 50 ms for (2, 4, 12) and 100 for (6, 4, 12), the latter twice as dear here
    expected = again.expected_ms(torch.zeros(1, LANG), None)[0]
    assert expected[0] == pytest.approx(50.0 * 1.1) and expected[4] == pytest.approx(100.0 * 2.0 * 1.1)


def test_guarded_stage_2_takes_the_most_probable_allowed_pair_the_position_permits():
    top_k = torch.tensor([0.0, -1.0])
    blocks = torch.tensor([float("-inf"), -0.5, -2.0])  # the first block count not permitted here
    allowed = torch.tensor([[True, False, True], [True, True, False]])
    expected = torch.tensor([[10.0, 20.0, 30.0], [15.0, 25.0, 35.0]])
    # permitted and allowed: (0, 2) at -2.0 and (1, 1) at -1.5
    assert guarded_stage2(top_k, blocks, allowed, expected) == (1, 1)
    # none allowed is permitted: the permitted pair expected to be fastest, (0, 1)
    only_first = torch.tensor([[True, False, False], [True, False, False]])
    assert guarded_stage2(top_k, blocks, only_first, expected) == (0, 1)


@pytest.fixture(scope="module")
def guard_ws(tmp_path_factory, embedded_runtime):
    from conftest import build_offline_workspace

    return build_offline_workspace(tmp_path_factory.mktemp("guard"), embedded_runtime, 24)[1]


def test_a_guarded_greedy_decision_runs_an_allowed_configuration(guard_ws, embedded_runtime):
    from online.config import OnlineTrainConfig
    from online.data import load_online_samples
    from online.evaluate import greedy_rollout
    from online.rollout import RolloutExecutor
    from online.train import build_controller
    from trainer.outcome import OutcomeModel as Outcome

    samples = load_online_samples(guard_ws, embedded_runtime.fingerprint)
    controller, _, _ = build_controller(OnlineTrainConfig(workspace=guard_ws.root), guard_ws, embedded_runtime,
                                        samples, (50.0, 150.0))
    outcome = Outcome.load(guard_ws.runs_dir / "offline-run" / "outcome.pt")
    actions = outcome.action_space.actions
    # one configuration expected at 1 ms, every other at 1000: at a budget of 10 ms only it fits
    target = actions[len(actions) // 2]
    with torch.no_grad():
        outcome.latency_head[-1].weight.zero_()
        outcome.latency_head[-1].bias.copy_(torch.tensor([1.0 if a == target else 1000.0 for a in actions]))
        outcome.latency_scale_ms.fill_(1.0)
    guard = LatencyGuard(outcome, torch.ones(len(actions)), 1.0, {}, 0)
    executor = RolloutExecutor(embedded_runtime, controller, samples, max_new_tokens=3)
    try:
        for sample in samples.rows("test")[:3]:
            r = greedy_rollout(executor, controller, sample, 10.0, controller.insertion_positions.index(1), guard)
            assert (r.max_crops, r.top_k, r.num_active_blocks) == target
            # where every configuration fits, the guard changes nothing
            position = controller.insertion_positions.index(1)
            loose = greedy_rollout(executor, controller, sample, 1e6, position, guard)
            free = greedy_rollout(executor, controller, sample, 1e6, position)
            assert (loose.max_crops, loose.top_k, loose.num_active_blocks) == (
                free.max_crops, free.top_k, free.num_active_blocks)
    finally:
        executor.close()
    # each 10 ms request ran over its configuration's 1 ms expectation, and told the guard so
    assert guard.tail() > math.exp(3 * 0.05 * 0.95 - 3 * 0.05 * 0.05) - 1e-6


def test_an_online_run_fits_its_guard_and_decides_under_it(guard_ws, embedded_runtime):
    from controller.latency_guard import GUARD_FILE, load_run_guard
    from online.config import OnlineTrainConfig
    from online.train import train_online
    from trainer.outcome import OutcomeModel as Outcome

    base = dict(workspace=guard_ws.root, steps=1, samples_per_step=2, group_size=2, max_new_tokens=3,
                budget_min_ms=30.0, budget_max_ms=300.0, checkpoint_every=1, evaluate=False, check_every=1,
                check_samples=2, check_budgets=2)
    result = train_online(OnlineTrainConfig(**base, run_id="guarded", guard_samples=2), runtime=embedded_runtime)
    guard = load_run_guard(result.run_dir)
    actions = Outcome.load(guard_ws.runs_dir / "offline-run" / "outcome.pt").action_space.actions
    assert guard is not None and guard.requests == 2 * len(actions)  # every configuration on both samples
    assert set(guard.stage_ratios) == {"vision", "prefill", "decode"} and guard.slack > 0
    assert 0 < guard.fit_median <= guard.slack  # a median of the ratios the slack is the 95th percentile of
    assert result.checks and (result.run_dir / GUARD_FILE).exists()
    # both of the parent run's predictors were measured on the guard's requests; it reads the tighter one
    assert set(guard.spread) == {"request_cost", "outcome"} and all(v >= 1.0 for v in guard.spread.values())
    assert guard.spread[guard.predictor_name] == min(guard.spread.values())
    unguarded = train_online(OnlineTrainConfig(**base, run_id="unguarded", guard_samples=0), runtime=embedded_runtime)
    assert load_run_guard(unguarded.run_dir) is None


def test_the_server_holds_an_online_controller_to_its_runs_guard():
    from serve.deciders import OnlineDecider, Stage2Inputs

    controller = _controller()
    with torch.no_grad():  # left alone, the controller chooses the dearest configuration, (6, 8, 16)
        for head, bias in ((controller.policy.crops_head, [0.0, 9.0]), (controller.policy.top_k_head, [0.0, 9.0]),
                           (controller.policy.blocks_head, [0.0, 5.0])):
            head[-1].weight.zero_()
            head[-1].bias.copy_(torch.tensor(bias))
    lang, tiling = torch.zeros(LANG), torch.full((len(CROPS),), float("nan"))

    def decide(decider: OnlineDecider, budget: float) -> tuple[int, int, int]:
        choice = decider.stage1(lang, tiling, budget)
        top_k, blocks = decider.stage2(choice, Stage2Inputs(lang, tiling, budget, torch.zeros(IMAGE), torch.zeros(8)))
        return choice.max_crops, top_k, blocks

    assert decide(OnlineDecider(controller, "run"), 75.0) == (6, 8, 16)
    # crops 6 twice as dear (ratio 2): at 75 ms only (2, 4, 12), (2, 4, 16) and (2, 8, 12) fit, and of
    # these the controller's scores favour (2, 8, 12) (9 + 0 against 0 + 5 and 0 + 0)
    guard = LatencyGuard(_outcome(PREDICTED), torch.tensor([1.0] * 4 + [2.0] * 4), 1.0, {}, 8, fit_median=1.0)
    guarded = OnlineDecider(controller, "run", guard)
    assert decide(guarded, 75.0) == (2, 8, 12)
    assert decide(guarded, 1e6) == (6, 8, 16)  # everything fits: the controller's own choice
    assert decide(guarded, 1.0) == (2, 4, 12)  # nothing fits: the configuration expected to be fastest
    # served requests that took twice their expectation: the guard now expects (2, 8, 12) at 140 ms
    choice = guarded.stage1(lang, tiling, 75.0)
    for _ in range(8):
        guarded.cost.observe(choice.cost_grid, (2, 8, 12), model_ms=140.0, measured_ms=140.0, insertion_position=1)
    assert guard.drift() == pytest.approx(2.0)
    assert guard.tail() == pytest.approx(math.exp(8 * 0.05 * 0.95))  # each over the 70 ms it was decided by
    assert decide(guarded, 75.0) == (2, 4, 12)


def test_the_latency_before_vision_reads_the_question_and_the_tiling_and_the_image_as_its_mean():
    model = OutcomeModel(LANG + IMAGE + 1 + len(CROPS), _space(), OutcomeConfig(use_tilings=True))
    with torch.no_grad():
        model.input_mean.copy_(torch.arange(LANG + IMAGE + 1 + len(CROPS), dtype=torch.float32))
        model.input_std.fill_(2.0)
        model.latency_scale_ms.fill_(3.0)
    lang = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    tiling = torch.tensor([[3.0, float("nan")]])
    # standardised by hand: the language columns, the image and its presence at their means (0), the
    # tilings as log(1 + crops) (an unknown one at its mean)
    x = torch.zeros(1, LANG + IMAGE + 1 + len(CROPS))
    x[0, :LANG] = (lang[0] - torch.arange(LANG)) / 2.0
    x[0, LANG + IMAGE + 1] = (math.log(4.0) - (LANG + IMAGE + 1)) / 2.0
    with torch.no_grad():
        expected = model.latency_head(x) * 3.0
    assert torch.allclose(model.latency_before_vision(lang, tiling), expected)
    # no tiling at all reads every tiling at its mean
    x[0, LANG + IMAGE + 1] = 0.0
    with torch.no_grad():
        assert torch.allclose(model.latency_before_vision(lang, None), model.latency_head(x) * 3.0)
