"""The controller on unseen samples of generated worlds, scored against the hidden truth.

    python benchmarks/transfer_worlds.py                         # the worlds that chose the defaults
    python benchmarks/transfer_worlds.py --worlds check          # the worlds kept for checking them
    python benchmarks/transfer_worlds.py --worlds final          # worlds no choice has seen
    python benchmarks/transfer_worlds.py --set violation_target=0.02 --out rows.jsonl
    python benchmarks/transfer_worlds.py --worlds all --render rows.jsonl   # the tables again, no training

Each world is a pair of synthetic origin-format trees with the same datasets and sizes and
different seeds (``synthetic``): ``ctrl train --offline`` (the defaults, or ``--set`` overrides)
learns on the first; its deployed controller (best checkpoint and table fallback) then decides
every sample of the second, as ``ctrl predict`` would. Every decision is scored by the second
world's hidden expected score of the chosen configuration (no outcome noise) and its recorded
(drawn) latency. Beside it: the tables fitted on every sample of the first world (``lut_p95``,
``lut_by_family``) and the clairvoyant choice (per sample, the best expected score whose
latency fits). Prints per world a table of accuracy (violation rate) per decider and budget,
then the checks of the controller's targets: its worst budget against the family table in that
table's standard errors, its largest violation rate, both mean gains over the p95 table and
the gap to the clairvoyant choice. ``lut_by_cluster`` is the table of questions clustered without
labels (``trainer.clusters``) on every sample of the first world. ``--set ignore_family_labels=true``
trains as on data without labels; the family table (the labels known) stays the reference.

Worlds are cached in benchmarks/.cache/transfer (ingest + embedded-model features).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "benchmarks" / ".cache" / "transfer"


@dataclass(frozen=True)
class World:
    name: str
    datasets: tuple[str, ...]
    samples: int  # per dataset, in each of the two trees
    train_seed: int
    test_seed: int
    # question template family weights of the training tree and of the unseen one (None: the training
    # tree's); families without labels (``labels=False``) show only in the question's words
    family_weights: tuple[tuple[str, float], ...] = ()
    test_family_weights: tuple[tuple[str, float], ...] | None = None
    labels: bool = True

    def spec_options(self, test: bool) -> dict:
        weights = self.test_family_weights if test and self.test_family_weights is not None else self.family_weights
        return {"family_weights": weights, "write_family": self.labels}


#: worlds that chose the defaults (``tune``), worlds kept out of the first choices of them (``check``,
#: ``fresh``; docs/results.md says which choices they saw later) and worlds no choice has seen (``final``)
WORLDS = {
    "tune": (
        World("coco-text", ("coco_2014_vqa", "text_vqa"), 400, 10, 110),  # tests/test_controller_vs_family.py
        World("text-okvqa", ("text_vqa", "okvqa"), 400, 11, 111),
        World("four-mix", ("coco_2014_vqa", "okvqa", "doc_qa", "science_qa_img"), 250, 12, 112),
    ),
    "check": (
        World("coco-text-small", ("coco_2014_vqa", "text_vqa"), 150, 20, 120),
        World("okvqa-tally-st", ("okvqa", "tally_qa", "st_qa"), 300, 21, 121),
        World("five-mix-large", ("coco_2014_vqa", "text_vqa", "okvqa", "doc_qa", "science_qa_img"), 1000, 22, 122),
        World("coco-text-300", ("coco_2014_vqa", "text_vqa"), 300, 31, 131),
    ),
    "fresh": (
        World("text-okvqa-small", ("text_vqa", "okvqa"), 200, 41, 141),
        World("coco-okvqa-doc", ("coco_2014_vqa", "okvqa", "doc_qa"), 300, 42, 142),
        World("tally-st-science", ("tally_qa", "st_qa", "science_qa_img"), 250, 43, 143),
    ),
    "final": (
        World("coco-tally-doc", ("coco_2014_vqa", "tally_qa", "doc_qa"), 200, 51, 151),
        World("st-okvqa-science", ("st_qa", "okvqa", "science_qa_img"), 200, 52, 152),
    ),
    # made after every choice of the label-free tables: no family labels anywhere (the family shows
    # only in the question's words), families of unequal size, a family only in the unseen tree
    "unlabelled": (
        World("coco-text-unequal", ("coco_2014_vqa", "text_vqa"), 400, 61, 161, labels=False,
              family_weights=(("count", 4.0), ("color", 0.3), ("written_text", 3.0), ("clock_time", 0.3))),
        World("text-okvqa-new-family", ("text_vqa", "okvqa"), 400, 62, 162, labels=False,
              family_weights=(("decade", 0.0),), test_family_weights=(("decade", 2.0),)),
        World("coco-okvqa-doc-unequal", ("coco_2014_vqa", "okvqa", "doc_qa"), 300, 63, 163, labels=False,
              family_weights=(("presence", 5.0), ("sport", 0.2), ("use", 3.0), ("animal_family", 0.3))),
    ),
}


def world_workspace(datasets: tuple[str, ...], samples: int, seed: int, **spec_options) -> Path:
    """The workspace of one generated tree, ingested with embedded-model features (cached)."""
    from crossfit_worlds import build_world

    tag = ""
    if spec_options.get("family_weights") or spec_options.get("write_family") is False:
        weights = "".join(f"{f}{w:g}" for f, w in spec_options.get("family_weights", ()))
        tag = f"-w{weights}" + ("-unlabelled" if spec_options.get("write_family") is False else "")
    return build_world(CACHE / f"{'+'.join(datasets)}-{samples}-s{seed}{tag}", datasets, seed, samples,
                       **spec_options)


def truth_scores(data, datasets: tuple[str, ...], samples: int, seed: int, **spec_options):
    """``data`` with ``score`` (and ``mean_score``) replaced by the hidden expected score of every
    (sample, configuration) of the world generated from (datasets, samples, seed)."""
    import torch

    from synthetic import SyntheticSpec, expected_score_matrix

    configs = [tuple(int(v) for v in k) for k in data.action_space.knob_values().tolist()]
    spec = SyntheticSpec(datasets=datasets, num_samples=samples, seed=seed, **spec_options)
    score = torch.from_numpy(expected_score_matrix(spec, data.dataset, data.sample_key, configs))
    score = torch.where(data.mask, score, float("nan"))
    return replace(data, score=score, mean_score=score)


def truth_families(data, datasets: tuple[str, ...], samples: int, seed: int, **spec_options):
    """``data`` with every sample's question family as the generator drew it (the family table's labels
    where the world's files carry none)."""
    from pipeline.keys import build_sample_key
    from synthetic import SyntheticSpec, build_truth, samples_of

    spec = SyntheticSpec(datasets=datasets, num_samples=samples, seed=seed,
                         **{**spec_options, "write_family": True})
    truth = build_truth(spec)
    family = {(ds, build_sample_key(ds, s.metadata)[0]): s.metadata["family"]
              for ds in datasets for s in samples_of(ds, truth[ds])}
    return replace(data, family=[family[(d, k)] for d, k in zip(data.dataset, data.sample_key)])


