"""``ctrl simulate``: the server's scheduler on a virtual clock over a profile's unseen samples."""

from __future__ import annotations

import json
import math

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cli import app
from conftest import build_offline_workspace
from pipeline.catalog import run_query
from pipeline.errors import CtrlError
from pipeline.schema import SIMULATIONS
from pipeline.workspace import Workspace
from simulate.calibration import Overheads, calibrate
from simulate.config import SimulateConfig, SimulateOptionError, parse_budget_mix
from simulate.profile import pareto_front
from simulate.run import (
    CellRunner,
    CellTask,
    Decider,
    fewest_replicas,
    load_inputs,
    make_workload,
    run_cells,
    summarize,
    trace_times,
    worker_count,
)
from simulate.simulation import ServerOptions, Simulation, Workload, cheapest_config

runner = CliRunner()


@pytest.fixture(scope="module")
def sim_ws(tmp_path_factory, embedded_runtime):
    """A synthetic workspace with a one-epoch offline run (no cross-fitting: its test split is unseen)."""
    _, ws = build_offline_workspace(tmp_path_factory.mktemp("simulate"), embedded_runtime, 80)
    return ws


@pytest.fixture(scope="module")
def inputs(sim_ws):
    """The run's profile and controller, no fixed costs, the machine as fast as the profile."""
    _, _, profile, decider, _ = load_inputs(SimulateConfig(workspace=sim_ws.root, run="offline-run", rate="1",
                                                           budget_ms="1000"))
    return profile, decider


def _config(ws, **kw):
    base = {"workspace": ws.root, "run": "offline-run", "budget_ms": "1000", "rate": "1"}
    return SimulateConfig(**{**base, **kw})


# -- options and inputs refused with one line


@pytest.mark.parametrize(("options", "message"), [
    ({"budget_ms": "150:0.6,300:0.3"}, "the shares sum to 0.9, not 1"),
    ({"budget_ms": "150,300"}, "has no share"),
    ({"budget_ms": ""}, "--budget-ms is required"),
    ({"rate": "0"}, "--rate: '0' must be a number > 0"),
    ({"rate": "fast"}, "--rate: 'fast' is not a number"),
    ({"rate": None}, "give --rate"),
    ({"load": "0.5"}, "not both"),
    ({"replicas": 20, "requests": 10}, "--replicas 20 is more than the 10 requests"),
    ({"deciders": "static:4/8"}, "is not controller, cheapest, front or static:C/K/B"),
    ({"deciders": "best"}, "'best' is not controller"),
    ({"requests": 10, "duration": 5.0}, "--requests or --duration"),
    ({"client_ms": -1.0}, "--client-ms must be a number of ms >= 0"),
    ({"service_noise": 3.0}, "--service-noise must be a log standard deviation in"),
    ({"jobs": -1}, "--jobs must be an integer >= 0"),
])
def test_bad_options_are_one_line_errors_naming_the_option(tmp_path, options, message):
    with pytest.raises(SimulateOptionError, match=message.replace("(", r"\(").replace("+", r"\+")) as caught:
        _config(Workspace(tmp_path), **options)
    assert "\n" not in str(caught.value)


def test_a_budget_mix_is_budgets_with_shares():
    assert parse_budget_mix("150") == ((150.0, 1.0),)
    assert parse_budget_mix("150:0.6, 300:0.4") == ((150.0, 0.6), (300.0, 0.4))


@pytest.mark.parametrize(("text", "message"), [
    ("0.5\n0.2\n", r":2: 0.2 s comes before the line above"),
    ("-1\n2\n", r":1: '-1' is a negative time"),
    ("# nothing\n\n", "needs at least two distinct times, got 0"),
])
def test_a_bad_trace_is_refused_naming_its_line(tmp_path, text, message):
    path = tmp_path / "trace.txt"
    path.write_text(text)
    with pytest.raises(CtrlError, match=message):
        trace_times(path)


