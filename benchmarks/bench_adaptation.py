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
* ``online@N``: ``ctrl train --online`` from it on B, the controller after N steps (a learning
  curve: the run is resumed step block by step block, and resumed runs draw what one run would);
* ``reprofiled``: ``ctrl profile`` on B (``--profile-samples`` of the dataset), ingested into a
  workspace of its own and trained offline again, deployed on the same budget range.

Every arm is measured paired on the test split (``online.evaluate``: each (sample, budget) runs
every decider back to back) at ``--budgets`` budgets across B's range. Per (decider, budget):
accuracy within budget (an answer over budget counts as wrong), the late share, and the paired
difference to ``offline_start`` with a bootstrap interval over samples. The cost of each arm is
its model time on B (rollouts, profile generations) and its wall time. Results:
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

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache" / "adapt"
RUN_A = "profile-a"


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
    """Online training from ``RUN_A`` on this (stretched) runtime; the controller file after each of
    ``steps`` and the cumulative model and wall time to it."""
    from online import OnlineTrainConfig, train_online

    run_id = f"online-{machine}"
    shutil.rmtree(ws / "runs" / run_id, ignore_errors=True)
    out = CACHE / f"{machine}-checkpoints"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    points, wall_s = [], 0.0
    for i, n in enumerate(steps):
        common = {"workspace": ws, "model": "testbed", "steps": n, "max_new_tokens": args.max_new_tokens,
                  "evaluate": False, "checkpoint_every": n, "threads": 1}
        config = (OnlineTrainConfig(**common, from_run=RUN_A, run_id=run_id, group_size=args.group_size,
                                    samples_per_step=args.samples_per_step, seed=args.seed)
                  if i == 0 else OnlineTrainConfig(**common, resume=run_id))
        say(f"online training on {machine}: to step {n}")
        started = time.perf_counter()
        result = train_online(config, runtime=runtime)
        wall_s += time.perf_counter() - started
        saved = out / f"step-{n}.pt"
        shutil.copy(result.checkpoint, saved)
        frame = result.steps
        points.append({"steps": n, "rollouts": int(frame["rollouts"].sum()), "checkpoint": str(saved),
                       "model_s": float(frame["time_model_s"].sum()), "wall_s": wall_s,
                       "budget_range_ms": list(result.budget_range_ms)})
    return {"run_id": run_id, "points": points}


def reprofiled(ws_a: Path, runtime: Any, machine: str, args: argparse.Namespace) -> dict[str, Any]:
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
            "model_s": float(report.measure_s), "generations": int(report.measured)}


def evaluate(ws_a: Path, runtime: Any, curve: dict[str, Any], reprof: dict[str, Any] | None,
             args: argparse.Namespace) -> dict[str, Any]:
    """Every arm measured paired on A's test split at budgets across B's calibrated range."""
    from online.config import OnlineTrainConfig
    from online.evaluate import run_paired
    from pipeline.workspace import Workspace
    from trainer.data import budget_grid
    from trainer.policy import ControllerPolicy
    from trainer.runs import RunDir, resolve_checkpoint
    from trainer.two_stage import TwoStageController, set_budget_range

    ws = Workspace(ws_a)
    config = OnlineTrainConfig.from_json(RunDir.resolve(ws, curve["run_id"]).read_config())
    lo, hi = float(config.budget_min_ms), float(config.budget_max_ms)
    budgets = [round(b, 1) for b in budget_grid(lo, hi, args.budgets)]
    first = TwoStageController.load(Path(curve["points"][0]["checkpoint"]), runtime.fingerprint)

    def deployed(workspace: Workspace, run: str) -> TwoStageController:
        policy = ControllerPolicy.load(resolve_checkpoint(workspace, RunDir.resolve(workspace, run).path),
                                       runtime.fingerprint)
        controller = TwoStageController(policy, first.two_stage)
        set_budget_range(controller.policy, first.policy.config.budget_min_ms, first.policy.config.budget_max_ms)
        return controller

    start = deployed(ws, RUN_A)
    deciders: list[tuple[str, TwoStageController, int | None]] = [
        ("offline_start", start, start.insertion_positions.index(1))]
    for point in curve["points"]:
        deciders.append((f"online@{point['steps']}",
                         TwoStageController.load(Path(point["checkpoint"]), runtime.fingerprint), None))
    if reprof is not None:
        again = deployed(Workspace(reprof["workspace"]), reprof["run_id"])
        deciders.append(("reprofiled", again, again.insertion_positions.index(1)))
    say(f"paired evaluation: {len(deciders)} deciders x {len(budgets)} budgets")
    outcomes = run_paired(ws, config, runtime, deciders, budgets, args.eval_samples, Progress("evaluated requests"))
    return {"budgets_ms": budgets, "budget_range_ms": [lo, hi],
            "outcomes": {f"{name}|{budget}": [[r.sample, r.score, r.latency_total_ms] for r in rollouts]
                         for (name, budget), rollouts in outcomes.items()}}