def evaluate_world(world: World, overrides: dict, folds: int | None, reuse: bool) -> list[dict]:
    import torch

    from trainer.baselines import ClairvoyantDecider, FamilyLookupTableDecider, LookupTableDecider
    from trainer.config import OfflineTrainConfig
    from trainer.data import load_offline_data
    from trainer.evaluate import evaluate_deciders
    from trainer.fallback import PolicyDecider, read_fallback
    from trainer.policy import ControllerPolicy
    from trainer.runs import RunDir, resolve_checkpoint

    train_ws = world_workspace(world.datasets, world.samples, world.train_seed, **world.spec_options(test=False))
    test_ws = world_workspace(world.datasets, world.samples, world.test_seed, **world.spec_options(test=True))
    settings = {**overrides, **({} if folds is None else {"cross_fit_folds": folds})}
    named = "-".join(f"{k}{json.dumps(v, sort_keys=True)}" for k, v in sorted(settings.items())) or "defaults"
    run_id = "transfer-" + re.sub(r"[^A-Za-z0-9._-]+", "", named)[:100]
    start = time.perf_counter()
    if not (reuse and (train_ws / "runs" / run_id / "evaluation.done").exists()):
        from trainer.offline import train_offline

        shutil.rmtree(train_ws / "runs" / run_id, ignore_errors=True)
        train_offline(OfflineTrainConfig(workspace=train_ws, run_id=run_id, disable_evaluation=True, **settings))
        (train_ws / "runs" / run_id / "evaluation.done").write_text("")
    seconds = time.perf_counter() - start
    from pipeline.workspace import Workspace

    run = RunDir.resolve(Workspace(train_ws), run_id)
    saved = OfflineTrainConfig.from_json(run.read_config())
    checkpoint = resolve_checkpoint(Workspace(train_ws), run.path)
    fallback = read_fallback(checkpoint)
    train_data = load_offline_data(train_ws)
    test_data = load_offline_data(test_ws)
    if not world.labels:  # the reference tables know the families the files do not record
        train_data = truth_families(train_data, world.datasets, world.samples, world.train_seed,
                                    **world.spec_options(test=False))
        test_data = truth_families(test_data, world.datasets, world.samples, world.test_seed,
                                   **world.spec_options(test=True))
    test = truth_scores(test_data, world.datasets, world.samples, world.test_seed, **world.spec_options(test=True))
    policy = ControllerPolicy.load(checkpoint, model_fingerprint=test.model_fingerprint)
    from trainer.outcome import OUTCOME_FILE, OutcomeDecider, OutcomeModel

    budgets = [round(b, 1) for b in saved.eval_budgets]
    from trainer.clusters import cluster_table

    clusters = cluster_table(train_data.without_family_labels(), budgets, saved.reward, seed=saved.seed)
    deciders = [PolicyDecider(policy, fallback), PolicyDecider(policy, name="policy"),
                OutcomeDecider(OutcomeModel.load(run.path / OUTCOME_FILE)), LookupTableDecider(train_data),
                FamilyLookupTableDecider(train_data), clusters, ClairvoyantDecider()]
    frame = evaluate_deciders(test, deciders, budgets, saved.reward)
    # the fallback's choice per budget: False where the table answers for the controller
    kept = None if fallback is None else fallback.controller_at(torch.tensor(budgets)).tolist()
    return [{"world": world.name, "decider": r["decider"], "budget_ms": r["budget_ms"], "accuracy": r["accuracy"],
             "se": r["accuracy_se"], "violation": r["violation_rate"], "n": r["num_samples"], "train_s": seconds,
             "fallback": None if kept is None else kept[budgets.index(r["budget_ms"])],
             "fallback_table": None if fallback is None else fallback.table.get("name", "lut_p95"),
             "groups": len(fallback.lookup_table().families) if fallback is not None and hasattr(
                 fallback.lookup_table(), "families") else 0,
             "clusters": len(clusters.families)}
            for r in frame.iter_rows(named=True)]


