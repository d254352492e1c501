"""``ctrl simulate``: every decider of :class:`simulate.config.SimulateConfig` on every workload cell, the
figures per cell (:func:`summarize`), the ``simulations`` table and the plot.

A cell is one arrival rate and one budget mix. Its requests (arrival times, samples, budgets) are drawn
once, seeded, and every decider serves the same ones: the comparisons between deciders are paired.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.catalog import build_catalog
from pipeline.errors import CtrlError
from pipeline.knobs import Config
from pipeline.process_pool import forkserver_context, kill_workers
from pipeline.schema import SIMULATIONS
from pipeline.workspace import Workspace, atomic_path
from serve.arrivals import ArrivalProcess, ArrivalSpecError, arrival_times, read_trace
from serve.config import available_cpus
from serve.deciders import OfflineDecider, find_controller, load_decider
from simulate.calibration import Overheads, calibrate
from simulate.config import PARALLEL_MIN_REQUESTS, STATIC_REQUEST_WEIGHT, SimulateConfig, mix_name
from simulate.profile import SimProfile, load_profile
from simulate.simulation import (
    ServerOptions,
    SimRequest,
    Simulation,
    Workload,
    capacity_rps,
    cheapest_config,
    without_memo,
)
from trainer.config import OfflineTrainConfig
from trainer.runs import RunDir

#: where a run's simulations are written (the ``simulations`` view reads them)
SIMULATIONS_DIR = "simulations"


def config_name(config: Config) -> str:
    return "/".join(str(v) for v in config)


@dataclass(frozen=True)
class Decider:
    """One ``--deciders`` entry: the controller (``static`` None) or a configuration fixed per request."""

    name: str
    static: Config | None


def expand_deciders(specs: tuple[str, ...], profile: SimProfile, decider: OfflineDecider) -> list[Decider]:
    """``--deciders`` as deciders: ``front`` is every front configuration as a static, ``cheapest`` the
    server's cheapest rule's configuration; a configuration the profile lacks is a one-line error."""
    out: dict[str, Decider] = {}
    for spec in specs:
        if spec == "controller":
            out[spec] = Decider("controller", None)
        elif spec == "cheapest":
            out[spec] = Decider("cheapest", cheapest_config(decider))
        elif spec == "front":
            for c in profile.front:
                name = f"static:{config_name(c)}"
                out.setdefault(name, Decider(name, c))
        else:
            config = tuple(int(v) for v in spec.partition(":")[2].split("/"))
            profile.column(config)
            out.setdefault(spec, Decider(spec, config))
    return list(out.values())


def trace_times(path: Path) -> np.ndarray:
    """A trace file's times, checked: a one-line error naming the file for a negative time (the rest is
    :func:`serve.arrivals.read_trace`'s: decreasing times, too few)."""
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        try:
            negative = bool(text) and float(text) < 0
        except ValueError:
            negative = False
        if negative:
            msg = f"{path}:{number}: {text!r} is a negative time; arrival times are seconds from the trace's start"
            raise CtrlError(msg)
    try:
        return read_trace(path)
    except ArrivalSpecError as exc:
        raise CtrlError(str(exc)) from None


