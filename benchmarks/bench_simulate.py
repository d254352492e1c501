"""``ctrl simulate`` against ``ctrl serve``: the same requests, arrival times and budgets, predicted by the
simulation and then measured on the served testbed, in one run.

Usage::

    python benchmarks/bench_simulate.py                       # prepare, calibrate, predict, measure, report
    python benchmarks/bench_simulate.py --phase report        # the tables from the saved runs
    python benchmarks/bench_simulate.py --loads 0.7 --multiples 2 --requests 60 --statics 1   # a smoke run

What it runs (prepared once under benchmarks/.cache, each step skipped when done):

* **The request pool**: the first ``--pool`` samples of ``bench_serve.py``'s fresh testbed set (seed 4242,
  never seen by the testbed model, the shipped profile or the controller), renamed ``testbed_bench``.
* **Its profile on this machine**: ``ctrl profile --model testbed --configs balanced`` (every configuration,
  one greedy generation each, hook-timed), ingested beside the shipped profile into a workspace of its own
  with features extracted, and ``bench_serve.py``'s offline run (``bench-serve``) copied into it. The
  simulation draws its requests from this dataset (``--samples testbed_bench``): every request's model time
  and score at every configuration is known.
* **The cells' scale**: a fresh ``ctrl serve`` (the controller deciding at its default budget) answers
  ``--calibration-requests`` pool requests one at a time, 0.1 s apart. Their mean client latency is the
  service time (capacity = its inverse; budgets are ``--multiples`` of it).
* **Calibration** (``--calibrate-with``): the request log the simulation reads its fixed costs and latency
  scales from (``--calibrate-from``), of a run apart from the measured cells: that paced run; a fresh
  server answering as many controller requests back to back and then a dozen at each static's knobs; or
  (the default) a fresh server under load (four times as many requests, Poisson at
  ``--calibration-load``, every fourth at a static's knobs), whose client also measures what the log
  cannot: the time outside the server's clock (``--client-ms``) and the spread of each request's model
  time around its sample's profiled one (``--service-noise``). A paced server's model times read ~1.5x
  slower on this VM than a loaded one's.
* ``--phase repredict``: the saved runs' predictions again from the other calibration, measurements kept.

Then per cell (``--loads`` x ``--multiples``): the requests (pool samples drawn with replacement, Poisson
arrivals at load x capacity, seeded per load) are simulated for the controller and ``--statics``
configurations of the front (fixed knobs, the cell's budget sent with them), with the server's defaults;
then each is sent open loop to a fresh ``ctrl serve --threads 1``. Reported per cell and decider, predicted
against measured: the share within budget (client clock, 503/504 missed), the accuracy of the answered,
the p95 client latency of the answered, and whether the deciders rank the same by right answers within
budget where the measured paired interval separates them. Every run is appended to ``--out`` as it
finishes; a re-run skips what is there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "benchmarks" / ".cache"

from serve.config import available_cpus  # noqa: E402
from simulate.calibration import SCALE_MIN_REQUESTS  # noqa: E402
from simulate.config import SimulateConfig  # noqa: E402
from simulate.run import load_inputs, make_workload, simulate, summarize  # noqa: E402
from simulate.simulation import ServerOptions, SimRequest, Simulation, Workload  # noqa: E402

POOL_NAME, RUN_ID, BENCH_SEED, BENCH_SAMPLES = "testbed_bench", "bench-serve", 4242, 1300
#: the loads of the speed phase's sweep
SWEEP_LOADS = (0.6, 0.7, 0.8, 0.9)


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bb = _module("bench_budgets")
bs = bb.bs


def ctrl(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, check=True)


def prepare(pool: int) -> tuple[Path, Path]:
    """The pool dataset and the simulation workspace (each step skipped when done)."""
    from testbed.dataset import read_dataset, write_dataset
    from testbed.task import generate_dataset

    serve_ws = CACHE / "serve-ws"
    bs.prepare_workspace(serve_ws, RUN_ID)
    source = CACHE / f"bench-testbed-seed{BENCH_SEED}-n{BENCH_SAMPLES}"
    if not (source / "dataset.json").exists():
        generate_dataset(source, BENCH_SAMPLES, seed=BENCH_SEED, split="bench")
    pool_dir = CACHE / f"sim-pool-{pool}"
    if not (pool_dir / "dataset.json").exists():
        full = read_dataset(source)
        (pool_dir / "images").mkdir(parents=True, exist_ok=True)
        for s in full.samples[:pool]:
            target = pool_dir / "images" / f"{s.image_id}.png"
            if not target.exists():
                shutil.copyfile(full.image_path(s), target)
        write_dataset(pool_dir, POOL_NAME, "bench", list(full.samples[:pool]))
    profile_dir = CACHE / f"sim-profile-{pool}"
    ctrl("profile", "--model", "testbed", "--dataset", str(pool_dir), "--configs", "balanced", "--out",
         str(profile_dir), "--threads", "1")
    ws = CACHE / f"sim-ws-{pool}"
    if not (ws / "CURRENT").exists():
        ctrl("ingest", str(ROOT / "data" / "exp5"), str(ROOT / "data" / "exp6"), str(profile_dir), "-w", str(ws))
    images = CACHE / f"sim-images-{pool}"
    if not images.exists():
        images.mkdir()
        for folder in (ROOT / "data" / "testbed" / "images", pool_dir / "images"):
            for f in folder.iterdir():
                (images / f.name).symlink_to(f.resolve())
    ctrl("extract-features", "-w", str(ws), "--model", "testbed", "--images", str(images))
    if not (ws / "runs" / RUN_ID).exists():
        shutil.copytree(serve_ws / "runs" / RUN_ID, ws / "runs" / RUN_ID,
                        ignore=shutil.ignore_patterns("simulations"))
    return pool_dir, ws


def pool_requests(pool_dir: Path) -> dict[str, Any]:
    """The pool's requests by example id (what the client sends and scores with)."""
    import base64

    from testbed.dataset import read_dataset

    dataset = read_dataset(pool_dir)
    out = {}
    for i, s in enumerate(dataset.samples):
        uri = "data:image/png;base64," + base64.b64encode(dataset.image_path(s).read_bytes()).decode()
        out[s.example_id] = bs.BenchRequest(i, s.example_id, s.family, s.question, list(s.answers), uri)
    return out


