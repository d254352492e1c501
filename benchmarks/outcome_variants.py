"""The outcome model's own decisions on unseen samples of generated worlds, variant by variant.

    python benchmarks/outcome_variants.py                          # every world of transfer_worlds
    python benchmarks/outcome_variants.py --only okvqa-tally-st --variants head,family_latency

The outcome model (``trainer.outcome``) is the controller's warm start and KL anchor: where its
per-sample choices fall short of the per-family table, the trained controller does too
(benchmarks/transfer_worlds.py). This checks the outcome model alone, in seconds per world
instead of minutes: it is fitted on the train split of a world's first tree (stopped on its val
split, as ``ctrl train --offline`` fits it), and its decisions on every sample of the second tree
are scored by the hidden expected score and the recorded latency, beside ``lut_p95`` and
``lut_by_family`` fitted on every sample of the first tree, at the budgets ``ctrl train
--offline`` would evaluate. Variants:

* ``head``: the defaults (a p95 latency head);
* ``neighbours40``: ``latency_neighbours=40`` (a median head times the p95 of latency / median,
  predicted out of fold, among the 40 nearest training samples);
* ``ensemble5``: the mean of five seeds' predictions (both heads);
* ``family_latency``: the p95 head's latency replaced, wherever a (question family, crops of the
  image at that configuration) group of the first tree holds at least 20 samples, by that
  group's p95 latency. The controller never reads the family labels: this is an upper bound on
  what a better latency model alone could give;
* ``table30``, ``table60``, ``table120``: not the outcome model but the lookup-table statistics
  of each question's k nearest samples of the first tree (cosine of the question feature): the
  mean score and the p95 latency of every configuration;
* ``family_from_question`` (``_cap32``, ``_cap64``): ``lut_by_question``
  (``trainer.baselines.QuestionFamilyTableDecider``, the deployed fallback table) fitted on the
  first tree: ``lut_by_family`` deciding by the family most of a question's 15 nearest
  first-tree questions carry, not by its label (every question of a family a reference, or at
  most 32 or 64, evenly spaced; 32 is the default).

Prints per variant and world the worst budget against ``lut_by_family`` (in that table's
standard errors), the largest violation rate and the mean gain over ``lut_p95`` (the family
table's beside it).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from transfer_worlds import WORLDS, truth_scores, world_workspace  # noqa: E402

from trainer.baselines import FamilyLookupTableDecider, LookupTableDecider, QuestionFamilyTableDecider  # noqa: E402
from trainer.config import OfflineTrainConfig  # noqa: E402
from trainer.data import ActionSpace, OfflineData, load_offline_data  # noqa: E402
from trainer.evaluate import evaluate_deciders  # noqa: E402
from trainer.outcome import OutcomeConfig, OutcomeDecider, OutcomeModel, fit_outcome_model  # noqa: E402
from trainer.run_record import resolve_config  # noqa: E402

VARIANTS = ("head", "neighbours40", "ensemble5", "family_latency", "table30", "table60", "table120",
            "family_from_question", "family_from_question_cap32", "family_from_question_cap64")
#: the smallest (family, crops) group whose p95 latency ``family_latency`` uses
MIN_GROUP = 20


class EnsembleModel:
    """The mean prediction of several outcome models (what :class:`OutcomeDecider` reads)."""

    def __init__(self, models: list[OutcomeModel]) -> None:
        self.models, self.action_space = models, models[0].action_space

    def predict(self, data: OfflineData) -> tuple[torch.Tensor, torch.Tensor]:
        scores, latencies = zip(*(m.predict(data) for m in self.models))
        return torch.stack(scores).mean(0), torch.stack(latencies).mean(0)


class FamilyLatencyModel:
    """An outcome model whose latency quantile is, where known, its (family, crops) group's p95."""

    def __init__(self, model: OutcomeModel, reference: OfflineData, quantile: float = 0.95) -> None:
        self.model, self.action_space = model, model.action_space
        values: dict[tuple, list[float]] = defaultdict(list)
        for i, keys in enumerate(self._groups(reference)):
            for a, key in enumerate(keys):
                if reference.mask[i, a]:
                    values[key].append(float(reference.latency_ms[i, a]))
        self.p95 = {k: float(torch.tensor(v).quantile(quantile)) for k, v in values.items() if len(v) >= MIN_GROUP}
        self._cached: tuple[OfflineData, torch.Tensor, torch.Tensor] | None = None

    def _groups(self, data: OfflineData) -> list[list[tuple]]:
        space: ActionSpace = self.action_space
        column = [space.max_crops_values.index(a[0]) for a in space.actions]
        crops = data.tiling_crops if data.tiling_crops is not None else torch.zeros(len(data), len(column))
        family = data.family or [None] * len(data)
        return [[(a, family[i], float(crops[i, c])) for a, c in enumerate(column)] for i in range(len(data))]

    def predict(self, data: OfflineData) -> tuple[torch.Tensor, torch.Tensor]:
        # the decider asks once per budget for the same data: the group lookup is done once
        if self._cached is None or self._cached[0] is not data:
            score, latency = self.model.predict(data)
            latency = latency.clone()
            for i, keys in enumerate(self._groups(data)):
                for a, key in enumerate(keys):
                    if key in self.p95:
                        latency[i, a] = self.p95[key]
            self._cached = (data, score, latency)
        return self._cached[1], self._cached[2]