def test_a_run_without_unseen_samples_is_refused(sim_ws, tmp_path):
    config_path = sim_ws.runs_dir / "offline-run" / "config.json"
    saved = config_path.read_text()
    try:  # a held-out dataset no sample belongs to
        config = json.loads(saved)
        config["holdout_dataset"] = "nowhere"
        config_path.write_text(json.dumps(config))
        with pytest.raises(CtrlError, match="nowhere"):
            load_inputs(_config(sim_ws))
    finally:
        config_path.write_text(saved)


def test_a_static_configuration_the_profile_lacks_is_refused(sim_ws, inputs):
    profile, decider = inputs
    sim = Simulation(profile, decider, Overheads())
    workload = Workload(np.array([0.0]), np.array([0]), np.array([1000.0]))
    with pytest.raises(CtrlError, match="the profile has no configuration 99/1/1"):
        sim.run(workload, (99, 1, 1))


# -- the unseen samples and the front


def test_requests_draw_only_the_runs_test_split(sim_ws, inputs):
    from trainer.data import load_offline_data, split_of

    profile, _ = inputs
    data = load_offline_data(sim_ws)
    complete = [i for i, s in enumerate(data.split) if s == "test" and bool(data.mask[i].all())]
    assert profile.split == "test" and len(profile) == len(complete) > 0
    assert all(split_of(data.dataset[i], data.sample_key[i]) == "test" for i in complete)
    np.testing.assert_allclose(profile.latency_ms, data.latency_ms.numpy()[complete])


def test_the_front_keeps_what_nothing_beats_on_both():
    accuracy = {(1, 1, 1): 0.5, (2, 1, 1): 0.6, (3, 1, 1): 0.55, (4, 1, 1): 0.7}
    latency = {(1, 1, 1): 10.0, (2, 1, 1): 20.0, (3, 1, 1): 30.0, (4, 1, 1): 40.0}
    assert pareto_front(accuracy, latency) == ((1, 1, 1), (2, 1, 1), (4, 1, 1))


# -- the server's behaviour on the virtual clock


def _static(profile):
    """A configuration whose latencies differ across the first samples."""
    return max(profile.configs)


def test_an_idle_server_answers_each_request_in_its_profiled_time_with_its_score(inputs):
    profile, decider = inputs
    static = _static(profile)
    column = profile.configs.index(static)
    samples = np.arange(min(5, len(profile)))
    arrivals = np.arange(len(samples)) * 100.0  # 100 s apart: nobody waits
    sim = Simulation(profile, decider, Overheads(latency_scale=1.5))
    served = sim.run(Workload(arrivals, samples, np.full(len(samples), 1e6)), static)
    assert [r.status for r in served] == ["ok"] * len(samples)
    for r, i in zip(served, samples, strict=True):
        assert r.config == static
        assert r.latency_ms == pytest.approx(profile.latency_ms[i, column] * 1.5)
        assert r.score == profile.score[i, column]


def test_the_clients_own_costs_add_to_every_client_latency_and_not_to_the_servers(inputs):
    profile, decider = inputs
    static = _static(profile)
    column = profile.configs.index(static)
    # two at once: the second waits for the first's worker time only, not for its client's costs
    workload = Workload(np.zeros(2), np.array([0, 1]), np.full(2, 1e6))
    served = Simulation(profile, decider, Overheads(client_ms=7.0)).run(workload, static)
    t0, t1 = profile.latency_ms[0, column], profile.latency_ms[1, column]
    assert served[0].latency_ms == pytest.approx(t0 + 7.0)
    assert served[1].latency_ms == pytest.approx(t0 + t1 + 7.0)