def newest_log(ws: Path, before: set[Path]) -> Path:
    found = sorted(set((ws / "requests").glob("*.jsonl")) - before)
    if not found:
        msg = f"no new request log under {ws / 'requests'}"
        raise SystemExit(msg)
    return found[-1]


def calibration_phase(ws: Path, requests: dict[str, Any], knobs: list[tuple[int, int, int] | None], out: Path,
                      pause_s: float = 0.1, suffix: str = "") -> dict[str, Any]:
    """A fresh server answers a pool request per entry of ``knobs`` one at a time (``pause_s`` after each
    answer; 0: back to back), at those knobs or (None) decided by the controller at its default budget:
    the controller's requests' mean client latency, and the request log."""
    saved = bs.path_with(out, f".calibration{suffix}.json")
    if saved.exists():
        return json.loads(saved.read_text())
    before = set((ws / "requests").glob("*.jsonl"))
    server = bs.Server(ws, RUN_ID, bs.path_with(out, ".server.log"), 8)
    try:
        rng = np.random.default_rng(7)
        ids = list(requests)
        chosen = [requests[ids[i]] for i in rng.integers(len(ids), size=len(knobs))]
        outs = []
        for r, k in zip(chosen, knobs, strict=True):
            outs.append(bs.send(server.port, bs.body_of(r, None, k), time.perf_counter(), 0.0, r, POOL_NAME))
            time.sleep(pause_s)
    finally:
        server.stop()
    ok = [o.latency_ms for o, k in zip(outs, knobs, strict=True) if o.status == 200 and k is None]
    result = {"service_ms": float(np.mean(ok)), "answered": len(ok), "log": str(newest_log(ws, before)),
              "pause_s": pause_s}
    bs.write_json(saved, result)
    return result


