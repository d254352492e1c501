"""Adapting a controller to a machine unlike its profile's: the offline start as is, online training
for N rollouts, or a re-profile on the new machine and offline training again.

    python benchmarks/bench_adaptation.py --machine here                 # this CPU against the shipped profile
    python benchmarks/bench_adaptation.py --machine emulated --stretch prefill=3,decode=1.5
    python benchmarks/bench_adaptation.py --machine emulated --phase report

Machine A is the one the shipped sample profile was recorded on; machine B is this one (``here``),
or this one with each timed stage stretched (``emulated``: ``benchmarks/emulated_machine.py``; the
extra time is real waiting inside the stage, so the product's own timers see a slower machine).
Every arm starts from the same offline run, trained on profile A (the README's main job, cached
in ``benchmarks/.cache/adapt``):

* ``offline_start``: that run deployed as is on B, on the budget range calibrated on B;
* ``kept@N``: ``ctrl train --online`` from it on B, the controller its held-out checks kept
  after N steps (what the run serves; a learning curve: the run is resumed step block by step
  block, and resumed runs draw what one run would); ``latest@N``: its last controller at the
  largest N, whatever the checks said; both decide under the run's latency guard
  (``--guard-samples``, ``controller.latency_guard``) as the run serves them, and ``offline_start+guard`` is
  the start under it (the guard's share of a gain, without a step);
* ``reprofiled``: ``ctrl profile`` on B (``--profile-samples`` of the dataset), ingested into a
  workspace of its own and trained offline again; its budgets are B's milliseconds already, so
  it keeps its own budget encoding;
* ``rescaled``: every configuration run once on B on ``--rescale-samples`` training samples, A's
  recorded latencies rescaled (``--rescale-by stage``: each recorded stage time, vision, prefill
  and decode, by that stage's measured / recorded ratio summed over all those requests;
  ``config``: each configuration's latencies by its own ratio of 90th percentiles), and the
  offline run trained again on that profile (its settings, no model runs); like the re-profile
  it keeps its own encoding.

Beside the arms, the fastest configuration runs on every request (``fastest``): a shared VM's speed
moves by a third within minutes, and where the fastest configuration misses a budget no decider
could have met it at that moment; each late share is followed, in brackets, by the late share on
the requests the fastest configuration met.

Every arm is measured paired on the test split (``online.evaluate``: each (sample, budget) runs
every decider back to back) at ``--budgets`` budgets across B's range. Per (decider, budget):
accuracy within budget (an answer over budget counts as wrong), the late share, and the paired
difference to ``offline_start`` with a bootstrap interval over samples. The cost of each arm is
its model time on B (rollouts and the online run's held-out checks, profile generations) and its
wall time. Results:
``benchmarks/.cache/adapt/<label>.json`` (the label is the machine's unless ``--label`` names
another, e.g. for a short trial that must not replace a full run's files); ``--phase report``
prints the tables.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve as bs
from emulated_machine import StageFactors, stretched
from molmoe_common import cpu_name

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache" / "adapt"
RUN_A = "profile-a"
#: the static decider of the evaluation: the fastest configuration on every request
FASTEST = "fastest"


def ctrl(*args: str) -> None:
    """A ``ctrl`` command in a child process, as a user runs it; its output goes to the cache's log."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / "commands.log").open("a") as log:
        log.write(f"$ ctrl {' '.join(args)}\n")
        log.flush()
        done = subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        msg = f"ctrl {' '.join(args)} failed (exit {done.returncode}); see {CACHE / 'commands.log'}"
        raise SystemExit(msg)


def say(line: str) -> None:
    """A progress line on stderr (a run takes tens of minutes)."""
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


