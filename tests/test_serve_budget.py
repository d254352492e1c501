"""serve/budget.py alone: each term of a request's budget with values worked out by hand."""

from __future__ import annotations

import math

import pytest

from controller.cost import LatencyScale, guard_config
from serve.budget import (
    CLASS_MARGIN_FLOORS,
    ArrivalRate,
    BudgetMargin,
    BudgetPlanner,
    Load,
    _arrival_cap_root,
    arrival_cap_ms,
    budget_class,
    cheapest_met_share,
    class_name,
    mean_wait_ms,
    queue_cap_ms,
)

REFERENCE = {(2, 4, 12): 20.0, (6, 8, 14): 50.0}


def test_budget_classes_by_multiples_of_the_cheapest_configuration():
    assert [class_name(budget_class(b, 50.0)) for b in (40.0, 50.0, 74.9, 75.0, 100.0, 149.0, 150.0, 250.0)] == [
        "<1x", "1-1.5x", "1-1.5x", "1.5-2x", "2-3x", "2-3x", "3-5x", ">=5x"]
    assert class_name(budget_class(10.0, None)) == "1-1.5x"  # nothing known: one class for all
    # the floor of a class reads its budgets as the cheapest configuration's: 1 / its upper edge
    assert CLASS_MARGIN_FLOORS[:3] == pytest.approx((1 / 1.5, 0.5, 1 / 3))
    assert CLASS_MARGIN_FLOORS[3:] == (0.2, 0.2)  # the margin's own bound


def test_queue_cap_by_hand():
    assert queue_cap_ms([], 30.0) is None
    assert queue_cap_ms([100.0, 150.0], 30.0) == 70.0  # min(100 - 30, 150 - 60)
    assert queue_cap_ms([40.0], 30.0) is None  # lost either way: it does not cap


def test_waiting_times_are_exact_for_an_mm1_queue():
    # M/M/1 at 5 requests/s, mean service 100 ms (exponential: scv 1): mean wait rho / (mu - lambda) =
    # 0.5 / (0.01 - 0.005) = 100 ms
    assert mean_wait_ms(100.0, Load(5.0, service_scv=1.0)) == pytest.approx(100.0)
    assert mean_wait_ms(100.0, Load(5.0)) == pytest.approx(50.0)  # deterministic service: half of M/M/1's
    # 2/s adjustable at 100 ms beside 3/s others of 50 ms (deterministic): rho 0.35, W = (0.002 * 100^2 +
    # 0.003 * 50^2) / (2 * 0.65) = 21.154 ms
    mixed = Load(2.0, rate_other=3.0, other_mean_ms=50.0, other_m2_ms2=2500.0)
    assert mean_wait_ms(100.0, mixed) == pytest.approx(21.154, abs=1e-3)
    assert mean_wait_ms(100.0, Load(10.0)) == math.inf


def test_arrival_cap_by_hand():
    # 5 requests/s of deterministic service s: s + 0.005 s^2 / (2 (1 - 0.005 s)) = 300 at s = 139.445 ms
    assert arrival_cap_ms(300.0, Load(5.0)) == pytest.approx(139.445, abs=1e-2)
    # 0.1 requests/s: s + 0.0001 s^2 / (2 (1 - 0.0001 s)) = 300 at s = 295.501 ms: a light load barely caps
    assert arrival_cap_ms(300.0, Load(0.1)) == pytest.approx(295.501, abs=1e-2)
    assert arrival_cap_ms(300.0, Load(0.0)) is None
    # others alone hold the server 99 % of the time: even an instant request waits past the budget
    assert arrival_cap_ms(50.0, Load(1.0, rate_other=19.8, other_mean_ms=50.0, other_m2_ms2=2500.0)) == 0.0