def make_workload(config: SimulateConfig, rate_rps: float, profile: SimProfile, seed: int) -> Workload:
    """The cell's requests at ``rate_rps``: ``--requests`` of them or ``--duration`` seconds' worth."""
    rng = np.random.default_rng(seed)
    process = ArrivalProcess("file", path=config.trace) if config.trace is not None else ArrivalProcess("poisson")
    if config.duration is not None:
        count = max(2, int(math.ceil(rate_rps * config.duration * 1.3)) + 20)
    else:
        count = int(config.requests)
    try:
        times = arrival_times(process, count, rate_rps, rng)
    except ArrivalSpecError as exc:
        raise CtrlError(str(exc)) from None
    if config.duration is not None:
        times = times[times <= config.duration]
        if len(times) == 0:
            msg = f"--duration {config.duration:g}: no request arrives in it at {rate_rps:.3g} requests/s"
            raise CtrlError(msg)
    samples = rng.integers(len(profile), size=len(times))
    budgets, shares = zip(*config.budgets, strict=True)
    chosen = rng.choice(len(budgets), size=len(times), p=np.asarray(shares) / sum(shares))
    return Workload(np.asarray(times, dtype=float), samples, np.asarray(budgets, dtype=float)[chosen])


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a share."""
    if n == 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(requests: list[SimRequest], workload: Workload) -> dict[str, Any]:
    """A cell's figures: within-budget share (Wilson interval), accuracy of the answered, right answers
    within budget (share and per second: goodput), client latency quantiles of the answered, the 503 and
    504 shares, the cheapest rule's share."""
    n = len(requests)
    met = sum(r.met for r in requests)
    answered = [r for r in requests if r.status == "ok"]
    right = sum(r.score for r in requests if r.met)
    latencies = np.asarray([r.latency_ms for r in answered], dtype=float)
    quantiles = np.percentile(latencies, [50, 95, 99]) if latencies.size else [math.nan] * 3
    low, high = wilson(met, n)
    duration = workload.duration_s
    return {
        "requests": n, "within_budget": met / n, "within_budget_low": low, "within_budget_high": high,
        "accuracy": float(np.mean([r.score for r in answered])) if answered else math.nan,
        "right_within_budget": right / n, "goodput_rps": right / duration if duration > 0 else math.nan,
        "latency_p50_ms": float(quantiles[0]), "latency_p95_ms": float(quantiles[1]),
        "latency_p99_ms": float(quantiles[2]),
        "rejected_503": sum(r.status in ("full", "refused") for r in requests) / n,
        "dropped_504": sum(r.status == "dropped" for r in requests) / n,
        "cheapest_share": sum(r.decided_by == "cheapest" for r in requests) / n,
    }


def paired_difference(a: list[SimRequest], b: list[SimRequest]) -> tuple[float, float, float]:
    """``a`` minus ``b`` in right answers within budget per request on the same requests: the mean and a
    normal 95 % interval (the requests' outcomes are correlated through the queue, so it is narrow)."""
    diff = np.asarray([(x.score if x.met else 0.0) - (y.score if y.met else 0.0) for x, y in zip(a, b, strict=True)])
    mean = float(diff.mean())
    half = 1.96 * float(diff.std(ddof=1)) / math.sqrt(len(diff)) if len(diff) > 1 else math.nan
    return mean, mean - half, mean + half


@dataclass
class CellResult:
    """One decider on one cell at a number of replicas."""

    decider: Decider
    rate_rps: float
    load: float
    budget_mix: str
    replicas: int
    figures: dict[str, Any]
    requests: list[SimRequest]
    meets_target: bool | None = None


@dataclass
class SimulationResult:
    simulation_id: str
    run_id: str
    profile: SimProfile
    overheads: Overheads
    capacity_rps: float
    cells: list[CellResult]
    target: float | None
    path: Path | None = None


def load_inputs(config: SimulateConfig) -> tuple[Workspace, RunDir, SimProfile, OfflineDecider, Overheads]:
    """The run, its profile, its controller and the overheads ``config`` simulates with."""
    workspace = Workspace(config.workspace)
    # "latest" is the latest offline run: an online run cannot be simulated (below)
    run = RunDir.resolve(workspace, config.run, ("offline",))
    if run.phase == "online":
        msg = (f"run {run.run_id} is an online run: its stage 2 reads the latency token of the model's own blocks, "
               "which a simulation without the model has not got\nHint: simulate the offline run it started from.")
        raise CtrlError(msg)
    fingerprint = OfflineTrainConfig.from_json(run.read_config()).model_fingerprint
    profile = load_profile(workspace, run, samples=config.samples)
    decider = load_decider(find_controller(workspace, str(run.path)), fingerprint)
    if not isinstance(decider, OfflineDecider):
        msg = f"run {run.run_id}: its controller is not an offline one"
        raise CtrlError(msg)
    if not decider.reference_latency_ms:
        msg = (f"run {run.run_id}: its controller records no reference latency per configuration (trained without "
               "a table fallback), so the server's budget planner has nothing to plan with")
        raise CtrlError(msg)
    # the scale multiplies these samples' recorded latencies: it is read against their medians
    overheads = (calibrate(config.calibrate_from, profile.median_latency_ms(), fingerprint, profile.log_spread(),
                           sample_latency_ms=profile.sample_latency_ms)
                 if config.calibrate_from is not None else Overheads())
    if config.latency_scale is not None:  # one scale for every configuration
        overheads = replace(overheads, latency_scale=float(config.latency_scale), scale_by_config={})
    if config.service_noise is not None:
        overheads = replace(overheads, noise_sigma=float(config.service_noise))
    if config.client_ms:
        overheads = replace(overheads, client_ms=float(config.client_ms))
    return workspace, run, profile, decider, overheads