class NeighbourTableModel:
    """Per sample, the lookup-table statistics of its k nearest reference samples by question
    feature (cosine): the mean recorded score and the p95 latency of each configuration."""

    def __init__(self, reference: OfflineData, k: int, quantile: float = 0.95) -> None:
        self.reference, self.k, self.quantile = reference, k, quantile
        self.action_space = reference.action_space
        self._cached: tuple[OfflineData, torch.Tensor, torch.Tensor] | None = None

    def predict(self, data: OfflineData) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cached is not None and self._cached[0] is data:
            return self._cached[1], self._cached[2]
        ref = self.reference
        a = torch.nn.functional.normalize(data.lang_features, dim=1)
        b = torch.nn.functional.normalize(ref.lang_features, dim=1)
        near = (a @ b.T).topk(min(self.k, len(ref)), dim=1).indices  # (N, k)
        score = torch.where(ref.mask, ref.scores("mean"), torch.nan)[near]  # (N, k, A)
        latency = torch.where(ref.mask, ref.latency_ms, torch.nan)[near]
        mean_score = score.nanmean(1).nan_to_num(-1.0)
        p95 = latency.nanquantile(self.quantile, dim=1).nan_to_num(float("inf"))
        self._cached = (data, mean_score, p95)
        return mean_score, p95


def variant_model(name: str, train: OfflineData, val: OfflineData, reference: OfflineData):
    if name == "head":
        return fit_outcome_model(train, val, OutcomeConfig())
    if name == "neighbours40":
        return fit_outcome_model(train, val, OutcomeConfig(latency_neighbours=40))
    if name == "ensemble5":
        return EnsembleModel([fit_outcome_model(train, val, OutcomeConfig(seed=s)) for s in range(5)])
    if name == "family_latency":
        return FamilyLatencyModel(fit_outcome_model(train, val, OutcomeConfig()), reference)
    if name.startswith("table"):
        return NeighbourTableModel(reference, int(name.removeprefix("table")))
    msg = f"unknown variant {name!r}; one of {', '.join(VARIANTS)}"
    raise ValueError(msg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], help="a world's name (repeatable)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    worlds = [w for ws in WORLDS.values() for w in ws if not args.only or w.name in args.only]
    print("| world | variant | worst - lut_by_family (its se) | max violation | gain over lut_p95 (family table's) |")
    print("|---|---|---:|---:|---:|")
    for world in worlds:
        first = load_offline_data(world_workspace(world.datasets, world.samples, world.train_seed))
        second = load_offline_data(world_workspace(world.datasets, world.samples, world.test_seed))
        test = truth_scores(second, world.datasets, world.samples, world.test_seed)
        config = resolve_config(OfflineTrainConfig(workspace="."), first)
        train, val = first.subset("train"), first.subset("val")
        tables = [LookupTableDecider(first), FamilyLookupTableDecider(first)]
        for variant in variants:
            if variant.startswith("family_from_question"):
                cap = int(variant.split("_cap")[1]) if "_cap" in variant else len(first)
                decider = QuestionFamilyTableDecider(first, references_per_family=cap, name=variant)
            else:
                decider = OutcomeDecider(variant_model(variant, train, val, first), name=variant)
            frame = evaluate_deciders(test, [*tables, decider], config.eval_budgets, config.reward)
            by = {(r["decider"], r["budget_ms"]): r for r in frame.iter_rows(named=True)}
            budgets = config.eval_budgets
            z = [(by[(variant, b)]["accuracy"] - by[("lut_by_family", b)]["accuracy"])
                 / by[("lut_by_family", b)]["accuracy_se"] for b in budgets]
            mean = {d: sum(by[(d, b)]["accuracy"] for b in budgets) / len(budgets)
                    for d in (variant, "lut_p95", "lut_by_family")}
            worst = min(range(len(z)), key=z.__getitem__)
            print(f"| {world.name} | {variant} | {z[worst]:+.2f} ({budgets[worst]:.0f} ms) | "
                  f"{max(by[(variant, b)]['violation_rate'] for b in budgets):.1%} | "
                  f"{mean[variant] - mean['lut_p95']:+.3f} ({mean['lut_by_family'] - mean['lut_p95']:+.3f}) |",
                  flush=True)


if __name__ == "__main__":
    main()