class Progress:
    """``done, total`` callbacks as a line every tenth of the way."""

    def __init__(self, what: str) -> None:
        self.what, self.shown = what, -1

    def __call__(self, done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if tenth > self.shown:
            self.shown = tenth
            say(f"{self.what}: {done:,} of {total:,}")


def workspace_a() -> Path:
    """The main job's workspace on the shipped profile (machine A), with the offline run ``RUN_A``."""
    ws = CACHE / "ws-a"
    if (ws / ".ready").exists():
        return ws
    shutil.rmtree(ws, ignore_errors=True)
    say("machine A: the main job's workspace and offline run (cached)")
    subprocess.run([sys.executable, str(ROOT / "data" / "generate.py")], cwd=ROOT, check=True, capture_output=True)
    ctrl("testbed", "train", "--eval-samples", "0")
    ctrl("ingest", str(ROOT / "data" / "exp5"), str(ROOT / "data" / "exp6"), "-w", str(ws))
    ctrl("extract-features", "--model", "testbed", "--images", str(ROOT / "data" / "testbed" / "images"), "-w", str(ws))
    ctrl("train", "--offline", "--run-id", RUN_A, "-w", str(ws))
    (ws / ".ready").write_text("ok\n")
    return ws


def online_curve(ws: Path, runtime: Any, machine: str, steps: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Online training from ``RUN_A`` on this (stretched) runtime, its held-out checks on (every
    ``--check-every`` steps) but never stopping early, so that the whole curve is drawn; after each
    of ``steps``: the kept controller (what the run would serve), the last one, the cumulative model
    time of rollouts and of checks, and the step at which ``--patience`` would have stopped it."""
    from controller.latency_guard import load_run_guard
    from online import OnlineTrainConfig, train_online

    run_id = f"online-{machine}"
    shutil.rmtree(ws / "runs" / run_id, ignore_errors=True)
    out = CACHE / f"{machine}-checkpoints"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    points, wall_s = [], 0.0
    for i, n in enumerate(steps):
        common = {"workspace": ws, "model": "testbed", "steps": n, "max_new_tokens": args.max_new_tokens,
                  "evaluate": False, "checkpoint_every": n, "threads": 1, "patience": 0}
        config = (OnlineTrainConfig(**common, from_run=RUN_A, run_id=run_id, group_size=args.group_size,
                                    samples_per_step=args.samples_per_step, seed=args.seed,
                                    check_every=args.check_every, guard_samples=args.guard_samples)
                  if i == 0 else OnlineTrainConfig(**common, resume=run_id))
        say(f"online training on {machine}: to step {n}")
        started = time.perf_counter()
        result = train_online(config, runtime=runtime)
        wall_s += time.perf_counter() - started
        kept, last = out / f"kept-{n}.pt", out / f"last-{n}.pt"
        shutil.copy(result.checkpoint, kept)
        shutil.copy(result.run_dir / "checkpoints" / "last.pt", last)
        frame = result.steps
        checks = frame.filter(frame["check_gain"].is_not_null())
        points.append({"steps": n, "rollouts": int(frame["rollouts"].sum()), "checkpoint": str(kept),
                       "last_checkpoint": str(last), "kept_step": int(frame["kept_step"][-1]),
                       "model_s": float(frame["time_model_s"].sum()),
                       "check_s": float(frame["time_check_s"].fill_null(0).sum()),
                       "check_requests": int(frame["check_requests"].fill_null(0).sum()),
                       "check_runs": check_runs(frame), "wall_s": wall_s,
                       "budget_range_ms": list(result.budget_range_ms),
                       "checks": [{k: row[k] for k in ("step", "check_gain", "check_gain_low", "check_gain_high",
                                                       "check_late_share", "check_start_late_share", "kept_step")}
                                  for row in checks.iter_rows(named=True)]})
    guard = load_run_guard(ws / "runs" / run_id)
    return {"run_id": run_id, "points": points, "guard": None if guard is None else guard.summary()}


def check_runs(frame: Any) -> int:
    """Requests the held-out checks of ``frame`` (online_steps rows) ran: two per pair, but one where
    the latest controller chose as the start."""
    pairs = frame["check_requests"].fill_null(0)
    return int((2 * pairs - frame["check_same_choice"].fill_null(0)).sum())


def patience_stop(checks: list[dict[str, Any]], patience: int) -> int | None:
    """The step after which a run with ``patience`` would have stopped (None: it would not have)."""
    since, kept = 0, 0
    for check in checks:
        if check["kept_step"] != kept:
            kept, since = check["kept_step"], 0
        else:
            since += 1
        if since >= patience:
            return check["step"]
    return None


def reprofiled(ws_a: Path, runtime: Any, machine: str, args: argparse.Namespace, stretch: str) -> dict[str, Any]:
    """Profile the dataset on this (stretched) runtime, ingest it with A's features, train offline."""
    from profiler import ProfileConfig, profile_model

    out = CACHE / f"{machine}-profile"
    ws = CACHE / f"ws-{machine}-reprofiled"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(ws, ignore_errors=True)
    say(f"re-profiling on {machine}")
    counted = Progress("profile generations")
    total, done = [0], [0]

    def advance(n: int, _label: str) -> None:  # the profiler reports increments
        done[0] += n
        counted(done[0], total[0])

    started = time.perf_counter()
    report = profile_model(ProfileConfig(datasets=[ROOT / "data" / "testbed"], model="testbed",
                                         max_new_tokens=args.max_new_tokens, out_dir=out,
                                         num_samples=args.profile_samples), runtime=runtime,
                           progress=advance,
                           on_total=lambda n: total.__setitem__(0, n))
    profile_s = time.perf_counter() - started
    say("re-profiled: ingest, features, offline training")
    started = time.perf_counter()
    ctrl("ingest", str(out), "-w", str(ws))
    ctrl("extract-features", "--model", "testbed", "--images", str(ROOT / "data" / "testbed" / "images"), "-w", str(ws))
    ctrl("train", "--offline", "--run-id", "reprofiled", "-w", str(ws))
    train_s = time.perf_counter() - started
    return {"workspace": str(ws), "run_id": "reprofiled", "profile_wall_s": profile_s, "train_wall_s": train_s,
            "model_s": float(report.measure_s), "generations": int(report.measured), "stretch": stretch}


def rescaled(ws_a: Path, runtime: Any, label: str, args: argparse.Namespace) -> dict[str, Any]:
    """The ``rescaled`` arm: A's profile with each configuration's latencies scaled by its speed ratio
    measured on B, trained offline again with ``RUN_A``'s settings (see the module docstring)."""
    import dataclasses

    import torch

    from controller.latency_guard import STAGES, recorded_stage_ms, stage_ratios
    from online.calibrate import TAIL_QUANTILE, budget_reference, calibration_rows
    from online.config import OnlineTrainConfig
    from online.data import load_online_samples
    from online.rollout import RolloutExecutor
    from online.train import build_controller
    from pipeline.workspace import Workspace
    from trainer.config import OfflineTrainConfig
    from trainer.data import load_offline_data
    from trainer.offline import train_offline
    from trainer.runs import RunDir

    ws = Workspace(ws_a)
    samples = load_online_samples(ws, runtime.fingerprint)
    parent = RunDir.resolve(ws, RUN_A).read_config()
    controller, _, _ = build_controller(OnlineTrainConfig(workspace=ws_a, from_run=RUN_A, model="testbed"), ws,
                                        runtime, samples, (50.0, 150.0))
    reference = budget_reference(ws, runtime, samples, parent)
    data = load_offline_data(ws, runtime.fingerprint)
    rows = calibration_rows(samples.rows("train"), args.rescale_samples, args.seed + 1)
    position = controller.insertion_positions.index(1)
    stages = recorded_stage_ms(ws, data)  # (stage, N, A) recorded ms, NaN where not recorded
    row_of = {key: i for i, key in enumerate(zip(data.dataset, data.sample_key))}
    executor = RolloutExecutor(runtime, controller, samples, args.max_new_tokens, True)
    ratios, model_ms, requests = [], 0.0, 0
    measured_stages, recorded_stages = [], []  # per request: each stage's measured and recorded ms
    say(f"rescaled arm: {len(data.action_space.actions)} configurations x {len(rows)} samples on {label}, "
        f"by {args.rescale_by}")
    try:
        for a, (crops, top_k, blocks) in enumerate(data.action_space.actions):
            force = (controller.max_crops_values.index(crops), position, controller.top_k_values.index(top_k),
                     controller.num_active_blocks_values.index(blocks))
            out = executor.run_fixed(rows, force)
            measured = np.array([r.latency_total_ms for r in out])
            recorded = np.array([reference.recorded_ms(row, (crops, top_k, blocks)) for row in rows])
            ok = np.isfinite(recorded) & (recorded > 0)
            ratios.append(float(np.quantile(measured[ok], TAIL_QUANTILE) / np.quantile(recorded[ok], TAIL_QUANTILE)))
            for r, row in zip(out, rows):
                i = row_of.get((samples.dataset[row], samples.sample_key[row]))
                recorded_stages.append(stages[:, i, a] if i is not None else np.full(len(STAGES), np.nan))
                measured_stages.append([np.nan if getattr(r, f"latency_{s}_ms") is None
                                        else getattr(r, f"latency_{s}_ms") for s in STAGES])
            model_ms += float(measured.sum())
            requests += len(out)
    finally:
        executor.close()
    ratio_of_stage = stage_ratios(np.array(measured_stages), np.array(recorded_stages))
    if args.rescale_by == "stage":  # each recorded stage time scaled by its stage's ratio, the rest kept
        extra = np.nansum((ratio_of_stage[:, None, None] - 1.0) * stages, axis=0)
        latency = data.latency_ms + torch.from_numpy(extra).to(data.latency_ms.dtype)
    else:
        latency = data.latency_ms * torch.tensor(ratios, dtype=data.latency_ms.dtype)
    scaled = dataclasses.replace(data, latency_ms=latency)
    run_id = f"rescaled-{label}"
    shutil.rmtree(ws_a / "runs" / run_id, ignore_errors=True)
    settings = {k: v for k, v in parent.items() if k not in ("run_id", "resume", "budget_min_ms", "budget_max_ms",
                                                               "eval_budgets")}
    started = time.perf_counter()
    train_offline(OfflineTrainConfig.from_json({**settings, "run_id": run_id}), data=scaled)
    return {"run_id": run_id, "requests": requests, "model_s": model_ms / 1000.0, "by": args.rescale_by,
            "train_wall_s": time.perf_counter() - started,
            "stage_ratios": dict(zip(STAGES, ratio_of_stage.tolist())),
            "ratios": {f"{c}/{k}/{b}": r for (c, k, b), r in zip(data.action_space.actions, ratios)}}


def deployed(workspace: Path, run: str, runtime: Any, like: Any, encoder_range: tuple[float, float] | None) -> Any:
    """An offline run's policy as a two-stage controller with ``like``'s online layout (run at
    insertion position 1 by the callers). ``encoder_range``: the budget encoder's range, e.g. B's
    calibrated one for machine A's policy, whose milliseconds were A's; None keeps the policy's own
    (a policy trained on B)."""
    from pipeline.workspace import Workspace
    from trainer.policy import ControllerPolicy
    from trainer.runs import RunDir, resolve_checkpoint
    from trainer.two_stage import TwoStageController, set_budget_range

    ws = Workspace(workspace)
    policy = ControllerPolicy.load(resolve_checkpoint(ws, RunDir.resolve(ws, run).path), runtime.fingerprint)
    controller = TwoStageController(policy, like.two_stage)
    if encoder_range is not None:
        set_budget_range(controller.policy, *encoder_range)
    return controller


def paired_outcomes(ws_a: Path, runtime: Any, run_id: str, deciders: list[tuple[str, Any, int | None]],
                    budgets: list[float], args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """``run_paired`` on A's test split with the online run's settings; per "decider|budget" the
    (sample, score, latency) of each request."""
    from online.config import OnlineTrainConfig
    from online.evaluate import run_paired
    from pipeline.workspace import Workspace
    from trainer.runs import RunDir

    ws = Workspace(ws_a)
    config = OnlineTrainConfig.from_json(RunDir.resolve(ws, run_id).read_config())
    outcomes = run_paired(ws, config, runtime, deciders, budgets, args.eval_samples, Progress("evaluated requests"))
    return {f"{name}|{budget}": [[r.sample, r.score, r.latency_total_ms] for r in rollouts]
            for (name, budget), rollouts in outcomes.items()}


def evaluate(ws_a: Path, runtime: Any, curve: dict[str, Any], reprof: dict[str, Any] | None,
             rescale: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, Any]:
    """Every arm measured paired on A's test split at budgets across B's calibrated range."""
    from controller.latency_guard import load_run_guard
    from online.calibrate import calibration_configs
    from online.config import OnlineTrainConfig
    from online.evaluate import Guarded
    from pipeline.workspace import Workspace
    from trainer.data import budget_grid
    from trainer.runs import RunDir
    from trainer.two_stage import TwoStageController

    config = OnlineTrainConfig.from_json(RunDir.resolve(Workspace(ws_a), curve["run_id"]).read_config())
    lo, hi = float(config.budget_min_ms), float(config.budget_max_ms)
    budgets = [round(b, 1) for b in budget_grid(lo, hi, args.budgets)]
    first = TwoStageController.load(Path(curve["points"][0]["checkpoint"]), runtime.fingerprint)
    calibrated = (first.policy.config.budget_min_ms, first.policy.config.budget_max_ms)
    start = deployed(ws_a, RUN_A, runtime, first, calibrated)
    fastest = calibration_configs(start)[0]
    # the fastest configuration at insertion position 1, as every deployed arm runs: the requests no
    # decider could have met at that moment are those it misses (a shared VM's speed moves by a
    # third within minutes)
    fastest = (fastest[0], start.insertion_positions.index(1), fastest[2], fastest[3])
    deciders: list[tuple[str, Any, int | None]] = [
        ("offline_start", start, start.insertion_positions.index(1)), (FASTEST, fastest, None)]
    # the online run's guard: its controllers decide under it, as the run serves them; the start beside
    # them both ways, so that the guard's share and the steps' share of a gain can be told apart
    guard = load_run_guard(ws_a / "runs" / curve["run_id"])

    def served(controller: Any) -> Any:
        return controller if guard is None else Guarded(controller, guard)

    if guard is not None:
        deciders.append(("offline_start+guard", served(start), start.insertion_positions.index(1)))
    for point in curve["points"]:
        deciders.append((f"kept@{point['steps']}",
                         served(TwoStageController.load(Path(point["checkpoint"]), runtime.fingerprint)), None))
    last = curve["points"][-1]
    deciders.append((f"latest@{last['steps']}",
                     served(TwoStageController.load(Path(last["last_checkpoint"]), runtime.fingerprint)), None))
    if reprof is not None:
        again = deployed(Path(reprof["workspace"]), reprof["run_id"], runtime, first, None)
        deciders.append(("reprofiled", again, again.insertion_positions.index(1)))
    if rescale is not None:
        refit = deployed(ws_a, rescale["run_id"], runtime, first, None)
        deciders.append(("rescaled", refit, refit.insertion_positions.index(1)))
    say(f"paired evaluation: {len(deciders)} deciders x {len(budgets)} budgets")
    outcomes = paired_outcomes(ws_a, runtime, curve["run_id"], deciders, budgets, args)
    # where the requests the guard decided had moved it by the end (the drift and tail factors)
    after = None if guard is None else {"drift": guard.drift(), "tail": guard.tail()}
    return {"budgets_ms": budgets, "budget_range_ms": [lo, hi], "outcomes": outcomes, "guard_after": after}


def calibration_ablation(ws_a: Path, runtime: Any, results: dict[str, Any], other: tuple[float, float],
                         args: argparse.Namespace) -> dict[str, Any]:
    """Machine A's offline policy deployed twice at the run's budgets, paired: its budget encoder over
    the range calibrated on B, and over ``other`` (e.g. the range another calibration rule gave)."""
    from trainer.policy import budget_normalization_range
    from trainer.two_stage import TwoStageController

    first = TwoStageController.load(Path(results["online"]["points"][0]["checkpoint"]), runtime.fingerprint)
    calibrated = deployed(ws_a, RUN_A, runtime, first,
                          (first.policy.config.budget_min_ms, first.policy.config.budget_max_ms))
    moved = deployed(ws_a, RUN_A, runtime, first, budget_normalization_range(*other))
    name = f"offline_start on {other[0]:.0f}-{other[1]:.0f} ms"
    position = calibrated.insertion_positions.index(1)
    budgets = results["evaluation"]["budgets_ms"]
    say(f"calibration ablation: the start on B's range and on {other[0]:.0f}-{other[1]:.0f} ms")
    return {"other_range_ms": list(other), "budgets_ms": budgets,
            "outcomes": paired_outcomes(ws_a, runtime, results["online"]["run_id"],
                                        [("offline_start", calibrated, position), (name, moved, position)],
                                        budgets, args)}


def speed_probe(ws_a: Path, runtime: Any) -> float:
    """The machine's speed now: the median latency (ms) of the fastest configuration, twice on 8
    training samples. A shared VM drifts by more than the emulated factors within half an hour, so
    the report says how fast the machine was at the calibration and during the evaluation."""
    from online.calibrate import calibration_configs
    from online.config import OnlineTrainConfig
    from online.data import load_online_samples
    from online.rollout import RolloutExecutor
    from online.train import build_controller
    from pipeline.workspace import Workspace

    ws = Workspace(ws_a)
    samples = load_online_samples(ws, runtime.fingerprint)
    controller, _, _ = build_controller(OnlineTrainConfig(workspace=ws_a, from_run=RUN_A, model="testbed"), ws,
                                        runtime, samples, (50.0, 150.0))
    executor = RolloutExecutor(runtime, controller, samples, 8, True)
    try:
        fastest, _ = calibration_configs(controller)
        rows = samples.rows("train")[:8]
        out = executor.run_fixed(rows, fastest) + executor.run_fixed(rows, fastest)
    finally:
        executor.close()
    return float(np.median([r.latency_total_ms for r in out]))


def within(rows: list[list[float]], budget: float) -> np.ndarray:
    """Per request: its score when answered within the budget, else 0."""
    return np.array([score if latency <= budget else 0.0 for _, score, latency in rows])


def late_where_feasible(ev: dict[str, Any], name: str, budget: float) -> float | None:
    """``name``'s late share on the requests at ``budget`` that the fastest configuration, run right
    beside them, met (None without that decider or without such requests)."""
    static = ev["outcomes"].get(f"{FASTEST}|{budget}")
    if static is None:
        return None
    met = [latency <= budget for _, _, latency in static]
    late = [latency > budget for (_, _, latency), ok in zip(ev["outcomes"][f"{name}|{budget}"], met) if ok]
    return float(np.mean(late)) if late else None


def paired_table(ev: dict[str, Any], base_name: str) -> list[str]:
    """Within-budget accuracy / late share per decider and budget (and, with the fastest configuration
    measured beside them, the late share on the requests it met), and the paired difference to
    ``base_name`` with its bootstrap interval over samples."""
    names = list(dict.fromkeys(key.split("|")[0] for key in ev["outcomes"]))
    lines = ["| decider | " + " | ".join(f"{b:.0f} ms" for b in ev["budgets_ms"]) + " |",
             "|---|" + "---|" * len(ev["budgets_ms"])]
    for name in names:
        cells = []
        for budget in ev["budgets_ms"]:
            rows = ev["outcomes"][f"{name}|{budget}"]
            mine = within(rows, budget)
            late = np.mean([latency > budget for _, _, latency in rows])
            cell = f"{mine.mean():.3f} / {late:.1%}"
            feasible = late_where_feasible(ev, name, budget)
            if feasible is not None and name != FASTEST:
                cell += f" ({feasible:.1%})"
            if name != base_name:
                base = within(ev["outcomes"][f"{base_name}|{budget}"], budget)
                _, lo, hi = bs.block_bootstrap_ci(mine - base, block=1, total=False)
                cell += f" ({mine.mean() - base.mean():+.3f} [{lo:+.3f}, {hi:+.3f}])"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def report(results: dict[str, Any]) -> str:
    """The tables: within-budget accuracy / late share per arm and budget, differences to the start."""
    ev = results["evaluation"]
    lines = [f"machine {results['machine']} ({results['stretch']}), {results['cpu']}; budget range on B "
             f"{ev['budget_range_ms'][0]:.0f}-{ev['budget_range_ms'][1]:.0f} ms, "
             f"{len(next(iter(ev['outcomes'].values())))} test requests per cell", ""]
    if results.get("speed_probe_ms"):
        p = results["speed_probe_ms"]
        lines += [f"the fastest configuration's median latency (the machine's speed): {p['start']:.1f} ms before the "
                  f"online run (its calibration), {p['evaluation']:.1f} ms before the evaluation, {p['end']:.1f} ms "
                  "after it", ""]
    lines += paired_table(ev, "offline_start")
    lines += ["", "| arm | kept step | model time on B: rollouts + checks | wall time on B |", "|---|---|---|---|"]
    for point in results["online"]["points"]:
        runs = point.get("check_runs")
        if runs is None:  # results written before the count was kept: from the run's own steps
            import polars as pl

            frame = pl.read_parquet(CACHE / "ws-a" / "runs" / results["online"]["run_id"] / "online_steps.parquet")
            runs = check_runs(frame.filter(pl.col("step") <= point["steps"]))
        lines.append(f"| online to step {point['steps']} ({point['rollouts']} rollouts, {runs} check requests) | "
                     f"{point['kept_step']} | {point['model_s']:.0f} + {point['check_s']:.0f} s | "
                     f"{point['wall_s']:.0f} s |")
    if results.get("reprofiled"):
        r = results["reprofiled"]
        model = f"{r['model_s']:.0f} s" if r.get("model_s") else "-"
        lines.append(f"| reprofiled ({r.get('generations') or '?'} generations) | | {model} | "
                     f"{r['profile_wall_s'] + r['train_wall_s']:.0f} s (profile {r['profile_wall_s']:.0f}) |")
    if results.get("rescaled"):
        r = results["rescaled"]
        by = r.get("by", "config")
        ratios = (", ".join(f"{k} x{v:.2f}" for k, v in r["stage_ratios"].items()) if by == "stage"
                  else "one per configuration")
        lines.append(f"| rescaled ({r['requests']} measured requests; {ratios}) | | {r['model_s']:.0f} s | "
                     f"training {r['train_wall_s']:.0f} s |")
    if results["online"].get("guard"):
        g = results["online"]["guard"]
        ratios = ", ".join(f"{k} x{v:.2f}" for k, v in g["stage_ratios"].items())
        lines.append(f"| latency guard ({g['requests']} requests; {ratios}; slack x{g['slack']:.2f}) | | "
                     f"{g['model_s']:.0f} s | |")
        if ev.get("guard_after"):
            a = ev["guard_after"]
            lines.append(f"| (the guard after the evaluation: drift x{a['drift']:.2f}, tail x{a['tail']:.2f}) | | | |")
    checks = results["online"]["points"][-1]["checks"]
    if checks:
        lines += ["", "| check after step | gain over the start [95% CI] | late: latest / start | kept |",
                  "|---|---|---|---|"]
        for c in checks:
            lines.append(f"| {c['step']} | {c['check_gain']:+.3f} [{c['check_gain_low']:+.3f}, "
                         f"{c['check_gain_high']:+.3f}] | {c['check_late_share']:.0%} / "
                         f"{c['check_start_late_share']:.0%} | {c['kept_step'] or 'start'} |")
        stop = patience_stop(checks, 2)
        lines += ["", "with the default --patience 2 the run would have stopped after step "
                  f"{stop}" if stop is not None else "with the default --patience 2 the run would not have stopped"]
    if results.get("calibration_ablation"):
        lines += ["", "the offline start on the range calibrated on B against another range, same budgets:", ""]
        lines += paired_table(results["calibration_ablation"], "offline_start")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--machine", choices=("here", "emulated"), default="here")
    p.add_argument("--stretch", default="prefill=3,decode=1.5,vision=1",
                   help="the emulated machine's stage factors (benchmark only; the product's timing is untouched)")
    p.add_argument("--phase", choices=("run", "report", "calibration"), default="run",
                   help="calibration: the offline start on B's range against --other-range, at the run's budgets")
    p.add_argument("--other-range", default=None, help="LO,HI ms for --phase calibration")
    p.add_argument("--label", default=None, help="names the run's files and runs (default: the machine)")
    p.add_argument("--steps", default="10,20,40", help="online steps at which the controller is evaluated")
    p.add_argument("--group-size", type=int, default=5)
    p.add_argument("--samples-per-step", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--profile-samples", type=int, default=None, help="samples re-profiled (default: all 600)")
    p.add_argument("--no-reprofile", action="store_true", help="leave the re-profiled arm out")
    p.add_argument("--reuse-reprofiled", action="store_true",
                   help="take the re-profiled arm's workspace and costs from this label's previous results")
    p.add_argument("--check-every", type=int, default=10, help="the online run's --check-every")
    p.add_argument("--guard-samples", type=int, default=8, help="the online run's --guard-samples (0: no guard)")
    p.add_argument("--rescale-samples", type=int, default=0,
                   help="training samples each configuration runs on for the rescaled arm (0: leave it out)")
    p.add_argument("--rescale-by", choices=("stage", "config"), default="stage",
                   help="the rescaled arm's ratios: one per timed stage, or one per configuration (90th percentiles)")
    p.add_argument("--budgets", type=int, default=5)
    p.add_argument("--eval-samples", type=int, default=None, help="test samples evaluated (default: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    label = args.label or args.machine
    path = CACHE / f"{label}.json"
    if args.phase == "report":
        print(report(json.loads(path.read_text())))
        return

    from runtime import ExecutionOptions, load_runtime
    from runtime.timing import cpu_threads

    factors = StageFactors.parse(args.stretch) if args.machine == "emulated" else StageFactors()
    ws_a = workspace_a()
    runtime = load_runtime("testbed", ExecutionOptions())
    if args.phase == "calibration":
        results = json.loads(path.read_text())
        if results["stretch"] != factors.label():
            msg = f"{path}: measured with {results['stretch']}, not {factors.label()}"
            raise SystemExit(msg)
        lo, hi = (float(x) for x in args.other_range.split(","))
        with cpu_threads(1, runtime.device), stretched(runtime, factors):
            results["calibration_ablation"] = calibration_ablation(ws_a, runtime, results, (lo, hi), args)
        path.write_text(json.dumps(results))
        print(report(results))
        return
    steps = sorted({int(s) for s in args.steps.split(",")})
    probe: dict[str, float] = {}
    with cpu_threads(1, runtime.device), stretched(runtime, factors):
        probe["start"] = speed_probe(ws_a, runtime)
        curve = online_curve(ws_a, runtime, label, steps, args)
        if args.reuse_reprofiled:
            reprof = json.loads(path.read_text())["reprofiled"]
            if reprof.get("stretch", factors.label()) != factors.label():
                msg = f"{path}: its re-profile ran with {reprof['stretch']}, not {factors.label()}"
                raise SystemExit(msg)
            say(f"re-profiled arm reused from {path} ({reprof['workspace']})")
        else:
            reprof = None if args.no_reprofile else reprofiled(ws_a, runtime, label, args, factors.label())
        rescale = rescaled(ws_a, runtime, label, args) if args.rescale_samples else None
        probe["evaluation"] = speed_probe(ws_a, runtime)
        evaluation = evaluate(ws_a, runtime, curve, reprof, rescale, args)
        probe["end"] = speed_probe(ws_a, runtime)
    results = {"machine": args.machine, "stretch": factors.label(), "cpu": cpu_name(), "args": vars(args),
               "online": curve, "reprofiled": reprof, "rescaled": rescale, "evaluation": evaluation,
               "speed_probe_ms": probe}
    path.write_text(json.dumps(results))
    print(report(results))


if __name__ == "__main__":
    main()
