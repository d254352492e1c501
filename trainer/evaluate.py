"""Evaluation of deciders over a grid of latency budgets: metrics frame, Parquet, plot, table,
and the evaluation of an offline run against the baselines (:func:`evaluate_run`).

One row per (decider, budget_ms), computed on the recorded outcomes of the chosen
configurations (the test split). Columns (see ``EVALUATION_COLUMNS``):

* ``accuracy``: mean recorded score of the chosen configurations;
* ``latency_ms_mean`` / ``latency_ms_p95``: their recorded latency (linear-interpolation p95);
* ``violation_rate``: share with latency > budget_ms (no tolerance: the training metric of docs/origin_format.md §7.8);
* ``accuracy_within_budget``: mean score with every answer over budget counted as 0: the
  accuracy a service with this deadline delivers (late answers are lost);
* ``reward_mean``: mean reward (``trainer.reward``) of the decisions;
* ``expected_reward``: sum_a pi(a|x) r(x, a) averaged over samples, for deciders that expose
  ``action_probs``; equal to reward_mean for the deterministic baselines, NaN otherwise;
* ``config_histogram``: JSON ``{"C/K/B": count}`` of the chosen configurations;
* ``accuracy_se``: standard error of ``accuracy`` over the samples;
* ``accuracy_vs_table`` / ``accuracy_vs_table_se``: mean per-sample score difference against
  the ``lut_p95`` decider's choice on the same samples and its standard error (paired, so a
  difference smaller than the accuracies' own intervals can still be told apart); null when
  no decider is named ``lut_p95``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl
import torch
from rich.table import Table

from pipeline.workspace import Workspace, atomic_path, record_checksum
from trainer.baselines import (
    BatchDecider,
    BestStaticDecider,
    ClairvoyantDecider,
    FamilyLookupTableDecider,
    LargestDecider,
    LookupTableDecider,
    OracleDecider,
    QuestionFamilyTableDecider,
    RandomDecider,
    budget_vector,
)
from trainer.clusters import CLUSTER_TABLE, cluster_table
from trainer.config import OfflineTrainConfig
from trainer.constraint import VIOLATION_TARGET
from trainer.crossfit import FoldModels, deployed_data, fold_run_dir, load_folds
from trainer.data import (
    OfflineData,
    budget_grid,
    default_budget_range,
    hold_out_dataset,
    load_offline_data,
    nonempty_split,
)
from trainer.fallback import PolicyDecider, TableFallback, answered_by, fallback_table, read_fallback
from trainer.outcome import OUTCOME_FILE, OutcomeDecider, OutcomeModel
from trainer.policy import ControllerPolicy
from trainer.request_cost import RequestCostConfig, RequestScoreTable, fit_request_cost
from trainer.request_table import LatencyClairvoyantDecider, RequestTableDecider
from trainer.reward import RewardConfig, compute_reward
from trainer.runs import RunDir, resolve_checkpoint

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["EVALUATION_COLUMNS", "GROUPS_FILE", "GROUP_COLUMNS", "VIOLATION_TARGET", "answered_by",
           "baseline_deciders", "default_budget_grid", "evaluate_deciders", "evaluate_deciders_by_group",
           "evaluate_run", "evaluation_dir", "evaluation_title", "format_evaluation_table", "format_group_table",
           "format_summary_table", "summarize_evaluation", "write_evaluation"]

EVALUATION_COLUMNS = ("decider", "budget_ms", "num_samples", "accuracy", "latency_ms_mean", "latency_ms_p95",
                      "violation_rate", "accuracy_within_budget", "reward_mean", "expected_reward", "config_histogram",
                      "accuracy_se", "accuracy_vs_table", "accuracy_vs_table_se")
#: the decider the paired differences are taken against
TABLE_DECIDER = "lut_p95"
#: the per-dataset and per-family breakdown of an offline evaluation, beside evaluation.parquet
GROUPS_FILE = "evaluation_groups.parquet"


def default_budget_grid(data: OfflineData, num: int = 8) -> list[float]:
    """``num`` budgets (ms, rounded to 0.1) evenly spaced over ``default_budget_range(data)`` (``budget_grid``)."""
    return [round(b, 1) for b in budget_grid(*default_budget_range(data), num)]


def outcome_metrics(score: torch.Tensor, latency_ms: torch.Tensor, budget_ms: float) -> dict[str, float]:
    """The evaluation's outcome columns for one (decider, budget) from the decisions' scores and
    latencies (both (N,)): accuracy, latency mean/p95, violation rate, accuracy within budget."""
    score, latency = score.double(), latency_ms.double()
    over = latency > float(budget_ms)
    return {"accuracy": float(score.mean()), "latency_ms_mean": float(latency.mean()),
            "latency_ms_p95": float(torch.quantile(latency, 0.95)), "violation_rate": float(over.double().mean()),
            "accuracy_within_budget": float(torch.where(over, 0.0, score).mean())}


def evaluation_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Evaluation rows as a frame with ``EVALUATION_COLUMNS`` and their dtypes (offline and online);
    a column a row lacks is null."""
    dtypes = {"decider": pl.String, "num_samples": pl.Int64, "config_histogram": pl.String}
    rows = [{c: row.get(c) for c in EVALUATION_COLUMNS} for row in rows]
    return pl.DataFrame(rows, schema={c: dtypes.get(c, pl.Float64) for c in EVALUATION_COLUMNS})