def test_each_request_draws_one_served_requests_fixed_costs(inputs):
    profile, decider = inputs
    static = _static(profile)
    column = profile.configs.index(static)
    # two served requests' parse, stage 1, stage 2 and rest: 1 + 2 + 3 + 4 and 10 + 20 + 30 + 40 ms around the model
    rows = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
    over = Overheads(parse_ms=5.0, stage1_ms=5.0, stage2_ms=5.0, rest_ms=5.0, fixed_rows=rows)
    samples = np.zeros(40, dtype=int)
    workload = Workload(np.arange(40) * 100.0, samples, np.full(40, 1e6))  # 100 s apart: nobody waits
    served = Simulation(profile, decider, over).run(workload, static)
    around = sorted({round(r.latency_ms - profile.latency_ms[0, column], 6) for r in served})
    assert around == [10.0, 100.0]  # one row or the other, never the medians' 20 ms
    again = Simulation(profile, decider, over).run(workload, None)  # the controller: the same draws per request
    assert [r.latency_ms - r.model_ms for r in again] == pytest.approx([r.latency_ms - r.model_ms for r in served])


def test_requests_arriving_together_wait_for_each_other_in_deadline_order(inputs):
    profile, decider = inputs
    static = _static(profile)
    column = profile.configs.index(static)
    over = Overheads(parse_ms=2.0, reply_ms=3.0)
    # three at once; the third has the earliest deadline, so it runs second
    workload = Workload(np.zeros(3), np.array([0, 1, 2]), np.array([1e6, 3e6, 2e6]))
    served = Simulation(profile, decider, over).run(workload, static)
    t0, t1, t2 = (profile.latency_ms[i, column] for i in (0, 1, 2))
    assert [r.status for r in served] == ["ok"] * 3
    assert served[0].latency_ms == pytest.approx(2.0 + t0 + 3.0)
    assert served[2].latency_ms == pytest.approx(2.0 + t0 + t2 + 3.0)
    assert served[1].latency_ms == pytest.approx(2.0 + t0 + t2 + t1 + 3.0)


def test_a_full_queue_answers_503_and_a_second_replica_takes_the_request(inputs):
    profile, decider = inputs
    static = _static(profile)
    workload = Workload(np.zeros(3), np.array([0, 1, 2]), np.full(3, 1e6))
    one = Simulation(profile, decider, Overheads(), options=ServerOptions(max_queue=0)).run(workload, static)
    assert [r.status for r in one] == ["ok", "full", "full"]
    two = Simulation(profile, decider, Overheads(), replicas=2, balancer="round-robin",
                     options=ServerOptions(max_queue=0)).run(workload, static)
    assert [r.status for r in two] == ["ok", "ok", "full"]
    assert [r.replica for r in two] == [0, 1, 0]
    column = profile.configs.index(static)
    assert two[1].latency_ms == pytest.approx(profile.latency_ms[1, column])  # it did not wait


def test_least_loaded_sends_a_request_to_the_idle_replica(inputs):
    profile, decider = inputs
    static = _static(profile)
    workload = Workload(np.array([0.0, 0.0, 0.0]), np.array([0, 1, 2]), np.full(3, 1e6))
    served = Simulation(profile, decider, Overheads(), replicas=3).run(workload, static)
    assert sorted(r.replica for r in served) == [0, 1, 2]


def test_a_request_that_has_waited_past_the_queue_deadline_is_dropped(inputs):
    profile, decider = inputs
    static = _static(profile)
    column = profile.configs.index(static)
    first = profile.latency_ms[0, column]
    # the second's budget is a quarter of the first's time: by its turn it has spent 4x and more
    budget = first / 4.5
    workload = Workload(np.zeros(2), np.array([0, 1]), np.array([1e6, budget]))
    served = Simulation(profile, decider, Overheads(), options=ServerOptions(queue_deadline=4.0)).run(workload, static)
    assert [r.status for r in served][0] == "ok"
    assert served[1].status in ("dropped", "refused")  # refused on arrival, or dropped when its turn comes
    assert not served[1].met and served[1].score == 0.0


