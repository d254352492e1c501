"""Budgets under load, from the first request: the controller on ``ctrl serve`` against every static
configuration on the served front, cold (a fresh server's first requests) and in steady state, at loads
of the default configuration's capacity and budgets of multiples of its service time; a mixed-tenant cell.

Usage::

    python benchmarks/bench_budgets.py                           # every cell at the defaults (hours)
    python benchmarks/bench_budgets.py --cells grid --loads 0.7 --multiples 3 --requests 400
    python benchmarks/bench_budgets.py --source /tmp/prev --label previous --deciders controller   # another revision
    python benchmarks/bench_budgets.py --phase report            # tables and target checks from the saved runs
    python benchmarks/bench_budgets.py --cells grid --arrivals gamma:2,onoff:3:10:50 --loads 0.7 --multiples 2,3 \
        --static-budgets                                     # bursty arrivals (serve/arrivals.py), statics per budget

What it runs. The workspace, the fresh request set (none of its requests seen by the testbed, the
profile or the controller) and the ``ctrl serve`` subprocess are those of ``bench_serve.py``. First
(saved in ``<out>.setup.json`` and reused):

* the served front: every configuration of the action space answers ``--front-requests`` requests one
  at a time, interleaved; per configuration its median client latency and the profile's held-out
  accuracy; the Pareto front of the two;
* the **default configuration's service time**: after a warm-up, one client sends ``--capacity-requests``
  requests without a budget (the server's default budget, the controller deciding), each
  ``--capacity-pause-s`` after the last one's answer (``--capacity paced``: the sequential service time,
  the mean client latency; the capacity is its inverse) or back to back (``--capacity back-to-back``:
  the answered requests per second; the load-aware cap reads such a client as saturating the server);

Cells (``--cells``):

* ``grid``: per load of ``--loads`` (fractions of that capacity, Poisson arrivals, open loop) and budget
  of ``--multiples`` (x the service time): the controller (one run per budget, a fresh server each, so
  that its first ``--cold`` requests are a cold start) and every front configuration with fixed knobs
  (one run per load, judged against every budget);
* ``midway``: at ``--midway-load``, the budget midway between the cheapest and the slowest front
  configuration's median: the controller and the front configurations;
* ``mixed``: a client at ``--tenant-multiple`` x the cheapest front configuration's median, at
  ``--tenant-load``, alone and then beside a second client at budgets below the cheapest configuration
  (``--impossible-multiple`` of its median) at ``--impossible-load``: the first client's figures, both
  runs on a fresh server, the same requests and arrival times.

Per cell, separately for the first ``--cold`` requests and for the rest (steady state): the rate within
budget (client clock: scheduled send to last byte) and the accuracy with 95 % Wilson intervals, and for
the steady part the paired difference controller minus static in correct answers and rate within
budget (moving-block bootstrap, ``--block``). Each run is appended to ``--out`` as it finishes
(``--label`` names the revision; a re-run skips the runs already there).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serve.arrivals import arrival_times, bursts, parse_arrivals  # noqa: E402
from serve.budget import replay_cheapest  # noqa: E402

#: after a burst's end, the seconds a server has to be back to budgets (the recovery figure)
RECOVERY_S = 10.0


def _bench_serve() -> Any:
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "benchmarks" / "bench_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bs = _bench_serve()
Outcome, BenchRequest = bs.Outcome, bs.BenchRequest


def open_loop(port: int, dataset: str, items: Sequence[tuple[Any, float, float | None, Any]]) -> list[Any]:
    """Send each (request, time s, budget ms, knobs) at its time, open loop; outcomes in item order."""
    t0 = time.perf_counter() + 0.2

    def one(item: tuple[Any, float, float | None, Any]) -> Any:
        request, at, budget, knobs = item
        return bs.send(port, bs.body_of(request, budget, knobs), t0, at, request, dataset)

    with ThreadPoolExecutor(max_workers=256) as pool:
        futures = []
        for item in items:
            delay = t0 + item[1] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, item))
        return [f.result() for f in futures]


def right_within(o: Any, budget_ms: float) -> float:
    """A request's score where it was answered within its budget; 0 otherwise (late, 503, 504: missed)."""
    return float(o.score) if o.status == 200 and o.latency_ms <= budget_ms else 0.0


def part_stats(outs: Sequence[Any], budget_ms: float) -> dict[str, Any]:
    """bench_serve's cell figures of ``outs`` (all of them), the share decided ``cheapest``, and the right
    answers within budget (``right_within``, the sum; ``right_within_rate`` with its Wilson interval)."""
    n = len(outs)
    right = sum(right_within(o, budget_ms) for o in outs)
    return {**bs.cell_stats(outs, budget_ms, 0),
            "cheapest_share": (sum(o.decided_by == "cheapest" for o in outs) / n) if n else math.nan,
            "right_within": right, "right_within_rate": right / n if n else math.nan,
            "right_within_ci": bs.wilson_interval(right, n)}


