"""Bursty arrivals: the arrival processes, the burst-aware wait model, the cheapest floor and the
deadline order of the queue, with values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from controller.cost import LatencyScale
from serve.arrivals import ArrivalSpecError, arrival_times, bursts, parse_arrivals, read_trace
from serve.budget import ArrivalRate, BudgetPlanner, Load, arrival_cap_ms, mean_wait_ms, replay_cheapest
from serve.queueing import DeadlineQueue, service_order

# -- arrival processes


def test_arrival_specs_and_their_errors():
    assert parse_arrivals("poisson").kind == "poisson"
    assert parse_arrivals("gamma:2").cv == 2.0
    onoff = parse_arrivals("onoff:3:10:50")
    assert (onoff.factor, onoff.on_s, onoff.off_s) == (3.0, 10.0, 50.0) and onoff.name == "onoff:3:10:50"
    for bad, says in (("gamma:0", "coefficient of variation"), ("gamma:x", "not a list of numbers"),
                      ("onoff:0.5:10:50", "burst factor"), ("onoff:3:0:50", "durations"),
                      ("bursty", "expected poisson"), ("onoff:3:10", "expected poisson")):
        with pytest.raises(ArrivalSpecError, match=says):
            parse_arrivals(bad)


@pytest.mark.parametrize(("spec", "cv"), [("poisson", 1.0), ("gamma:2", 2.0), ("gamma:0.5", 0.5)])
def test_renewal_processes_keep_their_mean_rate_and_variability(spec, cv):
    times = arrival_times(spec, 100_000, 8.0, seed=1)
    gaps = np.diff(times)
    assert np.all(gaps >= 0)
    assert len(times) / times[-1] == pytest.approx(8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_on_off_bursts_come_at_their_factor_and_keep_the_mean():
    # base rate r over 50 s and 3r over 10 s average to 10/s: r = 10 x 60 / 80 = 7.5
    times = arrival_times("onoff:3:10:50", 60_000, 10.0, seed=2)
    assert len(times) / times[-1] == pytest.approx(10.0, rel=0.03)
    phase = times % 60.0
    in_burst = np.mean(phase >= 50.0)  # a share 3 x 10 / (3 x 10 + 50) of the arrivals
    assert in_burst == pytest.approx(30 / 80, abs=0.01)
    assert bursts("onoff:3:10:50", 130.0) == [(50.0, 60.0), (110.0, 120.0)]
    assert bursts("poisson", 130.0) == []


def test_a_trace_file_is_rescaled_to_the_rate_with_its_shape_kept(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("# seconds\n10.0\n10.5\n\n11.0\n14.0\n")  # three gaps over 4 s: 0.75 per second
    assert list(read_trace(trace)) == [0.0, 0.5, 1.0, 4.0]
    # at 1.5 per second everything runs twice as fast; the fifth arrival starts the trace again one mean
    # gap (4 / 3 s, halved) after the last
    times = arrival_times(f"file:{trace}", 6, 1.5, seed=0)
    assert times == pytest.approx([0.0, 0.25, 0.5, 2.0, 2.0 + 2 / 3, 2.25 + 2 / 3])
    trace.write_text("1.0\n0.5\n")
    with pytest.raises(ArrivalSpecError, match=r"trace.txt:2: 0.5 s comes before"):
        read_trace(trace)
    trace.write_text("1.0\nsoon\n")
    with pytest.raises(ArrivalSpecError, match=r"trace.txt:2: 'soon' is not a time"):
        read_trace(trace)
    with pytest.raises(ArrivalSpecError, match="cannot read"):
        read_trace(tmp_path / "missing.txt")


# -- the wait model


def test_kingman_reduces_to_pollaczek_khinchine_for_poisson_arrivals():
    # M/M/1 at rho 0.5, 100 ms: W = 100 ms; arrivals three times as variable: rho / (1 - rho) (3 + 1) / 2 x 100
    assert mean_wait_ms(100.0, Load(5.0, service_scv=1.0)) == pytest.approx(100.0)
    assert mean_wait_ms(100.0, Load(5.0, service_scv=1.0, arrival_scv=3.0)) == pytest.approx(200.0)
    assert mean_wait_ms(100.0, Load(5.0, arrival_scv=0.0)) == pytest.approx(0.0)  # D/D/1: nobody waits
    # two streams: P-K's 21.154 ms plus (2 - 1) / 2 x 0.35 / 0.65 x 70 ms (the mean service of the mix)
    mixed = Load(2.0, rate_other=3.0, other_mean_ms=50.0, other_m2_ms2=2500.0, arrival_scv=2.0)
    assert mean_wait_ms(100.0, mixed) == pytest.approx(40.0, abs=1e-3)


def test_variable_arrivals_lower_the_arrival_cap():
    # s + rho / (1 - rho) s = 300 at rho = 0.005 s: s = 120; with arrival_scv 3, s + 2 rho / (1 - rho) s = 300: s = 100
    assert arrival_cap_ms(300.0, Load(5.0, service_scv=1.0)) == pytest.approx(120.0, abs=1e-6)
    assert arrival_cap_ms(300.0, Load(5.0, service_scv=1.0, arrival_scv=3.0)) == pytest.approx(100.0, abs=1e-6)


def test_a_burst_is_read_within_a_few_arrivals():
    rate = ArrivalRate()
    for i in range(21):  # two a second for ten seconds
        rate.observe(i * 0.5)
    assert rate.burst_rate(10.0) == pytest.approx(2.0)  # nothing faster lately: the windowed rate
    for i in range(1, 9):  # then twenty a second
        rate.observe(10.0 + i * 0.05)
    assert rate.rate(10.4) == pytest.approx(28 / 10.4)  # the window still remembers the quiet part
    assert rate.burst_rate(10.4) == pytest.approx(20.0)  # the last eight: 7 / 0.35 s


def test_the_dispersion_of_arrival_counts():
    rate = ArrivalRate()
    rate.observe(0.0)  # opens the span: eight one-second windows before 8.0
    for t in (1.5, 3.5, 5.5, 7.5):  # four arrivals in every other window
        for _ in range(4):
            rate.observe(t)
    # counts 4, 0, 4, 0, ...: mean 2, sample variance 8 x 4 / 7
    assert rate.dispersion(8.0, 1.0) == pytest.approx(16 / 7)
    assert rate.dispersion(8.0, 2.0) is None  # four windows are too few
    even = ArrivalRate()
    for i in range(17):
        even.observe(i * 0.5)
    assert even.dispersion(8.0, 1.0) == pytest.approx(0.0)  # two in every window: smoother than Poisson


# -- the floor


def test_the_cheapest_replay_follows_lindleys_recursion():
    arrivals = [(0.0, 100.0), (0.01, 100.0), (0.02, 100.0), (1.0, 30.0)]
    # waits 0, 30, 60, 0 at 40 ms each: the third ends exactly at its budget, the last's budget is below 40
    assert replay_cheapest(arrivals, [40.0]) == [True, True, True, False]
    # costs 40, 60, 40, 60: waits 0, 30, 80 (+ 40 = 120 > 100), 0 (60 > 30)
    assert replay_cheapest(arrivals, [40.0, 60.0]) == [True, True, False, False]
    assert replay_cheapest(arrivals, []) == [False] * 4


REFERENCE = {(2, 4, 12): 20.0, (6, 8, 14): 50.0}


def floor_planner(**kwargs) -> BudgetPlanner:
    """The cheapest configuration: 20 ms x scale 2, 10 ms after stage 1 and a 2 ms reply: 52 ms expected; its
    served requests ran at the reference (ratio 1): 32 ms in the replay."""
    p = BudgetPlanner(REFERENCE, LatencyScale(REFERENCE, fixed=2.0), met_target=0.95,
                      **{"cheapest_floor": True, **kwargs})
    for _ in range(10):
        p.observe_served(after_ms=10.0, service_ms=60.0, adjustable=True, model_over_reference=1.0)
        p.observe_reply(2.0)
    for i in range(30):  # one a second: the cheapest configuration would have met every 200 ms budget
        p.observe_arrival(float(i), adjustable=True, budget_ms=200.0)
    return p


def test_the_floor_decides_cheapest_while_the_controller_keeps_fewer_budgets():
    p = floor_planner()
    for _ in range(19):
        p.observe_kept(200.0, False)
    assert not p.plan(200.0, 0.0, now_s=30.0).floor  # 19 outcomes decide nothing yet
    p.observe_kept(200.0, False)
    plan = p.plan(200.0, 0.0, now_s=30.0)
    assert plan.floor and plan.cheapest and plan.budget_class == "3-5x"
    assert p.floor_states() == {"3-5x": True}
    assert not p.plan(100.0, 0.0, now_s=30.0).floor  # another class (1.5-2x): its own outcomes, none yet
    assert not p.plan(200.0, 0.0, now_s=30.0, fixed=True).floor  # fixed knobs are never decided for
    for _ in range(63):  # the window of 64 now holds one miss: 0.984, within the tolerance but below 1
        p.observe_kept(200.0, True)
    assert p.plan(200.0, 0.0, now_s=30.0).floor  # once on, it waits until they keep as many
    p.observe_kept(200.0, True)
    assert not p.plan(200.0, 0.0, now_s=30.0).floor
    off = floor_planner(cheapest_floor=False)
    for _ in range(30):
        off.observe_kept(200.0, False)
    assert not off.plan(200.0, 0.0, now_s=30.0).floor


def test_the_floor_tolerates_a_small_shortfall():
    p = floor_planner()
    for i in range(64):  # 63 of 64 within: 0.984, above the replay's 1.0 less the tolerance of 0.02
        p.observe_kept(200.0, i != 0)
    assert not p.plan(200.0, 0.0, now_s=30.0).floor
    p.observe_kept(200.0, False)  # the window of 64 drops the first miss: still 63 of 64
    assert not p.plan(200.0, 0.0, now_s=30.0).floor
    p.observe_kept(200.0, False)  # 62 of 64: 0.969
    assert p.plan(200.0, 0.0, now_s=30.0).floor


def test_a_burst_aware_plan_records_the_arrivals_variability():
    def clumped(**kwargs) -> BudgetPlanner:
        p = floor_planner(**kwargs)
        for start in range(31, 61, 5):  # then five at once every five seconds: as many per second on average
            for _ in range(5):
                p.observe_arrival(float(start), adjustable=True, budget_ms=200.0)
        return p

    plan = clumped().plan(1000.0, 0.0, now_s=60.5)
    # one-second windows: five in one of every five, none in the others: variance 4, mean 1
    assert plan.arrival_scv == pytest.approx(4.0, rel=0.15)
    plain = clumped(burst_aware=False).plan(1000.0, 0.0, now_s=60.5)
    assert plain.arrival_scv == 1.0
    # the same arrivals read as more variable wait longer: a lower cap
    assert plan.arrival_cap_ms < plain.arrival_cap_ms


# -- the queue's order


def test_earliest_deadline_first_among_those_that_can_still_make_it():
    # at 0.5 s with the cheapest taking 1 s, the deadline at 1.0 cannot be made: last
    assert service_order([5.0, 3.0, 1.0, 4.0], 0.5, 1.0) == [1, 3, 0, 2]
    assert service_order([2.0, 2.0], 0.0, 0.1) == [0, 1]  # ties: first come, first served
    assert service_order([1.0, 0.9, 3.0], 0.95, 0.1) == [2, 0, 1]  # the late ones oldest first
    # without a budget of its own a request is never moved back: its deadline orders it
    assert service_order([5.0, 3.0, 1.0, 4.0], 0.5, 1.0, [True, True, False, True]) == [2, 1, 3, 0]


class Waiting:
    def __init__(self, arrival: float, budget_ms: float, budget_source: str = "request") -> None:
        self.arrival, self.budget_ms, self.budget_source = arrival, budget_ms, budget_source


def test_the_deadline_queue_serves_in_that_order_and_drains_when_closed():
    clock = [0.0]
    q: DeadlineQueue[Waiting] = DeadlineQueue(lambda: 100.0, lambda: clock[0])
    loose, tight, lost = Waiting(0.0, 1000.0), Waiting(0.1, 300.0), Waiting(0.0, 50.0)
    for item in (loose, tight, lost):
        q.put(item)
    assert q.snapshot() == [tight, loose, lost] and len(q) == 3
    # a request with a deadline at 0.5 s would be served after the tight one only
    assert q.ahead_of(0.5) == [tight]
    assert q.get() is tight
    clock[0] = 0.95  # the loose one's 1.0 s deadline is now 50 ms away, less than the cheapest's 100 ms
    assert q.snapshot() == [loose, lost]  # both late: oldest first (ties by arrival keep the order put)
    q.close()
    assert [q.get(), q.get(), q.get()] == [loose, lost, None]


def test_default_budgets_keep_first_come_first_served():
    clock = [10.0]  # every deadline has passed: requests with budgets of their own would all be late
    q: DeadlineQueue[Waiting] = DeadlineQueue(lambda: 100.0, lambda: clock[0])
    items = [Waiting(0.1 * i, 300.0, "default") for i in range(3)]
    for item in items:
        q.put(item)
    assert q.snapshot() == items and q.ahead_of(0.35) == items[:1]


def test_unknown_cheapest_time_reads_as_zero():
    q: DeadlineQueue[Waiting] = DeadlineQueue(lambda: None, lambda: 0.0)
    a, b = Waiting(0.0, 10.0), Waiting(0.0, 5.0)
    q.put(a)
    q.put(b)
    assert q.snapshot() == [b, a] and len(q) == 2


def test_when_unreachable_is_refuse_run_or_a_400_naming_it():
    from serve.protocol import Limits, RequestError, parse_chat_request

    limits = Limits(default_max_tokens=4, max_tokens_limit=8, max_image_pixels=10_000)
    body = {"model": "m", "messages": [{"role": "user", "content": "Is it red?"}]}
    assert parse_chat_request(body, limits).when_unreachable == "refuse"
    assert parse_chat_request({**body, "when_unreachable": "run"}, limits).when_unreachable == "run"
    with pytest.raises(RequestError) as refused:
        parse_chat_request({**body, "when_unreachable": "queue"}, limits)
    assert refused.value.status == 400 and refused.value.param == "when_unreachable"
    assert "refuse, run" in refused.value.message


def test_a_refused_request_is_a_miss_for_its_class_margin():
    p = floor_planner()
    p.plan(200.0, 0.0, now_s=30.0)  # the class aims at 0.95 (the cheapest configuration would meet them all)
    p.observe_refused(200.0)
    # log(margin) += 0.1 x (0 - 0.95), as after a late answer; the other classes untouched
    assert p.margins() == {"3-5x": pytest.approx(math.exp(-0.095))}
    p.observe_refused(40.0)  # below the cheapest configuration: no margin to move
    assert p.margins() == {"3-5x": pytest.approx(math.exp(-0.095))}


def test_a_projected_start_skips_the_requests_that_will_be_dropped():
    from serve.queueing import projected_start_ms

    # 30 ms of the worker each (40 ms served), the running one done in 10 ms: starts at 10, 40, 70
    assert projected_start_ms([500.0, 500.0], [True, True], 10.0, 30.0, 40.0) == 70.0
    # the second's deadline is 60 ms away: its turn at 40 leaves 20 < 40: it will be dropped, costing nothing
    assert projected_start_ms([500.0, 60.0, 500.0], [True, True, True], 10.0, 30.0, 40.0) == 70.0
    assert projected_start_ms([500.0, 60.0, 500.0], [True, False, True], 10.0, 30.0, 40.0) == 100.0  # not droppable
    assert projected_start_ms([], [], 0.0, 30.0) == 0.0