def print_world(rows: list[dict]) -> dict:
    world = rows[0]["world"]
    budgets = sorted({r["budget_ms"] for r in rows})
    deciders = list(dict.fromkeys(r["decider"] for r in rows))
    by = {(r["decider"], r["budget_ms"]): r for r in rows}
    print(f"\n### {world} ({rows[0]['n']} unseen samples, trained in {rows[0]['train_s']:.0f} s; fallback table "
          f"{rows[0].get('fallback_table')} with {rows[0].get('groups', 0)} groups; lut_by_cluster "
          f"{rows[0].get('clusters', 0)} clusters)\n")
    print("| decider | " + " | ".join(f"{b:.0f}" for b in budgets) + " | mean |")
    print("|---|" + "---:|" * (len(budgets) + 1))
    for d in deciders:
        cells = []
        for b in budgets:
            r = by[(d, b)]
            mark = "" if d != "controller" or r["fallback"] is None else ("" if r["fallback"] else "ᵗ")
            cells.append(f"{r['accuracy']:.3f}{mark} ({r['violation']:.0%})")
        mean = sum(by[(d, b)]["accuracy"] for b in budgets) / len(budgets)
        print(f"| {d} | " + " | ".join(cells) + f" | {mean:.3f} |")
    ctrl = [by[("controller", b)] for b in budgets]
    # the target: at every budget, at most one standard error of the family table's accuracy below it
    family = [by[("lut_by_family", b)] for b in budgets]
    z = [(r["accuracy"] - f["accuracy"]) / f["se"] for r, f in zip(ctrl, family)]
    mean = {d: sum(by[(d, b)]["accuracy"] for b in budgets) / len(budgets) for d in deciders}
    gain_ctrl, gain_family = mean["controller"] - mean["lut_p95"], mean["lut_by_family"] - mean["lut_p95"]
    summary = {"world": world, "n": rows[0]["n"], "worst_z": min(z), "worst_budget": budgets[z.index(min(z))],
               "max_violation": max(r["violation"] for r in ctrl), "gain_ctrl": gain_ctrl, "gain_family": gain_family,
               "to_clairvoyant": mean["clairvoyant"] - mean["controller"]}
    print(f"\nworst controller - family table: {min(z):+.2f} of its se (at {summary['worst_budget']:.0f} ms); "
          f"max violation {summary['max_violation']:.1%}; mean gain over lut_p95: controller {gain_ctrl:+.3f}, "
          f"family table {gain_family:+.3f}; clairvoyant - controller {summary['to_clairvoyant']:+.3f}", flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", choices=sorted(WORLDS) + ["all"], default="tune")
    parser.add_argument("--only", action="append", default=[], help="a world's name (repeatable)")
    parser.add_argument("--folds", type=int, default=None, help="cross_fit_folds (default: the trainer's)")
    parser.add_argument("--set", action="append", default=[], help="OfflineTrainConfig field=JSON value")
    parser.add_argument("--reuse", action="store_true", help="reuse a finished run of the same settings")
    parser.add_argument("--out", type=Path, default=None, help="append the rows as JSON lines here")
    parser.add_argument("--render", type=Path, default=None, help="print the tables of rows written with --out")
    args = parser.parse_args()
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    worlds = [w for group, ws in WORLDS.items() if args.worlds in (group, "all") for w in ws]
    if args.only:
        worlds = [w for w in worlds if w.name in args.only]
    summaries = []
    if args.render is not None:  # tables of rows written before, without training
        rows = [json.loads(line) for line in args.render.read_text().splitlines()]
        worlds = [w for w in worlds if any(r["world"] == w.name for r in rows)]
    for world in worlds:
        if args.render is not None:
            summaries.append(print_world([r for r in rows if r["world"] == world.name]))
            continue
        rows = evaluate_world(world, overrides, args.folds, args.reuse)
        if args.out is not None:
            with args.out.open("a") as f:
                for r in rows:
                    f.write(json.dumps({**r, "settings": overrides}) + "\n")
        summaries.append(print_world(rows))
    print("\n| world | unseen samples | worst controller - lut_by_family (its se) | max violation | "
          "gain over lut_p95: controller | lut_by_family | clairvoyant - controller |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s in summaries:
        print(f"| {s['world']} | {s['n']} | {s['worst_z']:+.2f} ({s['worst_budget']:.0f} ms) | "
              f"{s['max_violation']:.1%} | {s['gain_ctrl']:+.3f} | {s['gain_family']:+.3f} | "
              f"{s['to_clairvoyant']:+.3f} |")


if __name__ == "__main__":
    main()
