"""The batch cost a batched server decides with: the step fit, a request's batch factor, the occupancy,
and how the budget planner reads them (values worked out by hand)."""

from __future__ import annotations

import math

import pytest

from controller.cost import LatencyScale
from runtime.base import RowKnobs
from serve.batch_cost import STEP_MIN, BatchCost, StepFit, step_features
from serve.budget import BudgetPlanner, Load, mean_wait_ms, queue_cap_ms, utilisation

LAYERS = 4


def knobs(blocks, k):
    return RowKnobs(tuple(blocks), tuple(k for _ in range(LAYERS)))


def test_step_features_count_the_blocks_any_row_runs_and_the_expert_products():
    rows = [knobs((0, 1, 2), 8), knobs((0, 1), 4)]
    assert step_features(rows) == (1.0, 3.0, 32.0)  # blocks {0, 1, 2}; 3 x 8 + 2 x 4 products
    assert step_features([knobs((0, 3), 2), knobs((1,), 1)]) == (1.0, 3.0, 5.0)


def test_a_step_fit_recovers_a_linear_step_time():
    fit = StepFit((0, 1, 2))
    # step = 2 + 0.5 per block run + 0.01 per product
    designs = [(1.0, 4.0, 32.0), (1.0, 2.0, 8.0), (1.0, 3.0, 40.0), (1.0, 4.0, 64.0), (1.0, 1.0, 8.0)]
    for _ in range(2):
        for f in designs:
            fit.observe(f, 2 + 0.5 * f[1] + 0.01 * f[2])
    assert fit.predict((1.0, 4.0, 96.0)) == pytest.approx(2 + 2 + 0.96)


def test_a_step_fit_gives_nothing_before_enough_steps_and_no_negative_term():
    fit = StepFit((0, 2))
    for i in range(STEP_MIN - 1):
        fit.observe((1.0, 0.0, float(i)), 5.0)
    assert fit.predict((1.0, 0.0, 3.0)) is None
    # times that fall with the products: the products' term is dropped, the constant fits their mean
    fit = StepFit((0, 2))
    for i in range(STEP_MIN):
        fit.observe((1.0, 0.0, float(i)), 10.0 - i)
    assert fit.predict((1.0, 0.0, 100.0)) == pytest.approx(sum(10.0 - i for i in range(STEP_MIN)) / STEP_MIN)


def _measured_cost() -> BatchCost:
    """Batched steps of 1 + 1 per block run + 0.1 per product; alone steps of 0.5 + 0.1 per product;
    decode steps half of every request's model time."""
    cost = BatchCost()
    for rows in ([knobs((0, 1, 2, 3), 8)], [knobs((0, 1), 4)], [knobs((0, 1, 2, 3), 8), knobs((0, 1), 4)],
                 [knobs((0,), 2), knobs((0, 1, 2), 2)], [knobs((0, 1, 2, 3), 1)] * 3):
        for _ in range(3):
            u, p = step_features(rows)[1:]
            cost.observe_step(rows, 1 + u + 0.1 * p)
    for k in knobs((0, 1, 2, 3), 8), knobs((0, 1), 4), knobs((0,), 1):
        for _ in range(3):
            cost.observe_alone(k, 0.5 + 0.1 * step_features([k])[2])
    for _ in range(5):
        cost.observe_request(model_ms=100.0, decode_ms=50.0)
    return cost


def test_a_request_beside_the_batch_is_expected_to_take_longer_than_alone():
    cost = _measured_cost()
    full, half = knobs((0, 1, 2, 3), 8), knobs((0, 1), 4)
    assert cost.factor(full, []) == 1.0  # nothing beside it: it runs alone
    # beside the full row: together 1 + 4 + 0.1 x 40 = 9, alone 0.5 + 0.8 = 1.3
    assert cost.factor(half, [full]) == pytest.approx(1 + 0.5 * (9 / 1.3 - 1))
    # the full row beside the half one adds no block: together 9 again, alone 0.5 + 3.2 = 3.7
    assert cost.factor(full, [half]) == pytest.approx(1 + 0.5 * (9 / 3.7 - 1))
    # other requests starting at 5/s, 40 ms each: the batch stalls 20 % of the time
    cost.observe_request(model_ms=100.0, decode_ms=50.0, start_ms=40.0)
    assert cost.factor(half, [full], starts_per_s=5.0) == pytest.approx(1 + 0.5 * (9 / 1.3 / 0.8 - 1))


