"""Replay a shared machine's latency noise through the latency guard's factors (no model runs).

The noise is what ``bench_adaptation.py`` measured: the fastest configuration's latencies in the
order the paired evaluation ran them, each over the median of its sample's five (so that only the
machine's moment-to-moment speed is left, not the sample's cost). Each recorded request stands for
six decided ones, times a log-normal prediction error (sigma 0.08). The slack and the fit median
come from the first 216 of them, as the guard's own requests; the rest are decided by the
product's ``LatencyGuard`` (its drift factor and, for a tail step above 0, its tail factor).
Printed per recorded run: the share of decided requests over their expectation (the guard's
quantile asks for 5 %) and the largest share in any 345 consecutive ones, averaged over 20 draws
of the prediction error.

    python benchmarks/replay_guard_tail.py [--runs 'benchmarks/.cache/adapt/*guard*.json']
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

import numpy as np

from controller import latency_guard

FIT, PER_REQUEST, SIGMA = 216, 6, 0.08


def machine_noise(path: Path) -> np.ndarray:
    ev = json.loads(path.read_text())["evaluation"]
    rows = [ev["outcomes"][f"fastest|{b}"] for b in ev["budgets_ms"]]
    latency = np.array([[column[i][2] for column in rows] for i in range(len(rows[0]))])
    return (latency / np.median(latency, 1, keepdims=True)).reshape(-1)


def replay(noise: np.ndarray, step: float, seed: int) -> tuple[float, float]:
    """The product's guard (``controller.latency_guard``, its tail step set to ``step``) deciding the
    replayed requests: base expectation 1 ms, measured the request's ratio."""
    rng = np.random.default_rng(seed)
    ratio = np.repeat(noise, PER_REQUEST) * np.exp(rng.normal(0.0, SIGMA, len(noise) * PER_REQUEST))
    fit = ratio[:FIT]
    # only the factors are replayed: no outcome model, no configuration ratios
    guard = latency_guard.LatencyGuard(None, None, latency_guard.guard_slack(fit, np.ones(FIT)), {}, FIT,
                                       fit_median=latency_guard.guard_slack(fit, np.ones(FIT), 0.5), tail_step=step)
    over = []
    for r in ratio[FIT:]:
        expected = guard.factor()
        over.append(r > expected)
        guard.observe(1.0, float(r), expected)
    over_arr = np.array(over, dtype=float)
    return float(over_arr.mean()), float(np.convolve(over_arr, np.ones(345) / 345, "valid").max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", default="benchmarks/.cache/adapt/*guard*.json")
    p.add_argument("--steps", default="0,0.01,0.02,0.05,0.1", help="tail steps (0: the drift factor alone)")
    args = p.parse_args()
    steps = [float(s) for s in args.steps.split(",")]
    print("| run | " + " | ".join(f"step {s:g}" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for path in sorted(glob.glob(args.runs)):
        noise = machine_noise(Path(path))
        cells = []
        for step in steps:
            out = np.array([replay(noise, step, seed) for seed in range(20)])
            cells.append(f"{out[:, 0].mean():.1%} / {out[:, 1].mean():.1%}")
        print(f"| {Path(path).stem} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
