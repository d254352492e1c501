"""Serving under load: the controller on the request path of ``ctrl serve`` against static configurations
and lookup tables, on requests it has never seen, with confidence intervals.

Usage::

    python benchmarks/bench_serve.py                      # both phases, the defaults below (hours)
    python benchmarks/bench_serve.py --phase front        # only the empty-queue front (minutes)
    python benchmarks/bench_serve.py --phase load         # the load phase on the saved front
    python benchmarks/bench_serve.py --phase report       # tables, plot and target check from the saved results
    python benchmarks/bench_serve.py --phase all --front-requests 3 --requests 30 --warmup 5 \\
        --loads 0.5 --budgets-ms 150 --out /tmp/bs/bench.jsonl --plot /tmp/bs/serve.png   # a smoke run

What it runs. The workspace (``--workspace``) is prepared on first use as before: the shipped sample
data ingested, features extracted, ``ctrl train --offline --run-id RUN``. A fresh testbed set
(``testbed.task.generate_dataset``, ``--bench-seed`` 4242, ``--bench-samples`` 1300, split "bench",
cached under benchmarks/.cache) provides the requests: none of them was seen by the testbed model
(seed 0), the profile (seed 2026) or the controller. A request is the question and the image as a
data URI; the client knows its family and references and scores the answer with the dataset's metric.
One ``ctrl serve --model testbed --controller RUN --threads 1`` subprocess serves the requests; it is
started afresh before each run of a controller, so that the state the server keeps from the requests
it served (the latency scale, the reserve, the met target's margin) comes from that run's own warm-up,
not from the run before it at another budget or load.

Phase "front" (empty queue). Every configuration of the action space (the 27 balanced ones) answers
the same ``--front-requests`` requests (40), one request at a time, configurations interleaved (a
shuffled round per request) so that the machine's drift hits all alike. Per configuration: the median
client latency (send to last byte), the median server total and model time from the reply's ``ctrl``
object (``latency_ms.model``: vision pass, prefill and decode, what ``ctrl profile`` times), the
profile's median latency and mean accuracy of that configuration (the workspace's exp6 measurements:
600 held-out samples) and the ratio of the two latencies. The served Pareto front (median served
latency against held-out accuracy) is printed and saved (``<out>.front.json``); ``--phase all`` and
``--phase load`` reuse it when its settings match.

Phase "load". Budgets in served ms (``--budget-multiples`` of the cheapest configuration's served
median, or ``--budgets-ms``); loads as fractions of the capacity (requests/s of one client sending
back to back, the controller deciding at the middle budget, after a warm-up). After the warm-up the
server's latency scale and reserve (GET /v1/models) are read once and held fixed: they convert a
served budget into the profile's ms for the tables, as the server does: (budget - reserve) / scale.
Capacity, scale and reserve are saved (``<out>.calibration.json``) so that a resumed run uses the
same arrival times. Per load one request sequence and one Poisson arrival sequence (both seeded by
the load) are sent open loop (a request leaves at its time whether or not earlier ones are
answered; latency runs from the scheduled time to the last byte; a 503, a 504 (the server's queue
deadline) or an error is missed and wrong) once for each of:

* "controller": the request's ``latency_budget_ms`` is the budget, no knobs (one run per budget), on a
  server with its defaults: queue-aware budgets and the met target's margin
  (docs/serving.md#queue-aware-budgets, docs/serving.md#met-target);
* "controller (no margin)": the same on a server started with ``--met-target 0``: the runs of
  ``--no-margin``, which runs nothing else;
* "controller (own budget)": the same on a server started with ``--no-queue-aware --met-target 0``
  (the controller reads each request's own budget left only): the runs of ``--no-queue-aware``,
  which runs nothing else;
* "family table": ``trainer.baselines.FamilyLookupTableDecider`` fitted on the run's training split
  (the split its fallback table was fitted on), told each request's family, fixed knobs per request
  (one run per budget): an upper reference, no server knows the family;
* "static C/K/B": every configuration on the served front, fixed knobs, one run per load judged
  against every budget (its latencies do not depend on the budget);
* "p95 table": the run's lut_p95 table (the fallback's budget-only table: p95 latency within the
  budget, profile ms) picks one configuration per budget: that configuration's static run (run
  once per load too when it is not on the front);
* "oracle" (``--oracle``): a hook, not implemented (:func:`oracle_knobs`).

Runs of a load go in a seeded random order, so that drift does not line up with the deciders.
Per cell (load, budget, decider), on the requests after ``--warmup``: the rate within budget (95 %
Wilson interval), correct answers and accuracy (Wilson), p50 / p95 / p99 latency of the answered
requests, throughput, 503s, the configurations chosen, and the paired difference controller minus
decider (same requests, same arrival times) in correct answers and in the rate within budget, with
95 % intervals from a moving-block bootstrap over the request index (``--block`` 50: queueing makes
neighbouring requests dependent). Steady state: the client counts the requests in the system (sent,
not answered) over time; each cell stores the time-averaged count per tenth of the run and is
flagged "not steady" when the last tenth holds more than twice the second (and at least
``--steady-min-excess`` more requests: at low load a tenth of 0.1 against 0.3 is noise).

Output. Every run is appended to ``--out`` (JSONL, the raw per-request outcomes and its cells) as soon
as it finishes; a re-run with the same settings skips the runs already there, so an interrupted run
resumes (a front measured again starts the load runs afresh). At the end (and with ``--phase
report``): one markdown table per load for the docs, ``<out>.cells.json``, the plot (``--plot``,
docs/serve_bench.png: within-budget rate and accuracy against load, one column per budget) and the
check of the targets: at every budget of at least twice the cheapest served median and every load up
to 0.7, the controller within budget for at least 95 % of requests, and for every static configuration
that meets the budget at least as often as the controller, the controller's paired correct-answer
difference above 0 with its interval above 0 at one budget or more and never below 0 beyond its
interval.

How long. Before each phase it prints its estimate (runs x requests / arrival rate). The front is
27 x 40 requests one at a time (1 to 4 minutes). The load phase at the defaults (4 budgets, loads
0.25 / 0.5 / 0.7 / 1.0, 1,100 requests per run) is 8 per-budget runs plus one per static configuration
(on the trained testbed the front holds 3 or 4 and the p95 table adds one), about 13 runs per load of
1,100 / (load x capacity) seconds each: 13 x 1,100 x (4 + 2 + 1.43 + 1) / capacity, about 1.2 hours
at the 29 requests/s the 2-core development VM served with one other job running, 3 hours at the
11 requests/s it served while other jobs kept both cores busy.

The Wilson intervals of a single cell treat its requests as independent, which queueing makes them
not: compare deciders by the paired differences and their block-bootstrap intervals.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.client
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CACHE = ROOT / "benchmarks" / ".cache"
MAX_TOKENS = 8  # as the sample profile was measured
KNOB_NAMES = ("max_crops", "top_k", "num_active_blocks")
#: seeds the fresh set must not use: the testbed's training set and the shipped sample profile
USED_SEEDS = (0, 2026)

Config = tuple[int, int, int]


def config_name(config: Sequence[int]) -> str:
    return "/".join(str(int(v)) for v in config)


def parse_config(name: str) -> Config:
    c, k, b = (int(v) for v in name.split("/"))
    return c, k, b


# -- statistics (pure functions, tests/test_bench_serve.py) -----------------------------------------------------


def wilson_interval(successes: float, n: int, level: float = 0.95) -> tuple[float, float]:
    """Two-sided Wilson score interval of a rate; (nan, nan) without trials. ``successes`` may be a sum of
    scores in [0, 1] (the interval is then the binomial one at that mean)."""
    if n <= 0:
        return math.nan, math.nan
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    spread = z * math.sqrt(max(0.0, p * (1 - p)) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - spread), min(1.0, centre + spread)


def block_bootstrap_ci(values: Sequence[float] | np.ndarray, *, block: int = 50, reps: int = 2000,
                       level: float = 0.95, seed: int = 0, total: bool = True) -> tuple[float, float, float]:
    """The sum (``total``) or mean of ``values`` and its percentile interval from a moving-block bootstrap.

    Each replicate concatenates ceil(n / block) blocks of ``block`` consecutive values, each starting at
    a uniformly drawn index, cut to n: neighbouring values (requests that queued behind each other) stay
    together, so their dependence widens the interval as it should. ``block`` 1 is the ordinary bootstrap;
    a block longer than n / 5 is shortened to it (fewer than five blocks would leave nothing to resample).
    """
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n == 0:
        return math.nan, math.nan, math.nan
    b = max(1, min(int(block), n // 5))
    k = math.ceil(n / b)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, n - b + 1, size=(reps, k))
    index = (starts[:, :, None] + np.arange(b)).reshape(reps, k * b)[:, :n]
    means = x[index].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    factor = n if total else 1
    return float(x.mean() * factor), float(lo * factor), float(hi * factor)


def pareto_front(points: Mapping[str, tuple[float, float]]) -> list[str]:
    """The names whose (latency, accuracy) no other point dominates: another point dominates when it is at
    least as fast and at least as accurate, and strictly better in one. Sorted by latency, then name."""
    front = [name for name, (lat, acc) in points.items()
             if not any(ol <= lat and oa >= acc and (ol < lat or oa > acc)
                        for other, (ol, oa) in points.items() if other != name)]
    return sorted(front, key=lambda name: (points[name][0], name))


def in_system_tenths(sched_s: Sequence[float], done_s: Sequence[float], start_s: float, end_s: float,
                     parts: int = 10) -> list[float]:
    """The time-averaged number of requests in the system (scheduled, not yet answered) in each of
    ``parts`` equal slices of [start_s, end_s]."""
    sched, done = np.asarray(sched_s, dtype=np.float64), np.asarray(done_s, dtype=np.float64)
    edges = np.linspace(start_s, end_s, parts + 1)
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        overlap = np.clip(np.minimum(done, b) - np.maximum(sched, a), 0.0, None)
        out.append(float(overlap.sum() / (b - a)) if b > a else math.nan)
    return out


def is_steady(tenths: Sequence[float], factor: float = 2.0, min_excess: float = 1.0) -> bool:
    """False when the last tenth holds more than ``factor`` x the second tenth's requests and at least
    ``min_excess`` more (the queue was still growing at the end of the run)."""
    if len(tenths) < 3:
        return True
    second, last = tenths[1], tenths[-1]
    return not (last > factor * second and last - second >= min_excess)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def median_or_nan(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if len(values) else math.nan


# -- workspace and requests -------------------------------------------------------------------------------------


def ctrl(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, check=True)


def prepare_workspace(ws: Path, run_id: str) -> None:
    """Sample data, the testbed, ingest, features and an offline run (each step skipped when done)."""
    if not (ROOT / "data" / "exp6").exists():
        subprocess.run([sys.executable, str(ROOT / "data" / "generate.py")], check=True)
    ctrl("testbed", "train", "--eval-samples", "0")
    if not (ws / "CURRENT").exists():
        ctrl("ingest", str(ROOT / "data" / "exp5"), str(ROOT / "data" / "exp6"), "-w", str(ws))
    ctrl("extract-features", "-w", str(ws), "--model", "testbed", "--images", str(ROOT / "data" / "testbed" / "images"))
    if not (ws / "runs" / run_id / "checkpoints" / "best.pt").exists():
        ctrl("train", "--offline", "-w", str(ws), "--run-id", run_id)


@dataclass
class BenchRequest:
    """One request of the fresh set: what is sent (question, image) and what the client alone knows."""

    index: int
    example_id: str
    family: str
    question: str
    answers: list[str]
    uri: str


def bench_requests(root: Path, num: int, seed: int) -> tuple[str, list[BenchRequest]]:
    """The fresh testbed set (generated once into ``root``): its dataset name and its requests."""
    from testbed.dataset import read_dataset
    from testbed.task import generate_dataset

    if seed in USED_SEEDS:
        msg = f"--bench-seed {seed} is a seed the testbed or the profile was drawn with ({USED_SEEDS}); pick another"
        raise SystemExit(msg)
    generate_dataset(root, num, seed=seed, split="bench")
    dataset = read_dataset(root)
    out = []
    for i, sample in enumerate(dataset.samples):
        uri = "data:image/png;base64," + base64.b64encode(dataset.image_path(sample).read_bytes()).decode()
        out.append(BenchRequest(i, sample.example_id, sample.family, sample.question, list(sample.answers), uri))
    return dataset.name, out


def profile_by_config(ws: Path) -> dict[str, dict[str, float]]:
    """Per configuration of the exp6 profile: its median total latency and its mean accuracy (the
    workspace's ``measurements`` view)."""
    from pipeline.catalog import run_query
    from pipeline.workspace import Workspace

    table = run_query(Workspace(ws), "SELECT max_crops, top_k, num_active_blocks, median(latency_total_ms) AS ms, "
                                     "avg(score) AS accuracy, count(*) AS n FROM measurements "
                                     "WHERE experiment = 'exp6' GROUP BY ALL").to_pylist()
    return {config_name((r["max_crops"], r["top_k"], r["num_active_blocks"])):
            {"median_ms": float(r["ms"]), "accuracy": float(r["accuracy"]), "n": int(r["n"])} for r in table}


@dataclass
class RunTables:
    """The run's tables, in the profile's ms: the fallback's lut_p95 table, the per-family table fitted on the
    same training split, and each configuration's reference (median training) latency."""

    p95: Any  # trainer.baselines.LookupTableDecider
    by_family: Any  # trainer.baselines.FamilyLookupTableDecider
    reference_ms: dict[str, float]


def run_tables(ws: Path, run_id: str) -> RunTables:
    import torch

    from trainer.baselines import FamilyLookupTableDecider
    from trainer.config import OfflineTrainConfig
    from trainer.fallback import read_fallback
    from trainer.offline import OfflineTrainer
    from trainer.runs import RunDir

    run_dir = ws / "runs" / run_id
    fallback = read_fallback(run_dir / "checkpoints" / "best.pt")
    if fallback is None:
        msg = f"run {run_id} has no table fallback to take the p95 table from"
        raise SystemExit(msg)
    p95 = fallback.budget_table()
    # the trainer's own constructor (it reads the data and writes nothing) gives the samples its fallback
    # table was fitted on: the per-family table is fitted on the same samples
    config = OfflineTrainConfig.from_json({**RunDir(run_dir).read_config(), "workspace": str(ws)})
    train = OfflineTrainer(config, run_dir=run_dir).table_data
    by_family = FamilyLookupTableDecider(train)
    if not torch.equal(torch.nan_to_num(by_family.global_table.latency_stat_ms, nan=-1.0),
                       torch.nan_to_num(p95.latency_stat_ms, nan=-1.0)):
        msg = "the per-family table's global table differs from the run's fallback table: not the same training split"
        raise SystemExit(msg)
    median = p95.latency_median_ms
    reference = {} if median is None else {
        config_name(a): float(m) for a, m in zip(p95.action_space.actions, median.tolist()) if math.isfinite(m)}
    return RunTables(p95, by_family, reference)


def oracle_knobs(request: BenchRequest, budget_ms: float) -> Config:
    """Hook for an "oracle" decider (``--oracle``): the knobs of ``request`` at ``budget_ms`` (served ms),
    e.g. the most accurate configuration that would be answered within the budget. Implemented, it runs
    once per (load, budget) like the controller and gets its rows in the tables and the plot. Not
    implemented: on unseen requests it needs every configuration's answer and its served latency at that
    moment of the queue (27 runs per request), which is what makes it an oracle and what makes it
    expensive; raising NotImplementedError skips it."""
    msg = "the oracle decider is a hook only (oracle_knobs)"
    raise NotImplementedError(msg)


# -- the server and the client ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``ctrl serve`` in a subprocess (one model thread, as the profile was measured)."""

    def __init__(self, ws: Path, run_id: str, log: Path, max_queue: int, flags: Sequence[str] = (),
                 root: Path = ROOT) -> None:
        self.ws, self.run_id, self.log_path, self.max_queue, self.flags = ws, run_id, log, max_queue, tuple(flags)
        self.root = root  # the source tree the server runs from (another revision's checkout, for comparisons)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_bytes(b"")  # one log per benchmark process; restarts append to it
        self._start()

    def restart(self) -> None:
        """A fresh process with the same options: nothing learned from earlier requests."""
        self.stop()
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--model", "testbed", "--controller", self.run_id, "-w",
             str(self.ws), "--port", str(self.port), "--threads", "1", "--max-queue", str(self.max_queue),
             *self.flags],
            cwd=self.root, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                msg = f"ctrl serve exited: {self.log_path.read_text()[-2000:]}"
                raise SystemExit(msg)
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                time.sleep(0.3)
        self.process.kill()
        msg = "ctrl serve did not start within 300 s"
        raise SystemExit(msg)

    def about(self) -> dict[str, Any]:
        """The ``ctrl`` object of GET /v1/models: latency scale, reserve, default budget."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", "/v1/models")
            return json.loads(conn.getresponse().read())["data"][0]["ctrl"]
        finally:
            conn.close()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


@dataclass
class Outcome:
    """One request as the client saw it; times in s from the run's start."""

    status: int  # HTTP status; 0: no reply (connection error or timeout)
    sched_s: float
    done_s: float
    score: float
    knobs: str | None = None
    server_ms: float | None = None  # ctrl.latency_ms.total
    model_ms: float | None = None  # ctrl.latency_ms.model: the generate the profile times
    scale: float | None = None
    decided_by: str | None = None
    margin: float | None = None  # ctrl.budget_margin (None: a server without the met target)

    @property
    def latency_ms(self) -> float:
        return (self.done_s - self.sched_s) * 1000.0


