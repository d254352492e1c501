"""The pure parts of benchmarks/bench_serve.py: the Pareto front, the paired block bootstrap, the
Wilson interval, the in-system count, the steady-state flag and the target check (no server)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serve.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_serve", None)


def test_pareto_front_by_hand(bench):
    points = {
        "G": (9.0, 0.40),   # the fastest: on the front whatever its accuracy
        "A": (10.0, 0.50),  # slower than G but more accurate: on
        "B": (12.0, 0.60),  # on
        "C": (12.0, 0.55),  # as fast as B, less accurate: off
        "D": (15.0, 0.60),  # as accurate as B, slower: off
        "E": (20.0, 0.70),  # on
        "H": (20.0, 0.70),  # the same point as E: neither is strictly better, both on
        "F": (25.0, 0.65),  # slower and less accurate than E: off
        "I": (30.0, 0.71),  # the most accurate: on
    }
    assert bench.pareto_front(points) == ["G", "A", "B", "E", "H", "I"]
    assert bench.pareto_front({"only": (5.0, 0.1)}) == ["only"]
    assert bench.pareto_front({}) == []


def test_block_bootstrap_constant_and_seeded(bench):
    est, lo, hi = bench.block_bootstrap_ci(np.ones(200), block=50, reps=200, seed=1)
    assert (est, lo, hi) == (200.0, 200.0, 200.0)  # a sum: every replicate is the same
    x = np.random.default_rng(0).normal(0.0, 1.0, 500)
    first = bench.block_bootstrap_ci(x, block=50, reps=300, seed=7)
    assert first == bench.block_bootstrap_ci(x, block=50, reps=300, seed=7)
    mean, mlo, mhi = bench.block_bootstrap_ci(x, block=50, reps=300, seed=7, total=False)
    assert first == pytest.approx((mean * 500, mlo * 500, mhi * 500))
    assert mlo < 0.0 < mhi and mlo < mean < mhi
    assert all(math.isnan(v) for v in bench.block_bootstrap_ci([], block=50))


def test_block_bootstrap_widens_for_dependent_requests(bench):
    # runs of 50 identical differences (a queue that favours one decider for a while): the ordinary
    # bootstrap (block 1) treats them as 1,000 independent values and is far too narrow
    signs = np.random.default_rng(3).choice([-1.0, 1.0], size=20)
    x = np.repeat(signs, 50)
    _, lo1, hi1 = bench.block_bootstrap_ci(x, block=1, reps=400, seed=0, total=False)
    _, lo50, hi50 = bench.block_bootstrap_ci(x, block=50, reps=400, seed=0, total=False)
    assert hi50 - lo50 > 3 * (hi1 - lo1)
    # a block is at most a fifth of the data: 25 values resample in blocks of 5, not as one block of 25
    short = np.random.default_rng(4).normal(0.0, 1.0, 25)
    _, lo, hi = bench.block_bootstrap_ci(short, block=50, reps=200, seed=0)
    assert (lo, hi) == bench.block_bootstrap_ci(short, block=5, reps=200, seed=0)[1:] and hi > lo


def test_wilson_interval(bench):
    lo, hi = bench.wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    lo, hi = bench.wilson_interval(0, 20)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(0.1611, abs=1e-3)
    assert bench.wilson_interval(20, 20)[1] == 1.0
    assert all(math.isnan(v) for v in bench.wilson_interval(0, 0))


def test_in_system_and_steady(bench):
    # request 0 in the system during [0, 4), request 1 during [2, 10); tenths of [0, 10) are 1 s long
    tenths = bench.in_system_tenths([0.0, 2.0], [4.0, 10.0], 0.0, 10.0)
    assert tenths == pytest.approx([1, 1, 2, 2, 1, 1, 1, 1, 1, 1])
    assert bench.is_steady([0.5, 1.0, 1.1, 1.0, 0.9, 1.2, 1.0, 1.1, 1.0, 1.9])
    assert not bench.is_steady([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0])
    assert bench.is_steady([0.1] * 9 + [0.3])  # three times as many, but a fraction of one request
    assert not bench.is_steady([0.1] * 9 + [0.3], min_excess=0.0)


def test_paired_stats_same_requests(bench):
    def outcome(i, score, late, status=200):
        return bench.Outcome(status, float(i), float(i) + (0.5 if late else 0.05), score)

    n = 120
    ctrl = [outcome(i, 1.0, late=False) for i in range(n)]
    other = [outcome(i, 1.0 if i % 2 else 0.0, late=i % 3 == 0, status=503 if i == 7 else 200) for i in range(n)]
    stats = bench.paired_stats(ctrl, other, budget_ms=100.0, warmup=20, block=10, reps=200, seed=0)
    measured = range(20, n)
    assert stats["diff_correct"] == pytest.approx(sum(1 - (i % 2) for i in measured))
    assert stats["diff_correct_ci"][0] > 0
    late = sum(i % 3 == 0 for i in measured)
    assert stats["diff_within"] == pytest.approx(late / len(measured))
    with pytest.raises(ValueError, match="differ in length"):
        bench.paired_stats(ctrl, other[:-1], 100.0, 20, block=10, reps=10, seed=0)


def test_check_targets(bench):
    def cell(load, budget, decider, within, diff=None, ci=None, config=None):
        c = {"load": load, "budget_ms": budget, "decider": decider, "within": within, "config": config}
        if diff is not None:
            c.update(diff_correct=diff, diff_correct_ci=ci)
        return c

    cells = [cell(0.5, 100.0, "controller", 0.97), cell(0.5, 150.0, "controller", 0.99),
             cell(0.5, 100.0, "static 2/8/12", 0.98, 12, (4, 20), "2/8/12"),
             cell(0.5, 150.0, "static 2/8/12", 0.99, 3, (-5, 11), "2/8/12"),
             cell(0.5, 100.0, "static 10/4/12", 0.60, -30, (-40, -20), "10/4/12"),  # meets the budget less often
             cell(1.0, 100.0, "controller", 0.50), cell(0.5, 60.0, "controller", 0.10)]  # outside the region
    ok, lines = bench.check_targets(cells, cheapest_ms=50.0)
    assert ok, lines
    cells[3].update(diff_correct=-8, diff_correct_ci=(-15, -1))  # below 0 beyond its interval at one budget
    ok, lines = bench.check_targets(cells, cheapest_ms=50.0)
    assert not ok and any(line.startswith("FAIL") and "2/8/12" in line for line in lines)
    cells[0]["within"] = 0.90  # short of the target: the line says what the best static configuration reached
    ok, lines = bench.check_targets(cells, cheapest_ms=50.0)
    assert not ok and ("FAIL load 0.5, budget 100 ms: controller within budget 0.900 (target >= 0.95); the best "
                       "static configuration, 2/8/12, 0.980") in lines