def test_a_budget_below_every_configuration_takes_the_cheapest_one(inputs):
    profile, decider = inputs
    low = min(decider.reference_latency_ms.values()) / 10
    n = min(6, len(profile))
    workload = Workload(np.arange(n) * 100.0, np.arange(n), np.full(n, low))
    served = Simulation(profile, decider, Overheads()).run(workload)
    assert {r.decided_by for r in served} == {"cheapest"}
    assert {r.config for r in served} == {cheapest_config(decider)}


def test_the_controller_at_a_generous_budget_on_an_idle_server_meets_every_budget(inputs):
    profile, decider = inputs
    n = min(8, len(profile))
    budget = 50 * max(decider.reference_latency_ms.values())
    workload = Workload(np.arange(n) * 100.0, np.arange(n), np.full(n, budget))
    served = Simulation(profile, decider, Overheads()).run(workload)
    assert all(r.met for r in served)
    assert all(r.decided_by in ("controller", "table") for r in served)


def test_every_decider_serves_the_same_requests_and_runs_repeat_exactly(sim_ws, inputs):
    profile, decider = inputs
    config = _config(sim_ws, rate="20", requests=60, budget_ms="150:0.5,600:0.5", seed=3)
    workload = make_workload(config, 20.0, profile, 3)
    again = make_workload(config, 20.0, profile, 3)
    np.testing.assert_array_equal(workload.arrivals, again.arrivals)
    np.testing.assert_array_equal(workload.samples, again.samples)
    assert set(np.unique(workload.budgets_ms)) == {150.0, 600.0}
    sim = Simulation(profile, decider, Overheads())
    first, second = sim.run(workload), sim.run(workload)
    assert [(r.status, r.config, r.latency_ms) for r in first] == [(r.status, r.config, r.latency_ms) for r in second]


def _outcomes(cells):
    """Every cell's figures and every request's end, as text (NaN equal to NaN)."""
    return repr([(c.decider.name, c.rate_rps, c.replicas, c.figures,
                  [(r.status, r.config, r.decided_by, r.latency_ms, r.score) for r in c.requests]) for c in cells])


def test_cells_simulated_in_worker_processes_end_as_those_simulated_here(sim_ws):
    config = _config(sim_ws, rate="3,9", requests=70, budget_ms="150:0.5,600:0.5", service_noise=0.3,
                     deciders="controller,cheapest")
    _, _, profile, decider, overheads = load_inputs(config)
    runner = CellRunner(config, profile, decider, overheads)
    deciders = [Decider("controller", None), Decider("cheapest", cheapest_config(decider))]
    tasks = [CellTask(rate, make_workload(config, rate, profile, seed), d)
             for seed, rate in enumerate((3.0, 9.0)) for d in deciders]
    here = run_cells(runner, tasks, 1)  # the controller is memoized in this process now
    done = []
    there = run_cells(runner, tasks, 2, progress=lambda n, total: done.append((n, total)))
    assert [c.decider.name for c in there] == ["controller", "cheapest"] * 2
    assert [c.rate_rps for c in there] == [3.0, 3.0, 9.0, 9.0]
    assert _outcomes(there) == _outcomes(here)
    assert done == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_worker_processes_start_only_for_enough_controller_requests(sim_ws, monkeypatch):
    monkeypatch.setattr("simulate.run.available_cpus", lambda: 4)
    arrivals = np.arange(10_000, dtype=float)

    def tasks(count, static=None, size=10_000):
        workload = Workload(arrivals[:size], np.zeros(size, dtype=int), np.full(size, 100.0))
        return [CellTask(1.0, workload, Decider("d", static))] * count

    auto = _config(sim_ws)
    assert worker_count(auto, tasks(2)) == 2  # 20,000 controller requests: one worker per cell
    assert worker_count(auto, tasks(6)) == 4  # no more than the CPUs
    assert worker_count(auto, tasks(2, size=9_999)) == 1
    assert worker_count(auto, tasks(1, size=10_000)) == 1  # one cell: nothing to share
    assert worker_count(auto, tasks(15, static=(1, 8, 16))) == 1  # a static's request is an eighth of the work
    assert worker_count(auto, tasks(16, static=(1, 8, 16))) == 4
    assert worker_count(_config(sim_ws, jobs=3), tasks(2, size=5)) == 2  # --jobs, at most one per cell
    assert worker_count(_config(sim_ws, jobs=1), tasks(8)) == 1