def paired(a: Sequence[Any], b: Sequence[Any], budget_ms: float, block: int, seed: int) -> dict[str, Any]:
    """bench_serve's paired difference ``a`` minus ``b`` on the same requests (all of them), and the
    difference in right answers within budget (``diff_right``, a moving-block bootstrap interval)."""
    out = bs.paired_stats(a, b, budget_ms, 0, block=block, reps=2000, seed=seed)
    d = np.array([right_within(x, budget_ms) - right_within(y, budget_ms) for x, y in zip(a, b)])
    diff = bs.block_bootstrap_ci(d, block=block, reps=2000, seed=seed, total=True)
    return {**out, "diff_right": diff[0], "diff_right_ci": diff[1:]}


def recovery_stats(outs: Sequence[Any], budget_ms: float, arrivals: str) -> dict[str, Any] | None:
    """For an on/off process: the rate within budget of the requests sent during bursts, in the
    :data:`RECOVERY_S` after each burst's end, and from then to the next burst (None for the others)."""
    if not outs:
        return None
    windows = bursts(arrivals, max(o.sched_s for o in outs))
    if not windows:
        return None
    phases: dict[str, list[Any]] = {"burst": [], "recovering": [], "recovered": []}
    for o in outs:
        t = o.sched_s
        phase = "recovered"
        for start, end in windows:
            if start <= t < end:
                phase = "burst"
            elif end <= t < end + RECOVERY_S:
                phase = "recovering"
        phases[phase].append(o)
    return {name: {"n": len(v), "within": (sum(x.status == 200 and x.latency_ms <= budget_ms for x in v) / len(v))
                   if v else math.nan} for name, v in phases.items()}


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def setup(args: argparse.Namespace, server: Any, dataset: str, requests: list[Any]) -> dict[str, Any]:
    """The served front and the default configuration's service time (cached in ``<out>.setup.json``)."""
    path = bs.path_with(args.out, ".setup.json")
    if path.exists():
        return json.loads(path.read_text())
    profile = bs.profile_by_config(args.workspace)
    tables = bs.run_tables(args.workspace, args.run_id)
    front = bs.phase_front(server, dataset, requests, args.front_requests, args.seed, profile, tables.reference_ms,
                           0.25)
    bs.print_front(front)
    order = np.random.default_rng([args.seed, 4]).permutation(len(requests))
    pick = [requests[int(i)] for i in np.resize(order, args.calibration_warmup + args.capacity_requests)]
    bs.run_back_to_back(server.port, dataset, [(r, None, None) for r in pick[:args.calibration_warmup]])
    if args.capacity == "paced":  # each request on an idle server that has seen no load: the sequential service time
        outs = []
        for r in pick[args.calibration_warmup:]:
            outs += bs.run_back_to_back(server.port, dataset, [(r, None, None)])[0]
            time.sleep(args.capacity_pause_s)
        answered = [o.latency_ms for o in outs if o.status == 200]
        capacity = 1000.0 / (sum(answered) / len(answered))
    else:
        outs, wall = bs.run_back_to_back(server.port, dataset,
                                         [(r, None, None) for r in pick[args.calibration_warmup:]])
        capacity = sum(o.status == 200 for o in outs) / wall
    front_ms = {r["config"]: r["client_ms"] for r in front["configs"]}
    result = {"front": front, "capacity_rps": capacity, "service_ms": 1000.0 / capacity,
              "default_configs": dict(bs.Counter(o.knobs for o in outs if o.knobs)),
              "cheapest_ms": front["cheapest_ms"], "slowest_front_ms": max(front_ms[c] for c in front["front"])}
    bs.write_json(path, result)
    print(f"capacity {capacity:.2f} requests/s (service {result['service_ms']:.0f} ms, configurations "
          f"{result['default_configs']})", flush=True)
    return result


