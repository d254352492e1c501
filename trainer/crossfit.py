"""K-fold cross-fitting: every sample judged by a network that never trained on it.

One train/val/test split leaves the table-fallback decision and the reported numbers to the
10 % of samples in one split, where one sample is one or two accuracy points. Cross-fitting
uses every sample instead:

* each sample gets a fold, ``fold_of(dataset, sample_key)`` (a hash, so the same sample is in
  the same fold in every run, and all configurations of a sample stay together);
* for fold k a network is trained on the samples of the other folds (its own epoch selection
  on those of them in the val split) and a ``lut_p95`` table is fitted on the same samples;
* every sample is then decided by its fold's network and its fold's table (:class:`OutOfFold`):
  the per-budget comparison that decides the fallback pools all N held-out comparisons, and
  the evaluation scores every sample exactly once, out of fold, with a standard error per
  budget;
* the deployed network is trained on every sample outside the val split (the val split picks
  its epoch), its table on every sample.

The fold runs (:func:`train_folds`) live in ``runs/<run_id>/folds/fold-<k>/`` (the usual run
files; not listed in the ``runs`` view).
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from pipeline.errors import CtrlError
from trainer.baselines import BatchDecider, LookupTableDecider, QuestionFamilyTableDecider
from trainer.config import OfflineTrainConfig
from trainer.data import OfflineData
from trainer.fallback import (
    PolicyDecider,
    TableFallback,
    choose_family_table_at,
    choose_request_table_at,
    compare_with_table,
    fallback_table,
    resolve_prefers,
    switched_table,
    table_kind,
    tables_only,
)
from trainer.policy import ControllerPolicy
from trainer.request_cost import RequestCostConfig
from trainer.request_table import REQUEST_TABLE, RequestTableDecider
from trainer.reward import RewardConfig
from trainer.runs import RunDir

__all__ = ["FOLDS_DIR", "FoldModels", "OutOfFold", "deployed_data", "fit_cross_fitted_fallback", "fold_data",
           "fold_of", "fold_run_dir", "folds_of", "load_folds", "train_folds"]

#: the folds' run directories, inside the parent run's directory
FOLDS_DIR = "folds"


def fold_of(dataset: str, sample_key: str, folds: int) -> int:
    """The fold (0..folds-1) of a sample: a hash of its identity, stable across runs."""
    digest = hashlib.sha256(f"ctrl-fold\0{dataset}\0{sample_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % folds


def folds_of(data: OfflineData, folds: int) -> torch.Tensor:
    """(N,) int64: every sample's fold."""
    return torch.tensor([fold_of(d, k, folds) for d, k in zip(data.dataset, data.sample_key)], dtype=torch.long)


def check_folds(data: OfflineData, folds: int) -> None:
    """CtrlError naming the folds that hold no sample of ``data``: each fold's network is judged on
    its own samples, and the assignment is a hash, so even ``folds`` <= samples can leave one empty."""
    counts = torch.bincount(folds_of(data, folds), minlength=folds).tolist()
    empty = [k for k, n in enumerate(counts) if n == 0]
    if empty:
        msg = (f"--cross-fit-folds {folds}: fold(s) {', '.join(map(str, empty))} of the {len(data)} samples "
               "would hold no sample (samples are assigned to folds by a hash of their key)\n"
               "Hint: use fewer folds, or 0 for one split.")
        raise CtrlError(msg)


def fold_data(data: OfflineData, fold: int, folds: int) -> OfflineData:
    """``data`` relabelled for fold ``fold``: its samples are the test split; of the others, the
    val samples stay val (epoch selection) and all the rest train."""
    assigned = folds_of(data, folds).tolist()
    split = ["test" if f == fold else ("val" if s == "val" else "train") for f, s in zip(assigned, data.split)]
    return replace(data, split=split)


def deployed_data(data: OfflineData) -> OfflineData:
    """``data`` relabelled for the deployed network: the test split joins the training samples."""
    return replace(data, split=["val" if s == "val" else "train" for s in data.split])