OUTCOME_FIELDS = tuple(Outcome.__dataclass_fields__)


def body_of(request: BenchRequest, budget_ms: float | None, knobs: Config | None) -> bytes:
    payload: dict[str, Any] = {"model": "testbed", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": [
        {"type": "text", "text": request.question}, {"type": "image_url", "image_url": {"url": request.uri}}]}],
        # names the profiled sample, so that a calibration from the request log pairs it with its own latency
        "metadata": {"example_id": request.example_id}}
    if budget_ms is not None:
        payload["latency_budget_ms"] = budget_ms
    if knobs is not None:
        payload["knobs"] = dict(zip(KNOB_NAMES, knobs))
    return json.dumps(payload).encode()


def send(port: int, body: bytes, t0: float, sched_s: float, request: BenchRequest, dataset: str) -> Outcome:
    """POST one request; the outcome with its times relative to ``t0`` (perf_counter)."""
    from runtime.scoring import score_answer

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
        status = response.status
    except (OSError, http.client.HTTPException):
        status, raw = 0, b""
    finally:
        conn.close()
    done = time.perf_counter() - t0
    if status != 200:
        return Outcome(status, sched_s, done, 0.0)
    try:
        reply = json.loads(raw)
        info = reply.get("ctrl") or {}
        knobs, lat = info.get("knobs") or {}, info.get("latency_ms") or {}
        score, _ = score_answer(dataset, reply["choices"][0]["message"]["content"] or "", request.answers)
    except (ValueError, KeyError, IndexError, TypeError):  # a reply without an answer: an error, missed and wrong
        return Outcome(0, sched_s, done, 0.0)
    model_ms = lat.get("model")  # what the profile times as one generate (the latency scale's numerator)
    if model_ms is None:  # a server without it: its parts (the input embedding left out)
        parts = [lat.get(k) for k in ("vision", "prefill", "decode")]
        model_ms = sum(parts) if all(p is not None for p in parts) else None
    return Outcome(200, sched_s, done, float(score), config_name([knobs[k] for k in KNOB_NAMES]) if knobs else None,
                   lat.get("total"), model_ms, info.get("latency_scale"), info.get("decided_by"),
                   info.get("budget_margin"))


