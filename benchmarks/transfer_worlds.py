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
the gap to the clairvoyant choice.

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
}


def world_workspace(datasets: tuple[str, ...], samples: int, seed: int) -> Path:
    """The workspace of one generated tree, ingested with embedded-model features (cached)."""
    from crossfit_worlds import build_world

    return build_world(CACHE / f"{'+'.join(datasets)}-{samples}-s{seed}", datasets, seed, samples)


def truth_scores(data, datasets: tuple[str, ...], samples: int, seed: int):
    """``data`` with ``score`` (and ``mean_score``) replaced by the hidden expected score of every
    (sample, configuration) of the world generated from (datasets, samples, seed)."""
    import torch

    from synthetic import SyntheticSpec, expected_score_matrix

    configs = [tuple(int(v) for v in k) for k in data.action_space.knob_values().tolist()]
    spec = SyntheticSpec(datasets=datasets, num_samples=samples, seed=seed)
    score = torch.from_numpy(expected_score_matrix(spec, data.dataset, data.sample_key, configs))
    score = torch.where(data.mask, score, float("nan"))
    return replace(data, score=score, mean_score=score)


def evaluate_world(world: World, overrides: dict, folds: int | None, reuse: bool) -> list[dict]:
    import torch

    from trainer.baselines import ClairvoyantDecider, FamilyLookupTableDecider, LookupTableDecider
    from trainer.config import OfflineTrainConfig
    from trainer.data import load_offline_data
    from trainer.evaluate import evaluate_deciders
    from trainer.fallback import PolicyDecider, read_fallback
    from trainer.policy import ControllerPolicy
    from trainer.runs import RunDir, resolve_checkpoint

    train_ws = world_workspace(world.datasets, world.samples, world.train_seed)
    test_ws = world_workspace(world.datasets, world.samples, world.test_seed)
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
    test = truth_scores(test_data, world.datasets, world.samples, world.test_seed)
    policy = ControllerPolicy.load(checkpoint, model_fingerprint=test.model_fingerprint)
    from trainer.outcome import OUTCOME_FILE, OutcomeDecider, OutcomeModel

    deciders = [PolicyDecider(policy, fallback), PolicyDecider(policy, name="policy"),
                OutcomeDecider(OutcomeModel.load(run.path / OUTCOME_FILE)), LookupTableDecider(train_data),
                FamilyLookupTableDecider(train_data), ClairvoyantDecider()]
    budgets = [round(b, 1) for b in saved.eval_budgets]
    frame = evaluate_deciders(test, deciders, budgets, saved.reward)
    # the fallback's choice per budget: False where the table answers for the controller
    kept = None if fallback is None else fallback.controller_at(torch.tensor(budgets)).tolist()
    return [{"world": world.name, "decider": r["decider"], "budget_ms": r["budget_ms"], "accuracy": r["accuracy"],
             "se": r["accuracy_se"], "violation": r["violation_rate"], "n": r["num_samples"], "train_s": seconds,
             "fallback": None if kept is None else kept[budgets.index(r["budget_ms"])]}
            for r in frame.iter_rows(named=True)]


def print_world(rows: list[dict]) -> dict:
    world = rows[0]["world"]
    budgets = sorted({r["budget_ms"] for r in rows})
    deciders = list(dict.fromkeys(r["decider"] for r in rows))
    by = {(r["decider"], r["budget_ms"]): r for r in rows}
    print(f"\n### {world} ({rows[0]['n']} unseen samples, trained in {rows[0]['train_s']:.0f} s)\n")
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