def test_a_trace_is_replayed_at_the_rate_asked_for_with_its_bursts(sim_ws, inputs, tmp_path):
    profile, _ = inputs
    trace = tmp_path / "trace.txt"
    # a burst of ten arrivals 10 ms apart, then one every second: mean gap (0.09 + 10) / 10 s
    times = [i * 0.01 for i in range(10)] + [0.09 + i for i in range(1, 11)]
    trace.write_text("# seconds\n" + "\n".join(f"{t:g}" for t in times) + "\n")
    config = _config(sim_ws, rate="2", trace=trace, requests=20)
    workload = make_workload(config, 2.0, profile, 0)
    gaps = np.diff(workload.arrivals)
    assert len(workload) == 20
    assert workload.arrivals[0] == 0.0  # a file's first arrival is at 0
    # rescaled so that its 19 gaps take 19 / 2 s (a mean rate of 2/s), the burst's gaps a hundredth of the others
    assert workload.arrivals[-1] == pytest.approx(9.5)
    assert gaps[1] / gaps[12] == pytest.approx(0.01)


def test_a_duration_bounds_the_arrivals(sim_ws, inputs):
    profile, _ = inputs
    config = _config(sim_ws, rate="50", duration=2.0, requests=None)
    workload = make_workload(config, 50.0, profile, 0)
    assert workload.arrivals.max() <= 2.0
    assert 60 <= len(workload) <= 140  # Poisson, 100 expected


def test_the_figures_count_a_late_or_refused_request_as_missed():
    from simulate.simulation import SimRequest

    def req(status, latency, budget, score):
        r = SimRequest(0, 0, 0.0, budget, status=status, latency_ms=latency, score=score)
        return r

    requests = [req("ok", 90.0, 100.0, 1.0), req("ok", 120.0, 100.0, 1.0), req("full", math.nan, 100.0, 0.0),
                req("dropped", math.nan, 100.0, 0.0)]
    figures = summarize(requests, Workload(np.array([0.0, 1.0, 2.0, 4.0]), np.zeros(4, int), np.full(4, 100.0)))
    assert figures["within_budget"] == 0.25
    assert figures["accuracy"] == 1.0  # of the two answered
    assert figures["right_within_budget"] == 0.25
    assert figures["goodput_rps"] == 0.25  # one right answer in 4 s
    assert figures["rejected_503"] == 0.25 and figures["dropped_504"] == 0.25


def test_the_fewest_replicas_search_finds_the_smallest_that_meets_the_target():
    from simulate.run import CellResult, Decider

    calls = []

    def simulated(n):
        calls.append(n)
        return CellResult(Decider("x", None), 1.0, 1.0, "100", n, {"within_budget": min(1.0, n / 10)}, [])

    assert fewest_replicas(simulated, 0.7, 64).replicas == 7
    assert fewest_replicas(simulated, 0.7, 5).meets_target is False
    assert max(calls) <= 16


# -- calibration from a served request log