def run_back_to_back(port: int, dataset: str, items: Sequence[tuple[BenchRequest, float | None, Config | None]]
                     ) -> tuple[list[Outcome], float]:
    """One client, one request at a time: the outcomes and the wall time (s)."""
    t0 = time.perf_counter()
    out = []
    for request, budget, knobs in items:
        body = body_of(request, budget, knobs)
        out.append(send(port, body, t0, time.perf_counter() - t0, request, dataset))
    return out, time.perf_counter() - t0


def run_open_loop(port: int, dataset: str, requests: Sequence[BenchRequest], arrivals_s: Sequence[float],
                  knobs_of: Callable[[BenchRequest], Config | None], budget_ms: float | None) -> list[Outcome]:
    """Send request i at ``arrivals_s[i]`` whether or not earlier ones were answered (open loop)."""
    t0 = time.perf_counter() + 0.2

    def one(request: BenchRequest, at: float) -> Outcome:
        return send(port, body_of(request, budget_ms, knobs_of(request)), t0, at, request, dataset)

    # more threads than the server's queue can hold: a thread never delays a send (the server's 503 does)
    with ThreadPoolExecutor(max_workers=256) as pool:
        futures = []
        for request, at in zip(requests, arrivals_s):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, request, at))
        return [f.result() for f in futures]


