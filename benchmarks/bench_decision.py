"""Controller decision latency: the exported controller against the training-time path, same run.

    python benchmarks/bench_decision.py                       # both feature widths, one thread
    python benchmarks/bench_decision.py --workspace workspace --run latest   # + agreement with ctrl predict

The paths below decide the same inputs (a policy with the default architecture and tilings, random
weights standing in for trained ones, and a table fallback that leaves every budget to the
network, so that the network always runs — the slow case):

* ``training-time``: what a decision costs without the export — the policy's two stages over the
  whole action space with the greedy rule of :mod:`trainer.greedy`, and the fallback's
  nearest-grid lookup;
* ``deployed (eager)``: :class:`controller.deploy.DeployedController` called from Python, the
  module ``ctrl predict`` runs;
* ``exported``: the file ``ctrl export`` writes, loaded with ``torch.jit.load``, its ``decide``;
  ``exported, stage1 + stage2``: the same file called as a server calls it, ``stage1`` and then
  ``stage2`` at its crops (stage 2 computes the language and budget features again);
* ``exported, lut_by_request answers``: the file of the same policy with a per-request table answering
  at every budget (its cost model and score table, ``trainer.request_table``), given the prompts'
  lengths; ``exported, expected_latency``: that file's cost model alone, every configuration of each
  request;
* ``compiled``: the package ``ctrl export --compiled`` writes (AOTInductor), loaded with
  ``torch._inductor.aoti_load_package`` and called as a function; ``compiled, boxed_run``: the same
  package through ``.loader.boxed_run([...])``, which skips the wrapper's per-call argument
  parsing (``--no-compiled`` leaves both out: compiling takes a minute or two per width).

Batch 1: ``--repeats`` calls, each with a new budget, after 200 warm-up calls; batch 1,000:
``--batch-repeats`` calls. Median, p95 and p99 in µs (batch 1) or ms (batch 1,000). The
``arithmetic floor`` row of each width is the time the decision's matrix products alone take at
the rate this machine multiplies large float32 matrices (measured at the start of the run): no
float32 implementation of the same network decides much faster (the products run near the core's peak).

With ``--workspace`` and ``--run``, the exported file of that run also decides every sample of
the workspace at every budget of the run's grid (and between grid points) and is compared with
``ctrl predict`` (the count of differing decisions is printed; it must be 0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _stats(times: list[float], scale: float) -> tuple[float, float, float]:
    times = sorted(times)
    n = len(times)
    return (statistics.median(times) * scale, times[min(n - 1, int(0.95 * n))] * scale,
            times[min(n - 1, int(0.99 * n))] * scale)


def build(lang_dim: int, image_dim: int, hidden_dim: int = 128):
    """A policy over the balanced 27 configurations with tilings, its fallback, and its deployed module."""
    import torch
    from bench_trainer import synthetic_data

    from controller.deploy import DeployedController
    from trainer.baselines import LookupTableDecider
    from trainer.fallback import TableFallback
    from trainer.policy import ControllerPolicy, PolicyConfig

    torch.manual_seed(0)
    data = synthetic_data(2000, lang_dim, image_dim)
    policy = ControllerPolicy(PolicyConfig(lang_feature_dim=lang_dim, image_feature_dim=image_dim,
                                           budget_min_ms=150.0, budget_max_ms=420.0, use_tilings=True,
                                           hidden_dim=hidden_dim),
                              data.action_space).eval()
    with torch.no_grad():  # weights away from the near-uniform initial heads
        for p in policy.parameters():
            p.add_(0.3 * torch.randn_like(p))
    tilings = torch.randint(1, 13, (len(data), len(data.action_space.max_crops_values))).float()
    policy.set_feature_normalization(data.image_features, data.image_present, data.lang_features, tilings)
    grid = [150.0 + 30.0 * i for i in range(10)]
    nan = [float("nan")] * len(grid)
    fallback = TableFallback(grid_ms=grid, use_controller=[True] * len(grid), controller_reward=nan,
                             table_reward=nan, reward_difference_se=nan, controller_violation_rate=nan,
                             table_violation_rate=nan, table_violation_upper=nan, max_violation_rate=0.05,
                             confidence=0.95, table=LookupTableDecider(data).state())
    return data, tilings, policy, fallback, DeployedController(policy, fallback).eval()


def with_request_table(data, tilings, policy, fallback):
    """The same policy deployed with a per-request table (``lut_by_request``) answering at every budget, and
    the prompt lengths it reads: the cost model and score table fitted on ``data`` with drawn prompt and
    answer lengths (their values do not change what a decision costs)."""
    from dataclasses import replace

    import torch

    from controller.deploy import DeployedController
    from trainer.request_table import RequestTableDecider

    g = torch.Generator().manual_seed(2)
    n, a = len(data), len(data.action_space)
    prompt = torch.randint(10, 200, (n,), generator=g).float()
    outputs = torch.randint(1, 12, (n, a), generator=g).float()
    data = replace(data, tiling_crops=tilings, prompt_tokens=prompt, output_tokens=outputs)
    request = RequestTableDecider.fit(data)
    table = replace(fallback, use_controller=[False] * len(fallback.grid_ms), request_table=request.state(),
                    request_table_at=[True] * len(fallback.grid_ms))
    return prompt, DeployedController(policy, table).eval()


def multiply_adds(deployed) -> int:
    """Multiply-adds of one decision's matrix products (stage 2 runs at the chosen crops only)."""
    names = ("lang_w", "image_w", "b1_w", "b2_w", "fuse_w", "crops1_w", "crops2_w", "context_w", "heads1_w",
             "heads2_w")
    return sum(getattr(deployed, name).numel() for name in names)