def test_calibration_reads_the_medians_of_a_request_log(tmp_path):
    rows = []
    for i, (crops, model) in enumerate([(2, 100.0), (2, 120.0), (6, 300.0)]):
        rows.append({"time": f"2026-12-07T05:00:0{i}.000000Z", "status": "ok", "model_fingerprint": "abc",
                     "max_crops": crops, "top_k": 8,
                     "num_active_blocks": 16, "reply_reserve_ms": 4.0 + i, "latency_parse_ms": 1.0 + i,
                     "latency_queue_ms": 0.0, "latency_stage1_ms": 2.0, "latency_preprocess_ms": 5.0 * crops,
                     "latency_stage2_ms": 0.5, "latency_model_ms": model,
                     "latency_total_ms": 1.0 + i + 2.0 + 5.0 * crops + model + 0.5 + 1.5})
    rows.append({**rows[0], "status": "error"})
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reference = {(2, 8, 16): 50.0, (6, 8, 16): 100.0}
    over = calibrate(log, reference, "abc")
    assert over.requests == 3
    assert over.parse_ms == 2.0 and over.stage1_ms == 2.0 and over.stage2_ms == 0.5 and over.reply_ms == 5.0
    assert over.preprocess_ms == {2: 10.0, 6: 30.0}
    assert over.rest_ms == pytest.approx(1.5)
    assert over.latency_scale == 2.4  # ratios 2.0, 2.4, 3.0
    # each answered request's parse, stage 1, stage 2 and rest, for the simulated requests to draw
    assert over.fixed_rows.tolist() == [[1.0, 2.0, 0.5, 1.5], [2.0, 2.0, 0.5, 1.5], [3.0, 2.0, 0.5, 1.5]]
    with pytest.raises(CtrlError, match="no answered request of model other"):
        calibrate(log, reference, "other")


def test_calibration_reads_the_most_recent_requests_of_every_log(tmp_path):
    def row(second, model_ms):
        return {"time": f"2026-12-07T05:00:{second:02d}.000000Z", "status": "ok", "model_fingerprint": "abc",
                "max_crops": 2, "top_k": 4, "num_active_blocks": 12, "reply_reserve_ms": 1.0, "latency_parse_ms": 1.0,
                "latency_queue_ms": 0.0, "latency_stage1_ms": 1.0, "latency_preprocess_ms": 1.0,
                "latency_stage2_ms": 1.0, "latency_model_ms": model_ms, "latency_total_ms": model_ms + 5.0}

    (tmp_path / "requests").mkdir()
    # an older session on a slow machine (5x), a newer one at 2x, in files whose names sort the other way
    (tmp_path / "requests" / "b-old.jsonl").write_text("\n".join(json.dumps(row(s, 50.0)) for s in range(10)))
    (tmp_path / "requests" / "a-new.jsonl").write_text("\n".join(json.dumps(row(s, 20.0)) for s in range(20, 26)))
    reference = {(2, 4, 12): 10.0}
    assert calibrate(tmp_path, reference, recent=6).latency_scale == 2.0
    assert calibrate(tmp_path, reference, recent=8).requests == 8
    assert calibrate(tmp_path, reference, recent=100).latency_scale == 5.0  # the median of 10 at 5x, 6 at 2x


def test_a_configuration_with_enough_requests_in_the_log_keeps_its_own_latency_scale(tmp_path):
    from simulate.calibration import SCALE_MIN_REQUESTS

    reference = {(2, 4, 12): 10.0, (6, 8, 14): 20.0, (10, 8, 16): 40.0}
    runs = [((2, 4, 12), 30.0)] * SCALE_MIN_REQUESTS + [((6, 8, 14), 20.0)] * 3 + [((10, 8, 16), 44.0)] * 6
    rows = [{"time": "2026-12-07T05:00:00.000000Z", "status": "ok", "model_fingerprint": "abc", "max_crops": c,
             "top_k": k, "num_active_blocks": b,
             "reply_reserve_ms": 1.0, "latency_parse_ms": 1.0, "latency_queue_ms": 0.0, "latency_stage1_ms": 1.0,
             "latency_preprocess_ms": 1.0, "latency_stage2_ms": 1.0, "latency_model_ms": ms,
             "latency_total_ms": ms + 5.0} for (c, k, b), ms in runs]
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    over = calibrate(log, reference)
    # ratios: 3.0 x 8, 1.0 x 3, 1.1 x 6; the median of all 17 is the 9th smallest, 1.1
    assert over.scale_by_config == {(2, 4, 12): 3.0}
    assert over.latency_scale == pytest.approx(1.1)
    assert over.scale((2, 4, 12)) == 3.0 and over.scale((6, 8, 14)) == pytest.approx(1.1)


