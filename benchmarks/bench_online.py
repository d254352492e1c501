"""Online GRPO step time on CPU with the embedded model, split into its parts.

    python benchmarks/bench_online.py                   # 12 steps, 2 groups x G=5, 16 new tokens
    python benchmarks/bench_online.py --rollout-batch 1,8 --rounds 2   # batched rollouts against alone

Builds (once, cached in benchmarks/.cache) a workspace from the synthetic tree (ingest +
extract-features with the embedded model), then runs ``train_online`` from a fresh controller
with a fixed budget range and reports per-step medians (the first step, which includes
warm-up runs of new configurations, is excluded) of:

* model: rollout execution (vision, prefill, decode; shared prefixes once per stage-1 choice);
* controller: the two controller stages and the sampling during rollouts;
* update: the loss (recomputing the latency tokens through decoder blocks 0..p-1 with
  autograd), backward and the optimizer step;
* bookkeeping: rewards, advantages, metrics rows, Parquet files and checkpoints.

The target: controller + bookkeeping < 5% of the step time.

``--rollout-batch 1,8`` runs the same training once per setting (``--rounds`` times, the settings
alternating, each from the same seed) and compares the model's time per step and per rollout, the
share of rollouts whose suffix and decode latencies were modeled, and the latency model's median
relative error on the rollouts timed alone: what the CPU's ``--rollout-batch auto`` rests on.
The CPU's model is printed: compare only figures of one run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "benchmarks" / ".cache"


def sample_workspace() -> Path:
    """The synthetic tree (``data/generate.py --synthetic``) ingested, with embedded-model features (cached)."""
    from features import FeatureConfig, extract_features
    from pipeline.ingestion import IngestConfig, ingest

    root = CACHE / "online-ws"
    if (root / ".ready").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    data = CACHE / "synthetic-data"
    subprocess.run([sys.executable, str(ROOT / "data" / "generate.py"), "--synthetic", "--out", str(data)],
                   check=True, capture_output=True)
    ingest(IngestConfig(paths=[data / "exp5", data / "exp6"], workspace=root))
    extract_features(FeatureConfig(workspace=root, images_dir=data / "images"))
    (root / ".ready").write_text("ok\n")
    return root


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def run_arm(ws: Path, args: argparse.Namespace, rollout_batch: str):
    from online import OnlineTrainConfig, train_online

    shutil.rmtree(ws / "runs", ignore_errors=True)
    config = OnlineTrainConfig(workspace=ws, fresh=True, steps=args.steps, samples_per_step=args.samples_per_step,
                               group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                               budget_min_ms=40.0, budget_max_ms=200.0, checkpoint_every=5, evaluate=False,
                               threads=args.threads, check_every=0,  # the steps' cost, without held-out checks
                               rollout_batch=rollout_batch)
    return config, train_online(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per request (0 = torch's default)")
    parser.add_argument("--rollout-batch", default="1",
                        help="comma-separated --rollout-batch settings to compare (e.g. 1,8)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per setting, alternating")
    args = parser.parse_args()

    import torch

    ws = sample_workspace()
    settings = [s.strip() for s in args.rollout_batch.split(",") if s.strip()]
    if len(settings) > 1:
        compare(ws, args, settings)
        return
    config, result = run_arm(ws, args, settings[0])
    frame = result.steps.slice(1)  # step 1 includes the warm-up runs of every new configuration
    parts = {"model": "time_model_s", "controller": "time_controller_s", "update": "time_update_s",
             "bookkeeping": "time_bookkeeping_s"}
    totals = [sum(row[c] for c in parts.values()) for row in frame.iter_rows(named=True)]
    threads = config.threads or torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} thread(s) per request; {len(frame)} measured steps of "
          f"{args.samples_per_step} groups x G={args.group_size} ({args.samples_per_step * args.group_size} rollouts), "
          f"max_new_tokens {args.max_new_tokens}")
    print(f"step time median {statistics.median(totals):.3f} s")
    for name, column in parts.items():
        shares = [row[column] / t for row, t in zip(frame.iter_rows(named=True), totals)]
        print(f"  {name:<12} median {statistics.median(frame[column].to_list()):.4f} s  "
              f"share {statistics.median(shares):6.2%}")
    overhead = [(row["time_controller_s"] + row["time_bookkeeping_s"]) / t
                for row, t in zip(frame.iter_rows(named=True), totals)]
    print(f"controller + bookkeeping: median share {statistics.median(overhead):.2%} (target < 5%)")
    print("rollout latency (controller included) median "
          f"{statistics.median(frame['latency_ms_mean'].to_list()):.1f} ms, "
          f"controller {statistics.median(frame['controller_ms_mean'].to_list()):.2f} ms per rollout; "
          f"prefixes per step median {statistics.median(frame['prefixes'].to_list())} for "
          f"{args.samples_per_step * args.group_size} rollouts")


def compare(ws: Path, args: argparse.Namespace, settings: list[str]) -> None:
    """The same training once per setting per round, the settings alternating; medians per setting."""
    import torch

    model_s: dict[str, list[float]] = {s: [] for s in settings}
    modeled: dict[str, list[float]] = {s: [] for s in settings}
    errors: dict[str, list[float]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for setting in settings:
            _, result = run_arm(ws, args, setting)
            frame = result.steps.slice(1)
            model_s[setting] += frame["time_model_s"].to_list()
            modeled[setting].append(float(frame["rollouts_modeled"].sum()) / float(frame["rollouts"].sum()))
            errors[setting] += [e for e in frame["latency_model_error"].to_list() if e is not None]
    rollouts = args.samples_per_step * args.group_size
    print(f"{cpu_model()}, torch {torch.__version__}, {args.threads or torch.get_num_threads()} thread(s); "
          f"{args.steps - 1} measured steps x {args.rounds} round(s) of {rollouts} rollouts, "
          f"max_new_tokens {args.max_new_tokens}")
    base = statistics.median(model_s[settings[0]])
    print("| --rollout-batch | model s per step | ms per rollout | vs first | rollouts modeled | model error |")
    print("|---|---:|---:|---:|---:|---:|")
    for setting in settings:
        step = statistics.median(model_s[setting])
        error = f"{statistics.median(errors[setting]):.1%}" if errors[setting] else "-"
        print(f"| {setting} | {step:.3f} | {1000 * step / rollouts:.1f} | {step / base:.2f}x | "
              f"{statistics.median(modeled[setting]):.0%} | {error} |")


if __name__ == "__main__":
    main()