def _standard_error(values: torch.Tensor) -> float:
    values = values.double()
    return float(values.std() / math.sqrt(len(values))) if len(values) > 1 else math.nan


def _expected_reward(decider: BatchDecider, data: OfflineData, budget: torch.Tensor, rewards: torch.Tensor) -> float:
    """Exact sum_a pi(a|x) r(x, a) averaged over samples; NaN if the decider has no distribution."""
    probs_fn = getattr(decider, "action_probs", None)
    if probs_fn is None:
        return float("nan")
    probs = torch.as_tensor(probs_fn(data, budget), dtype=torch.float64)
    if probs.shape != rewards.shape:
        msg = f"{decider.name}: action_probs has shape {tuple(probs.shape)}, expected {tuple(rewards.shape)}"
        raise ValueError(msg)
    if bool((probs[~data.mask] > 0).any()):
        msg = f"{decider.name}: action_probs puts mass on actions outside the mask"
        raise ValueError(msg)
    per_sample = (probs * torch.nan_to_num(rewards.double(), nan=0.0)).sum(dim=1)
    return float(per_sample.mean())


def evaluate_deciders(test: OfflineData, deciders: Sequence[BatchDecider], budgets_ms: Sequence[float],
                      reward: RewardConfig) -> pl.DataFrame:
    """Metrics of every decider at every budget on ``test`` (one row per (decider, budget_ms)).

    Raises ValueError when a decider chooses an action outside ``test.mask`` (its outcome
    was never recorded, so no metric could be computed honestly).
    """
    return evaluate_deciders_by_group(test, deciders, budgets_ms, reward)[0]