def test_the_log_spread_beyond_the_samples_own_is_the_service_noise(tmp_path):
    import math as m

    reference = {(2, 4, 12): 10.0}
    ratios = [m.exp(0.3), m.exp(-0.3)] * 4  # the log of the ratio: +-0.3, a variance of 0.09
    rows = [{"time": "2026-12-07T05:00:00.000000Z", "status": "ok", "model_fingerprint": "abc", "max_crops": 2,
             "top_k": 4, "num_active_blocks": 12,
             "reply_reserve_ms": 1.0, "latency_parse_ms": 1.0, "latency_queue_ms": 0.0, "latency_stage1_ms": 1.0,
             "latency_preprocess_ms": 1.0, "latency_stage2_ms": 1.0, "latency_model_ms": 10.0 * r,
             "latency_total_ms": 10.0 * r + 5.0} for r in ratios]
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # the samples themselves spread 0.2 (a variance of 0.04): 0.05 is the machine's
    assert calibrate(log, reference, sample_spread={(2, 4, 12): 0.2}).noise_sigma == pytest.approx(m.sqrt(0.05))
    assert calibrate(log, reference, sample_spread={(2, 4, 12): 0.5}).noise_sigma == 0.0  # no room left for noise
    assert calibrate(log, reference).noise_sigma == 0.0


def test_requests_naming_their_sample_are_read_against_its_own_latency(tmp_path):
    import math as m

    own = {"fast": 10.0, "slow": 30.0}  # two samples' profiled latency at 2/4/12; their median: 20 ms
    served = [("fast", m.exp(0.1)), ("slow", m.exp(-0.1))] * 2 + [("slow", m.exp(0.1)), ("fast", m.exp(-0.1))] * 2
    rows = [{"time": "2026-12-07T05:00:00.000000Z", "status": "ok", "model_fingerprint": "abc", "max_crops": 2,
             "top_k": 4, "num_active_blocks": 12, "reply_reserve_ms": 1.0, "latency_parse_ms": 1.0,
             "latency_queue_ms": 0.0, "latency_stage1_ms": 1.0, "latency_preprocess_ms": 1.0,
             "latency_stage2_ms": 1.0, "latency_model_ms": own[sample] * r, "latency_total_ms": own[sample] * r + 5.0,
             "metadata": json.dumps({"example_id": sample, "team": "x"})} for sample, r in served]
    # one request naming a sample the simulation does not hold, one without metadata: read against the median
    rows += [{**rows[0], "metadata": json.dumps({"example_id": "unknown"}), "latency_model_ms": 40.0},
             {**rows[0], "metadata": None, "latency_model_ms": 40.0}]
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reference = {(2, 4, 12): 20.0}

    def sample_latency(example_id, config):
        return own.get(example_id) if tuple(config) == (2, 4, 12) else None

    over = calibrate(log, reference, sample_spread={(2, 4, 12): 0.5}, sample_latency_ms=sample_latency)
    assert over.paired == 8 and over.requests == 10
    # paired, each request's log ratio is +-0.1 around 0: the noise is 0.1, whatever the samples' own spread
    assert over.noise_sigma == pytest.approx(0.1)
    # the scale: the median of eight ratios e^+-0.1 and two of 40 / 20 = 2, the 5th and 6th of ten: e^0.1
    assert over.scale((2, 4, 12)) == pytest.approx(m.exp(0.1))
    # unpaired (no sample latencies given), the same log reads 0.5 x and 1.5 x the median: a wide spread
    assert calibrate(log, reference).paired == 0


def test_a_profile_finds_a_sample_by_its_example_id(inputs):
    profile = inputs[0]
    config = profile.configs[3]
    first = profile.example_id[0]
    assert profile.sample_latency_ms(first, config) == float(profile.latency_ms[0, 3])
    assert profile.sample_latency_ms("no such sample", config) is None
    assert profile.sample_latency_ms(first, (99, 99, 99)) is None


