"""How often the fastest configuration missed the bottom of the calibrated range minutes later.

Reads the adaptation benchmark's recorded evaluations (``bench_adaptation.py``): the lowest budget
is the low end its online run calibrated, and the fastest configuration ran at it beside every
decider. Printed per evaluation: its late share at that budget and at that budget times each
margin (the calibration's ``FLOOR_MARGIN`` multiplies the floor it measures).

    python benchmarks/floor_margin.py [--runs 'benchmarks/.cache/adapt/*guard*.json'] [--margins 1,1.05,1.1,1.2]
        [--exclude margin]
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", default="benchmarks/.cache/adapt/*guard*.json")
    p.add_argument("--margins", default="1,1.05,1.1,1.2")
    p.add_argument("--exclude", default=None, help="leave out result files whose name contains this")
    args = p.parse_args()
    margins = [float(m) for m in args.margins.split(",")]
    print("| evaluation | lowest budget | " + " | ".join(f"late at x{m:g}" for m in margins) + " |")
    print("|---|---|" + "---|" * len(margins))
    seen: set[tuple[float, ...]] = set()
    for path in sorted(glob.glob(args.runs)):
        if args.exclude and args.exclude in Path(path).name:
            continue
        ev = json.loads(Path(path).read_text())["evaluation"]
        low = ev["budgets_ms"][0]
        latency = np.array([row[2] for row in ev["outcomes"][f"fastest|{low}"]])
        if tuple(latency) in seen:  # a results file kept under two names
            continue
        seen.add(tuple(latency))
        cells = " | ".join(f"{(latency > low * m).mean():.1%}" for m in margins)
        print(f"| {Path(path).stem} | {low:.0f} ms | {cells} |")


if __name__ == "__main__":
    main()