def within(rows: list[list[float]], budget: float) -> np.ndarray:
    """Per request: its score when answered within the budget, else 0."""
    return np.array([score if latency <= budget else 0.0 for _, score, latency in rows])


def report(results: dict[str, Any]) -> str:
    """The tables: within-budget accuracy / late share per arm and budget, differences to the start."""
    ev = results["evaluation"]
    names = list(dict.fromkeys(key.split("|")[0] for key in ev["outcomes"]))
    lines = [f"machine {results['machine']} ({results['stretch']}), {results['cpu']}; budget range on B "
             f"{ev['budget_range_ms'][0]:.0f}-{ev['budget_range_ms'][1]:.0f} ms, "
             f"{len(next(iter(ev['outcomes'].values())))} test requests per cell", ""]
    lines.append("| decider | " + " | ".join(f"{b:.0f} ms" for b in ev["budgets_ms"]) + " |")
    lines.append("|---|" + "---|" * len(ev["budgets_ms"]))
    for name in names:
        cells = []
        for budget in ev["budgets_ms"]:
            rows = ev["outcomes"][f"{name}|{budget}"]
            mine = within(rows, budget)
            late = np.mean([latency > budget for _, _, latency in rows])
            cell = f"{mine.mean():.3f} / {late:.1%}"
            if name != "offline_start":
                base = within(ev["outcomes"][f"offline_start|{budget}"], budget)
                _, lo, hi = bs.block_bootstrap_ci(mine - base, block=1, total=False)
                cell += f" ({mine.mean() - base.mean():+.3f} [{lo:+.3f}, {hi:+.3f}])"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| arm | model time on B | wall time on B |", "|---|---|---|"]
    for point in results["online"]["points"]:
        lines.append(f"| online@{point['steps']} ({point['rollouts']} rollouts) | {point['model_s']:.0f} s | "
                     f"{point['wall_s']:.0f} s |")
    if results.get("reprofiled"):
        r = results["reprofiled"]
        model = f"{r['model_s']:.0f} s" if r.get("model_s") else "-"
        lines.append(f"| reprofiled ({r.get('generations') or '?'} generations) | {model} | "
                     f"{r['profile_wall_s'] + r['train_wall_s']:.0f} s (profile {r['profile_wall_s']:.0f}) |")
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--machine", choices=("here", "emulated"), default="here")
    p.add_argument("--stretch", default="prefill=3,decode=1.5,vision=1",
                   help="the emulated machine's stage factors (benchmark only; the product's timing is untouched)")
    p.add_argument("--phase", choices=("run", "report"), default="run")
    p.add_argument("--label", default=None, help="names the run's files and runs (default: the machine)")
    p.add_argument("--steps", default="10,20,40", help="online steps at which the controller is evaluated")
    p.add_argument("--group-size", type=int, default=5)
    p.add_argument("--samples-per-step", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--profile-samples", type=int, default=None, help="samples re-profiled (default: all 600)")
    p.add_argument("--no-reprofile", action="store_true", help="leave the re-profiled arm out")
    p.add_argument("--budgets", type=int, default=5)
    p.add_argument("--eval-samples", type=int, default=None, help="test samples evaluated (default: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    label = args.label or args.machine
    path = CACHE / f"{label}.json"
    if args.phase == "report":
        print(report(json.loads(path.read_text())))
        return

    from runtime import load_runtime
    from runtime.timing import cpu_threads

    factors = StageFactors.parse(args.stretch) if args.machine == "emulated" else StageFactors()
    ws_a = workspace_a()
    runtime = load_runtime("testbed", "cpu", None, "auto", compile=True)
    steps = sorted({int(s) for s in args.steps.split(",")})
    with cpu_threads(1, runtime.device), stretched(runtime, factors):
        curve = online_curve(ws_a, runtime, label, steps, args)
        reprof = None if args.no_reprofile else reprofiled(ws_a, runtime, label, args)
        evaluation = evaluate(ws_a, runtime, curve, reprof, args)
    results = {"machine": args.machine, "stretch": factors.label(), "cpu": cpu_name(), "args": vars(args),
               "online": curve, "reprofiled": reprof, "evaluation": evaluation}
    path.write_text(json.dumps(results))
    print(report(results))


if __name__ == "__main__":
    main()