@dataclass(frozen=True)
class CellTask:
    """One decider on one workload cell: what a worker is handed."""

    rate_rps: float
    workload: Workload
    decider: Decider


class CellRunner:
    """Simulates :class:`CellTask` cells with one run's profile, controller and overheads (in this process, or
    in a worker handed a copy of them: the same inputs give the same results)."""

    def __init__(self, config: SimulateConfig, profile: SimProfile, decider: OfflineDecider,
                 overheads: Overheads) -> None:
        self.config, self.profile, self.decider, self.overheads = config, profile, decider, overheads
        self.capacity = capacity_rps(profile, overheads)
        self.options = ServerOptions(config.max_queue, config.queue_deadline, config.met_target or None)

    def __call__(self, task: CellTask) -> CellResult:
        config = self.config

        def simulated(replicas: int) -> CellResult:
            sim = Simulation(self.profile, self.decider, self.overheads, replicas=replicas, balancer=config.balancer,
                             options=self.options, seed=config.seed)
            requests = sim.run(task.workload, task.decider.static)
            for request in requests:  # a sweep would hold one plan per request simulated
                request.plan = None
            return CellResult(task.decider, task.rate_rps, task.rate_rps / self.capacity, mix_name(config.budgets),
                              replicas, summarize(requests, task.workload), requests)

        if config.target is None:
            return simulated(config.replicas)
        return fewest_replicas(simulated, config.target, config.max_replicas)


def worker_count(config: SimulateConfig, tasks: list[CellTask]) -> int:
    """The worker processes ``--jobs`` asks for, resolved (1: none, the cells run in this process)."""
    if config.jobs:
        return max(1, min(int(config.jobs), len(tasks)))
    work = sum(len(t.workload) * (1.0 if t.decider.static is None else STATIC_REQUEST_WEIGHT) for t in tasks)
    if len(tasks) < 2 or work < PARALLEL_MIN_REQUESTS:
        return 1
    return max(1, min(available_cpus(), len(tasks)))


_WORKER: CellRunner | None = None


def _start_worker(config: SimulateConfig, profile: SimProfile, deployed: Any, controller_run: str,
                  overheads: Overheads) -> None:
    """A worker process's start: one thread (the workers share the CPUs) and its copy of the inputs (a decider
    of its own round the deployed controller, as every simulation makes for each replica)."""
    import torch

    global _WORKER
    torch.set_num_threads(1)
    _WORKER = CellRunner(config, profile, OfflineDecider(deployed, controller_run), overheads)


def _run_in_worker(task: CellTask) -> CellResult:
    assert _WORKER is not None, "a worker runs cells only after _start_worker"
    return _WORKER(task)