def test_arrival_cap_with_bursty_arrivals_and_batching_by_hand():
    # 10 requests/s arriving three times as variable as Poisson: W(s) = 0.005 s^2 / (1 - 0.01 s) (Pollaczek-
    # Khinchine) + (3 - 1) / 2 x rho^2 / (1 - rho) / 0.01 (Kingman) = 0.015 s^2 / (1 - 0.01 s);
    # s + W(s) = 200 is 0.005 s^2 + 3 s - 200 = 0: s = (sqrt(13) - 3) / 0.01 = 60.555 ms
    assert arrival_cap_ms(200.0, Load(10.0, arrival_scv=3.0)) == pytest.approx(60.555, abs=1e-3)
    # requests that hold the server no time (occupancy 0) wait for nothing: the budget itself
    assert arrival_cap_ms(200.0, Load(10.0, arrival_scv=3.0, occupancy=0.0)) == pytest.approx(200.0)
    # answered in closed form, not by the bisection that remains for arrivals smoother than Poisson
    assert _arrival_cap_root(200.0, Load(10.0, arrival_scv=3.0)) == pytest.approx(60.555, abs=1e-3)
    # the same arrivals held at half the requests' time (a batch): rho = 0.005 s, W(s) = 0.00375 s^2 / (1 - 0.005 s);
    # -0.00125 s^2 + 2 s - 200 = 0: s = (2 - sqrt(3)) / 0.0025 = 107.180 ms
    assert arrival_cap_ms(200.0, Load(10.0, arrival_scv=3.0, occupancy=0.5)) == pytest.approx(107.180, abs=1e-3)
    # Poisson, with others holding the server 25 % of the time at 50 ms each (second moment 2,500 ms^2):
    # W(s) = (0.005 s^2 + 12.5) / (2 (0.75 - 0.005 s)); s + W(s) = 200: -0.0025 s^2 + 1.75 s - 143.75 = 0,
    # s = (1.75 - sqrt(3.0625 - 1.4375)) / 0.005 = 95.049 ms
    assert arrival_cap_ms(200.0, Load(5.0, rate_other=5.0, other_mean_ms=50.0,
                                      other_m2_ms2=2500.0)) == pytest.approx(95.049, abs=1e-3)


def test_the_arrival_cap_is_the_longest_service_time_that_meets_the_budget():
    for load in (Load(40.0, 3.0, 20.0, 900.0, 0.7, 9.0, 0.3), Load(2.0, service_scv=2.5), Load(25.0, 10.0, 4.0, 20.0)):
        for budget in (30.0, 150.0, 1000.0):
            cap = arrival_cap_ms(budget, load)
            assert cap + mean_wait_ms(cap, load) <= budget
            longer = cap * (1 + 1e-9) + 1e-9
            assert longer > budget or longer + mean_wait_ms(longer, load) > budget


def test_what_the_cheapest_configuration_would_meet():
    assert cheapest_met_share([30.0, 50.0, 70.0, 90.0], 68.0, 0.0) == 0.5  # no queue: two of four fit
    # 10 requests/s of 30 ms: rho 0.3, W = 0.01 x 900 / (2 x 0.7) = 6.4286 ms; P(wait <= 68 - 30) =
    # 1 - 0.3 exp(-38 x 0.3 / 6.4286) = 0.94907
    assert cheapest_met_share([30.0, 30.0], 68.0, 10.0) == pytest.approx(0.94907, abs=1e-5)
    # 30 and 50 ms: rho 0.4, W = 0.01 x 1700 / 1.2 = 14.167 ms; (0.86320 + 0.75938) / 2
    assert cheapest_met_share([30.0, 50.0], 68.0, 10.0) == pytest.approx(0.81129, abs=1e-5)
    assert cheapest_met_share([30.0], 68.0, 40.0) == 0.0  # rho 1.2: the queue grows without bound
    assert math.isnan(cheapest_met_share([], 68.0, 1.0))