def test_service_noise_draws_each_requests_time_the_same_for_every_decider(inputs):
    profile, decider = inputs
    a, b = profile.configs[0], _static(profile)
    n = min(30, len(profile))
    samples = np.arange(n) % len(profile)
    workload = Workload(np.arange(n) * 100.0, samples, np.full(n, 1e6))
    sim = Simulation(profile, decider, Overheads(noise_sigma=0.3))
    factors = []
    for static in (a, b):
        column = profile.configs.index(static)
        served = sim.run(workload, static)
        factors.append([r.latency_ms / profile.latency_ms[r.sample, column] for r in served])
    np.testing.assert_allclose(factors[0], factors[1])  # paired: the same draw whoever decides
    logs = np.log(factors[0])
    assert 0.15 < logs.std() < 0.45 and abs(np.median(logs)) < 0.2
    again = [r.latency_ms for r in Simulation(profile, decider, Overheads(noise_sigma=0.3)).run(workload, a)]
    assert again == [r.latency_ms for r in sim.run(workload, a)]  # seeded


# -- the command


def test_ctrl_simulate_prints_the_answer_and_writes_the_simulations_view(sim_ws, tmp_path):
    plot = tmp_path / "attainment.png"
    result = runner.invoke(app, ["simulate", "-w", str(sim_ws.root), "--run", "offline-run", "--load", "0.5,0.9",
                                 "--budget-ms", "400", "--requests", "80", "--deciders", "controller,cheapest,front",
                                 "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "the controller:" in lines[0] and "within budget" in lines[0]
    assert lines[1].startswith("The best static, ") and lines[2].startswith("Controller minus best static")
    assert plot.stat().st_size > 1000
    files = sorted((sim_ws.runs_dir / "offline-run" / "simulations").glob("*.parquet"))
    assert files and pq.read_schema(files[-1]).names == SIMULATIONS.column_names
    rows = run_query(sim_ws, "SELECT decider, load, requests, within_budget, rejected_503 + dropped_504 AS lost "
                             "FROM simulations ORDER BY load, decider").to_pylist()
    assert sorted({round(r["load"], 6) for r in rows}) == [0.5, 0.9]
    assert {r["decider"] for r in rows} >= {"controller"}
    assert all(r["requests"] == 80 and 0 <= r["within_budget"] <= 1 - r["lost"] + 1e-9 for r in rows)
    # plain DuckDB on the workspace's catalog sees the new view too
    con = duckdb.connect(str(sim_ws.catalog_path), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM simulations").fetchone()[0] == len(rows)
    finally:
        con.close()


def test_ctrl_simulate_with_a_target_reports_replicas(sim_ws):
    result = runner.invoke(app, ["simulate", "-w", str(sim_ws.root), "--run", "offline-run", "--load", "3",
                                 "--budget-ms", "400", "--requests", "60", "--deciders", "controller,cheapest",
                                 "--target", "0.9", "--max-replicas", "8"])
    assert result.exit_code == 0, result.output
    assert "Replicas to meet 90.0 %" in result.output or "Controller minus best static" in result.output
    rows = run_query(sim_ws, "SELECT replicas, meets_target, target FROM simulations WHERE target IS NOT NULL"
                     ).to_pylist()
    assert rows and all(r["target"] == 0.9 and 1 <= r["replicas"] <= 8 for r in rows)
    assert all(r["meets_target"] or r["replicas"] == 8 for r in rows)


def test_ctrl_simulate_refuses_an_unknown_run_in_one_line(sim_ws):
    result = runner.invoke(app, ["simulate", "-w", str(sim_ws.root), "--run", "nope", "--rate", "1",
                                 "--budget-ms", "100"])
    assert result.exit_code == 1
    assert "run 'nope' not found" in result.output