def test_joining_the_blocks_the_batch_runs_costs_less_than_adding_blocks():
    cost = _measured_cost()
    running = [knobs((0, 1), 4)] * 2
    same, more = knobs((0, 1), 4), knobs((0, 1, 2, 3), 4)
    # the marginal step time the row adds: 0.8 for the same blocks, 2 + 1.6 for two blocks more
    assert cost.step_ms([*running, same]) - cost.step_ms(running) == pytest.approx(0.8)
    assert cost.step_ms([*running, more]) - cost.step_ms(running) == pytest.approx(3.6)


def test_nothing_measured_reads_as_alone():
    assert BatchCost().factor(knobs((0, 1), 4), [knobs((0,), 8)]) == 1.0
    assert BatchCost().occupancy == 1.0


def test_the_occupancy_is_the_time_a_request_holds_the_worker_alone():
    cost = BatchCost()
    cost.observe_request(model_ms=100.0, decode_ms=50.0, exclusive_ms=30.0, worker_ms=120.0)  # 0.25
    cost.observe_request(model_ms=100.0, decode_ms=50.0, worker_ms=80.0)  # answered alone: 1
    assert cost.occupancy == pytest.approx(0.625)


def test_the_queue_cap_counts_each_request_s_hold_on_the_worker():
    # one request at a time: the i-th waiting one needs t + i x 10 <= its time left
    assert queue_cap_ms([100.0, 100.0], 10.0) == pytest.approx(80.0)
    # holding the worker half the time: 0.5 (t + (i - 1) x 10) + 10 <= left
    assert queue_cap_ms([100.0, 100.0], 10.0, occupancy=0.5) == pytest.approx(170.0)


def test_the_arrival_cap_reads_the_batched_service_rate():
    alone, batched = Load(10.0), Load(10.0, occupancy=0.5)
    assert utilisation(50.0, alone) == pytest.approx(0.5)
    assert utilisation(50.0, batched) == pytest.approx(0.25)
    # Pollaczek-Khinchine, deterministic service: lambda S^2 / (2 (1 - rho)) of the busy time 25 ms
    assert mean_wait_ms(50.0, batched) == pytest.approx(0.01 * 25.0 ** 2 / (2 * 0.75))
    assert mean_wait_ms(120.0, alone) == math.inf and mean_wait_ms(120.0, batched) < math.inf


def test_the_plan_divides_the_controller_s_budget_by_the_batch_factor():
    reference = {(1, 8, 16): 40.0, (1, 4, 8): 20.0}
    planner = BudgetPlanner(reference, LatencyScale(reference, fixed=2.0), met_target=None)
    alone = planner.plan(300.0, 10.0, now_s=0.0)
    batched = planner.plan(300.0, 10.0, now_s=0.0, batch_factor=1.5, batch_rows_expected=3, occupancy=0.4)
    assert alone.controller_budget_ms == pytest.approx((300.0 - 10.0) / 2.0)
    assert batched.controller_budget_ms == pytest.approx((300.0 - 10.0) / 2.0 / 1.5)
    assert (batched.batch_factor, batched.batch_rows_expected, batched.occupancy) == (1.5, 3, 0.4)
    fixed = planner.plan(300.0, 10.0, now_s=0.0, fixed=True, batch_factor=1.5)
    assert fixed.controller_budget_ms == pytest.approx(145.0) and fixed.batch_factor == 1.0