def test_arrival_rate_over_recent_arrivals():
    rate = ArrivalRate(window=32, horizon_s=30.0, minimum=5)
    for t in (0.0, 0.5, 1.0, 1.5):
        rate.observe(t)
    assert rate.rate(2.0) is None  # four arrivals say nothing yet
    rate.observe(2.0)
    assert rate.rate(2.5) == pytest.approx(1.6)  # (5 - 1) / (2.5 - 0.0)
    assert rate.rate(40.0) is None  # the last arrival left the horizon: no estimate, no cap
    short = ArrivalRate(window=3, minimum=3)
    for t in (0.0, 1.0, 2.0, 3.0):
        short.observe(t)
    assert short.rate(3.0) == pytest.approx(1.0)  # the last three: (3 - 1) / (3.0 - 1.0)


def planner(met_target: float | None = 0.95, **kwargs) -> BudgetPlanner:
    p = BudgetPlanner(REFERENCE, LatencyScale(REFERENCE, fixed=2.0), met_target=met_target, **kwargs)
    for _ in range(10):
        p.observe_served(after_ms=10.0, service_ms=60.0, adjustable=True, model_over_reference=None)
        p.observe_reply(2.0)
    return p


def test_a_plan_without_load():
    plan = planner().plan(200.0, 30.0, now_s=100.0)
    assert plan.reserve_ms == 12.0 and plan.reply_reserve_ms == 2.0
    assert plan.budget_left_ms == 158.0  # 200 - 30 - 12
    # the cheapest configuration is expected to take 20 x 2 + 12 = 52 ms: 200 / 52 = 3.8
    assert plan.budget_class == "3-5x" and plan.budget_margin == 1.0 and plan.met_target == 0.95
    assert plan.queue_cap_ms is None and plan.arrival_rate_rps is None and plan.arrival_cap_ms is None
    assert plan.feasible_rate is None  # nothing served with a reference latency yet
    assert plan.controller_budget_ms == 79.0 and not plan.cheapest  # 158 x 1 / 2


def test_the_queue_and_the_arrivals_cap_the_plan():
    p = planner()
    # one request waits with 105 ms left: it needs 52 - 2 = 50 ms after this one, so this one may take 55
    plan = p.plan(200.0, 30.0, now_s=100.0, waiting_left_ms=[105.0])
    assert plan.queue_cap_ms == 55.0 and plan.controller_budget_ms == 22.5  # (55 - 10) / 2
    for i in range(11):  # ten requests a second whose cost the controller chooses
        p.observe_arrival(100.0 + i / 10, adjustable=True)
    plan = p.plan(200.0, 0.0, now_s=101.0)
    assert plan.arrival_rate_rps == pytest.approx(10.0)
    # budget less the reply's 2 ms: s + 0.01 s^2 / (2 (1 - 0.01 s)) = 198 at s = 76.180 ms (service times
    # alike: the ten recorded were all 60 ms)
    assert plan.arrival_cap_ms == pytest.approx(76.180, abs=1e-2)
    assert plan.controller_budget_ms == pytest.approx((76.180 - 10.0) / 2, abs=1e-2)
    # requests with fixed knobs are never capped (the terms are recorded, none applied)
    fixed = p.plan(200.0, 0.0, now_s=101.0, waiting_left_ms=[105.0], fixed=True)
    assert fixed.queue_cap_ms is None and fixed.arrival_cap_ms is None and fixed.controller_budget_ms == 94.0