class OutOfFold:
    """A decider that decides every sample with the decider of the sample's fold.

    ``deciders[k]`` was fitted without fold k; ``fold`` holds the folds of the samples of the
    data this decider is asked about (the full data of the cross-fit, in its order).
    """

    def __init__(self, name: str, deciders: Sequence[BatchDecider], fold: torch.Tensor) -> None:
        self.name = name
        self.deciders = list(deciders)
        self.fold = fold.long()

    def _per_fold(self, data: OfflineData, budget_ms: torch.Tensor | float,
                  fn: Callable[[BatchDecider, OfflineData, torch.Tensor], torch.Tensor],
                  out: torch.Tensor) -> torch.Tensor:
        if len(data) != len(self.fold):
            msg = f"{self.name}: asked about {len(data)} samples, built for {len(self.fold)}"
            raise ValueError(msg)
        budget = torch.as_tensor(budget_ms, dtype=torch.float32)
        for k, decider in enumerate(self.deciders):
            rows = (self.fold == k).nonzero().flatten()
            if len(rows):
                part_budget = budget if budget.ndim == 0 else budget[rows]
                out[rows] = torch.as_tensor(fn(decider, data.select(rows.tolist()), part_budget), dtype=out.dtype)
        return out

    def decide(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        return self._per_fold(data, budget_ms, lambda d, part, b: d.decide(part, b),
                              torch.zeros(len(data), dtype=torch.long))

    def action_probs(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        if not all(hasattr(d, "action_probs") for d in self.deciders):
            msg = f"{self.name}: not every fold's decider exposes action_probs"
            raise AttributeError(msg)
        return self._per_fold(data, budget_ms, lambda d, part, b: d.action_probs(part, b),
                              torch.zeros(len(data), len(data.action_space), dtype=torch.float64))


def fold_run_dir(run_dir: Path, fold: int) -> Path:
    """Where fold ``fold`` of the run in ``run_dir`` trains."""
    return run_dir / FOLDS_DIR / f"fold-{fold}"


#: trains one fold: (its config, its data, its run directory, its progress callback)
TrainFold = Callable[[OfflineTrainConfig, OfflineData, Path, Callable[[dict], None]], object]


def train_folds(run_dir: Path, config: OfflineTrainConfig, data: OfflineData, train_fold: TrainFold,
                notify: Callable[[dict], None]) -> None:
    """The K fold networks of the cross-fit of the run in ``run_dir``, each in ``folds/fold-<k>``
    (a finished fold is kept, an interrupted one restarts), trained by ``train_fold`` with the
    run's options but no cross-fit, table fallback or evaluation of their own. ``notify`` hears
    ``phase="fold"`` events (fold, num_folds, epoch)."""
    k_total = config.cross_fit_folds
    # ``data`` is what the run learns from: a held-out dataset is already out of it
    fold_config = OfflineTrainConfig.from_json({**config.to_json(), "cross_fit_folds": 0, "run_id": None,
                                                "resume": None, "disable_table_fallback": True,
                                                "disable_evaluation": True, "holdout_dataset": None})
    for k in range(k_total):
        target = fold_run_dir(run_dir, k)
        if (target / "metrics.parquet").exists() and RunDir(target).best_checkpoint.exists():
            continue
        shutil.rmtree(target, ignore_errors=True)  # an interrupted fold restarts

        def relay(event: dict, fold: int = k + 1) -> None:
            notify({"phase": "fold", "fold": fold, "num_folds": k_total, "epoch": event.get("epoch", 0)})

        relay({})
        train_fold(fold_config, fold_data(data, k, k_total), target, relay)


class FoldModels:
    """The K fold networks of a cross-fitted run and, per fold, its training samples (recorded
    scores: the tables are fitted on them), with every sample's fold."""

    def __init__(self, run_dir: Path, data: OfflineData, folds: int) -> None:
        self.folds = folds
        self.fold = folds_of(data, folds)
        self.policies: list[ControllerPolicy] = []
        self.train: list[OfflineData] = []
        for k in range(folds):
            checkpoint = RunDir(fold_run_dir(run_dir, k)).best_checkpoint
            if not checkpoint.exists():
                msg = f"{checkpoint}: fold {k} of the cross-fit was not trained (resume the run)"
                raise FileNotFoundError(msg)
            self.policies.append(ControllerPolicy.load(checkpoint, model_fingerprint=data.model_fingerprint))
            self.train.append(fold_data(data, k, folds).subset("train"))

    def out_of_fold(self, name: str, make: Callable[[int], BatchDecider]) -> OutOfFold:
        """``make(k)`` builds fold k's decider (from ``self.policies[k]`` / ``self.train[k]``)."""
        return OutOfFold(name, [make(k) for k in range(self.folds)], self.fold)


def load_folds(run_dir: Path, data: OfflineData, folds: int) -> FoldModels:
    return FoldModels(run_dir, data, folds)


def fit_cross_fitted_fallback(models: FoldModels, targets: OfflineData, grid_ms: list[float], reward: RewardConfig,
                              deployed_table: LookupTableDecider | QuestionFamilyTableDecider, confidence: float,
                              prefers: str = "auto", seed: int = 0,
                              deployed_request: RequestTableDecider | None = None,
                              request_table: bool = False) -> TableFallback:
    """The fallback rule on every sample, out of fold: fold k's network against fold k's table (of
    ``deployed_table``'s kind; a family or cluster table with its families or its global table per
    budget, :func:`trainer.fallback.choose_family_table_at`, also out of fold) on the samples of
    fold k, pooled over the folds (``targets``: all samples with the training scores). The deployed
    fallback answers with ``deployed_table``; ``deployed_request`` (the per-request table, stored with it
    for its cost model) answers in its place, with ``request_table``, at the budgets where fold k's
    per-request table beats fold k's table out of fold (:func:`trainer.fallback.choose_request_table_at`)."""
    kind = table_kind(deployed_table)
    tables = [fallback_table(models.train[k], kind, grid_ms, reward, seed) for k in range(models.folds)]
    family_at = None
    if kind == "cluster":  # a labelled family table answers with its families at every budget
        family_at = choose_family_table_at(models.out_of_fold(deployed_table.name, lambda k: tables[k]),
                                           models.out_of_fold("lut_p95", lambda k: LookupTableDecider(models.train[k])),
                                           targets, grid_ms, reward, confidence=confidence)
    network = models.out_of_fold("policy", lambda k: PolicyDecider(models.policies[k]))
    table = models.out_of_fold(deployed_table.name, lambda k: switched_table(tables[k], grid_ms, family_at))
    request_state = None if deployed_request is None else deployed_request.state()
    fallback = compare_with_table(network, table, targets, grid_ms, reward, deployed_table.state(),
                                  confidence=confidence, prefers=resolve_prefers(prefers, deployed_table))
    request_at = None if deployed_request is None else [False] * len(grid_ms)
    if deployed_request is not None and request_table:
        request = models.out_of_fold(REQUEST_TABLE, lambda k: RequestTableDecider.fit(
            models.train[k], RequestCostConfig(seed=seed)))
        beats_table = choose_request_table_at(request, table, targets, grid_ms, reward, confidence=confidence)
        request_at = tables_only(fallback.use_controller, beats_table)
    return replace(fallback, family_table_at=family_at, request_table=request_state, request_table_at=request_at)