def loaded_calibration(args: argparse.Namespace, ws: Path, requests: dict[str, Any], cells: dict[str, Any]
                       ) -> dict[str, Any]:
    """A fresh server under load, apart from the cells: ``4 x --calibration-requests`` pool requests, Poisson
    at ``--calibration-load`` of the capacity (its own seed), budgets of 2x the service time, every fourth
    at a static's knobs in turn. Its request log, and what only the client knows: the time outside the
    server's clock (client latency less the server's total, less the log's reply term) and the spread of
    each request's model time around its sample's profiled one at that configuration (the log does not
    say which sample a request was; the client does)."""
    saved = bs.path_with(args.out, ".calibration-loaded.json")
    if saved.exists():
        return json.loads(saved.read_text())
    _, profile, _, _ = cell_of(args, ws, cells)
    statics = statics_of(profile.front, args.statics)
    count = 4 * args.calibration_requests
    rng = np.random.default_rng(99)
    arrivals = bb.arrival_times("poisson", count, args.calibration_load * 1000.0 / cells["service_ms"], rng)
    samples = rng.integers(len(profile), size=count)
    knobs = [statics[(i // 4) % len(statics)] if statics and i % 4 == 3 else None for i in range(count)]
    budget = 2.0 * cells["service_ms"]
    before = set((ws / "requests").glob("*.jsonl"))
    server = bs.Server(ws, RUN_ID, bs.path_with(args.out, ".server.log"), 8)
    try:
        items = [(requests[profile.example_id[int(s)]], float(t), budget, k)
                 for t, s, k in zip(arrivals, samples, knobs, strict=True)]
        outs = bb.open_loop(server.port, POOL_NAME, items)
    finally:
        server.stop()
    gaps = [o.latency_ms - o.server_ms for o in outs if o.status == 200 and o.server_ms is not None]
    logs: dict[str, list[float]] = {}
    for o, s in zip(outs, samples, strict=True):
        if o.status == 200 and o.model_ms and o.knobs:
            config = bs.parse_config(o.knobs)
            profiled = profile.latency_ms[int(s), profile.column(config)]
            logs.setdefault(o.knobs, []).append(math.log(o.model_ms / profiled))
    spread = [x - float(np.mean(v)) for v in logs.values() if len(v) >= 5 for x in v]
    log = newest_log(ws, before)
    reply = calibrate_log(log, profile).reply_ms
    result = {"service_ms": float(np.mean([o.latency_ms for o, k in zip(outs, knobs, strict=True)
                                           if o.status == 200 and k is None])),
              "answered": sum(o.status == 200 for o in outs), "log": str(log), "pause_s": None,
              "load": args.calibration_load, "client_ms": max(0.0, float(np.median(gaps)) - reply),
              "noise": float(np.std(spread)) if spread else 0.0}
    bs.write_json(saved, result)
    return result


def calibrate_log(log: Path, profile: Any) -> Any:
    from simulate.calibration import calibrate

    return calibrate(log, profile.median_latency_ms(), None, profile.log_spread())


def statics_of(front: tuple, count: int) -> list[tuple[int, int, int]]:
    """``count`` configurations spread along the front, its cheapest and its dearest first."""
    if count <= 0:
        return []
    picks = np.unique(np.round(np.linspace(0, len(front) - 1, count)).astype(int))
    return [tuple(front[i]) for i in picks]


def cell_of(args: argparse.Namespace, ws: Path, calibration: dict[str, Any]) -> tuple[Any, ...]:
    config = SimulateConfig(workspace=ws, run=RUN_ID, samples=POOL_NAME, rate="1", budget_ms="1000",
                            requests=args.requests, calibrate_from=Path(calibration["log"]))
    _, _, profile, decider, overheads = load_inputs(config)
    if "client_ms" in calibration:  # what only the client of a loaded calibration run measured
        overheads = replace(overheads, client_ms=calibration["client_ms"], noise_sigma=calibration["noise"])
    return config, profile, decider, overheads


def outcome_requests(outs: list[Any], workload: Workload) -> list[SimRequest]:
    """Measured outcomes as simulated requests (for the same figures)."""
    reqs = []
    for i, (o, budget) in enumerate(zip(outs, workload.budgets_ms, strict=True)):
        status = {200: "ok", 503: "refused", 504: "dropped"}.get(o.status, "error")
        reqs.append(SimRequest(i, int(workload.samples[i]), float(workload.arrivals[i]), float(budget),
                               status=status, latency_ms=o.latency_ms if o.status == 200 else math.nan,
                               score=o.score, decided_by=o.decided_by))
    return reqs


def measure_phase(args: argparse.Namespace, ws: Path, pool_dir: Path, cells: dict[str, Any],
                  calibration: dict[str, Any]) -> None:
    config, profile, decider, overheads = cell_of(args, ws, calibration)
    requests = pool_requests(pool_dir)
    service, capacity = cells["service_ms"], 1000.0 / cells["service_ms"]
    statics = statics_of(profile.front, args.statics)
    done = {(r["load"], r["multiple"], r["decider"]) for r in read_records(args.out)}
    server = None
    try:
        for li, load in enumerate(args.loads):
            rate = load * capacity
            workload = make_workload(config, rate, profile, 1000 + li)
            for multiple in args.multiples:
                budget = multiple * service
                cell = Workload(workload.arrivals, workload.samples, np.full(len(workload), budget))
                for name, static in [("controller", None), *((f"static:{bs.config_name(c)}", c) for c in statics)]:
                    if (load, multiple, name) in done:
                        continue
                    tick = time.perf_counter()
                    predicted = Simulation(profile, decider, overheads, options=ServerOptions()).run(cell, static)
                    predict_s = time.perf_counter() - tick
                    if server is None:
                        server = bs.Server(ws, RUN_ID, bs.path_with(args.out, ".server.log"), 8)
                    else:
                        server.restart()
                    items = [(requests[profile.example_id[int(s)]], float(t), budget, static)
                             for t, s in zip(cell.arrivals, cell.samples, strict=True)]
                    outs = bb.open_loop(server.port, POOL_NAME, items)
                    measured = outcome_requests(outs, cell)
                    record = {"load": load, "multiple": multiple, "decider": name, "rate_rps": rate,
                              "budget_ms": budget, "requests": len(cell), "predict_s": predict_s,
                              "predicted": summarize(predicted, cell), "measured": summarize(measured, cell),
                              "predicted_right": [r.score if r.met else 0.0 for r in predicted],
                              "measured_right": [r.score if r.met else 0.0 for r in measured],
                              "predicted_configs": [bs.config_name(r.config) if r.config else None for r in predicted],
                              "measured_configs": [o.knobs for o in outs],
                              "predicted_latency_ms": [r.latency_ms for r in predicted],
                              "measured_latency_ms": [r.latency_ms for r in measured],
                              "predicted_model_ms": [r.model_ms for r in predicted],
                              "measured_model_ms": [o.model_ms for o in outs],
                              "measured_server_ms": [o.server_ms for o in outs]}
                    with args.out.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                    p, m = record["predicted"], record["measured"]
                    print(f"load {load} x{multiple} {name}: within {100 * p['within_budget']:.1f} / "
                          f"{100 * m['within_budget']:.1f} %, accuracy {p['accuracy']:.3f} / {m['accuracy']:.3f}, "
                          f"p95 {p['latency_p95_ms']:.0f} / {m['latency_p95_ms']:.0f} ms (predicted / measured)",
                          flush=True)
    finally:
        if server is not None:
            server.stop()


def static_of(record: dict[str, Any]) -> tuple[int, int, int] | None:
    """The configuration of a run's ``static:C/K/B`` decider; None for the controller."""
    return None if record["decider"] == "controller" else bs.parse_config(record["decider"].removeprefix("static:"))


def measured_overheads(runs: list[tuple[dict[str, Any], Workload]], profile: Any, base: Any) -> Any:
    """``base`` with the latency scales (overall and per configuration with >= 5 requests) and the service
    spread that ``runs`` (records with their cells) measured: their served model times over the profiled
    times of the same samples at the same configurations."""
    ratios: dict[tuple[int, int, int], list[float]] = {}
    for r, cell in runs:
        for i, (c, ms) in enumerate(zip(r["measured_configs"], r["measured_model_ms"], strict=True)):
            if c is not None and ms is not None:
                knobs = bs.parse_config(c)
                ratios.setdefault(knobs, []).append(ms / profile.latency_ms[cell.samples[i], profile.column(knobs)])
    every = [x for v in ratios.values() for x in v]
    if not every:
        return base
    spread = [math.log(x) - float(np.mean(np.log(v))) for v in ratios.values() if len(v) >= 5 for x in v]
    return replace(base, latency_scale=float(np.median(every)),
                   scale_by_config={k: float(np.median(v)) for k, v in ratios.items() if len(v) >= 5},
                   noise_sigma=float(np.std(spread)) if spread else 0.0)


def repredict_phase(args: argparse.Namespace, ws: Path, cells: dict[str, Any], calibration: dict[str, Any]) -> Path:
    """The saved runs' predictions again, from another calibration (the cells, their requests and their
    measurements unchanged): ``<out>-<calibration>.jsonl``. ``--oracle-scale``: each run at its own measured
    speed (a diagnosis); ``--rolling-scale N``: each run at the speed the N runs measured just before it (a
    prediction from the minutes before the cell, as a server's recent log would give it)."""
    config, profile, decider, overheads = cell_of(args, ws, calibration)
    tag = args.calibrate_with + ("-oracle-scale" if args.oracle_scale else "") + (
        f"-rolling-{args.rolling_scale}" if args.rolling_scale else "")
    out = args.out.with_name(f"{args.out.stem}-{tag}.jsonl")
    rows, before = [], []
    for r in read_records(args.out):
        li = args.loads.index(r["load"])
        workload = make_workload(config, r["rate_rps"], profile, 1000 + li)
        cell = Workload(workload.arrivals, workload.samples, np.full(len(workload), r["budget_ms"]))
        static = static_of(r)
        run_overheads = overheads
        if args.oracle_scale:  # a diagnosis, not a prediction: the run's own model times over the profile's
            run_overheads = measured_overheads([(r, cell)], profile, overheads)
        elif args.rolling_scale and before:  # the runs measured just before this one (the first: the calibration)
            run_overheads = measured_overheads(before[-args.rolling_scale:], profile, overheads)
        before.append((r, cell))
        predicted = Simulation(profile, decider, run_overheads, options=ServerOptions()).run(cell, static)
        measured_right = r["measured_right"]
        r = {**r, "predicted": summarize(predicted, cell), "predicted_right": [p.score if p.met else 0.0
                                                                               for p in predicted],
             "predicted_configs": [bs.config_name(p.config) if p.config else None for p in predicted],
             "predicted_latency_ms": [p.latency_ms for p in predicted],
             "predicted_model_ms": [p.model_ms for p in predicted], "measured_right": measured_right}
        rows.append(json.dumps(r))
    out.write_text("\n".join(rows) + "\n")
    return out


def noise_floor_phase(args: argparse.Namespace, ws: Path, cells: dict[str, Any], calibration: dict[str, Any]) -> str:
    """How often the simulation meets the targets against itself. Per measured run, the simulation at that
    run's own speed and spread (``--oracle-scale``'s overheads) is drawn ``--draws`` times (the service noise
    and the balancer reseeded; the arrivals, samples and budgets kept), at the benchmark's cell size and at
    ``--floor-requests``; each draw after the first is compared with the first, as a measurement is with a
    prediction whose only error is the run's own luck. A target that a perfect simulator misses in many
    draws cannot be checked on cells that small."""
    config, profile, decider, overheads = cell_of(args, ws, calibration)
    records = read_records(args.out)
    lines = [f"Noise floor: {len(records)} runs, each at its own measured speed and spread, {args.draws} draws of "
             "the service noise; the share of draws within each target of the first draw.", "",
             "| requests per cell | within 2 pt | accuracy 1.5 pt | p95 10 % | within-budget gap, median (p90) pt |",
             "|---|---|---|---|---|"]
    def cell_at(r: dict[str, Any], size: int) -> Workload:
        config.requests = size
        workload = make_workload(config, r["rate_rps"], profile, 1000 + args.loads.index(r["load"]))
        return Workload(workload.arrivals, workload.samples, np.full(len(workload), r["budget_ms"]))

    for size in (args.requests, *args.floor_requests):
        hits = {"within": 0, "accuracy": 0, "p95": 0}
        gaps, pairs = [], 0
        for r in records:
            static = static_of(r)
            own = measured_overheads([(r, cell_at(r, args.requests))], profile, overheads)
            cell = cell_at(r, size)
            draws = [summarize(Simulation(profile, decider, own, options=ServerOptions(), seed=seed).run(cell, static),
                               cell) for seed in range(args.draws)]
            first = draws[0]
            for d in draws[1:]:
                pairs += 1
                gap = abs(d["within_budget"] - first["within_budget"])
                gaps.append(100 * gap)
                hits["within"] += gap <= 0.02
                hits["accuracy"] += abs(d["accuracy"] - first["accuracy"]) <= 0.015
                hits["p95"] += abs(d["latency_p95_ms"] - first["latency_p95_ms"]) <= 0.10 * first["latency_p95_ms"]
        share = {k: 100 * v / max(1, pairs) for k, v in hits.items()}
        lines.append(f"| {size:,} | {share['within']:.0f} % | {share['accuracy']:.0f} % | {share['p95']:.0f} % | "
                     f"{np.median(gaps):.1f} ({np.percentile(gaps, 90):.1f}) |")
    return "\n".join(lines)


def ws_of(args: argparse.Namespace) -> Path:
    return CACHE / f"sim-ws-{args.pool}"


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(args: argparse.Namespace, cells: dict[str, Any], calibration: dict[str, Any]) -> str:
    """Predicted against measured per cell and decider, the targets' hit rates, and the rankings."""
    records = read_records(args.out)
    how = ("back to back" if calibration.get("pause_s", 0.1) == 0 else f"at load {calibration['load']:g}"
           if calibration.get("pause_s", 0.1) is None else f"{calibration.get('pause_s', 0.1):g} s apart")
    _, _, _, overheads = cell_of(args, ws_of(args), calibration)
    lines = [f"Service time {cells['service_ms']:.1f} ms (capacity {1000 / cells['service_ms']:.2f}/s); "
             f"{len(records)} runs; predictions calibrated from the run of {calibration['answered']} controller "
             f"requests {how} (latency scale x{overheads.latency_scale:.2f}, per configuration "
             + ", ".join(f"{bs.config_name(c)} x{v:.2f}" for c, v in overheads.scale_by_config.items())
             + f"; service noise {overheads.noise_sigma:.2f}; client {overheads.client_ms:.1f} ms).", "",
             "| load | budget | decider | within budget: predicted / measured | accuracy | p95 ms |",
             "|---|---|---|---|---|---|"]
    hits = {"within": 0, "accuracy": 0, "p95": 0}
    for r in records:
        p, m = r["predicted"], r["measured"]
        within = abs(p["within_budget"] - m["within_budget"]) <= 0.02
        accuracy = abs(p["accuracy"] - m["accuracy"]) <= 0.015
        p95 = abs(p["latency_p95_ms"] - m["latency_p95_ms"]) <= 0.10 * m["latency_p95_ms"]
        hits["within"] += within
        hits["accuracy"] += accuracy
        hits["p95"] += p95
        lines.append(f"| {r['load']:g} | {r['multiple']:g}x ({r['budget_ms']:.0f} ms) | {r['decider']} | "
                     f"{100 * p['within_budget']:.1f} / {100 * m['within_budget']:.1f} %"
                     f"{'' if within else ' (miss)'} | "
                     f"{p['accuracy']:.3f} / {m['accuracy']:.3f} {'' if accuracy else '(miss)'} | "
                     f"{p['latency_p95_ms']:.0f} / {m['latency_p95_ms']:.0f} {'' if p95 else '(miss)'} |")
    n = max(1, len(records))
    lines += ["", f"Within 2 points: {hits['within']}/{n}; accuracy within 1.5 points: {hits['accuracy']}/{n}; "
                  f"p95 within 10 %: {hits['p95']}/{n} (target: 90 % of the cells each)."]
    lines += ["", *ranking_lines(records, args.block), "", *term_lines(records)]
    return "\n".join(lines)


def _median_ratio(a: list[float], b: list[float]) -> float:
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None
             and math.isfinite(x) and math.isfinite(y) and y > 0]
    return float(np.median([x / y for x, y in pairs])) if pairs else math.nan


def term_lines(records: list[dict[str, Any]]) -> list[str]:
    """Where the model of the server is wrong, per run: the model time (measured over predicted, the same
    request at the same configuration), the time outside it (client latency less model time, medians,
    measured less predicted: host costs plus queueing), and, for the controller, the share of requests
    decided alike."""
    out = ["| load | budget | decider | model time measured / predicted | latency less model: measured - "
           "predicted (ms, medians) | decided alike |", "|---|---|---|---|---|---|"]
    for r in records:
        same = [i for i, (a, b) in enumerate(zip(r["predicted_configs"], r["measured_configs"], strict=True))
                if a is not None and a == b]
        ratio = _median_ratio([r["measured_model_ms"][i] for i in same], [r["predicted_model_ms"][i] for i in same])

        def outside(latency: list[float], model: list[float | None]) -> float:
            rest = [x - y for x, y in zip(latency, model, strict=True)
                    if y is not None and math.isfinite(x) and math.isfinite(y)]
            return float(np.median(rest)) if rest else math.nan

        host = (outside(r["measured_latency_ms"], r["measured_model_ms"])
                - outside(r["predicted_latency_ms"], r["predicted_model_ms"]))
        answered = sum(a is not None and b is not None
                       for a, b in zip(r["predicted_configs"], r["measured_configs"], strict=True))
        alike = f"{100 * len(same) / answered:.0f} %" if r["decider"] == "controller" and answered else ""
        out.append(f"| {r['load']:g} | {r['multiple']:g}x | {r['decider']} | x{ratio:.2f} | {host:+.1f} | {alike} |")
    return out


def ranking_lines(records: list[dict[str, Any]], block: int) -> list[str]:
    """Per cell, each pair of deciders the measured paired interval separates (right answers within budget):
    whether the simulation orders them the same."""
    cells: dict[tuple[float, float], list[dict[str, Any]]] = {}
    for r in records:
        cells.setdefault((r["load"], r["multiple"]), []).append(r)
    agree = total = 0
    out = []
    for (load, multiple), runs in sorted(cells.items()):
        for i, a in enumerate(runs):
            for b in runs[i + 1:]:
                diff = np.asarray(a["measured_right"]) - np.asarray(b["measured_right"])
                _, low, high = bs.block_bootstrap_ci(diff, block=block)
                if low <= 0 <= high:
                    continue
                total += 1
                predicted = float(np.sum(a["predicted_right"]) - np.sum(b["predicted_right"]))
                same = (predicted > 0) == (high > 0)
                agree += same
                if not same:
                    out.append(f"load {load:g} x{multiple:g}: measured {a['decider']} vs {b['decider']} "
                               f"{'+' if high > 0 else '-'}, predicted the other way")
    return [f"Rankings: the simulation orders {agree} of the {total} pairs the measurement separates the same.",
            *out]


def speed_phase(args: argparse.Namespace, ws: Path, cells: dict[str, Any], calibration: dict[str, Any]) -> str:
    """Simulated requests per second on one thread: the controller and the cheapest front configuration, each
    over ``--speed-requests`` requests at load 0.9 and the middle budget multiple, median of three; then a
    sweep of the controller over :data:`SWEEP_LOADS`, ``--speed-requests`` each, through ``ctrl simulate``'s
    entry in this process and in one worker per CPU (wall clock, loading and starting included)."""
    import platform

    import torch

    torch.set_num_threads(1)
    config, profile, decider, overheads = cell_of(args, ws, calibration)
    service = cells["service_ms"]
    rate = 0.9 * 1000.0 / service
    config.requests = args.speed_requests
    workload = make_workload(config, rate, profile, 1)
    budget = args.multiples[len(args.multiples) // 2] * service
    cell = Workload(workload.arrivals, workload.samples, np.full(len(workload), budget))
    lines = [f"Simulation speed, {len(cell)} requests, one thread ({platform.processor() or platform.machine()}):"]
    _, _, _, unmemoized, _ = load_inputs(config)
    object.__setattr__(unmemoized.deployed, "_ctrl_memoized", True)  # the baseline: every call computed
    for name, static, who in (("controller", None, decider),
                              ("controller without the per-question memo", None, unmemoized),
                              (f"static:{bs.config_name(profile.front[0])}", profile.front[0], decider)):
        times = []
        for _ in range(3):
            tick = time.perf_counter()
            Simulation(profile, who, overheads).run(cell, static)
            times.append(time.perf_counter() - tick)
        lines.append(f"  {name}: {len(cell) / float(np.median(times)):,.0f} requests/s (median of 3)")
    # a sweep through `ctrl simulate`'s own entry, wall clock (inputs loaded, workers started): in this process,
    # then in one worker per CPU
    sweep = replace(config, rate=None, load=",".join(f"{v:g}" for v in SWEEP_LOADS), requests=args.speed_requests,
                    deciders="controller")
    total = len(SWEEP_LOADS) * args.speed_requests
    for jobs in (1, available_cpus()):
        tick = time.perf_counter()
        simulate(replace(sweep, jobs=jobs))
        seconds = time.perf_counter() - tick
        lines.append(f"  controller sweep, {len(SWEEP_LOADS)} loads x {args.speed_requests:,} requests, --jobs {jobs}: "
                     f"{seconds:.1f} s ({total / seconds:,.0f} requests/s)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=("all", "report", "speed", "repredict", "noise-floor"), default="all")
    p.add_argument("--calibrate-with", choices=("paced", "back-to-back", "loaded"), default="loaded",
                   help="the calibration run the predictions read: the paced run that defines the cells "
                        "(controller requests 0.1 s apart), one back to back with some requests at each "
                        "static's knobs, or one under load (with the client's own costs and the service "
                        "spread paired with the profile)")
    p.add_argument("--calibration-load", type=float, default=0.7, help="the loaded calibration run's load")
    p.add_argument("--pool", type=int, default=200, help="pool requests (the first of the fresh set)")
    p.add_argument("--loads", default="0.5,0.7,0.9")
    p.add_argument("--multiples", default="1.5,2,3")
    p.add_argument("--requests", type=int, default=200, help="requests per run")
    p.add_argument("--statics", type=int, default=3, help="front configurations run as statics")
    p.add_argument("--calibration-requests", type=int, default=40)
    p.add_argument("--block", type=int, default=25, help="moving-block bootstrap block (requests)")
    p.add_argument("--oracle-scale", action="store_true",
                   help="repredict: each run at its own measured model time over the profile's (a diagnosis of "
                        "what the rest of the model gets right when the machine's speed is known, not a prediction)")
    p.add_argument("--rolling-scale", type=int, default=0, metavar="N",
                   help="repredict: each run at the model-time scale and spread the N runs measured just before it "
                        "(the first run: the calibration's)")
    p.add_argument("--draws", type=int, default=8, help="noise-floor: draws of the service noise per run")
    p.add_argument("--floor-requests", default="1000",
                   help="noise-floor: cell sizes to draw besides --requests (comma-separated)")
    p.add_argument("--speed-requests", type=int, default=10_000, help="requests the speed phase simulates")
    p.add_argument("--out", type=Path, default=CACHE / "bench_simulate.jsonl")
    args = p.parse_args(argv)
    args.loads = [float(v) for v in args.loads.split(",")]
    args.multiples = [float(v) for v in args.multiples.split(",")]
    args.floor_requests = [int(v) for v in args.floor_requests.split(",") if v]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pool_dir, ws = prepare(args.pool)
    requests = pool_requests(pool_dir)
    # the cells (service time, capacity) come from the paced run; the predictions from --calibrate-with's
    cells = calibration_phase(ws, requests, [None] * args.calibration_requests, args.out)
    calibration = cells
    if args.calibrate_with == "back-to-back":  # the controller's requests, then some at each static's knobs
        _, profile, _, _ = cell_of(args, ws, cells)
        knobs = [None] * args.calibration_requests + [
            c for c in statics_of(profile.front, args.statics) for _ in range(SCALE_MIN_REQUESTS + 4)]
        calibration = calibration_phase(ws, requests, knobs, args.out, pause_s=0.0, suffix="-back-to-back")
    elif args.calibrate_with == "loaded":
        calibration = loaded_calibration(args, ws, requests, cells)
    if args.phase == "repredict":
        args.out = repredict_phase(args, ws, cells, calibration)
        args.phase = "report"
    if args.phase == "speed":
        print(speed_phase(args, ws, cells, calibration))
        return
    if args.phase == "noise-floor":
        text = noise_floor_phase(args, ws, cells, calibration)
        print(text)
        bs.path_with(args.out, "-noise-floor.md").write_text(text + "\n")
        return
    if args.phase == "all":
        measure_phase(args, ws, pool_dir, cells, calibration)
    text = report(args, cells, calibration)
    print(text)
    bs.path_with(args.out, ".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