def test_each_served_request_moves_the_next_plan():
    p = planner()
    for i in range(11):
        p.observe_arrival(100.0 + i / 10, adjustable=True)
    assert p.plan(200.0, 0.0, now_s=101.0).arrival_cap_ms == pytest.approx(76.180, abs=1e-2)
    for service in (30.0, 90.0) * 5:  # the twenty served now spread: mean 60, variance 450, scv 0.125
        p.observe_served(after_ms=10.0, service_ms=service, adjustable=True, model_over_reference=None)
    # s + 0.01 x 1.125 s^2 / (2 (1 - 0.01 s)) = 198: -0.004375 s^2 + 2.98 s - 198 = 0 at s = 74.617 ms
    assert p.plan(200.0, 0.0, now_s=101.0).arrival_cap_ms == pytest.approx(74.617, abs=1e-2)
    # the cheapest configuration's met share, from the model-time ratios served: one at 1 x its 20 ms + 10
    # ms after stage 1, queued at 10 requests/s: 1 - 0.3 exp(-168 x 0.3 / 6.4286) = 0.99988
    p.observe_served(after_ms=10.0, service_ms=60.0, adjustable=True, model_over_reference=1.0)
    assert p.plan(200.0, 0.0, now_s=101.0).feasible_rate == pytest.approx(0.99988, abs=1e-5)
    # then one at 5 x: costs 30 and 110 ms, rho 0.7, W = 108.33 ms, share 0.68359; the class's mean 0.84174
    p.observe_served(after_ms=10.0, service_ms=60.0, adjustable=True, model_over_reference=5.0)
    assert p.plan(200.0, 0.0, now_s=101.0).feasible_rate == pytest.approx(0.84174, abs=1e-5)


def test_the_cheapest_configurations_least_time_follows_the_windows_and_the_scale():
    scale = LatencyScale(REFERENCE)
    p = BudgetPlanner(REFERENCE, scale, met_target=0.95)
    for _ in range(10):
        p.observe_served(after_ms=10.0, service_ms=60.0, adjustable=True, model_over_reference=None)
        p.observe_reply(2.0)
    assert p.cheapest_least_ms() == (32.0, 2.0)  # 20 x scale 1 + the 10th percentiles 10 and 2
    for _ in range(2):  # of twelve, the 10th percentile is the second smallest
        p.observe_served(after_ms=0.0, service_ms=60.0, adjustable=True, model_over_reference=None)
    assert p.cheapest_least_ms() == (22.0, 2.0)
    for _ in range(2):
        p.observe_reply(0.5)
    assert p.cheapest_least_ms() == (20.5, 0.5)
    scale.observe((6, 8, 14), 150.0)  # a ratio of 3: the scale every configuration reads until its own
    assert p.cheapest_least_ms() == (60.5, 0.5)


def test_below_every_reference_the_cheapest_rule_applies():
    plan = planner().plan(45.0, 0.0, now_s=1.0)  # (45 - 12) / 2 = 16.5 < 20
    assert plan.cheapest and plan.budget_class == "<1x" and plan.met_target is None


def test_each_budget_class_keeps_its_own_margin():
    p = planner()
    wide, tight, impossible = (p.plan(b, 0.0, now_s=1.0) for b in (200.0, 60.0, 45.0))
    assert (wide.budget_class, tight.budget_class, impossible.budget_class) == ("3-5x", "1-1.5x", "<1x")
    for _ in range(50):  # a stream of budgets nothing can meet, all missed
        p.observe_outcome(impossible, met=False)
    assert p.plan(200.0, 0.0, now_s=1.0).budget_margin == 1.0  # untouched
    p.observe_outcome(wide, met=False)
    assert p.plan(200.0, 0.0, now_s=1.0).budget_margin == pytest.approx(math.exp(-0.095))
    assert p.plan(60.0, 0.0, now_s=1.0).budget_margin == 1.0
    for _ in range(50):
        p.observe_outcome(tight, met=False)
    # down to where its budgets read as the cheapest configuration, not further
    assert p.plan(60.0, 0.0, now_s=1.0).budget_margin == pytest.approx(1 / 1.5)
    assert p.margins() == {"1-1.5x": pytest.approx(1 / 1.5), "3-5x": pytest.approx(math.exp(-0.095))}