def run_cells(runner: CellRunner, tasks: list[CellTask], jobs: int,
              progress: Callable[[int, int], None] | None = None) -> list[CellResult]:
    """Every task's cell, in the tasks' order: here (``jobs`` 1) or in ``jobs`` worker processes, each handed a
    copy of the runner's inputs."""
    total = len(tasks)
    if jobs <= 1:
        cells = []
        for task in tasks:
            cells.append(runner(task))
            if progress is not None:
                progress(len(cells), total)
        return cells
    inputs = (runner.config, runner.profile, without_memo(runner.decider.deployed), runner.decider.controller_run,
              runner.overheads)
    # each worker forks from a server that has imported the simulation (torch included) once
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=forkserver_context("simulate.run"),
                               initializer=_start_worker, initargs=inputs)
    try:
        futures = [pool.submit(_run_in_worker, task) for task in tasks]
        for done, _ in enumerate(as_completed(futures), start=1):
            if progress is not None:
                progress(done, total)
        return [f.result() for f in futures]
    except BrokenProcessPool:
        msg = (f"--jobs {jobs}: a worker process died (killed, or out of memory)\n"
               "Hint: rerun with --jobs 1 to simulate in this process.")
        raise CtrlError(msg) from None
    except BaseException:  # interrupted, or a cell's error: the other cells' work is not wanted
        kill_workers(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def simulate(config: SimulateConfig, progress: Callable[[int, int], None] | None = None) -> SimulationResult:
    """Run ``config``'s simulation and write its rows to the run's ``simulations/`` (the ``simulations``
    view); returns every cell."""
    if config.trace is not None:
        trace_times(config.trace)  # a bad trace is refused before anything loads
    workspace, run, profile, decider, overheads = load_inputs(config)
    runner = CellRunner(config, profile, decider, overheads)
    rates = list(config.rates) if config.rates else [load * runner.capacity for load in config.loads]
    deciders = expand_deciders(config.decider_specs, profile, decider)
    tasks: list[CellTask] = []
    for cell_index, rate in enumerate(rates):
        workload = make_workload(config, rate, profile, config.seed + cell_index)
        if config.target is None and config.replicas > len(workload):
            msg = f"--replicas {config.replicas} is more than the {len(workload)} requests of the cell at {rate:.3g}/s"
            raise CtrlError(msg)
        tasks.extend(CellTask(rate, workload, d) for d in deciders)
    cells = run_cells(runner, tasks, worker_count(config, tasks), progress)
    result = SimulationResult(new_simulation_id(), run.run_id, profile, overheads, runner.capacity, cells,
                              config.target)
    result.path = write_simulation(run, result, config)
    if workspace.current_generation() is not None:
        build_catalog(workspace)  # ctrl.duckdb gains the `simulations` view (plain duckdb reads the catalog)
    return result


def fewest_replicas(simulated: Callable[[int], CellResult], target: float, most: int) -> CellResult:
    """The cell at the fewest replicas (up to ``most``) whose within-budget share meets ``target``:
    doubling, then bisection (the share grows with the replicas); the cell at ``most`` marked as not
    meeting it where none does."""
    tried: dict[int, CellResult] = {}

    def at(n: int) -> CellResult:
        if n not in tried:
            tried[n] = simulated(n)
            tried[n].meets_target = tried[n].figures["within_budget"] >= target
        return tried[n]

    low, high = 0, 1
    while not at(high).meets_target:
        if high >= most:
            return at(most)
        low, high = high, min(most, high * 2)
    while high - low > 1:
        mid = (low + high) // 2
        if at(mid).meets_target:
            high = mid
        else:
            low = mid
    return at(high)


def new_simulation_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def rows_of(result: SimulationResult, config: SimulateConfig) -> list[dict[str, Any]]:
    """The ``simulations`` rows of ``result`` (:data:`pipeline.schema.SIMULATIONS`)."""
    arrivals = f"trace:{config.trace.name}" if config.trace is not None else "poisson"
    rows = []
    for cell in result.cells:
        rows.append({
            "simulation_id": result.simulation_id, "run_id": result.run_id,
            "decider": cell.decider.name, "arrivals": arrivals, "rate_rps": cell.rate_rps, "load": cell.load,
            "budget_ms": cell.budget_mix, "replicas": cell.replicas, "balancer": config.balancer,
            "seed": config.seed, "sample_split": result.profile.split, "samples": len(result.profile),
            "latency_scale": result.overheads.latency_scale, "overheads": result.overheads.source,
            "capacity_rps": result.capacity_rps, "target": result.target, "meets_target": cell.meets_target,
            **cell.figures,
        })
    return rows


def write_simulation(run: RunDir, result: SimulationResult, config: SimulateConfig) -> Path:
    """``runs/<run_id>/simulations/<simulation_id>.parquet``, written atomically."""
    path = run.path / SIMULATIONS_DIR / f"{result.simulation_id}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows_of(result, config), schema=SIMULATIONS.arrow_schema())
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return path
