"""Controller decision latency and offline GRPO training throughput on CPU.

    python benchmarks/bench_trainer.py                 # 5,000 synthetic samples x 27 configurations

1. Decision latency: one decision (``ControllerPolicy.log_probs`` under a full mask + argmax,
   inference mode) at batch 1, median and p95 of ``--repeats`` calls after 50 warm-up calls,
   for the embedded model's feature widths (64) and MolmoE-1B's (2048 language, 2048 image).
2. Training: ``train_offline`` with the default config (G = 5, 8 budgets per sample, batch 32)
   for ``--epochs`` epochs on an in-process ``OfflineData`` of ``--samples`` samples x 27
   configurations (random features, synthetic outcomes; split 80/10/10 by sample key),
   without the final evaluation. Throughput = sampled groups / training wall time.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "benchmarks" / ".cache"


@contextmanager
def torch_threads(n: int):
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def synthetic_data(num_samples: int, lang_dim: int, image_dim: int, seed: int = 0):
    """An OfflineData with a latency/accuracy trade-off like the sample data (all 27 configurations recorded)."""
    import torch

    from pipeline.knobs import BALANCED_MAX_CROPS, BALANCED_NUM_ACTIVE_BLOCKS, BALANCED_TOP_K
    from trainer.data import ActionSpace, OfflineData, split_of

    g = torch.Generator().manual_seed(seed)
    space = ActionSpace(tuple(itertools.product(BALANCED_MAX_CROPS, BALANCED_TOP_K, BALANCED_NUM_ACTIVE_BLOCKS)))
    knobs = space.knob_values()
    n = num_samples
    size = 0.8 + 0.6 * torch.rand(n, 1, generator=g)  # per-sample image size factor
    latency = (55 + 11 * (knobs[:, 0] + 1) * size + knobs[:, 2] * (4 + 0.4 * knobs[:, 1])) * (
        1 + 0.05 * torch.randn(n, len(space), generator=g))
    logit = (1.5 * torch.log2(1 + knobs[:, 0]) / 3.7 + knobs[:, 1] / 12 + (knobs[:, 2] - 14) / 4 - 1.2
             + torch.randn(n, 1, generator=g))
    score = (torch.rand(n, len(space), generator=g) < torch.sigmoid(logit)).float()
    keys = [f"ex:{i}" for i in range(n)]
    return OfflineData(action_space=space, model_fingerprint="bench" * 8, dataset=["synthetic"] * n, sample_key=keys,
                       example_id=[str(i) for i in range(n)], split=[split_of("synthetic", k) for k in keys],
                       image_features=torch.randn(n, image_dim, generator=g),
                       image_present=torch.ones(n, dtype=torch.bool),
                       lang_features=torch.randn(n, lang_dim, generator=g) + size, score=score,
                       latency_ms=latency.float(), latency_is_sample=torch.ones(n, len(space), dtype=torch.bool),
                       mask=torch.ones(n, len(space), dtype=torch.bool))


def decision_latency(lang_dim: int, image_dim: int, repeats: int) -> tuple[float, float, int]:
    """(median µs, p95 µs, parameter count) of one batch-1 decision."""
    import torch

    from trainer.policy import ControllerPolicy, PolicyConfig

    data = synthetic_data(64, lang_dim, image_dim)
    policy = ControllerPolicy(PolicyConfig(lang_feature_dim=lang_dim, image_feature_dim=image_dim,
                                           budget_min_ms=150.0, budget_max_ms=420.0), data.action_space).eval()
    image, present, lang, mask = data.image_features[:1], data.image_present[:1], data.lang_features[:1], data.mask[:1]
    budget = torch.tensor([250.0])
    times = []
    with torch.inference_mode():
        for i in range(50 + repeats):
            started = time.perf_counter()
            policy.log_probs(image, present, lang, budget, mask).argmax(-1)
            if i >= 50:
                times.append(time.perf_counter() - started)
    times.sort()
    return (statistics.median(times) * 1e6, times[int(0.95 * len(times))] * 1e6,
            sum(p.numel() for p in policy.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=1000, help="decisions timed per setting")
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()

    import polars as pl

    from trainer.config import OfflineTrainConfig
    from trainer.offline import train_offline

    with torch_threads(args.threads):
        print(f"\nCPU, {args.threads} torch threads\n")
        print("| decision (batch 1) | parameters | median µs | p95 µs |")
        print("|---|---:|---:|---:|")
        for label, lang_dim, image_dim in (("embedded features (64 + 64)", 64, 64),
                                           ("MolmoE-1B widths (2048 + 2048)", 2048, 2048)):
            median, p95, params = decision_latency(lang_dim, image_dim, args.repeats)
            print(f"| {label} | {params:,} | {median:.0f} | {p95:.0f} |")

        data = synthetic_data(args.samples, 64, 64)
        ws = CACHE / "trainer-ws"
        shutil.rmtree(ws, ignore_errors=True)
        config = OfflineTrainConfig(workspace=ws, num_epochs=args.epochs, disable_evaluation=True, cross_fit_folds=0)
        started = time.perf_counter()
        result = train_offline(config, data=data)
        seconds = time.perf_counter() - started
        metrics = result.metrics
        epochs = metrics.filter(pl.col("kind") == "epoch")
        groups = int(metrics.filter(pl.col("kind") == "step")["groups"].sum())
        val_s = float(epochs["wall_time_s"][0])  # epoch 0 = load + one validation pass, before any step
        print(f"\n| training ({len(data):,} samples x {len(data.action_space)} configurations, "
              f"{len(data.subset('train')):,} train) | value |")
        print("|---|---:|")
        print(f"| {args.epochs} epochs, wall time | {seconds:.1f} s |")
        print(f"| per epoch (steps + validation + checkpoints) | {seconds / args.epochs:.2f} s |")
        print(f"| groups sampled (G = {config.group_size}) | {groups:,} |")
        print(f"| throughput | {groups / seconds:,.0f} groups/s |")
        print(f"| validation expected reward, initial -> best | {result.initial_val_expected_reward:.3f} -> "
              f"{result.best_val_expected_reward:.3f} |")
        print(f"| (first validation pass: {val_s:.2f} s) | |")
        shutil.rmtree(ws, ignore_errors=True)


if __name__ == "__main__":
    main()