def evaluate_deciders_by_group(test: OfflineData, deciders: Sequence[BatchDecider], budgets_ms: Sequence[float],
                               reward: RewardConfig, clusters: Sequence[str | None] | None = None,
                               ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """:func:`evaluate_deciders`'s frame, and the same decisions broken down per dataset, per
    question family and, with ``clusters`` (one name per sample), per question group the deployed
    table reads (``GROUP_COLUMNS``: one row per (decider, budget_ms, group_by, group))."""
    if len(test) == 0:
        msg = "`test` has no samples"
        raise ValueError(msg)
    names = [d.name for d in deciders]
    if len(set(names)) != len(names):
        msg = f"decider names must be unique, got {names!r}"
        raise ValueError(msg)
    n = len(test)
    rows_idx = torch.arange(n)
    knob_values = test.action_space.knob_values()  # (A, 3)
    labels = [test.action_space.label(i) for i in range(len(test.action_space))]
    if clusters is not None and len(clusters) != n:
        msg = f"`clusters` has {len(clusters)} names for {n} samples"
        raise ValueError(msg)
    groups = _groups(test, clusters)
    rows: list[dict[str, Any]] = []
    group_rows: list[dict[str, Any]] = []
    for budget_ms in budgets_ms:
        budget = budget_vector(float(budget_ms), n)
        # rewards of every action at this budget: the decisions' rewards and the expected reward
        all_rewards = compute_reward(test.score, test.latency_ms, budget[:, None], knob_values[None, :, :],
                                     reward)["reward"]
        decisions = {}
        for decider in deciders:
            chosen = torch.as_tensor(decider.decide(test, budget)).long()
            if chosen.shape != (n,):
                msg = f"{decider.name}: decide returned shape {tuple(chosen.shape)}, expected ({n},)"
                raise ValueError(msg)
            outside = int((~test.mask[rows_idx, chosen]).sum())
            if outside:
                msg = f"{decider.name}: {outside} of {n} decisions at budget {budget_ms} ms are outside the mask"
                raise ValueError(msg)
            decisions[decider.name] = chosen
        table = decisions.get(TABLE_DECIDER)
        for decider in deciders:
            chosen = decisions[decider.name]
            score = test.score[rows_idx, chosen]
            latency = test.latency_ms[rows_idx, chosen]
            paired = None if table is None else (score - test.score[rows_idx, table]).double()
            rows.append({
                "decider": decider.name,
                "budget_ms": float(budget_ms),
                "num_samples": n,
                **outcome_metrics(score, latency, float(budget_ms)),
                "reward_mean": float(all_rewards[rows_idx, chosen].double().mean()),
                "expected_reward": _expected_reward(decider, test, budget, all_rewards),
                "config_histogram": _histogram(chosen, labels),
                "accuracy_se": _standard_error(score),
                "accuracy_vs_table": None if paired is None else float(paired.mean()),
                "accuracy_vs_table_se": None if paired is None else _standard_error(paired),
            })
            for group_by, group, index in groups:
                group_rows.append({
                    "decider": decider.name, "budget_ms": float(budget_ms), "group_by": group_by, "group": group,
                    "num_samples": len(index), **outcome_metrics(score[index], latency[index], float(budget_ms)),
                    "accuracy_se": _standard_error(score[index]),
                    "config_histogram": _histogram(chosen[index], labels)})
    order = {name: i for i, name in enumerate(names)}
    rows.sort(key=lambda r: order[r["decider"]])  # stable: budgets keep their order within a decider
    group_rows.sort(key=lambda r: (order[r["decider"]], r["group_by"], r["group"]))  # stable: budgets in order
    return evaluation_frame(rows), group_frame(group_rows)


#: the columns of the per-group breakdown (``evaluation_groups.parquet``, view ``evaluation_groups``)
GROUP_COLUMNS = ("decider", "budget_ms", "group_by", "group", "num_samples", "accuracy", "accuracy_se",
                 "violation_rate", "accuracy_within_budget", "config_histogram")
#: the group of samples without a question family
NO_FAMILY = "(none)"


def _groups(data: OfflineData, clusters: Sequence[str | None] | None = None) -> list[tuple[str, str, torch.Tensor]]:
    """(group_by, group, row indices) per dataset and, where recorded, per question family and cluster."""
    out = []
    for group_by, labels in (("dataset", data.dataset), ("family", data.family), ("cluster", clusters)):
        if labels is None:
            continue
        rows: dict[str, list[int]] = {}
        for i, label in enumerate(labels):
            rows.setdefault(NO_FAMILY if label is None else label, []).append(i)
        out += [(group_by, label, torch.tensor(index)) for label, index in sorted(rows.items())]
    return out


def _histogram(chosen: torch.Tensor, labels: list[str]) -> str:
    counts = torch.bincount(chosen, minlength=len(labels)).tolist()
    return json.dumps({labels[i]: c for i, c in enumerate(counts) if c})


def group_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Per-group rows as a frame with ``GROUP_COLUMNS`` and their dtypes."""
    dtypes = {"decider": pl.String, "group_by": pl.String, "group": pl.String, "num_samples": pl.Int64,
              "config_histogram": pl.String}
    return pl.DataFrame([{c: row.get(c) for c in GROUP_COLUMNS} for row in rows],
                        schema={c: dtypes.get(c, pl.Float64) for c in GROUP_COLUMNS})


def write_evaluation(run_dir: str | os.PathLike, frame: pl.DataFrame, run_id: str | None = None,
                     groups: pl.DataFrame | None = None) -> tuple[Path, Path]:
    """Write ``run_dir/evaluation.parquet`` (with a leading ``run_id`` column, default the
    directory name) and ``run_dir/evaluation.png``, and with ``groups`` (:data:`GROUP_COLUMNS`)
    ``run_dir/evaluation_groups.parquet``; each appears atomically. Returns the first two paths."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = run_id if run_id is not None else run_dir.name
    for name, part, columns in (("evaluation", frame, EVALUATION_COLUMNS),
                                ("evaluation groups", groups, GROUP_COLUMNS)):
        missing = [] if part is None else [c for c in columns if c not in part.columns]
        if missing:
            msg = f"{name} frame lacks columns {missing!r}"
            raise ValueError(msg)

    def with_run_id(part: pl.DataFrame) -> pl.DataFrame:
        return part.drop("run_id", strict=False).select(pl.lit(run_id, dtype=pl.String).alias("run_id"), pl.all())

    parquet_path, png_path = run_dir / "evaluation.parquet", run_dir / "evaluation.png"
    written = [(parquet_path, frame)] + ([] if groups is None else [(run_dir / GROUPS_FILE, groups)])
    for path, part in written:
        with atomic_path(path) as tmp:
            with_run_id(part).write_parquet(tmp)
        record_checksum(path)
    with atomic_path(png_path, suffix=".png") as tmp:  # matplotlib picks the format from the name
        _plot(frame, run_id).savefig(tmp, dpi=120)
    return parquet_path, png_path


# -- an offline run against the baselines -------------------------------------------------

#: build a decider fitted on training samples: (its name, how to build it from those samples)
Fitted = Callable[[str, Callable[[OfflineData], BatchDecider]], BatchDecider]


def baseline_deciders(fitted: Fitted, *, family: bool, seed: int, grid_ms: Sequence[float] | None = None,
                      reward: RewardConfig | None = None) -> list[BatchDecider]:
    """The baselines of every evaluation, in their order: oracle, clairvoyant, best_static (the best one
    configuration per budget, with hindsight), lut_p95, lut_by_family and
    lut_by_question (where the samples record a question family: the per-family tables by the label,
    and by the family the question reads as, as a server would run them), lut_by_cluster (with
    ``grid_ms`` and ``reward``: the per-cluster tables of questions clustered without labels,
    ``trainer.clusters``), lut_mean5 (the origin's table, docs/origin_format.md §7.9: mean latency
    within budget x 1.05), largest, random; with them, the deciders that read each request's own cost
    (:mod:`trainer.request_table`): ``lut_by_request`` after the tables and the reference row
    ``latency_clairvoyant`` after ``clairvoyant``. ``fitted`` builds the ones fitted on training samples:
    on the train split, or out of fold in a cross-fitted run."""
    request = _RequestDeciders(seed)
    tables = [fitted("lut_p95", LookupTableDecider)]
    if family:
        tables.append(fitted("lut_by_family", FamilyLookupTableDecider))
        tables.append(fitted("lut_by_question", QuestionFamilyTableDecider))
    if grid_ms is not None and reward is not None:
        grid = [float(b) for b in grid_ms]
        tables.append(fitted(CLUSTER_TABLE, lambda train: cluster_table(train.without_family_labels(), grid, reward,
                                                                        seed=seed)))
    tables.append(fitted("lut_by_request", request.table))
    mean5 = fitted("lut_mean5", lambda train: LookupTableDecider(train, statistic="mean", tolerance=0.05))
    return [OracleDecider(), ClairvoyantDecider(), fitted("latency_clairvoyant", request.clairvoyant),
            BestStaticDecider(), *tables, mean5, LargestDecider(), RandomDecider(seed=seed)]


class _RequestDeciders:
    """``lut_by_request`` and ``latency_clairvoyant``, sharing one fit of the request cost model and
    score table per training set (a cross-fitted run builds both on each fold's)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._fitted: dict[int, tuple[OfflineData, RequestScoreTable]] = {}

    def _scores(self, train: OfflineData) -> RequestScoreTable:
        if id(train) not in self._fitted:  # the data is kept beside its fit, so its id is not reused
            model = fit_request_cost(train, RequestCostConfig(seed=self.seed))
            self._fitted[id(train)] = (train, RequestScoreTable(train, model))
        return self._fitted[id(train)][1]

    def table(self, train: OfflineData) -> RequestTableDecider:
        scores = self._scores(train)
        return RequestTableDecider(scores.model, scores)

    def clairvoyant(self, train: OfflineData) -> LatencyClairvoyantDecider:
        return LatencyClairvoyantDecider(self._scores(train))


def evaluate_run(workspace: Workspace | str | Path | None, run: str | Path, budgets_ms: list[float] | None = None,
                 data: OfflineData | None = None) -> pl.DataFrame:
    """``ctrl evaluate RUN``: the run's controller vs the outcome model (``trainer.outcome``) and
    the baselines (:func:`baseline_deciders`).

    A run with a ``holdout_dataset`` is evaluated on every sample of that dataset, by the
    deployed controller and by tables fitted on the samples it learned from. Otherwise a
    cross-fitted run (``cross_fit_folds`` >= 2) is evaluated on every sample, each decided out
    of fold by the networks, outcome models and tables of the fold that did not train on it;
    and any other run by its best checkpoint on the test split. Writes ``evaluation.parquet``
    (with ``run_id``), ``evaluation.png`` and the per-dataset and per-family breakdown
    ``evaluation_groups.parquet`` (``group_by`` dataset, family, and cluster: the question group
    each sample reads as under the deployed table, or under a cluster table where that has none)
    into the run directory (``budgets_ms``: into :func:`evaluation_dir` beside it) and returns the
    first frame (without ``run_id``).
    """
    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    run_dir = RunDir.resolve(ws, run)
    config = OfflineTrainConfig.from_json(run_dir.read_config())
    if data is None:
        data = load_offline_data(ws, config.model_fingerprint)
    if config.ignore_family_labels:
        data = data.without_family_labels()
    checkpoint = resolve_checkpoint(ws, run_dir.path)
    fallback = read_fallback(checkpoint)
    budgets = [float(b) for b in (budgets_ms or config.eval_budgets)]
    if config.holdout_dataset:
        # the deployed controller and tables of everything the run learned from, on the dataset it never saw
        evaluated, rest = hold_out_dataset(data, config.holdout_dataset)
        own = _deployed_deciders(run_dir.path, checkpoint, fallback, data.model_fingerprint)
        learned_from = nonempty_split(deployed_data(rest) if config.cross_fit_folds else rest, "train")

        def fitted(name: str, make: Callable[[OfflineData], BatchDecider]) -> BatchDecider:
            return make(learned_from)
    elif config.cross_fit_folds:
        models = load_folds(run_dir.path, data, config.cross_fit_folds)
        evaluated = data
        own = _cross_fitted_controllers(run_dir.path, models, fallback, config)

        def fitted(name: str, make: Callable[[OfflineData], BatchDecider]) -> BatchDecider:
            return models.out_of_fold(name, lambda k: make(models.train[k]))
    else:
        train, evaluated = nonempty_split(data, "train"), nonempty_split(data, "test")
        own = _deployed_deciders(run_dir.path, checkpoint, fallback, data.model_fingerprint)

        def fitted(name: str, make: Callable[[OfflineData], BatchDecider]) -> BatchDecider:
            return make(train)
    grid = [float(b) for b in config.eval_budgets]
    deciders = [*own, *baseline_deciders(fitted, family=data.family is not None, seed=config.seed, grid_ms=grid,
                                         reward=config.reward)]
    clusters = _question_groups(fallback, evaluated, lambda: cluster_table(
        (data if config.cross_fit_folds else nonempty_split(data, "train")).without_family_labels(), grid,
        config.reward, seed=config.seed))
    frame, groups = evaluate_deciders_by_group(evaluated, deciders, budgets, config.reward, clusters=clusters)
    write_evaluation(evaluation_dir(run_dir.path, budgets_ms), frame, run_id=run_dir.path.name, groups=groups)
    return frame


#: where evaluations at budgets other than the run's own grid go, inside the run's directory
OTHER_BUDGETS_DIR = "evaluations"


def evaluation_dir(run_dir: Path, budgets_ms: Sequence[float] | None) -> Path:
    """Where an evaluation of the run in ``run_dir`` is written: the run's own directory for its
    grid (``budgets_ms`` None), else ``evaluations/budgets-<b>-<b>...`` beside it, so that the run's
    record (the ``evaluations`` view) is never replaced by one at a few other budgets."""
    if not budgets_ms:
        return Path(run_dir)
    tag = "-".join(f"{float(b):g}" for b in budgets_ms)
    return Path(run_dir) / OTHER_BUDGETS_DIR / f"budgets-{tag}"


def _question_groups(fallback: TableFallback | None, data: OfflineData,
                     fit_clusters: Callable[[], QuestionFamilyTableDecider]) -> list[str | None] | None:
    """The question group every sample of ``data`` reads as: the family or cluster of the deployed
    fallback's table where it has families, else of a cluster table (``fit_clusters``); None where
    neither finds more than one group."""
    table = None if fallback is None else fallback.lookup_table()
    if not isinstance(table, QuestionFamilyTableDecider) or not table.has_families:
        table = fit_clusters()
    return table.read_family(data.lang_features) if table.has_families else None


def _deployed_deciders(run_path: Path, checkpoint: Path, fallback: TableFallback | None,
                       fingerprint: str) -> list[BatchDecider]:
    """The run's deployed controller (best checkpoint and fallback), its network alone where a
    fallback exists, and its outcome model where it saved one."""
    policy = ControllerPolicy.load(checkpoint, model_fingerprint=fingerprint)
    # PolicyDecider exposes action_probs, so its rows get the exact expected reward
    own: list[BatchDecider] = [PolicyDecider(policy, fallback)]
    own += [PolicyDecider(policy, name="policy")] if fallback else []
    outcome_file = run_path / OUTCOME_FILE
    own += [OutcomeDecider(OutcomeModel.load(outcome_file))] if outcome_file.exists() else []
    return own


def evaluation_title(run_dir: Path) -> str:
    """The heading of a run's evaluation table: which samples it was computed on."""
    try:
        config = RunDir(Path(run_dir)).read_config()
        folds = int(config.get("cross_fit_folds") or 0)
        holdout = config.get("holdout_dataset")
    except (OSError, ValueError, TypeError):
        folds, holdout = 0, None
    if holdout:
        return f"evaluation (every sample of {holdout}, a dataset left out of training)"
    return (f"evaluation (every sample, out of fold: {folds}-fold cross-fit)" if folds
            else "evaluation (test split)")


def _cross_fitted_controllers(run_path: Path, models: FoldModels, fallback: TableFallback | None,
                              config: OfflineTrainConfig) -> list[BatchDecider]:
    """The run's own deciders, out of fold: fold k's network (with the deployed fallback's
    per-budget choice answered by fold k's table), the network alone where a fallback exists,
    and fold k's outcome model where every fold saved one."""

    def controller(k: int) -> PolicyDecider:
        own = (None if fallback is None
               else replace(fallback, table=fallback_table(models.train[k], fallback.table_kind, fallback.grid_ms,
                                                           config.reward, config.seed).state()))
        return PolicyDecider(models.policies[k], own)

    deciders: list[BatchDecider] = [models.out_of_fold("controller", controller)]
    if fallback is not None:
        deciders.append(models.out_of_fold("policy", lambda k: PolicyDecider(models.policies[k], name="policy")))
    outcome_files = [fold_run_dir(run_path, k) / OUTCOME_FILE for k in range(models.folds)]
    if all(f.exists() for f in outcome_files):
        deciders.append(models.out_of_fold("outcome", lambda k: OutcomeDecider(OutcomeModel.load(outcome_files[k]))))
    return deciders


#: the deciders a summary compares the deployed controller with, besides the best static configuration
SUMMARY_TABLES = ("lut_by_family", "lut_by_question", "lut_by_cluster", "lut_by_request", "lut_mean5")


def summarize_evaluation(frame: pl.DataFrame, fallback: TableFallback | None) -> list[dict[str, Any]]:
    """Per budget of an evaluation ``frame``, the deployed controller beside the strongest simple
    deciders: who answered for it (:func:`answered_by`), and ``controller``, ``best_static``,
    ``lut_p95`` and the best table (of ``SUMMARY_TABLES``: the most accurate one within the violation
    goal, else the one late least often), each as a row of the frame (accuracy, accuracy_se,
    violation_rate, config_histogram). A decider the frame lacks is None."""
    by = {(r["decider"], r["budget_ms"]): r for r in frame.iter_rows(named=True)}
    out = []
    for budget in sorted({r["budget_ms"] for r in frame.iter_rows(named=True)}):
        tables = [by[(name, budget)] for name in SUMMARY_TABLES if (name, budget) in by]
        within = [r for r in tables if r["violation_rate"] <= VIOLATION_TARGET]
        best_table = (max(within, key=lambda r: r["accuracy"]) if within
                      else min(tables, key=lambda r: r["violation_rate"]) if tables else None)
        out.append({"budget_ms": budget, "answered_by": answered_by(fallback, budget),
                    "controller": by.get(("controller", budget)), "best_static": by.get(("best_static", budget)),
                    TABLE_DECIDER: by.get((TABLE_DECIDER, budget)), "best_table": best_table})
    return out


# pragma: no mutate start (presentation: the plot and the terminal table, outside the mutation score)
def _plot(frame: pl.DataFrame, title: str) -> Figure:
    """Accuracy and violation rate against budget, one line per decider (Agg canvas, no pyplot state)."""
    # matplotlib takes about half a second to import; only runs that write a plot pay for it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(fig)
    from matplotlib import colormaps

    ax_acc, ax_vio = fig.subplots(1, 2)
    # tab20's dark shades first, then its light ones: 20 distinct colours (the default cycle has 10,
    # and an evaluation shows 11 deciders or more); markers tell neighbours apart as well
    palette = colormaps["tab20"].colors
    colours = [palette[i] for i in range(0, 20, 2)] + [palette[i] for i in range(1, 20, 2)]
    markers = "osD^v<>ph*"
    for i, name in enumerate(frame["decider"].unique(maintain_order=True).to_list()):
        part = frame.filter(frame["decider"] == name).sort("budget_ms")
        style = {"linewidth": 2.5 if name == "controller" else 1.5, "color": colours[i % len(colours)],
                 "marker": markers[i % len(markers)]}
        ax_acc.plot(part["budget_ms"].to_list(), part["accuracy"].to_list(), label=name, **style)
        ax_vio.plot(part["budget_ms"].to_list(), part["violation_rate"].to_list(), label=name, **style)
    ax_vio.axhline(VIOLATION_TARGET, color="black", linestyle="--", linewidth=1, label=f"{VIOLATION_TARGET:.0%} target")
    ax_acc.set(xlabel="latency budget (ms)", ylabel="accuracy (mean recorded score)", title="accuracy")
    ax_vio.set(xlabel="latency budget (ms)", ylabel="share of samples with latency > budget",
               title="budget violation rate",
               ylim=(-0.02, 1.02))
    for ax in (ax_acc, ax_vio):
        ax.grid(alpha=0.3)
    ax_vio.legend(fontsize="small")
    fig.suptitle(f"evaluation {title}")
    return fig


def format_evaluation_table(frame: pl.DataFrame, title: str = "evaluation (test split)") -> Table:
    """A terminal table: one row per (decider, budget), the most frequent configuration last;
    accuracy with its standard error and, where known, the paired difference to ``lut_p95``."""
    table = Table(title=title)
    for header in ("decider", "budget ms", "accuracy ± se", "vs lut_p95 ± se", "latency ms mean", "latency ms p95",
                   "violation",
                   "acc. within budget", "reward", "expected reward", "top configuration"):
        table.add_column(header, justify="left" if header in ("decider", "top configuration") else "right")
    for row in frame.iter_rows(named=True):
        hist = json.loads(row["config_histogram"]) if row["config_histogram"] else {}
        top = max(hist.items(), key=lambda kv: kv[1]) if hist else None
        top_text = f"{top[0]} ({top[1] / row['num_samples']:.0%})" if top else ""
        violation = f"{row['violation_rate']:.1%}"
        if row["violation_rate"] > VIOLATION_TARGET:
            violation = f"[red]{violation}[/red]"
        expected = row["expected_reward"]
        se, diff, diff_se = row.get("accuracy_se"), row.get("accuracy_vs_table"), row.get("accuracy_vs_table_se")
        accuracy = f"{row['accuracy']:.3f}" + ("" if se is None or math.isnan(se) else f" ± {se:.3f}")
        versus = "" if diff is None else f"{diff:+.3f}" + ("" if diff_se is None or math.isnan(diff_se)
                                                            else f" ± {diff_se:.3f}")
        table.add_row(row["decider"], f"{row['budget_ms']:.1f}", accuracy, versus,
                      f"{row['latency_ms_mean']:.1f}",
                      f"{row['latency_ms_p95']:.1f}", violation, f"{row['accuracy_within_budget']:.3f}",
                      f"{row['reward_mean']:.3f}",
                      "" if expected is None or math.isnan(expected) else f"{expected:.3f}", top_text)
    return table


def format_summary_table(summary: list[dict[str, Any]], title: str = "summary") -> Table:
    """The terminal table of :func:`summarize_evaluation`: per budget, accuracy ± standard error and the
    share late of the deployed controller (and who answered), the best static configuration, lut_p95
    and the best table."""
    table = Table(title=title)
    for header in ("budget ms", "answered by", "controller", "best static configuration", "lut_p95", "best table"):
        table.add_column(header, justify="right" if header == "budget ms" else "left")

    def cell(row: dict[str, Any] | None, label: str = "") -> str:
        if row is None:
            return ""
        late = f"{row['violation_rate']:.1%} late"
        if row["violation_rate"] > VIOLATION_TARGET:
            late = f"[red]{late}[/red]"
        se = row.get("accuracy_se")
        accuracy = f"{row['accuracy']:.3f}" + ("" if se is None or math.isnan(se) else f" ± {se:.3f}")
        return f"{accuracy}, {late}" + (f" ({label})" if label else "")

    for row in summary:
        static = row["best_static"]
        config = ""
        if static is not None and static["config_histogram"]:
            hist = json.loads(static["config_histogram"])
            config = max(hist.items(), key=lambda kv: kv[1])[0]
        best = row["best_table"]
        table.add_row(f"{row['budget_ms']:.1f}", row["answered_by"], cell(row["controller"]), cell(static, config),
                      cell(row[TABLE_DECIDER]), cell(best, best["decider"] if best is not None else ""))
    return table


def format_group_table(groups: pl.DataFrame, group_by: str,
                       deciders: Sequence[str] = ("controller", "lut_p95", "lut_by_family", "lut_by_cluster",
                                                  "clairvoyant")) -> Table:
    """A terminal table of ``evaluation_groups`` rows: per (group, budget), the accuracy of each of
    ``deciders`` present, and the controller's violation rate and most frequent configuration."""
    part = groups.filter(pl.col("group_by") == group_by)
    present = [d for d in deciders if d in set(part["decider"].to_list())]
    table = Table(title=f"per {group_by}: accuracy")
    for header in (group_by, "samples", "budget ms", *present, "controller violation", "controller top configuration"):
        table.add_column(header, justify="left" if header in (group_by, "controller top configuration") else "right")
    by = {(r["decider"], r["group"], r["budget_ms"]): r for r in part.iter_rows(named=True)}
    keys = sorted({(r["group"], r["budget_ms"]) for r in part.iter_rows(named=True)})
    for group, budget in keys:
        cells = [f"{by[(d, group, budget)]['accuracy']:.3f}" if (d, group, budget) in by else "" for d in present]
        ctrl = by.get(("controller", group, budget))
        violation, top = "", ""
        if ctrl is not None:
            violation = f"{ctrl['violation_rate']:.1%}"
            hist = json.loads(ctrl["config_histogram"])
            label, count = max(hist.items(), key=lambda kv: kv[1])
            top = f"{label} ({count / ctrl['num_samples']:.0%})"
        n = next(by[(d, group, budget)]["num_samples"] for d in present if (d, group, budget) in by) if present else 0
        table.add_row(group, str(n), f"{budget:.1f}", *cells, violation, top)
    return table
# pragma: no mutate end