# -- phase "front" ----------------------------------------------------------------------------------------------


def action_space() -> list[Config]:
    from pipeline import knobs

    return [tuple(int(v) for v in c) for c in knobs.balanced_combinations(
        knobs.EXP6_MAX_CROPS, knobs.EXP6_TOP_K, knobs.EXP6_NUM_ACTIVE_BLOCKS)]


def phase_front(server: Server, dataset: str, requests: list[BenchRequest], n: int, seed: int,
                profile: dict[str, dict[str, float]], reference_ms: dict[str, float], per_request_s: float
                ) -> dict[str, Any]:
    """Every configuration on the same ``n`` requests at an empty queue; the served front."""
    configs = action_space()
    order = np.random.default_rng([seed, 1]).permutation(len(requests))[:n]
    print(f"\nphase front: {len(configs)} configurations x {n} requests, one at a time: about "
          f"{len(configs) * n * per_request_s / 60:.1f} min", flush=True)
    rng = np.random.default_rng([seed, 2])
    by_config: dict[str, list[Outcome]] = {config_name(c): [] for c in configs}
    t0 = time.perf_counter()
    for r, i in enumerate(order):
        for j in rng.permutation(len(configs)):  # a shuffled round: drift hits every configuration alike
            name = config_name(configs[j])
            out, _ = run_back_to_back(server.port, dataset, [(requests[int(i)], None, configs[j])])
            by_config[name].extend(out)
        if (r + 1) % max(1, n // 5) == 0:
            print(f"  {r + 1}/{n} rounds, {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for name, outs in by_config.items():
        ok = [o for o in outs if o.status == 200]
        model = [o.model_ms for o in ok if o.model_ms is not None]
        prof = profile.get(name, {})
        model_median = median_or_nan(model)
        rows.append({
            "config": name, "n": len(outs), "answered": len(ok),
            "client_ms": median_or_nan([o.latency_ms for o in ok]),
            "server_total_ms": median_or_nan([o.server_ms for o in ok if o.server_ms is not None]),
            "model_ms": model_median, "profile_median_ms": prof.get("median_ms", math.nan),
            "reference_median_ms": reference_ms.get(name, math.nan),
            "model_over_profile": model_median / prof["median_ms"] if prof else math.nan,
            "heldout_accuracy": prof.get("accuracy", math.nan),
            "served_accuracy": sum(o.score for o in outs) / len(outs) if outs else math.nan})
    points = {r["config"]: (r["client_ms"], r["heldout_accuracy"]) for r in rows
              if math.isfinite(r["client_ms"]) and math.isfinite(r["heldout_accuracy"])}
    front = pareto_front(points)
    cheapest = min(points, key=lambda c: points[c][0])
    return {"configs": rows, "front": front, "cheapest": cheapest, "cheapest_ms": points[cheapest][0]}


def print_front(result: dict[str, Any]) -> None:
    rows = sorted(result["configs"], key=lambda r: r["client_ms"])
    print("\n| config | served client p50 ms | server total p50 | model p50 | profile p50 "
          "| model / profile | held-out accuracy | served accuracy | front |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        mark = "**yes**" if r["config"] in result["front"] else ""
        print(f"| {r['config']} | {r['client_ms']:.1f} | {r['server_total_ms']:.1f} | {r['model_ms']:.1f} | "
              f"{r['profile_median_ms']:.1f} | {r['model_over_profile']:.2f} | {r['heldout_accuracy']:.3f} | "
              f"{r['served_accuracy']:.2f} | {mark} |")
    print(f"served front: {', '.join(result['front'])}; cheapest {result['cheapest']} at "
          f"{result['cheapest_ms']:.1f} ms", flush=True)


# -- phase "load" -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One open-loop run of a load: a decider at a budget (None: a static configuration, every budget)."""

    decider: str  # controller | family table | static | oracle
    budget_ms: float | None
    config: str | None

    @property
    def key(self) -> str:
        return f"{self.decider}|{self.budget_ms}|{self.config}"


def load_sequence(num_requests: int, load: float, seed: int, pool: int) -> tuple[np.ndarray, np.ndarray]:
    """The load's request indices (a seeded permutation of the fresh set, repeated as needed) and its
    arrival times at rate 1 (exponential gaps; divide by the rate)."""
    rng = np.random.default_rng([seed, 3, round(load * 1000)])
    index = np.concatenate([rng.permutation(pool) for _ in range(math.ceil(num_requests / pool))])[:num_requests]
    arrivals = np.cumsum(rng.exponential(1.0, num_requests))
    return index, arrivals


def read_runs(path: Path, settings_id: str) -> list[dict[str, Any]]:
    """The run records of ``path`` written with these settings (a torn last line is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("settings_id") == settings_id:
            out.append(record)
    return out


def outcomes_of(record: dict[str, Any]) -> list[Outcome]:
    columns = record["outcomes"]
    n = len(columns["status"])  # runs recorded before a field existed lack its column
    return [Outcome(*values) for values in zip(*(columns.get(f, [None] * n) for f in OUTCOME_FIELDS))]


def cell_stats(outs: Sequence[Outcome], budget_ms: float, warmup: int) -> dict[str, Any]:
    """A cell's unpaired figures on the requests after the warm-up."""
    measured = list(outs[warmup:])
    n = len(measured)
    answered = [o for o in measured if o.status == 200]
    latencies = [o.latency_ms for o in answered]
    within = sum(o.latency_ms <= budget_ms for o in answered)
    correct = sum(o.score for o in measured)
    span = (max(o.done_s for o in measured) - min(o.sched_s for o in measured)) if measured else math.nan
    histogram = Counter(o.knobs for o in answered if o.knobs)
    return {"n": n, "within": within / n if n else math.nan, "within_ci": wilson_interval(within, n),
            "correct": correct, "accuracy": correct / n if n else math.nan, "accuracy_ci": wilson_interval(correct, n),
            **{f"p{q}_ms": percentile(latencies, q) for q in (50, 95, 99)},
            "throughput_rps": len(answered) / span if span > 0 else math.nan,
            "rejected_503": sum(o.status == 503 for o in measured),
            # the server's queue deadline dropped it (docs/serving.md): missed, not an error
            "dropped_504": sum(o.status == 504 for o in measured),
            "errors": sum(o.status not in (200, 503, 504) for o in measured),
            "configs": dict(sorted(histogram.items(), key=lambda kv: -kv[1])),
            "decided_by": dict(Counter(o.decided_by for o in answered if o.decided_by)),
            # the scale the server divided the budgets by, as the replies report it
            "scale_median": median_or_nan([o.scale for o in answered if o.scale is not None]),
            # the share of the budget left the controller read (the met target's margin)
            "margin_median": median_or_nan([o.margin for o in answered if o.margin is not None])}


def paired_stats(ctrl_outs: Sequence[Outcome], other: Sequence[Outcome], budget_ms: float, warmup: int, *,
                 block: int, reps: int, seed: int) -> dict[str, Any]:
    """Controller minus decider on the same requests: correct answers (sum) and the rate within budget."""
    a, b = ctrl_outs[warmup:], other[warmup:]
    if len(a) != len(b):
        msg = f"paired runs differ in length ({len(a)} and {len(b)})"
        raise ValueError(msg)

    def met(o: Outcome) -> float:
        return float(o.status == 200 and o.latency_ms <= budget_ms)

    d_correct = np.array([x.score - y.score for x, y in zip(a, b)])
    d_within = np.array([met(x) - met(y) for x, y in zip(a, b)])
    diff_c = block_bootstrap_ci(d_correct, block=block, reps=reps, seed=seed, total=True)
    diff_w = block_bootstrap_ci(d_within, block=block, reps=reps, seed=seed, total=False)
    return {"diff_correct": diff_c[0], "diff_correct_ci": diff_c[1:], "diff_within": diff_w[0],
            "diff_within_ci": diff_w[1:]}


def run_record(spec: RunSpec, load: float, rate: float, outs: list[Outcome], budgets: list[float], warmup: int,
               settings_id: str, extra: dict[str, Any], steady_min_excess: float) -> dict[str, Any]:
    arrivals_end = max(o.sched_s for o in outs)
    tenths = in_system_tenths([o.sched_s for o in outs], [o.done_s for o in outs], 0.0, arrivals_end)
    judged = budgets if spec.budget_ms is None else [spec.budget_ms]
    cells = {str(b): cell_stats(outs, b, warmup) for b in judged}
    return {"settings_id": settings_id, "load": load, "rate_rps": rate, **asdict(spec),
            "in_system_tenths": tenths, "steady": is_steady(tenths, min_excess=steady_min_excess),
            "wall_s": max(o.done_s for o in outs), "cells": cells, **extra,
            "outcomes": {f: [getattr(o, f) for o in outs] for f in OUTCOME_FIELDS}}


def calibrate(server: Server, dataset: str, requests: list[BenchRequest], middle_ms: float, seed: int,
              warmup_n: int, capacity_n: int) -> dict[str, Any]:
    """Warm up (the controller at the middle budget), read the scale and reserve, measure the capacity."""
    order = np.random.default_rng([seed, 4]).permutation(len(requests))
    pick = [requests[int(i)] for i in np.resize(order, warmup_n + capacity_n)]
    run_back_to_back(server.port, dataset, [(r, middle_ms, None) for r in pick[:warmup_n]])
    about = server.about()
    outs, wall = run_back_to_back(server.port, dataset, [(r, middle_ms, None) for r in pick[warmup_n:]])
    answered = sum(o.status == 200 for o in outs)
    return {"latency_scale": float(about["latency_scale"]), "reserve_ms": float(about["overhead_reserve_ms"]),
            "latency_scale_source": about.get("latency_scale_source"), "capacity_rps": answered / wall,
            "capacity_requests": capacity_n, "middle_budget_ms": middle_ms}


def budgets_of(args: argparse.Namespace, front: dict[str, Any]) -> list[float]:
    if args.budgets_ms:
        return sorted(float(b) for b in args.budgets_ms.split(","))
    return [round(float(m) * front["cheapest_ms"], 1) for m in args.budget_multiples.split(",")]


def knobs_function(spec: RunSpec, tables: RunTables, scale: float, reserve_ms: float,
                   families: set[str]) -> Callable[[BenchRequest], Config | None]:
    """The knobs a run's requests fix (None: the controller decides)."""
    if spec.decider in CONTROLLERS:
        return lambda request: None
    if spec.decider == "oracle":
        return lambda request: oracle_knobs(request, spec.budget_ms or math.inf)
    if spec.decider == "family table":
        assert spec.budget_ms is not None
        profile_budget = (spec.budget_ms - reserve_ms) / scale  # as the server converts a budget
        by_family = {f: tuple(int(v) for v in tables.by_family.lookup(profile_budget, f)) for f in families}
        return lambda request: by_family[request.family]
    fixed = parse_config(spec.config or "")
    return lambda request: fixed


def phase_load(server: Server, args: argparse.Namespace, dataset: str, requests: list[BenchRequest],
               front: dict[str, Any], tables: RunTables, settings_id: str, calibration: dict[str, Any]) -> None:
    budgets = calibration["budgets_ms"]
    loads = [float(v) for v in args.loads.split(",")]
    variant = variant_of(args)
    picks = calibration["p95_picks"]
    statics = list(dict.fromkeys([*front["front"], *picks.values()]))
    oracle = False
    if args.oracle:
        try:
            oracle_knobs(requests[0], budgets[0])
            oracle = True
        except NotImplementedError as exc:
            print(f"oracle skipped: {exc}", flush=True)
    done = {(r["load"], RunSpec(r["decider"], r["budget_ms"], r["config"]).key) for r in read_runs(args.out,
                                                                                                    settings_id)}
    plan: list[tuple[float, RunSpec]] = []
    for load in loads:
        if variant != "controller":  # only the controller depends on the server's options
            specs = [RunSpec(variant, b, None) for b in budgets]
        else:
            specs = [RunSpec("controller", b, None) for b in budgets]
            specs += [RunSpec("family table", b, None) for b in budgets]
            specs += [RunSpec("static", None, c) for c in statics]
            specs += [RunSpec("oracle", b, None) for b in budgets] if oracle else []
        rng = np.random.default_rng([args.seed, 5, round(load * 1000)])
        plan += [(load, specs[int(i)]) for i in rng.permutation(len(specs)) if (load, specs[int(i)].key) not in done]
    capacity = calibration["capacity_rps"]
    seconds = sum(args.requests / (load * capacity) for load, _ in plan)
    print(f"\nphase load: budgets {budgets} ms, loads {loads} of {capacity:.2f} requests/s, {args.requests} requests "
          f"per run ({args.warmup} warm-up); {len(plan)} runs to go ({len(done)} done): about {seconds / 3600:.2f} h",
          flush=True)
    scale, reserve = calibration["latency_scale"], calibration["reserve_ms"]
    for k, (load, spec) in enumerate(plan):
        if spec.decider in CONTROLLERS:
            server.restart()
        index, unit_arrivals = load_sequence(args.requests, load, args.seed, len(requests))
        rate = load * capacity
        sequence = [requests[int(i)] for i in index]
        knobs_of = knobs_function(spec, tables, scale, reserve, {r.family for r in requests})
        started = time.perf_counter()
        outs = run_open_loop(server.port, dataset, sequence, unit_arrivals / rate, knobs_of, spec.budget_ms)
        about = server.about()
        extra = {"scale_after": about.get("latency_scale"), "reserve_after": about.get("overhead_reserve_ms")}
        record = run_record(spec, load, rate, outs, budgets, args.warmup, settings_id, extra, args.steady_min_excess)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        label = spec.decider if spec.config is None else f"static {spec.config}"
        at = "" if spec.budget_ms is None else f" at {spec.budget_ms} ms"
        first = next(iter(record["cells"].values()))
        print(f"[{k + 1}/{len(plan)}] load {load} {label}{at}: {time.perf_counter() - started:.0f} s, "
              f"p50 {first['p50_ms']:.0f} ms, 503s {first['rejected_503']}, in system by tenth "
              f"{' '.join(f'{v:.1f}' for v in record['in_system_tenths'])}"
              f"{'' if record['steady'] else '  NOT STEADY'}; within budget "
              + ", ".join(f"{float(b):g}: {c['within']:.2f}" for b, c in record["cells"].items()), flush=True)


# -- cells, tables, plot, targets -------------------------------------------------------------------------------


#: the decider name of controller runs on a server that gives the controller each request's own budget
OWN_BUDGET = "controller (own budget)"
#: the decider name of controller runs on a server without the met target's margin (``--met-target 0``)
NO_MARGIN = "controller (no margin)"
CONTROLLERS = ("controller", NO_MARGIN, OWN_BUDGET)
#: the server options of each controller variant
SERVER_FLAGS = {"controller": (), NO_MARGIN: ("--met-target", "0"),
                OWN_BUDGET: ("--no-queue-aware", "--met-target", "0")}


def build_cells(records: list[dict[str, Any]], calibration: dict[str, Any], front: dict[str, Any],
                args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (load, budget, decider) cell with its unpaired figures and the paired difference to the
    controller's run at the same load and budget."""
    budgets, picks = calibration["budgets_ms"], calibration["p95_picks"]
    by_key: dict[tuple[float, str, float | None, str | None], dict[str, Any]] = {}
    for r in records:
        by_key[(r["load"], r["decider"], r["budget_ms"], r["config"])] = r
    cells = []
    for load in sorted({r["load"] for r in records}):
        order = {c: i for i, c in enumerate(front["front"])}  # the front's order: fastest first
        statics = sorted({c for (ld, d, _, c) in by_key if ld == load and d == "static"},
                         key=lambda c: (order.get(c, len(order)), c))
        for budget in budgets:
            ctrl_run = by_key.get((load, "controller", budget, None))
            ctrl_outs = outcomes_of(ctrl_run) if ctrl_run else None
            rows: list[tuple[str, str | None, dict[str, Any] | None]] = [
                ("controller", None, ctrl_run),
                # the same controller on servers without the margin, and without the queue cap either
                (NO_MARGIN, None, by_key.get((load, NO_MARGIN, budget, None))),
                (OWN_BUDGET, None, by_key.get((load, OWN_BUDGET, budget, None))),
                ("family table", None, by_key.get((load, "family table", budget, None))),
                ("oracle", None, by_key.get((load, "oracle", budget, None))),
                ("p95 table", picks[str(budget)], by_key.get((load, "static", None, picks[str(budget)])))]
            rows += [(f"static {c}", c, by_key.get((load, "static", None, c))) for c in statics]
            for name, config, run in rows:
                if run is None:
                    continue
                cell = {"load": load, "rate_rps": run["rate_rps"], "budget_ms": budget,
                        "profile_budget_ms": (budget - calibration["reserve_ms"]) / calibration["latency_scale"],
                        "decider": name, "config": config, "on_front": config in front["front"],
                        "in_system_tenths": run["in_system_tenths"], "steady": run["steady"],
                        **run["cells"][str(budget)]}
                if ctrl_outs is not None and name != "controller":
                    cell.update(paired_stats(ctrl_outs, outcomes_of(run), budget, args.warmup, block=args.block,
                                             reps=args.bootstrap, seed=args.seed))
                cells.append(cell)
    return cells


def _ci(lo_hi: Sequence[float], fmt: str) -> str:
    return f"[{format(lo_hi[0], fmt)}, {format(lo_hi[1], fmt)}]"


def markdown_tables(cells: list[dict[str, Any]]) -> str:
    """One markdown table per load, for the docs."""
    out = []
    for load in sorted({c["load"] for c in cells}):
        part = [c for c in cells if c["load"] == load]
        out.append(f"\nload {load} of capacity ({part[0]['rate_rps']:.2f} requests/s)\n")
        out.append("| budget ms | decider | within budget [95% CI] | correct of N [95% CI] | controller - decider: "
                   "correct [95% CI] | controller - decider: within [95% CI] | 503s | p50 / p99 ms | steady |")
        out.append("|---:|---|---|---|---|---|---:|---|---|")
        for c in part:
            n = c["n"]
            name = f"p95 table ({c['config']})" if c["decider"] == "p95 table" else c["decider"]
            name = f"**{name}**" if c["decider"] == "controller" else name
            correct = f"{c['correct']:.0f} of {n} [{c['accuracy_ci'][0] * n:.0f}, {c['accuracy_ci'][1] * n:.0f}]"
            paired_c = (f"{c['diff_correct']:+.0f} {_ci(c['diff_correct_ci'], '+.0f')}" if "diff_correct" in c else "")
            paired_w = (f"{c['diff_within']:+.3f} {_ci(c['diff_within_ci'], '+.3f')}" if "diff_within" in c else "")
            out.append(f"| {c['budget_ms']:g} | {name} | {c['within']:.3f} {_ci(c['within_ci'], '.3f')} | {correct} | "
                       f"{paired_c} | {paired_w} | {c['rejected_503']} | {c['p50_ms']:.0f} / {c['p99_ms']:.0f} | "
                       f"{'yes' if c['steady'] else 'NO'} |")
    return "\n".join(out)


def check_targets(cells: list[dict[str, Any]], cheapest_ms: float, *, min_multiple: float = 2.0,
                  max_load: float = 0.7, within_target: float = 0.95) -> tuple[bool, list[str]]:
    """The targets (module docstring) on the cells with budget >= ``min_multiple`` x the cheapest served
    median and load <= ``max_load``; (all met, one line per check)."""
    region = [c for c in cells if c["budget_ms"] >= min_multiple * cheapest_ms - 0.1 and c["load"] <= max_load + 1e-9]
    lines, ok = [], True
    if not region:
        return False, [f"no cell with budget >= {min_multiple:g} x {cheapest_ms:.1f} ms and load <= {max_load:g}"]
    for c in (c for c in region if c["decider"] == "controller"):
        good = c["within"] >= within_target
        ok &= good
        # what the static configurations reached at the same load and budget: the bar any decider faces
        best = max((s for s in region if s["load"] == c["load"] and s["budget_ms"] == c["budget_ms"]
                    and s["decider"].startswith("static")), key=lambda s: s["within"], default=None)
        reach = "" if good or best is None else (f"; the best static configuration, {best['config']}, "
                                                 f"{best['within']:.3f}")
        lines.append(f"{'PASS' if good else 'FAIL'} load {c['load']:g}, budget {c['budget_ms']:g} ms: controller "
                     f"within budget {c['within']:.3f} (target >= {within_target}){reach}")
    statics = [c for c in region if c["decider"].startswith("static") and "diff_correct" in c]
    for load, config in sorted({(c["load"], c["config"]) for c in statics}):
        ctrl_within = {c["budget_ms"]: c["within"] for c in region
                       if c["load"] == load and c["decider"] == "controller"}
        rivals = [c for c in statics if c["load"] == load and c["config"] == config
                  and c["within"] >= ctrl_within.get(c["budget_ms"], math.inf)]
        if not rivals:
            lines.append(f"  -  load {load:g}, static {config}: meets no budget as often as the controller")
            continue
        above = [c for c in rivals if c["diff_correct"] > 0 and c["diff_correct_ci"][0] > 0]
        below = [c for c in rivals if c["diff_correct_ci"][1] < 0]
        good = bool(above) and not below
        ok &= good
        detail = ", ".join(f"{c['budget_ms']:g} ms: {c['diff_correct']:+.0f} {_ci(c['diff_correct_ci'], '+.0f')}"
                           for c in rivals)
        lines.append(f"{'PASS' if good else 'FAIL'} load {load:g}, static {config} (within budget as often at "
                     f"{len(rivals)} budgets): controller - static correct answers {detail}")
    return ok, lines


def plot(cells: list[dict[str, Any]], path: Path, capacity: float) -> None:
    """Within-budget rate and accuracy against load, one column per budget; error bars: the 95 % intervals."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    budgets = sorted({c["budget_ms"] for c in cells})
    fig = Figure(figsize=(4.2 * len(budgets), 7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(budgets), squeeze=False, sharex=True)
    deciders = list(dict.fromkeys(c["decider"] for c in cells))  # the tables' order: controller first
    loads = sorted({c["load"] for c in cells})
    dodge = 0.15 * min((b - a for a, b in zip(loads, loads[1:])), default=0.1) / max(1, len(deciders))
    for j, budget in enumerate(budgets):
        for i, decider in enumerate(deciders):
            sel = sorted((c for c in cells if c["budget_ms"] == budget and c["decider"] == decider),
                         key=lambda c: c["load"])
            if not sel:
                continue
            bold = decider == "controller"
            style = ({"linewidth": 3, "color": "black", "zorder": 5} if bold
                     else {"linewidth": 1.2, "linestyle": ":" if decider == "family table" else "--"})
            x = [c["load"] + (i - (len(deciders) - 1) / 2) * dodge for c in sel]  # error bars side by side
            for row, (key, ci) in enumerate((("within", "within_ci"), ("accuracy", "accuracy_ci"))):
                y = [c[key] for c in sel]
                # clamped: a Wilson bound can sit a rounding error past the value (0 of n)
                err = [[max(0.0, v - c[ci][0]) for v, c in zip(y, sel)],
                       [max(0.0, c[ci][1] - v) for v, c in zip(y, sel)]]
                axes[row][j].errorbar(x, y, yerr=err, marker="o", capsize=3, label=decider, **style)
        axes[0][j].axhline(0.95, color="grey", linewidth=0.8)
        axes[0][j].set_title(f"budget {budget:g} ms")
        axes[1][j].set_xlabel(f"load (fraction of {capacity:.1f} requests/s)")
        for row in (0, 1):
            axes[row][j].grid(alpha=0.3)
    axes[0][0].set_ylabel("within budget (503 = missed)")
    axes[1][0].set_ylabel("accuracy (503 = wrong)")
    axes[0][-1].legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def report(args: argparse.Namespace, settings_id: str, front: dict[str, Any], calibration: dict[str, Any]) -> bool:
    records = read_runs(args.out, settings_id)
    if not records:
        print(f"no load runs with these settings in {args.out}")
        return False
    cells = build_cells(records, calibration, front, args)
    print(markdown_tables(cells))
    for c in cells:
        if c["decider"] in ("controller", "family table"):
            shown = ", ".join(f"{k}: {v}" for k, v in list(c["configs"].items())[:6])
            print(f"load {c['load']:g}, {c['budget_ms']:g} ms, {c['decider']}: {shown}"
                  f"{'' if len(c['configs']) <= 6 else ', ...'}; decided by {c['decided_by']}"
                  + ("" if math.isnan(c.get("margin_median", math.nan)) else
                     f"; budget margin median {c['margin_median']:.2f}"))
    unsteady = sorted({(c["load"], c["decider"], c["config"] or c["budget_ms"]) for c in cells if not c["steady"]})
    if unsteady:
        print(f"not steady (the last tenth of the run held more than twice the second's requests): {unsteady}")
    write_json(path_with(args.out, ".cells.json"), cells)
    plot(cells, args.plot, calibration["capacity_rps"])
    ok, lines = check_targets(cells, front["cheapest_ms"])
    print(f"\ntargets (budget >= 2 x {front['cheapest_ms']:.1f} ms, load <= 0.7):")
    print("\n".join(lines))
    print(f"targets {'MET' if ok else 'NOT MET'}; cells in {path_with(args.out, '.cells.json')}, plot {args.plot}")
    return ok


# -- files, settings, main --------------------------------------------------------------------------------------


def path_with(out: Path, suffix: str) -> Path:
    return out.with_name(out.stem + suffix)


def write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)


def settings_of(args: argparse.Namespace, *names: str, **extra: Any) -> tuple[dict[str, Any], str]:
    """The settings a saved result depends on, and their id (results of other settings are ignored)."""
    settings = {**{n: getattr(args, n) for n in names}, **extra}
    return settings, hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def load_settings_of(args: argparse.Namespace, front: dict[str, Any]) -> tuple[dict[str, Any], str]:
    # a front measured again (other budgets, other static configurations) starts the load cells afresh
    return settings_of(args, "run_id", "bench_seed", "bench_samples", "requests", "warmup", "max_queue", "seed",
                       "budgets_ms", "budget_multiples", front=front["front"], cheapest_ms=front["cheapest_ms"])


def variant_of(args: argparse.Namespace) -> str:
    """The controller variant a run of these options measures (``controller`` runs every decider)."""
    if args.no_queue_aware and args.no_margin:
        msg = "--no-queue-aware and --no-margin are two runs: give one of them"
        raise SystemExit(msg)
    return OWN_BUDGET if args.no_queue_aware else NO_MARGIN if args.no_margin else "controller"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--phase", choices=("front", "load", "all", "report"), default="all")
    parser.add_argument("--workspace", type=Path, default=CACHE / "serve-ws")
    parser.add_argument("--run-id", default="bench-serve")
    parser.add_argument("--bench-seed", type=int, default=4242, help="seed of the fresh testbed set")
    parser.add_argument("--bench-samples", type=int, default=1300, help="samples of the fresh testbed set")
    parser.add_argument("--front-requests", type=int, default=40, help="requests per configuration, phase front")
    parser.add_argument("--budget-multiples", default="1.5,2,3,4",
                        help="budgets: multiples of the cheapest configuration's served median")
    parser.add_argument("--budgets-ms", default=None, help="explicit budgets in served ms (comma-separated)")
    parser.add_argument("--loads", default="0.25,0.5,0.7,1.0", help="arrival rates, fractions of the capacity")
    parser.add_argument("--requests", type=int, default=1100, help="requests per run (warm-up included)")
    parser.add_argument("--warmup", type=int, default=100, help="first requests of each run left out of the cells")
    parser.add_argument("--calibration-warmup", type=int, default=40, help="requests before the scale is read")
    parser.add_argument("--capacity-requests", type=int, default=60, help="back-to-back requests for the capacity")
    parser.add_argument("--max-queue", type=int, default=16, help="the server's --max-queue")
    parser.add_argument("--block", type=int, default=50, help="block length of the paired bootstrap (requests)")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap replicates")
    parser.add_argument("--steady-min-excess", type=float, default=1.0,
                        help="a run is not steady only if its last tenth also holds this many more requests")
    parser.add_argument("--oracle", action="store_true", help="the oracle decider (a hook: skipped)")
    parser.add_argument("--no-queue-aware", action="store_true",
                        help=f"serve with --no-queue-aware --met-target 0 and run only the controller, recorded as "
                             f"{OWN_BUDGET!r}")
    parser.add_argument("--no-margin", action="store_true",
                        help=f"serve with --met-target 0 and run only the controller, recorded as {NO_MARGIN!r}")
    parser.add_argument("--seed", type=int, default=0, help="request orders, arrivals, bootstrap")
    parser.add_argument("--out", type=Path, default=CACHE / "bench_serve.jsonl")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "serve_bench.png")
    args = parser.parse_args(argv)
    if args.warmup >= args.requests:
        parser.error("--warmup must be smaller than --requests")
    return args


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops the benchmark as Ctrl-C does: the server subprocess is stopped, finished runs kept."""
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    front_settings, front_id = settings_of(args, "run_id", "bench_seed", "bench_samples", "front_requests")
    front_path, calibration_path = path_with(args.out, ".front.json"), path_with(args.out, ".calibration.json")
    saved_front = json.loads(front_path.read_text()) if front_path.exists() else None
    front = saved_front if saved_front and saved_front.get("settings_id") == front_id else None
    calibrations = json.loads(calibration_path.read_text()) if calibration_path.exists() else {}
    if args.phase == "report":
        load_id = load_settings_of(args, front)[1] if front is not None else None
        if front is None or load_id not in calibrations:
            msg = f"nothing to report: no front or calibration with these settings next to {args.out}"
            raise SystemExit(msg)
        print_front(front)
        report(args, load_id, front, calibrations[load_id])
        return
    if args.phase == "load" and front is None:
        msg = f"no front with these settings in {front_path}: run --phase front (or all) first"
        raise SystemExit(msg)

    signal.signal(signal.SIGTERM, _interrupt)
    os.environ.setdefault("CTRL_WORKSPACE", str(args.workspace))
    prepare_workspace(args.workspace, args.run_id)
    dataset, requests = bench_requests(CACHE / f"bench-testbed-seed{args.bench_seed}-n{args.bench_samples}",
                                       args.bench_samples, args.bench_seed)
    families = Counter(r.family for r in requests)
    print(f"fresh set: {len(requests)} requests (seed {args.bench_seed}), families {dict(families)}", flush=True)
    tables = run_tables(args.workspace, args.run_id)
    profile = profile_by_config(args.workspace)
    server = Server(args.workspace, args.run_id, path_with(args.out, ".server.log"), args.max_queue,
                    SERVER_FLAGS[variant_of(args)])
    try:
        # warm the client's and the server's paths at the server's default budget
        pool = np.random.default_rng([args.seed, 6]).permutation(len(requests))[:10]
        outs, _ = run_back_to_back(server.port, dataset, [(requests[int(i)], None, None) for i in pool])
        per_request_s = statistics.median(o.latency_ms for o in outs) / 1000.0
        print(f"server on port {server.port}: warm-up median {per_request_s * 1000:.0f} ms per request", flush=True)
        if args.phase == "all" and front is None:
            # before the front and the capacity are known: one request at a time is the capacity, and a
            # front of about 4 configurations plus one p95 pick off it
            num_budgets = len((args.budgets_ms or args.budget_multiples).split(","))
            runs = 2 * num_budgets + 5
            load_s = sum(runs * args.requests * per_request_s / float(v) for v in args.loads.split(","))
            print(f"whole run: about {(27 * args.front_requests * per_request_s + load_s) / 3600:.1f} h "
                  f"({runs} runs per load guessed; each phase prints its own estimate)", flush=True)
        if args.phase == "front" or front is None:
            front = phase_front(server, dataset, requests, args.front_requests, args.seed, profile,
                                tables.reference_ms, per_request_s)
            front.update({"settings_id": front_id, "settings": front_settings, "dataset": dataset,
                          "server_after": server.about()})
            write_json(front_path, front)
            print_front(front)
            print(f"front saved to {front_path}")
        else:
            print(f"front reused from {front_path}")
            print_front(front)
        if args.phase == "front":
            return
        load_settings, load_id = load_settings_of(args, front)
        calibration = calibrations.get(load_id)
        budgets = budgets_of(args, front)
        middle = float(statistics.median(budgets))
        if calibration is None:
            print(f"\ncalibration: {args.calibration_warmup} warm-up and {args.capacity_requests} capacity requests, "
                  f"about {(args.calibration_warmup + args.capacity_requests) * per_request_s:.0f} s", flush=True)
            calibration = calibrate(server, dataset, requests, middle, args.seed, args.calibration_warmup,
                                    args.capacity_requests)
            scale, reserve = calibration["latency_scale"], calibration["reserve_ms"]
            calibration["budgets_ms"] = budgets
            calibration["p95_picks"] = {str(b): config_name(tables.p95.lookup((b - reserve) / scale)) for b in budgets}
            calibration["settings"] = load_settings
            calibrations[load_id] = calibration
            write_json(calibration_path, calibrations)
        else:
            calibrate(server, dataset, requests, middle, args.seed, args.calibration_warmup, 0)
            print(f"\ncalibration reused from {calibration_path} (the server now reads scale "
                  f"{server.about()['latency_scale']:.2f})")
        print(f"latency scale {calibration['latency_scale']:.3f}, reserve {calibration['reserve_ms']:.1f} ms (held "
              f"fixed); capacity {calibration['capacity_rps']:.2f} requests/s (controller at {middle:g} ms); p95 table "
              f"picks {calibration['p95_picks']}", flush=True)
        phase_load(server, args, dataset, requests, front, tables, load_id, calibration)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the finished runs are in {args.out}; the same command resumes", flush=True)
        raise SystemExit(130) from None
    finally:
        server.stop()
    report(args, load_id, front, calibration)


if __name__ == "__main__":
    main()