def test_the_target_drops_to_what_the_cheapest_configuration_meets():
    p = planner()
    for ratio in (1.0, 2.0, 3.0, 4.0):  # the cheapest (20 ms) at these ratios, plus 10 ms after: 30, 50, 70, 90
        p.observe_served(after_ms=10.0, service_ms=60.0, adjustable=True, model_over_reference=ratio)
    plan = p.plan(70.0, 0.0, now_s=1.0)  # 68 ms once the reply is taken off: two of the four fit
    assert plan.feasible_rate == 0.5 and plan.met_target == 0.5
    later = p.plan(100.0, 0.0, now_s=1.0)  # another class: its own history (98 ms: all four fit)
    assert later.feasible_rate == 1.0 and later.met_target == 0.95
    again = p.plan(72.0, 0.0, now_s=1.0)  # 70 ms: three of four; the class's mean of 0.5 and 0.75
    assert again.feasible_rate == pytest.approx(0.625) and again.met_target == pytest.approx(0.625)
    # a miss at a target of 0.625 moves the margin by 0.1 x 0.625 (not 0.95)
    p.observe_outcome(again, met=False)
    assert p.plan(72.0, 0.0, now_s=1.0).budget_margin == pytest.approx(math.exp(-0.0625))


def test_the_warm_up_seeds_every_margin():
    p = planner()
    ratios = [1.0] * 9 + [1.25]  # median 1, 90th percentile 1.25
    assert p.seed_margin(ratios) == pytest.approx(0.8)
    assert p.plan(200.0, 0.0, now_s=1.0).budget_margin == pytest.approx(0.8)
    off = planner(met_target=None)
    assert off.seed_margin(ratios) == 1.0 and off.plan(200.0, 0.0, now_s=1.0).budget_margin == 1.0


def test_a_margin_observed_at_a_lower_target():
    margin = BudgetMargin(0.95)
    assert margin.observe(False, target=0.5) == pytest.approx(math.exp(-0.05))
    assert margin.observe(True, target=0.99) == pytest.approx(math.exp(-0.05 + 0.1 * 0.05))  # never above its own


GUARDED = {(2, 4, 12): 20.0, (2, 8, 12): 30.0, (6, 4, 12): 45.0, (6, 4, 16): 55.0, (6, 8, 14): 57.0}


def scale_of(config):
    return 1.12 if config == (6, 8, 14) else 0.9  # 6/8/14 is dearer on this machine than its profile says


def test_the_guard_replaces_a_configuration_whose_median_here_exceeds_the_budget():
    # 6/8/14 expected at 57 x 1.12 = 63.84 ms
    assert guard_config((6, 8, 14), GUARDED, scale_of, 70.0) == (6, 8, 14)  # fits: kept
    # 60 ms: at 6 crops 6/4/12 (40.5) and 6/4/16 (49.5) fit; the larger reference is taken
    assert guard_config((6, 8, 14), GUARDED, scale_of, 60.0) == (6, 4, 16)
    assert guard_config((6, 8, 14), GUARDED, scale_of, 45.0) == (6, 4, 12)  # 6/4/16 no longer fits
    # nothing at 6 crops fits (2-crop ones would, but the vision pass ran at 6): the fastest at 6
    assert guard_config((6, 8, 14), GUARDED, scale_of, 30.0) == (6, 4, 12)
    assert guard_config((6, 4, 12), GUARDED, scale_of, 30.0) == (6, 4, 12)  # never dearer than chosen
    assert guard_config((10, 8, 16), GUARDED, scale_of, 1.0) == (10, 8, 16)  # no reference: not judged


def test_each_configuration_gets_its_own_scale_once_measured():
    reference = {(2, 4, 12): 10.0, (6, 8, 14): 20.0}
    scale = LatencyScale(reference, quantile=0.5)
    for _ in range(4):
        scale.observe((6, 8, 14), 30.0)  # 1.5 each
    assert scale.of((6, 8, 14)) == 1.5 == scale.value  # four of its own: the global scale (also 1.5)
    for _ in range(4):
        scale.observe((2, 4, 12), 9.0)  # 0.9 each
    assert scale.value == 1.5  # eight ratios, the sorted fifth: 1.5
    assert scale.of((2, 4, 12)) == 1.5  # four of its own are too few
    scale.observe((2, 4, 12), 9.0)
    assert scale.of((2, 4, 12)) == pytest.approx(0.9)  # five: its own median
    assert LatencyScale(reference, fixed=2.0).of((2, 4, 12)) == 2.0