def plan_runs(args: argparse.Namespace, su: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run of the chosen cells: kind, load, budget (None: a static judged at every budget), config."""
    cells = args.cells.split(",")
    statics = su["front"]["front"] if args.statics == "front" else [c for c in args.statics.split(",") if c]
    statics = statics if "static" in args.deciders.split(",") else []
    ctrl = "controller" in args.deciders.split(",")
    runs: list[dict[str, Any]] = []
    if "grid" in cells:
        for arrivals in args.arrivals.split(","):
            extra = {} if arrivals == "poisson" else {"arrivals": arrivals}
            for load in (float(v) for v in args.loads.split(",")):
                budgets = [round(float(m) * su["service_ms"], 1) for m in args.multiples.split(",")]
                runs += [{"kind": "controller", "load": load, "budget_ms": b, "config": None, **extra}
                         for b in budgets if ctrl]
                per_budget = budgets if args.static_budgets else [None]
                runs += [{"kind": "static", "load": load, "budget_ms": b, "config": c, **extra}
                         for c in statics for b in per_budget]
    if "midway" in cells:
        budget = round((su["cheapest_ms"] + su["slowest_front_ms"]) / 2, 1)
        load = args.midway_load
        runs += [{"kind": "controller", "load": load, "budget_ms": budget, "config": None}] if ctrl else []
        runs += [{"kind": "static", "load": load, "budget_ms": None, "config": c} for c in statics
                 if not any(r["kind"] == "static" and r["load"] == load and r["config"] == c for r in runs)]
    if "mixed" in cells and ctrl:
        budget = round(args.tenant_multiple * su["cheapest_ms"], 1)
        runs += [{"kind": kind, "load": args.tenant_load, "budget_ms": budget, "config": None}
                 for kind in ("tenant alone", "tenant mixed")]
    return runs


def run_key(run: dict[str, Any], label: str) -> str:
    arrivals = run.get("arrivals", "poisson")
    return (f"{label}|{run['kind']}|{run['load']}|{run['budget_ms']}|{run['config']}"
            + ("" if arrivals == "poisson" else f"|{arrivals}"))


def arrivals_of(record: dict[str, Any]) -> str:
    """A run's arrival process (records written before there was a choice are Poisson)."""
    return record.get("arrivals", "poisson")


def execute(args: argparse.Namespace, server: Any, dataset: str, requests: list[Any], su: dict[str, Any],
            run: dict[str, Any]) -> dict[str, Any]:
    rate = run["load"] * su["capacity_rps"]
    index, unit = bs.load_sequence(args.requests, run["load"], args.seed, len(requests))
    times = unit / rate
    if arrivals_of(run) != "poisson":  # the same requests, at the process's times
        times = arrival_times(arrivals_of(run), args.requests, rate, [args.seed, 3, round(run["load"] * 1000), 1])
    knobs = None if run["config"] is None else bs.parse_config(run["config"])
    items = [(requests[int(i)], float(t), run["budget_ms"], knobs) for i, t in zip(index, times)]
    tenant = len(items)
    if run["kind"] == "tenant mixed":  # the second client's requests, interleaved by time
        rate_b = args.impossible_load * su["capacity_rps"]
        rng = np.random.default_rng([args.seed, 7])
        times_b = np.cumsum(rng.exponential(1.0 / rate_b, int(items[-1][1] * rate_b * 1.2) + 10))
        times_b = times_b[times_b <= items[-1][1]]
        impossible_ms = round(args.impossible_multiple * su["cheapest_ms"], 1)
        other = [(requests[int(i)], float(t), impossible_ms, None)
                 for i, t in zip(rng.permutation(len(requests))[:len(times_b)], times_b)]
        items = items + other
    order = sorted(range(len(items)), key=lambda i: items[i][1])
    if run["kind"] != "static":
        server.restart()
    started = time.perf_counter()
    outs_sorted = open_loop(server.port, dataset, [items[i] for i in order])
    outs: list[Any] = [None] * len(items)
    for pos, i in enumerate(order):
        outs[i] = outs_sorted[pos]
    outs = outs[:tenant]  # the measured client's requests, in its own order
    print(f"  {run['kind']} {run['config'] or ''} {arrivals_of(run)} load {run['load']} budget {run['budget_ms']}: "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return {**run, "rate_rps": rate, "outcomes": {f: [getattr(o, f) for o in outs] for f in bs.OUTCOME_FIELDS}}


def report(args: argparse.Namespace, su: dict[str, Any]) -> str:
    """Markdown: per cell and label, cold and steady figures; the static configurations beside, paired."""
    records = [r for r in read_records(args.out) if arrivals_of(r) == "poisson"]
    lines = [f"capacity {su['capacity_rps']:.2f} requests/s, service {su['service_ms']:.0f} ms, cheapest front "
             f"configuration {su['front']['cheapest']} at {su['cheapest_ms']:.0f} ms; front "
             f"{', '.join(su['front']['front'])}", ""]
    statics = {(r["load"], r["config"]): bs.outcomes_of(r) for r in records if r["kind"] == "static"}
    cold = args.cold
    cells = [r for r in records if r["kind"] != "static"]
    lines.append("| load | budget ms | decider | first {0}: within [CI] | first {0}: accuracy [CI] | steady: n "
                 "| steady: within [CI] | steady: accuracy [CI] | cheapest share | controller - decider: correct [CI] "
                 "| within [CI] |".format(cold))
    lines.append("|---:|---:|---|---|---|---:|---|---|---:|---|---|")

    def ci(v: Sequence[float]) -> str:
        return f"[{v[0]:.3f}, {v[1]:.3f}]"

    for r in sorted(cells, key=lambda r: (r["kind"].startswith("tenant"), r["load"], r["budget_ms"], r["label"])):
        outs = bs.outcomes_of(r)
        b = r["budget_ms"]
        first, rest = part_stats(outs[:cold], b), part_stats(outs[cold:], b)
        name = f"{r['kind']} ({r['label']})"
        lines.append(f"| {r['load']} | {b:g} | **{name}** | {first['within']:.3f} {ci(first['within_ci'])} | "
                     f"{first['accuracy']:.3f} {ci(first['accuracy_ci'])} | {rest['n']} | {rest['within']:.3f} "
                     f"{ci(rest['within_ci'])} | {rest['accuracy']:.3f} {ci(rest['accuracy_ci'])} | "
                     f"{rest['cheapest_share']:.2f} | | |")
        if r["kind"] != "controller":
            continue
        for (load, config), souts in sorted(statics.items()):
            if load != r["load"] or len(souts) != len(outs):
                continue
            f1, s1 = part_stats(souts[:cold], b), part_stats(souts[cold:], b)
            d = paired(outs[cold:], souts[cold:], b, args.block, args.seed)
            lines.append(f"| {load} | {b:g} | static {config} | {f1['within']:.3f} {ci(f1['within_ci'])} | "
                         f"{f1['accuracy']:.3f} {ci(f1['accuracy_ci'])} | {s1['n']} | {s1['within']:.3f} "
                         f"{ci(s1['within_ci'])} | {s1['accuracy']:.3f} {ci(s1['accuracy_ci'])} | | "
                         f"{d['diff_correct']:+.0f} [{d['diff_correct_ci'][0]:+.0f}, {d['diff_correct_ci'][1]:+.0f}] | "
                         f"{d['diff_within']:+.3f} [{d['diff_within_ci'][0]:+.3f}, {d['diff_within_ci'][1]:+.3f}] |")
    return "\n".join(lines)


def report_compare(args: argparse.Namespace, su: dict[str, Any]) -> str:
    """Markdown: per load and budget where both labels of ``--compare A,B`` ran the controller, label A minus
    label B on the same requests (the same arrival times), first ``--cold`` and steady state apart: right
    answers within budget, the rate within budget (moving-block bootstrap intervals) and each one's right
    answers within budget per second of the run (goodput). Empty without ``--compare``."""
    if not args.compare:
        return ""
    a_label, b_label = args.compare.split(",")
    runs = {(r["label"], r["load"], r["budget_ms"]): r for r in read_records(args.out)
            if r["kind"] == "controller" and arrivals_of(r) == "poisson"}
    cold = args.cold
    lines = [f"| load | budget ms | part | {a_label}: within | {b_label}: within | {a_label} - {b_label}: right "
             f"within budget [CI] | within [CI] | goodput {a_label} / {b_label} (right within budget per s) |",
             "|---:|---:|---|---:|---:|---|---|---|"]
    for (label, load, budget), ra in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        rb = runs.get((b_label, load, budget))
        if label != a_label or rb is None:
            continue
        oa, ob = bs.outcomes_of(ra), bs.outcomes_of(rb)
        if len(oa) != len(ob):
            continue
        seconds = args.requests / ra["rate_rps"]
        for part, sa, sb in (("first", oa[:cold], ob[:cold]), ("steady", oa[cold:], ob[cold:])):
            fa, fb = part_stats(sa, budget), part_stats(sb, budget)
            d = paired(sa, sb, budget, min(args.block, max(1, len(sa) // 4)), args.seed)
            part_s = seconds * len(sa) / len(oa)
            lines.append(f"| {load} | {budget:g} | {part} | {fa['within']:.3f} | {fb['within']:.3f} | "
                         f"{d['diff_right']:+.1f} [{d['diff_right_ci'][0]:+.1f}, {d['diff_right_ci'][1]:+.1f}] | "
                         f"{d['diff_within']:+.3f} [{d['diff_within_ci'][0]:+.3f}, {d['diff_within_ci'][1]:+.3f}] | "
                         f"{fa['right_within'] / part_s:.2f} / {fb['right_within'] / part_s:.2f} |")
    return "\n".join(lines)


def steady_cells(args: argparse.Namespace, arrivals: str = "poisson"
                 ) -> dict[tuple[str, str, float, float], tuple[dict, list[Any]]]:
    """(label, kind, load, budget) -> (steady figures, outcomes) of every controller run of the arrival
    process; statics under label "static" and kind = their configuration, one entry per budget some
    controller run was judged at."""
    records = [r for r in read_records(args.out) if arrivals_of(r) == arrivals]
    runs = [r for r in records if r["kind"] != "static"]
    out: dict[tuple[str, str, float, float], tuple[dict, list[Any]]] = {}
    for r in runs:
        outs = bs.outcomes_of(r)
        out[(r["label"], r["kind"], r["load"], r["budget_ms"])] = (part_stats(outs[args.cold:], r["budget_ms"]), outs)
    # a static run that sent a budget is judged at it (and replaces one judged after the fact)
    statics = sorted((r for r in records if r["kind"] == "static"), key=lambda r: r["budget_ms"] is not None)
    for r in statics:
        outs = bs.outcomes_of(r)
        budgets = {b for (_, k, ld, b) in out if k == "controller" and ld == r["load"]}
        for budget in budgets if r["budget_ms"] is None else budgets & {r["budget_ms"]}:
            out[("static", r["config"], r["load"], budget)] = (part_stats(outs[args.cold:], budget), outs)
    return out


def check_targets(args: argparse.Namespace, su: dict[str, Any], label: str = "this") -> list[str]:
    """The targets of the budgets benchmark, one line each (PASS / FAIL / MISSING)."""
    cells = steady_cells(args)
    lines = []
    service = su["service_ms"]

    def beats_statics(load: float, budget: float, ctrl: tuple[dict, list[Any]]) -> tuple[bool, str]:
        stats, outs = ctrl
        rivals = [(c, s, o) for (lab, c, ld, b), (s, o) in cells.items()
                  if lab == "static" and ld == load and b == budget and s["within"] >= stats["within"]]
        worst = []
        ok = True
        for config, _, souts in rivals:
            d = paired(outs[args.cold:], souts[args.cold:], budget, args.block, args.seed)
            ok &= d["diff_correct"] > 0
            worst.append((d["diff_correct"], config, d["diff_correct_ci"]))
        if not worst:
            return True, "no static configuration meets budgets as often"
        d, config, ci = min(worst)
        return ok, (f"{len(rivals)} static configurations meet budgets as often; least gain {d:+.0f} "
                    f"[{ci[0]:+.0f}, {ci[1]:+.0f}] correct against {config}")

    def cold_stats(key: tuple[str, str, float, float]) -> dict:
        return part_stats(cells[key][1][:args.cold], key[3])

    for load, floor, cold_floor in ((0.7, 0.95, 0.95), (0.9, 0.90, None)):
        key = (label, "controller", load, round(3 * service, 1))
        if key not in cells:
            lines.append(f"MISSING load {load}, budgets 3x")
            continue
        stats = cells[key][0]
        ok, why = beats_statics(load, key[3], cells[key])
        cold = cold_stats(key)["within"]
        within_ok = stats["within"] >= floor and (cold_floor is None or cold >= cold_floor)
        lines.append(f"{'PASS' if ok and within_ok else 'FAIL'} load {load}, budgets 3x ({key[3]:g} ms): within "
                     f"{cold:.3f} first {args.cold}, {stats['within']:.3f} steady (>= {floor}); {why}")
    alone = next((v for k, v in cells.items() if k[0] == label and k[1] == "tenant alone"), None)
    mixed = next((v for k, v in cells.items() if k[0] == label and k[1] == "tenant mixed"), None)
    if alone and mixed:
        a, m = alone[0], mixed[0]
        ok = (a["within_ci"][0] <= m["within"] <= a["within_ci"][1]
              and a["accuracy_ci"][0] <= m["accuracy"] <= a["accuracy_ci"][1])
        lines.append(f"{'PASS' if ok else 'FAIL'} mixed tenants: within {m['within']:.3f} beside the other client, "
                     f"{a['within']:.3f} [{a['within_ci'][0]:.3f}, {a['within_ci'][1]:.3f}] alone; accuracy "
                     f"{m['accuracy']:.3f}, {a['accuracy']:.3f} [{a['accuracy_ci'][0]:.3f}, {a['accuracy_ci'][1]:.3f}]")
    else:
        lines.append("MISSING mixed tenants")
    midway = round((su["cheapest_ms"] + su["slowest_front_ms"]) / 2, 1)
    key = (label, "controller", args.midway_load, midway)
    cheapest = cells.get(("static", su["front"]["cheapest"], args.midway_load, midway))
    if key in cells and cheapest:
        stats = cells[key][0]
        ok, why = beats_statics(args.midway_load, midway, cells[key])
        within_ok = stats["within"] >= cheapest[0]["within"]
        verdict = "PASS" if ok and within_ok else "FAIL"
        lines.append(f"{verdict} midway ({midway:g} ms, load {args.midway_load}): within {stats['within']:.3f}, "
                     f"the cheapest configuration {cheapest[0]['within']:.3f}; {why}")
    else:
        lines.append("MISSING midway")
    return lines


def report_arrivals(args: argparse.Namespace, su: dict[str, Any]) -> str:
    """Markdown for the runs of arrival processes other than Poisson: per process, load and budget, every
    label's controller and every static configuration, steady figures with right answers within budget,
    the paired difference of each controller label against each static one, and (on/off) the recovery."""
    records = read_records(args.out)
    cells_by = [a for a in dict.fromkeys(arrivals_of(r) for r in records) if a != "poisson"]
    lines = []
    for arrivals in cells_by:
        cells = steady_cells(args, arrivals)
        lines += ["", f"**{arrivals}**", ""]
        # the same arrival times in every controller run of the process: one line per budget
        runs = {r["budget_ms"]: r for r in records if arrivals_of(r) == arrivals and r["kind"] == "controller"}
        for budget, r in sorted(runs.items()):
            outs = bs.outcomes_of(r)[args.cold:]
            bound = replay_cheapest([(o.sched_s, budget) for o in outs], [su["cheapest_ms"]])
            lines.append(f"- budget {budget:g} ms: every steady request at the "
                         f"cheapest configuration's {su['cheapest_ms']:.1f} ms, first come first served, would meet "
                         f"{sum(bound) / len(bound):.3f} of the budgets")
        lines += ["",
                  "| load | budget ms | decider | steady n | within [CI] | accuracy | right within budget [CI] "
                  "| 503 / 504 | in bursts: within | 10 s after: within | then: within |",
                  "|---:|---:|---|---:|---|---:|---|---:|---:|---:|---:|"]
        for (lab, kind, load, budget) in sorted(cells, key=lambda k: (k[2], k[3], k[0] == "static", k[0], k[1])):
            stats, outs = cells[(lab, kind, load, budget)]
            steady = outs[args.cold:]
            rec = recovery_stats(steady, budget, arrivals)
            phases = " | ".join(f"{rec[p]['within']:.3f} ({rec[p]['n']})" if rec else "" for p in
                                ("burst", "recovering", "recovered")) if rec else " | | "
            name = f"**controller ({lab})**" if lab != "static" else f"static {kind}"
            lines.append(f"| {load} | {budget:g} | {name} | {stats['n']} | {stats['within']:.3f} "
                         f"[{stats['within_ci'][0]:.3f}, {stats['within_ci'][1]:.3f}] | {stats['accuracy']:.3f} | "
                         f"{stats['right_within']:.0f} [{stats['right_within_ci'][0] * stats['n']:.0f}, "
                         f"{stats['right_within_ci'][1] * stats['n']:.0f}] | {stats['rejected_503']} / "
                         f"{stats['dropped_504']} | {phases} |")
        lines += ["", "| load | budget ms | controller | static | controller - static: right within budget [CI] "
                      "| within [CI] |", "|---:|---:|---|---|---|---|"]
        for (lab, kind, load, budget), (_, outs) in sorted(cells.items()):
            if lab == "static" or kind != "controller":
                continue
            for (slab, config, sload, sbudget), (_, souts) in sorted(cells.items()):
                if slab != "static" or (sload, sbudget) != (load, budget) or len(souts) != len(outs):
                    continue
                d = paired(outs[args.cold:], souts[args.cold:], budget, args.block, args.seed)
                lines.append(f"| {load} | {budget:g} | {lab} | {config} | {d['diff_right']:+.0f} "
                             f"[{d['diff_right_ci'][0]:+.0f}, {d['diff_right_ci'][1]:+.0f}] | "
                             f"{d['diff_within']:+.3f} [{d['diff_within_ci'][0]:+.3f}, "
                             f"{d['diff_within_ci'][1]:+.3f}] |")
    return "\n".join(lines)


def check_arrival_targets(args: argparse.Namespace, su: dict[str, Any], label: str = "this") -> list[str]:
    """The bursty-arrival targets, one line each (PASS / FAIL / MISSING): at load 0.7 under Gamma(CV 2)
    and 3x on/off bursts, >= 95 % within budget in steady state and more right answers within budget than
    every static configuration (the paired interval above 0) at budgets 2x and 3x; under 10x bursts, right
    answers within budget not below the cheapest static configuration's and >= 95 % within budget from
    :data:`RECOVERY_S` after each burst's end."""
    lines = []
    service = su["service_ms"]
    present = {arrivals_of(r) for r in read_records(args.out)}
    for arrivals in ("gamma:2", "onoff:3:10:50"):
        cells = steady_cells(args, arrivals) if arrivals in present else {}
        for multiple in (2, 3):
            key = (label, "controller", 0.7, round(multiple * service, 1))
            if key not in cells:
                lines.append(f"MISSING {arrivals} load 0.7 budgets {multiple}x")
                continue
            stats, outs = cells[key]
            worst = None
            for (lab, config, load, budget), (_, souts) in cells.items():
                if lab == "static" and (load, budget) == key[2:] and len(souts) == len(outs):
                    d = paired(outs[args.cold:], souts[args.cold:], budget, args.block, args.seed)
                    if worst is None or d["diff_right_ci"][0] < worst[0]["diff_right_ci"][0]:
                        worst = (d, config)
            ok = stats["within"] >= 0.95 and worst is not None and worst[0]["diff_right_ci"][0] > 0
            why = "no static runs" if worst is None else (
                f"least gain {worst[0]['diff_right']:+.0f} [{worst[0]['diff_right_ci'][0]:+.0f}, "
                f"{worst[0]['diff_right_ci'][1]:+.0f}] right within budget against {worst[1]}")
            lines.append(f"{'PASS' if ok else 'FAIL'} {arrivals} load 0.7 budgets {multiple}x ({key[3]:g} ms): within "
                         f"{stats['within']:.3f} steady (>= 0.95); {why}")
    bursty = [a for a in present if a.startswith("onoff:10:")]
    for arrivals in bursty or ["onoff:10:10:50"]:
        cells = steady_cells(args, arrivals) if arrivals in present else {}
        ctrl = [(k, v) for k, v in cells.items() if k[0] == label and k[1] == "controller"]
        if not ctrl:
            lines.append(f"MISSING {arrivals}")
            continue
        for (lab, _, load, budget), (stats, outs) in sorted(ctrl):
            cheapest = cells.get(("static", su["front"]["cheapest"], load, budget))
            rec = recovery_stats(outs[args.cold:], budget, arrivals)
            recovered = rec["recovered"]["within"] if rec else math.nan
            if cheapest is None:
                lines.append(f"MISSING {arrivals} load {load} budget {budget:g}: the cheapest static run")
                continue
            d = paired(outs[args.cold:], cheapest[1][args.cold:], budget, args.block, args.seed)
            ok = d["diff_right_ci"][1] >= 0 and recovered >= 0.95
            lines.append(f"{'PASS' if ok else 'FAIL'} {arrivals} load {load} budget {budget:g}: right within budget "
                         f"{d['diff_right']:+.0f} [{d['diff_right_ci'][0]:+.0f}, {d['diff_right_ci'][1]:+.0f}] against "
                         f"the cheapest ({su['front']['cheapest']}); within {recovered:.3f} from {RECOVERY_S:g} s "
                         "after a burst's end (>= 0.95)")
    return lines


def plot(args: argparse.Namespace, path: Path) -> None:
    """Per controller cell: steady within-budget rate against accuracy, the controllers of every label
    and the static configurations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    processes = list(dict.fromkeys(["poisson", *(arrivals_of(r) for r in read_records(args.out))]))
    by_process = {a: steady_cells(args, a) for a in processes}
    panels = sorted({(a, ld, b) for a, cells in by_process.items() for (lab, k, ld, b) in cells if k == "controller"},
                    key=lambda p: (processes.index(p[0]), p[1], p[2]))
    if not panels:
        return
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    markers = {"this": ("*", "tab:red", 160), "previous": ("s", "tab:blue", 60)}
    others = iter([("^", "tab:green", 60), ("v", "tab:purple", 60), ("D", "tab:orange", 50), ("P", "tab:brown", 60)])
    for lab in sorted({k[0] for cells in by_process.values() for k in cells} - {"static", *markers}):
        markers[lab] = next(others, ("o", "k", 40))
    for ax, (arrivals, load, budget) in zip(axes.flat, panels):
        for (lab, kind, ld, b), (s, _) in by_process[arrivals].items():
            if (ld, b) != (load, budget):
                continue
            if lab == "static":
                ax.scatter(s["within"], s["accuracy"], c="0.6", s=18)
                ax.annotate(kind, (s["within"], s["accuracy"]), fontsize=6, color="0.4")
            elif kind == "controller":
                marker, color, size = markers[lab]
                ax.scatter(s["within"], s["accuracy"], marker=marker, c=color, s=size, label=f"controller ({lab})",
                           zorder=3)
        ax.set_title(f"{arrivals}, load {load:g}, budget {budget:g} ms", fontsize=8)
        ax.set_xlabel("within budget (steady)", fontsize=8)
        ax.set_ylabel("accuracy (steady)", fontsize=8)
        ax.axvline(0.95, color="0.8", lw=0.8, ls="--")
        ax.tick_params(labelsize=7)
    handles: dict[str, Any] = {}  # every label's marker once, whichever panel has it
    for ax in axes.flat:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(name, handle)
    axes.flat[0].legend(list(handles.values()), list(handles), fontsize=6, loc="lower left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phase", choices=("run", "report"), default="run")
    p.add_argument("--cells", default="grid,midway,mixed", help="comma-separated: grid, midway, mixed")
    p.add_argument("--arrivals", default="poisson", help="comma-separated arrival processes of the grid: poisson, "
                   "gamma:CV, onoff:FACTOR:ON_S:OFF_S, file:PATH (serve/arrivals.py), each at the grid's mean loads")
    p.add_argument("--statics", default="front", help="the static configurations run: front (every one on the "
                   "served front) or a comma-separated list such as 2/4/12,6/4/14")
    p.add_argument("--deciders", default="controller,static", help="comma-separated: controller, static")
    p.add_argument("--workspace", type=Path, default=bs.CACHE / "serve-ws")
    p.add_argument("--run-id", default="bench-serve")
    p.add_argument("--source", type=Path, default=ROOT, help="the source tree the server runs from")
    p.add_argument("--label", default="this", help="the revision's name in the records and tables")
    p.add_argument("--server-flags", default="", help="extra `ctrl serve` options of the controller runs, e.g. "
                   "'--no-load-aware' (give the variant its own --label)")
    p.add_argument("--bench-seed", type=int, default=4242)
    p.add_argument("--bench-samples", type=int, default=1300)
    p.add_argument("--front-requests", type=int, default=20)
    p.add_argument("--calibration-warmup", type=int, default=20)
    p.add_argument("--capacity-requests", type=int, default=60)
    p.add_argument("--capacity", choices=("paced", "back-to-back"), default="paced",
                   help="how the default configuration's service time is measured: paced (one request at a time, "
                   "--capacity-pause-s apart, so that the server reads no load: the sequential service time) or "
                   "back-to-back (one client without pauses: the load-aware cap reads that as saturation and moves "
                   "the controller towards the cheapest configuration)")
    p.add_argument("--capacity-pause-s", type=float, default=1.0)
    p.add_argument("--static-budgets", action="store_true",
                   help="run each static configuration once per budget, sending the budget with its fixed knobs (the "
                   "server orders, refuses and drops them as it does the controller's), instead of once without a "
                   "budget, judged at every budget after the fact")
    p.add_argument("--loads", default="0.5,0.7,0.9")
    p.add_argument("--multiples", default="1.5,2,3")
    p.add_argument("--midway-load", type=float, default=0.5)
    p.add_argument("--tenant-multiple", type=float, default=3.0)
    p.add_argument("--tenant-load", type=float, default=0.5)
    p.add_argument("--impossible-multiple", type=float, default=0.5,
                   help="the second client's budgets, x the cheapest front configuration's median")
    p.add_argument("--impossible-load", type=float, default=0.3)
    p.add_argument("--requests", type=int, default=1100, help="requests per run (the measured client's)")
    p.add_argument("--cold", type=int, default=100, help="the first requests of a run, reported apart")
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--block", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=bs.CACHE / "bench_budgets.jsonl")
    p.add_argument("--plot", type=Path, default=None, help="write the plot here (phase report)")
    p.add_argument("--compare", default="", help="phase report: A,B (two labels): label A's controller runs minus "
                                                 "label B's on the same requests, per load and budget")
    args = p.parse_args(argv)
    if args.compare and len([x for x in args.compare.split(",") if x]) != 2:
        p.error(f"--compare takes two labels, A,B; got {args.compare!r}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    setup_path = bs.path_with(args.out, ".setup.json")
    if args.phase == "report":
        su = json.loads(setup_path.read_text())
        print(report(args, su))
        print(report_arrivals(args, su))
        print(report_compare(args, su))
        print("\n".join(check_targets(args, su)))
        print("\n".join(check_arrival_targets(args, su)))
        if args.plot:
            plot(args, args.plot)
        return
    bs.prepare_workspace(args.workspace, args.run_id)
    import runtime.scoring  # noqa: F401  (imported here: its first import inside the client threads stalls them all)
    dataset, requests = bs.bench_requests(bs.CACHE / f"bench-set-{args.bench_seed}", args.bench_samples,
                                          args.bench_seed)
    label_file = "".join(c if c.isalnum() else "-" for c in args.label)
    server = bs.Server(args.workspace, args.run_id, bs.path_with(args.out, f".{label_file}.server.log"),
                       args.max_queue, flags=args.server_flags.split(), root=args.source)
    try:
        su = setup(args, server, dataset, requests)
        done = {run_key(r, r["label"]) for r in read_records(args.out)}
        runs = [r for r in plan_runs(args, su) if run_key(r, args.label) not in done]
        for spec in args.arrivals.split(","):
            parse_arrivals(spec)  # a bad spec fails before any run
        seconds = sum(args.requests / (r["load"] * su["capacity_rps"]) for r in runs)
        print(f"{len(runs)} runs to go ({args.label}): about {seconds / 60:.0f} min", flush=True)
        for run in runs:
            record = {"label": args.label, **execute(args, server, dataset, requests, su, run)}
            with args.out.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
    finally:
        server.stop()
    print(report(args, su))


if __name__ == "__main__":
    main()