def matmul_rate(repeats: int = 30) -> float:
    """FLOP/s of one large float32 matrix product on this machine now (the arithmetic's ceiling)."""
    import torch

    a, b = torch.randn(1000, 2048), torch.randn(2048, 128)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - started)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / statistics.median(times)


def timed(fn, inputs: list[tuple], warmup: int) -> list[float]:
    import torch

    times = []
    with torch.inference_mode():
        for i, args in enumerate(inputs):
            started = time.perf_counter()
            fn(*args)
            if i >= warmup:
                times.append(time.perf_counter() - started)
    return times


def latency_table(repeats: int, batch_repeats: int, compiled: bool = True, hidden_dim: int = 128) -> list[str]:
    import torch

    from controller.deploy import load_compiled, load_deployed, save_compiled, save_deployed
    from trainer.greedy import policy_greedy

    rows = ["| features | path | batch 1 median µs | p95 µs | p99 µs | batch 1,000 median ms | p95 ms | p99 ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    rate = matmul_rate()
    print(f"float32 matrix products run at {rate / 1e9:.1f} GFLOP/s here (1000 x 2048 x 128)\n", flush=True)
    for label, lang_dim, image_dim in (("embedded (64 + 64)", 64, 64), ("MolmoE-1B (2048 + 2048)", 2048, 2048)):
        data, tilings, policy, fallback, deployed = build(lang_dim, image_dim, hidden_dim)
        macs = multiply_adds(deployed)
        rows.append(f"| {label} | arithmetic floor ({macs / 1e3:.0f}k multiply-adds at {rate / 1e9:.1f} GFLOP/s) "
                    f"| {2 * macs / rate * 1e6:.0f} | | | {2 * macs * 1000 / rate * 1e3:.2f} | | |")
        print(rows[-1], flush=True)
        paths = []
        with tempfile.TemporaryDirectory() as tmp:
            exported = load_deployed(save_deployed(deployed, Path(tmp) / "controller.pt"))

            def two_calls(lang, image, present, budget, tiling):
                crops = exported.stage1(lang, budget, tiling)
                return crops, *exported.stage2(lang, image, present, budget, crops, tiling)

            paths += [("exported", exported.decide), ("exported, stage1 + stage2", two_calls)]
            if compiled:
                package = load_compiled(save_compiled(deployed, Path(tmp) / "controller.pt2"))
                run = package.loader.boxed_run

                def boxed(*args):
                    return run(list(args))

                paths += [("compiled", package), ("compiled, boxed_run", boxed)]

        def training_time(lang, image, present, budget, tiling):
            fallback.controller_at(budget)
            return policy_greedy(policy, image, present, lang, budget, tiling_crops=tiling)

        g = torch.Generator().manual_seed(1)
        n = len(data)
        warmup = 200
        singles = []
        for i in range(warmup + repeats):
            j = i % n
            singles.append((data.lang_features[j:j + 1], data.image_features[j:j + 1], data.image_present[j:j + 1],
                            150.0 + 270.0 * torch.rand(1, generator=g), tilings[j:j + 1]))
        batches = []
        for i in range(20 + batch_repeats):
            j = (i * 1000) % (n - 1000)
            batches.append((data.lang_features[j:j + 1000], data.image_features[j:j + 1000],
                            data.image_present[j:j + 1000], 150.0 + 270.0 * torch.rand(1000, generator=g),
                            tilings[j:j + 1000]))
        for name, fn in (("training-time", training_time), ("deployed (eager)", deployed), *paths):
            one = _stats(timed(fn, singles, warmup), 1e6)
            many = _stats(timed(fn, batches, 20), 1e3)
            rows.append(f"| {label} | {name} | {one[0]:.0f} | {one[1]:.0f} | {one[2]:.0f} | "
                        f"{many[0]:.2f} | {many[1]:.2f} | {many[2]:.2f} |")
            print(rows[-1], flush=True)
        # the per-request table answering for the network, and its cost model alone (every configuration)
        prompt, by_request = with_request_table(data, tilings, policy, fallback)
        with tempfile.TemporaryDirectory() as tmp:
            exported = load_deployed(save_deployed(by_request, Path(tmp) / "controller.pt"))
        with_prompt = [(*args, prompt[i % n:i % n + 1]) for i, args in enumerate(singles)]
        batch_rows = [(i * 1000) % (n - 1000) for i in range(20 + batch_repeats)]
        batches_prompt = [(*args, prompt[j:j + 1000]) for args, j in zip(batches, batch_rows)]
        for name, fn, single, batch in (
                ("exported, lut_by_request answers", exported.decide, with_prompt, batches_prompt),
                ("exported, expected_latency (every configuration)",
                 lambda lang, image, present, budget, tiling, tokens: exported.expected_latency(lang, tiling, tokens),
                 with_prompt, batches_prompt)):
            one = _stats(timed(fn, single, warmup), 1e6)
            many = _stats(timed(fn, batch, 20), 1e3)
            rows.append(f"| {label} | {name} | {one[0]:.0f} | {one[1]:.0f} | {one[2]:.0f} | "
                        f"{many[0]:.2f} | {many[1]:.2f} | {many[2]:.2f} |")
            print(rows[-1], flush=True)
    return rows


def agreement(workspace: str, run: str) -> str:
    """Differences between the exported file of ``run`` and ``ctrl predict`` on every sample and budget."""
    import polars as pl
    import torch

    from controller.deploy import export_controller, load_deployed
    from controller.predict import predict, read_prediction_inputs
    from pipeline import Workspace
    from trainer.fallback import read_fallback
    from trainer.policy import ControllerPolicy
    from trainer.runs import resolve_checkpoint

    ws = Workspace(workspace)
    checkpoint = resolve_checkpoint(ws, run)
    policy = ControllerPolicy.load(checkpoint)
    feats = read_prediction_inputs(ws, policy)
    fallback = read_fallback(checkpoint)
    grid = fallback.grid_ms if fallback is not None else [200.0, 300.0, 400.0]
    budgets = sorted({*grid, *((a + b) / 2 + 0.3 for a, b in zip(grid, grid[1:])), grid[0] - 50.0, grid[-1] + 100.0})
    with tempfile.TemporaryDirectory() as tmp:
        exported = load_deployed(export_controller(ws, checkpoint, Path(tmp) / "controller.pt").path)
        frame = predict(ws, checkpoint, budgets, None)
    n = len(feats["sample_key"])
    differ = 0
    for budget in budgets:
        with torch.inference_mode():
            knobs = torch.stack(exported.decide(feats["lang"], feats["image"], feats["image_present"],
                                                torch.full((n,), budget), feats["tiling_crops"]), 1)
        rows = frame.filter(pl.col("budget_ms") == budget).select("max_crops", "top_k", "num_active_blocks")
        differ += int((knobs != rows.to_torch()).any(1).sum())
    return f"{workspace} run {run}: {n} samples x {len(budgets)} budgets, {differ} decisions differ from ctrl predict"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=5000, help="batch-1 decisions timed per path")
    parser.add_argument("--batch-repeats", type=int, default=200, help="1,000-decision batches timed per path")
    parser.add_argument("--no-compiled", action="store_true", help="leave out the AOTInductor package")
    parser.add_argument("--hidden-dim", type=int, default=128, help="the policy's width (ctrl train --hidden-dim)")
    parser.add_argument("--workspace", help="also compare the exported file with ctrl predict on this workspace")
    parser.add_argument("--run", default="latest")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    print(f"\nCPU, {args.threads} torch thread(s), torch {torch.__version__}, hidden_dim {args.hidden_dim}\n")
    latency_table(args.repeats, args.batch_repeats, compiled=not args.no_compiled, hidden_dim=args.hidden_dim)
    if args.workspace:
        print("\n" + agreement(args.workspace, args.run))


if __name__ == "__main__":
    main()
