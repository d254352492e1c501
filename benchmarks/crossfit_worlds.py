"""Cross-fitted controller against the p95 table (and the per-family table) across worlds.

    python benchmarks/crossfit_worlds.py                       # the synthetic worlds (embedded features)
    python benchmarks/crossfit_worlds.py --workspace NAME=DIR  # also an ingested workspace with features

Builds (once, cached in benchmarks/.cache/worlds) the synthetic MolmoE-like worlds below
(ingest + extract-features with the embedded model), trains ``ctrl train --offline
--cross-fit-folds K`` on each (plus any ``--workspace``), and prints per world, out of fold over
every sample: the mean accuracy over the budget grid of the controller, the p95 table, the
per-family table and the oracle; the worst paired difference controller - table at any budget
in standard errors; the largest violation rate. Extra options go to ``OfflineTrainConfig``
through ``--set key=value``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "benchmarks" / ".cache" / "worlds"

#: (name, datasets, seed): three worlds with different seeds and question mixes
SYNTHETIC_WORLDS = (("syn-coco-text-0", ("coco_2014_vqa", "text_vqa"), 0),
                    ("syn-text-okvqa-1", ("text_vqa", "okvqa"), 1),
                    ("syn-coco-text-2", ("coco_2014_vqa", "text_vqa"), 2))


def build_world(root: Path, datasets: tuple[str, ...], seed: int, samples: int, **spec_options) -> Path:
    """The workspace ``root/ws`` of a generated tree in ``root/tree``, ingested with embedded-model
    features: built once (``root/.ready`` marks it done), reused afterwards. ``spec_options``: more
    ``SyntheticSpec`` fields (family weights, unlabelled families)."""
    from features import FeatureConfig, extract_features
    from pipeline.ingestion import IngestConfig, ingest
    from synthetic import SyntheticSpec, generate_tree

    ws = root / "ws"
    if (root / ".ready").exists():
        return ws
    shutil.rmtree(root, ignore_errors=True)
    generate_tree(SyntheticSpec(datasets=datasets, num_samples=samples, seed=seed, **spec_options), root / "tree")
    ingest(IngestConfig(paths=[root / "tree" / "exp5", root / "tree" / "exp6"], workspace=ws))
    extract_features(FeatureConfig(workspace=ws, images_dir=root / "tree" / "images"))
    (root / ".ready").write_text("ok\n")
    return ws


def synthetic_workspace(name: str, datasets: tuple[str, ...], seed: int, samples: int) -> Path:
    return build_world(CACHE / f"{name}-{samples}", datasets, seed, samples)


def summarize(frame) -> dict[str, float]:
    import polars as pl

    def mean_accuracy(decider: str) -> float | None:
        part = frame.filter(pl.col("decider") == decider)
        return None if part.is_empty() else float(part["accuracy"].mean())

    ctrl = frame.filter(pl.col("decider") == "controller").sort("budget_ms")
    z = [d / s if s else (0.0 if d == 0 else float("inf") * (1 if d > 0 else -1))
         for d, s in zip(ctrl["accuracy_vs_table"], ctrl["accuracy_vs_table_se"])]
    return {"controller": mean_accuracy("controller"), "policy": mean_accuracy("policy"),
            "outcome": mean_accuracy("outcome"),
            "lut_p95": mean_accuracy("lut_p95"), "lut_by_family": mean_accuracy("lut_by_family"),
            "oracle": mean_accuracy("oracle"), "worst_z": min(z),
            "max_violation": float(ctrl["violation_rate"].max()),
            "table_max_violation": float(frame.filter(pl.col("decider") == "lut_p95")["violation_rate"].max()),
            "num_samples": int(ctrl["num_samples"][0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=400, help="samples per synthetic dataset")
    parser.add_argument("--workspace", action="append", default=[], help="NAME=DIR of an ingested workspace")
    parser.add_argument("--no-synthetic", action="store_true")
    parser.add_argument("--set", action="append", default=[], help="OfflineTrainConfig field=JSON value")
    args = parser.parse_args()

    from trainer.config import OfflineTrainConfig
    from trainer.offline import train_offline

    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    worlds = [(name, Path(path)) for name, path in (w.split("=", 1) for w in args.workspace)]
    if not args.no_synthetic:
        worlds += [(name, synthetic_workspace(name, datasets, seed, args.samples))
                   for name, datasets, seed in SYNTHETIC_WORLDS]
    header = ("world", "N", "ctrl", "policy", "outcome", "lut_p95", "lut_by_family", "oracle", "worst ctrl-table (se)",
              "ctrl max viol", "table max viol", "train s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, ws in worlds:
        run_id = f"crossfit-{args.folds}-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        shutil.rmtree(ws / "runs" / run_id, ignore_errors=True)
        start = time.perf_counter()
        result = train_offline(OfflineTrainConfig(workspace=ws, cross_fit_folds=args.folds, run_id=run_id,
                                                  **overrides))
        s = summarize(result.evaluation)

        def fmt(v: float | None) -> str:
            return "" if v is None else f"{v:.3f}"

        print(f"| {name} | {s['num_samples']} | {fmt(s['controller'])} | {fmt(s['policy'])} | {fmt(s['outcome'])} | "
              f"{fmt(s['lut_p95'])} | {fmt(s['lut_by_family'])} | {fmt(s['oracle'])} | {s['worst_z']:+.2f} | "
              f"{s['max_violation']:.1%} | "
              f"{s['table_max_violation']:.1%} | {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
