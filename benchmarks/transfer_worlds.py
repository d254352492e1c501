"""The controller on unseen samples of generated worlds, scored against the hidden truth.

    python benchmarks/transfer_worlds.py                         # the worlds that chose the defaults
    python benchmarks/transfer_worlds.py --worlds check          # the worlds kept for checking them
    python benchmarks/transfer_worlds.py --worlds final          # worlds no choice has seen
    python benchmarks/transfer_worlds.py --worlds tiling         # each request's tiling in the features
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
``lut_by_tiling`` (where the data has tilings and families) also knows each request's tiling: per
(family, configuration, crops used) the training mean score and p95 latency (coarser cells where one
has under 5 samples). The ``tiling`` worlds write their images at a scale at which the features'
tilings are the crops the hidden latency was drawn with (``TILING_SPEC``). ``cost_clairvoyant`` (where
``latency_clairvoyant`` is shown) splits that reference's lead in two: the same expected scores, each
request's *expected* latency known from the hidden truth (its tiling, prompt and answer-length law, without
the draw's noise), held to it times the training tree's 95th percentile of measured / expected: what a perfect
cost model could buy a table. Its lead over a decider is what cost knowledge can still add; the rest of
``latency_clairvoyant``'s is the draw, which no decision made before the request runs can know.

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
    # more ``SyntheticSpec`` fields of both trees as (field, value) pairs (image_scale, image_sizes,
    # prompt_context, max_crops, ...); ``world_workspace`` names each in its cache tag
    spec: tuple[tuple[str, object], ...] = ()

    def spec_options(self, test: bool) -> dict:
        weights = self.test_family_weights if test and self.test_family_weights is not None else self.family_weights
        return {"family_weights": weights, "write_family": self.labels, **dict(self.spec)}


#: the tiling worlds' trees: images written at 0.375 (``synthetic.truth.TILING_IMAGE_SCALE``, 84/224) of
#: their original size, so the embedded preprocessor tiles each file as Molmo's rule tiles the original
#: (the features' tilings are the crops the latency was drawn with); the real sets' size spread; prompts
#: with context of a length per family; max_crops up to 12 (1-12 crops)
TILING_SPEC: tuple[tuple[str, object], ...] = (("image_scale", 0.375), ("image_sizes", "vqa"),
                                               ("prompt_context", True), ("max_crops", (2, 6, 12)))


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
    # a request's tiling observable in the features, so that a per-request latency model can
    # learn from it; no family labels in the files (``lut_by_tiling`` reads the generator's)
    "tiling": (
        World("tiling-coco-text", ("coco_2014_vqa", "text_vqa"), 400, 71, 171, labels=False, spec=TILING_SPEC),
        World("tiling-text-doc-okvqa", ("text_vqa", "doc_qa", "okvqa"), 300, 72, 172, labels=False,
              spec=TILING_SPEC),
        World("tiling-coco-doc-st", ("coco_2014_vqa", "doc_qa", "st_qa"), 300, 73, 173, labels=False,
              spec=TILING_SPEC),
    ),
}

#: short names of ``World.spec`` fields in a cache tag
_TAG_NAMES = {"image_scale": "x", "image_sizes": "sizes", "prompt_context": "ctx", "max_crops": "c", "top_k": "k",
              "num_active_blocks": "b"}


def _tag_value(value: object) -> str:
    if isinstance(value, bool):
        return "" if value else "0"
    if isinstance(value, (tuple, list)):
        return ".".join(_tag_value(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def world_workspace(datasets: tuple[str, ...], samples: int, seed: int, **spec_options) -> Path:
    """The workspace of one generated tree, ingested with embedded-model features (cached)."""
    from crossfit_worlds import build_world

    tag = ""
    if spec_options.get("family_weights") or spec_options.get("write_family") is False:
        weights = "".join(f"{f}{w:g}" for f, w in spec_options.get("family_weights", ()))
        tag = f"-w{weights}" + ("-unlabelled" if spec_options.get("write_family") is False else "")
    for name, value in sorted(spec_options.items()):  # World.spec: every other field, by name
        if name not in ("family_weights", "write_family"):
            tag += f"-{_TAG_NAMES.get(name, name)}{_tag_value(value)}"
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


def truth_latencies(data, datasets: tuple[str, ...], samples: int, seed: int, **spec_options):
    """(N, A) float32: the hidden expected latency of every (sample, configuration) of ``data``."""
    import torch

    from synthetic import SyntheticSpec, expected_latency_matrix

    configs = [tuple(int(v) for v in k) for k in data.action_space.knob_values().tolist()]
    spec = SyntheticSpec(datasets=datasets, num_samples=samples, seed=seed, **spec_options)
    return torch.from_numpy(expected_latency_matrix(spec, data.dataset, data.sample_key, configs))


class CostClairvoyantDecider:
    """``cost_clairvoyant``: the request table's expected scores; each request's expected latency known (the
    hidden truth's), times ``factor``; the most accurate configuration it fits, else the fastest. A reference
    of the benchmark only: nothing outside a generated world knows the expected latency."""

    name = "cost_clairvoyant"

    def __init__(self, scores, expected_ms, factor: float) -> None:
        self.scores, self.expected_ms, self.factor = scores, expected_ms, float(factor)
        self.action_space = scores.model.action_space

    def decide(self, data, budget_ms):
        import torch

        from trainer.baselines import best_candidate, budget_vector

        if len(data) != self.expected_ms.shape[0]:
            msg = "cost_clairvoyant decides the samples whose expected latencies it was given"
            raise ValueError(msg)
        score = self.scores.expected_score(data.lang_features, data.tiling_crops)
        bound = self.expected_ms * self.factor
        fits = data.mask & (bound <= budget_vector(budget_ms, len(data))[:, None])
        best, found = best_candidate(fits, score, bound)
        fastest, _ = best_candidate(data.mask, -bound, torch.zeros_like(bound))
        return torch.where(found, best, fastest)

    def action_probs(self, data, budget_ms):
        import torch

        return torch.nn.functional.one_hot(self.decide(data, budget_ms), len(data.action_space)).float()


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


class TilingLookupTableDecider:
    """``"lut_by_tiling"``: a reference table that knows each request's family and tiling.

    Fitted on ``train`` (its allowed entries; ``train.family`` the labels, ``train.tiling_crops`` the
    crops): per request and allowed configuration a, with c the crops the request's image tiles into at
    a's max_crops (``data.tiling_crops``), the score cell is the mean training score (``score_kind`` of
    ``OfflineData.scores``) of (family, a, c), falling back to (a, c) and then to a where a cell has
    fewer than ``min_samples`` training samples (an unknown family or tiling skips the cells that need
    it). The latency cell is the training ``quantile`` (p95) latency of the same cells, (family, a, c)
    -> (a, c) -> a (``latency_by_family=False``: from (a, c) on; the families' answer and prompt lengths
    then widen every cell, which cost 0.036 mean accuracy in ``tiling-coco-text``). Chosen: the best
    score cell among the configurations whose latency cell fits the budget (ties -> the lower latency
    cell); when none fits, the lowest latency cell. A labelled reference, not a deployable table. The
    interface of ``trainer.baselines.DeterministicDecider``: ``name``, ``decide`` inside ``data.mask``,
    one-hot ``action_probs``.
    """

    name = "lut_by_tiling"

    def __init__(self, train, min_samples: int = 5, quantile: float = 0.95, latency_by_family: bool = True,
                 score_kind: str = "recorded", name: str = "lut_by_tiling") -> None:
        import numpy as np

        if train.tiling_crops is None or train.family is None:
            msg = "lut_by_tiling needs training data with tilings and family labels"
            raise ValueError(msg)
        self.action_space, self.min_samples, self.name = train.action_space, int(min_samples), name
        self._latency_from = 0 if latency_by_family else 1  # the first latency cell: (family, a, c) or (a, c)
        self._crops_column = train.action_space.knob_indices()[:, 0].numpy()  # per action, its max_crops column
        crops = train.tiling_crops.numpy()[:, self._crops_column]  # (N, A): crops used at each action
        score, latency = train.scores(score_kind).double().numpy(), train.latency_ms.double().numpy()
        scores: dict[tuple, list[float]] = {}
        latencies: dict[tuple, list[float]] = {}
        for i, a in zip(*np.nonzero(train.mask.numpy())):
            a = int(a)
            keys = self._keys(train.family[i], a, crops[i, a])
            for key in keys:
                scores.setdefault(key, []).append(score[i, a])
            for key in keys[self._latency_from:]:  # latency cells: ((family, a, c),) (a, c) and a
                latencies.setdefault(key, []).append(latency[i, a])
        self.score_cells = {k: (float(np.mean(v)), len(v)) for k, v in scores.items()}
        self.latency_cells = {k: (float(np.quantile(v, quantile)), len(v)) for k, v in latencies.items()}

    @staticmethod
    def _keys(family: str | None, action: int, crops: float) -> list[tuple]:
        """The cells of one (request, action), finest first: (family, a, c), (a, c), (a,); a cell whose
        family or crops are unknown is left out (its key is then None)."""
        known = crops == crops  # not NaN
        c = int(crops) if known else None
        return [("fac", family, action, c) if known and family is not None else None,
                ("ac", action, c) if known else None, ("a", action)]

    def _cell(self, cells: dict, keys: list[tuple]) -> float:
        for key in keys:
            value = cells.get(key) if key is not None else None
            if value is not None and (value[1] >= self.min_samples or key[0] == "a"):
                return value[0]
        return float("nan")

    def tables(self, data):
        """(score, latency) float32 (N, A): each (request, action)'s score and latency cell (NaN: the
        action never recorded in training)."""
        import numpy as np
        import torch

        n, num_actions = len(data), len(self.action_space)
        crops = (np.full((n, num_actions), np.nan) if data.tiling_crops is None
                 else data.tiling_crops.numpy()[:, self._crops_column])
        family = data.family or [None] * n
        score, latency = np.full((n, num_actions), np.nan), np.full((n, num_actions), np.nan)
        for i, a in zip(*np.nonzero(data.mask.numpy())):
            keys = self._keys(family[i], int(a), crops[i, a])
            score[i, a] = self._cell(self.score_cells, keys)
            latency[i, a] = self._cell(self.latency_cells, keys[self._latency_from:])
        return torch.from_numpy(score).float(), torch.from_numpy(latency).float()

    def decide(self, data, budget_ms):
        import torch

        from trainer.baselines import best_candidate, budget_vector, require_allowed_actions

        if data.action_space != self.action_space:
            msg = "the data's action space differs from the lut_by_tiling table's (built on other data)"
            raise ValueError(msg)
        require_allowed_actions(data)
        score, latency = self.tables(data)
        seen = ~torch.isnan(latency)
        budget = budget_vector(budget_ms, len(data))
        fits = data.mask & seen & (latency <= budget[:, None])
        best, found = best_candidate(fits, torch.nan_to_num(score, nan=-1e30), latency)
        # nothing fits: the lowest latency cell (actions unseen in training last, still inside the mask)
        fastest, _ = best_candidate(data.mask, -torch.nan_to_num(latency, nan=1e30), torch.zeros_like(latency))
        return torch.where(found, best, fastest)

    def action_probs(self, data, budget_ms):
        import torch

        return torch.nn.functional.one_hot(self.decide(data, budget_ms), len(data.action_space)).float()


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
    if train_data.tiling_crops is not None and train_data.family is not None:  # the labelled tiling table
        deciders.insert(5, TilingLookupTableDecider(train_data))
    # each request's own cost: the deployable per-request table and the ceiling of cost knowledge
    from trainer.request_cost import RequestCostConfig, RequestScoreTable, cost_quality, fit_request_cost
    from trainer.request_table import LatencyClairvoyantDecider, RequestTableDecider

    cost = fit_request_cost(train_data, RequestCostConfig(seed=saved.seed))
    request_scores = RequestScoreTable(train_data, cost)
    deciders += [RequestTableDecider(cost, request_scores), LatencyClairvoyantDecider(request_scores)]
    # the expected latency known: its measured / expected spread over the training tree sets the bound
    expected_train = truth_latencies(train_data, world.datasets, world.samples, world.train_seed,
                                     **world.spec_options(test=False))
    ratio = (train_data.latency_ms / expected_train)[train_data.mask & ~train_data.latency_ms.isnan()]
    factor = float(torch.quantile(ratio.double(), 0.95))
    deciders.append(CostClairvoyantDecider(request_scores, truth_latencies(
        test, world.datasets, world.samples, world.test_seed, **world.spec_options(test=True)), factor))
    quality = cost_quality(cost, test)
    frame = evaluate_deciders(test, deciders, budgets, saved.reward)
    # the fallback's choice per budget: False where the table answers for the controller
    kept = None if fallback is None else fallback.controller_at(torch.tensor(budgets)).tolist()
    return [{"world": world.name, "decider": r["decider"], "budget_ms": r["budget_ms"], "accuracy": r["accuracy"],
             "se": r["accuracy_se"], "violation": r["violation_rate"], "n": r["num_samples"], "train_s": seconds,
             "fallback": None if kept is None else kept[budgets.index(r["budget_ms"])],
             "fallback_table": None if fallback is None else fallback.table.get("name", "lut_p95"),
             "groups": len(fallback.lookup_table().families) if fallback is not None and hasattr(
                 fallback.lookup_table(), "families") else 0,
             "clusters": len(clusters.families), "cost_error": quality.median_abs_error,
             "cost_coverage": quality.coverage,
             "request_table_at": None if fallback is None or fallback.request_table_at is None
             else fallback.requests_at(torch.tensor([r["budget_ms"]])).tolist()[0]}
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
            mark = "" if d != "controller" or r["fallback"] is None else (
                "" if r["fallback"] else "ʳ" if r.get("request_table_at") else "ᵗ")
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
    if "latency_clairvoyant" in deciders:
        # the share of the network-to-latency_clairvoyant gap each decider closes, where that gap is over 2 points
        wide = [b for b in budgets if by[("latency_clairvoyant", b)]["accuracy"] - by[("policy", b)]["accuracy"] > 0.02]
        shares = {}
        for d in deciders:
            closed = [(by[(d, b)]["accuracy"] - by[("policy", b)]["accuracy"])
                      / (by[("latency_clairvoyant", b)]["accuracy"] - by[("policy", b)]["accuracy"]) for b in wide]
            shares[d] = sum(closed) / len(closed) if closed else float("nan")
        summary["gap_closed"] = shares
        if "cost_clairvoyant" in deciders:  # the share of the lead that cost knowledge could buy at all
            knowable = [(by[("cost_clairvoyant", b)]["accuracy"] - by[("policy", b)]["accuracy"])
                        / (by[("latency_clairvoyant", b)]["accuracy"] - by[("policy", b)]["accuracy"]) for b in wide]
            summary["gap_knowable"] = sum(knowable) / len(knowable) if knowable else float("nan")
        summary["cost_error"], summary["cost_coverage"] = rows[0].get("cost_error"), rows[0].get("cost_coverage")
        print(f"\nper-request cost model on the unseen tree: median |error| {summary['cost_error']:.1%}, its p95 "
              f"covers {summary['cost_coverage']:.1%}; share of the policy-to-latency_clairvoyant gap closed at "
              f"{len(wide)} budgets where it is > 2 points: "
              + ", ".join(f"{d} {v:+.0%}" for d, v in shares.items() if v == v), flush=True)
        if "gap_knowable" in summary:
            print(f"of that gap, cost_clairvoyant (the expected latency known, no draw) reaches "
                  f"{summary['gap_knowable']:+.0%}: the rest is the draw", flush=True)
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
