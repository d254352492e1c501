"""Baseline deciders: per-sample oracle and clairvoyant choice, static lookup tables (global, per
question family, and per family as the question reads), always-largest, random.

A decider maps (samples, budget) to one action per sample. Every decider here chooses
inside ``data.mask`` (the configurations recorded for the sample); when nothing fits the
budget it falls back to the fastest allowed action. Deciders that take training data
(the lookup tables) read it in their constructor and never look at the outcomes of the
data they decide for, only at its mask (which configurations exist for a sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import torch

from trainer.data import Action, ActionSpace, OfflineData

__all__ = ["BatchDecider", "BestStaticDecider", "ClairvoyantDecider", "DeterministicDecider",
           "FamilyLookupTableDecider",
           "LargestDecider", "LookupTableDecider", "OracleDecider", "QuestionFamilyTableDecider", "RandomDecider",
           "UNFAMILIAR_QUANTILE", "best_candidate", "budget_vector", "closest_similarity", "nearest_family",
           "require_allowed_actions", "table_from_state"]


@runtime_checkable
class BatchDecider(Protocol):
    """``name`` keys the results (``"controller"``, ``"oracle"``, ``"lut_p95"``, ...).

    ``decide(data, budget_ms)``: budget_ms float, 0-d or (N,) tensor in ms -> LongTensor (N,)
    of action indices, each inside ``data.mask``. A decider may also define
    ``action_probs(data, budget_ms) -> FloatTensor (N, A)`` (its decision distribution);
    the evaluation then reports the exact expected reward.
    """

    name: str

    def decide(self, data: OfflineData, budget_ms: torch.Tensor) -> torch.Tensor: ...


def budget_vector(budget_ms: torch.Tensor | float, n: int) -> torch.Tensor:
    """float32 (N,) budgets from a scalar, a 0-d or 1-element tensor, or an (N,) tensor."""
    b = torch.as_tensor(budget_ms, dtype=torch.float32).flatten()
    if b.numel() == 1:
        return b.expand(n).clone()
    if b.numel() != n:
        msg = f"`budget_ms` must be a scalar or have one value per sample ({n}), got {b.numel()} values"
        raise ValueError(msg)
    return b


def require_allowed_actions(data: OfflineData) -> None:
    """A ValueError when a sample of ``data`` has no allowed action (nothing can be decided for it)."""
    empty = int((~data.mask.any(dim=1)).sum())
    if empty:
        msg = f"{empty} samples have no allowed action in `mask`; nothing can be decided for them"
        raise ValueError(msg)


def best_candidate(cand: torch.Tensor, primary: torch.Tensor,
                   secondary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, among ``cand`` (bool (N, A)) the highest ``primary``, ties -> lowest ``secondary``
    (then the lowest index). Returns (index (N,), row has a candidate (N,))."""
    inf = torch.tensor(float("inf"))
    p = torch.where(cand, primary, -inf)
    best = p.amax(dim=1, keepdim=True)  # amax: max(keepdim=True) is ~300x slower on CPU (torch 2.13)
    tied = cand & (p == best)
    s = torch.where(tied, torch.nan_to_num(secondary, nan=1e30), inf)
    return s.argmin(dim=1), cand.any(dim=1)


def _fastest_allowed(data: OfflineData) -> torch.Tensor:
    """Per sample, the allowed action with the lowest recorded latency."""
    idx, _ = best_candidate(data.mask, -data.latency_ms, torch.zeros_like(data.latency_ms))
    return idx


class DeterministicDecider:
    """A decider with one decision per (sample, budget): its ``action_probs`` are that decision, one-hot."""

    name: str

    def decide(self, data: OfflineData, budget_ms: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def action_probs(self, data: OfflineData, budget_ms: torch.Tensor) -> torch.Tensor:
        """One-hot (N, A): a deterministic decider puts all its mass on its decision."""
        return torch.nn.functional.one_hot(self.decide(data, budget_ms), len(data.action_space)).float()


class OracleDecider(DeterministicDecider):
    """Per sample, with hindsight: the allowed action with the best recorded score among
    those whose recorded latency fits the budget (ties -> lower latency); if none fits,
    the fastest allowed action. An upper bound no deployable decider reaches."""

    name = "oracle"
    #: the scores it chooses by (``OfflineData.scores``)
    score_kind = "recorded"

    def decide(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        require_allowed_actions(data)
        b = budget_vector(budget_ms, len(data))
        fits = data.mask & (data.latency_ms <= b[:, None])
        best, found = best_candidate(fits, data.scores(self.score_kind), data.latency_ms)
        return torch.where(found, best, _fastest_allowed(data))


class ClairvoyantDecider(OracleDecider):
    """Per sample, the allowed action with the best *expected* score among those whose recorded
    latency fits the budget (ties -> lower latency); if none fits, the fastest allowed action.

    The expected score is ``data.scores("mean")``: the mean of the sample's recorded runs of the
    configuration (exp5 and exp6), or the hidden truth where a generated world supplies it. The
    oracle chooses by the very outcome it is scored on and so also picks the lucky draws; this
    decider knows each sample's outcome *distribution* only, so the gap between the two is luck,
    and the gap between a controller and this decider is what per-sample knowledge could still
    add. With one recorded run per configuration the two coincide.
    """

    name = "clairvoyant"
    score_kind = "mean"


class LookupTableDecider(DeterministicDecider):
    """Static lookup table chosen on training data (docs/origin_format.md §7.9, on one latency definition).

    Per configuration, from ``train`` (pass ``data.subset("train")``; its allowed entries only):
    the mean score and a latency statistic, ``statistic="quantile"`` (the ``quantile``, default
    p95) or ``"mean"``. For a budget B the table's choice is the configuration with the best
    mean score among those with statistic <= B * (1 + ``tolerance``) (ties -> lower statistic);
    when none fits, the configuration with the lowest statistic. The choice depends on the
    budget only; per sample the best-ranked configuration that is recorded for it is used.
    Besides, ``latency_median_ms``: the median latency per configuration, which a server
    compares its own measured latencies with (``controller.cost.LatencyScale``).

    * ``LookupTableDecider(train)``: ``"lut_p95"``, p95 latency within the budget.
    * ``LookupTableDecider(train, statistic="mean", tolerance=0.05)``: ``"lut_mean5"``, the
      origin's mean latency within budget x 1.05.
    """

    def __init__(self, train: OfflineData, quantile: float = 0.95, tolerance: float = 0.0,
                 statistic: Literal["quantile", "mean"] = "quantile", name: str | None = None) -> None:
        if statistic not in ("quantile", "mean"):
            msg = f"`statistic` must be 'quantile' or 'mean', got {statistic!r}"
            raise ValueError(msg)
        if not 0.0 <= quantile <= 1.0:
            msg = f"`quantile` must be in [0, 1], got {quantile!r}"
            raise ValueError(msg)
        if tolerance < 0:
            msg = f"`tolerance` must be >= 0, got {tolerance!r}"
            raise ValueError(msg)
        if len(train) == 0:
            msg = "`train` has no samples: a lookup table needs training data"
            raise ValueError(msg)
        self.action_space = train.action_space
        self.statistic, self.quantile, self.tolerance = statistic, quantile, tolerance
        if name is None:
            pct = round(tolerance * 100)
            name = f"lut_p{round(quantile * 100)}" if statistic == "quantile" else "lut_mean"
            name += str(pct) if statistic == "mean" and pct else (f"_tol{pct}" if pct else "")
        self.name = name
        nan = torch.tensor(float("nan"))
        # only allowed entries count: a configuration is judged by the samples that recorded it
        score = torch.where(train.mask, train.score, nan).double()
        latency = torch.where(train.mask, train.latency_ms, nan).double()
        self.num_samples = train.mask.sum(dim=0)  # (A,)
        seen = self.num_samples > 0
        score_sum = torch.nan_to_num(score, nan=0.0).sum(0)
        self.mean_score = torch.where(seen, score_sum / self.num_samples.clamp(min=1), nan)
        if statistic == "mean":
            stat = torch.nan_to_num(latency, nan=0.0).sum(0) / self.num_samples.clamp(min=1)
        else:
            stat = torch.nanquantile(latency, quantile, dim=0)
        self.latency_stat_ms = torch.where(seen, stat, nan)  # (A,), NaN: never recorded in train
        # the typical latency per configuration: the unit a server calibrates its clock against
        self.latency_median_ms: torch.Tensor | None = torch.where(seen, torch.nanquantile(latency, 0.5, dim=0), nan)

    def state(self) -> dict:
        """The table as plain values (checkpoints): :meth:`from_state` rebuilds it without the data."""
        return {"action_space": self.action_space.to_json(), "statistic": self.statistic, "quantile": self.quantile,
                "tolerance": self.tolerance, "name": self.name, "num_samples": self.num_samples.tolist(),
                "mean_score": self.mean_score.tolist(), "latency_stat_ms": self.latency_stat_ms.tolist(),
                "latency_median_ms": None if self.latency_median_ms is None else self.latency_median_ms.tolist()}

    @classmethod
    def from_state(cls, state: dict) -> LookupTableDecider:
        table = cls.__new__(cls)
        table.action_space = ActionSpace.from_json(state["action_space"])
        table.statistic, table.quantile, table.tolerance = state["statistic"], state["quantile"], state["tolerance"]
        table.name = state["name"]
        table.num_samples = torch.tensor(state["num_samples"], dtype=torch.long)
        table.mean_score = torch.tensor(state["mean_score"], dtype=torch.float64)
        table.latency_stat_ms = torch.tensor(state["latency_stat_ms"], dtype=torch.float64)
        median = state.get("latency_median_ms")  # absent from a checkpoint written without it
        table.latency_median_ms = None if median is None else torch.tensor(median, dtype=torch.float64)
        return table

    def lookup(self, budget_ms: float) -> Action:
        """The table's configuration for one budget (before the per-sample mask)."""
        return self.action_space.actions[int(self.choose(torch.tensor([float(budget_ms)]), None)[0])]

    def choose(self, budget: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(N,) action indices for (N,) budgets in ms; ``mask`` (N, A) restricts each row (None: any action)."""
        num_actions = len(self.action_space)
        seen = ~torch.isnan(self.latency_stat_ms)
        allowed = seen.expand(len(budget), num_actions) if mask is None else mask & seen
        stat = self.latency_stat_ms.float()[None, :].expand(len(budget), num_actions)
        fits = allowed & (stat <= budget[:, None] * (1.0 + self.tolerance))
        best, found = best_candidate(fits, self.mean_score.float()[None, :].expand_as(stat), stat)
        # fallback by the TRAIN statistic (never the decided-for data's latencies); actions
        # unseen in train rank last but stay possible so that the choice is inside the mask
        base = allowed if mask is None else mask
        fallback, _ = best_candidate(base, -torch.nan_to_num(stat, nan=1e30), torch.zeros_like(stat))
        return torch.where(found, best, fallback)

    def decide(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        if data.action_space != self.action_space:
            msg = "the data's action space differs from the lookup table's (built on other data)"
            raise ValueError(msg)
        require_allowed_actions(data)
        return self.choose(budget_vector(budget_ms, len(data)), data.mask)


class FamilyLookupTableDecider(DeterministicDecider):
    """:class:`LookupTableDecider`'s rule fitted per question family (``"lut_by_family"``).

    From ``train`` (pass ``data.subset("train")``): one table per family on that family's
    training samples (``train.family``), and the global table on all of them (the same table
    as ``LookupTableDecider(train, ...)``). A sample of a family seen in ``train`` gets its
    family's table; a sample of a family unseen in training, or without a family, gets the
    global table's choice. ``quantile``, ``tolerance`` and ``statistic`` mean what they mean
    for :class:`LookupTableDecider` and apply to every table. Training data without family
    labels gives the global table for every sample.
    """

    def __init__(self, train: OfflineData, quantile: float = 0.95, tolerance: float = 0.0,
                 statistic: Literal["quantile", "mean"] = "quantile", name: str = "lut_by_family") -> None:
        self.name = name
        self.global_table = LookupTableDecider(train, quantile, tolerance, statistic)
        self.action_space = self.global_table.action_space
        rows = _rows_by_family(train.family)
        self.tables: dict[str, LookupTableDecider] = {
            family: LookupTableDecider(train.select(index), quantile, tolerance, statistic, name=f"{name}:{family}")
            for family, index in sorted(rows.items())}

    @property
    def families(self) -> tuple[str, ...]:
        """The families with their own table (seen in training), sorted."""
        return tuple(self.tables)

    def state(self) -> dict:
        """The tables as plain values: :meth:`from_state` rebuilds the decider without the data."""
        return {"name": self.name, "global": self.global_table.state(),
                "families": {family: table.state() for family, table in self.tables.items()}}

    @classmethod
    def from_state(cls, state: dict) -> FamilyLookupTableDecider:
        decider = cls.__new__(cls)
        decider.name = state["name"]
        decider.global_table = LookupTableDecider.from_state(state["global"])
        decider.action_space = decider.global_table.action_space
        decider.tables = {family: LookupTableDecider.from_state(table) for family, table in state["families"].items()}
        return decider

    def table_for(self, family: str | None) -> LookupTableDecider:
        """The table that decides for a sample of ``family`` (the global one for None or an unseen family)."""
        return self.global_table if family is None else self.tables.get(family, self.global_table)

    def lookup(self, budget_ms: float, family: str | None = None) -> Action:
        """The configuration for one budget and family (before the per-sample mask)."""
        return self.table_for(family).lookup(budget_ms)

    def choose(self, budget: torch.Tensor, family: Sequence[str | None] | None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """(N,) action indices for (N,) budgets in ms and N family labels (None: no labels);
        ``mask`` (N, A) restricts each row (None: any action)."""
        if family is not None and len(family) != len(budget):
            msg = f"`family` has {len(family)} labels for {len(budget)} budgets"
            raise ValueError(msg)
        out = self.global_table.choose(budget, mask)
        for label, index in _rows_by_family(family).items():
            table = self.tables.get(label)
            if table is not None:
                rows = torch.tensor(index, dtype=torch.long)
                out[rows] = table.choose(budget[rows], None if mask is None else mask[rows])
        return out

    def decide(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        if data.action_space != self.action_space:
            msg = "the data's action space differs from the lookup tables' (built on other data)"
            raise ValueError(msg)
        require_allowed_actions(data)
        return self.choose(budget_vector(budget_ms, len(data)), data.family, data.mask)


def _rows_by_family(family: Sequence[str | None] | None) -> dict[str, list[int]]:
    """Row indices per family label (rows without one left out)."""
    rows: dict[str, list[int]] = {}
    for i, label in enumerate(family or ()):
        if label is not None:
            rows.setdefault(label, []).append(i)
    return rows


def nearest_family(lang: torch.Tensor, reference_features: torch.Tensor, reference_family: torch.Tensor,
                   num_families: int, neighbours: int) -> torch.Tensor:
    """(N,) family indices: for each row of ``lang`` (N, L), the family that most of its ``neighbours``
    nearest reference questions belong to (cosine similarity; a tie goes to the lower index).
    ``reference_features`` (R, L) are unit rows, ``reference_family`` (R,) int64 in [0, num_families).
    TorchScript-compatible: the deployed controller reads the family with this function."""
    query = torch.nn.functional.normalize(lang.float(), dim=1)
    k = min(neighbours, reference_features.shape[0])
    near = torch.mm(query, reference_features.t()).topk(k, dim=1).indices
    votes = torch.zeros(lang.shape[0], num_families, dtype=torch.float32, device=lang.device)
    votes.scatter_add_(1, reference_family.index_select(0, near.flatten()).view(near.shape),
                       torch.ones(near.shape, dtype=torch.float32, device=lang.device))
    return votes.argmax(1)


def closest_similarity(lang: torch.Tensor, reference_features: torch.Tensor) -> torch.Tensor:
    """(N,) float32: each row's cosine similarity to its most similar reference question (-1.0 without
    references). TorchScript-compatible: the deployed controller tells unfamiliar questions by it."""
    if reference_features.shape[0] == 0:
        return torch.full((lang.shape[0],), -1.0, dtype=torch.float32, device=lang.device)
    query = torch.nn.functional.normalize(lang.float(), dim=1)
    return torch.mm(query, reference_features.t()).amax(1)


#: the low quantile of the training questions' similarity to their closest reference that sets how
#: unlike them a question must be to read as no family (``QuestionFamilyTableDecider.min_similarity``)
UNFAMILIAR_QUANTILE = 0.01


class QuestionFamilyTableDecider(DeterministicDecider):
    """:class:`FamilyLookupTableDecider`'s per-family tables, each sample's family read from its
    question rather than from a label (``"lut_by_question"``): a table a server can run.

    The family a question reads as is the one most of its ``neighbours`` nearest reference
    questions carry (:func:`nearest_family` on the language features); the references are up to
    ``references_per_family`` training questions of every labelled family, evenly spaced over its
    rows (a bounded size, and a small family votes as loudly as a large one). Training data without
    family labels gives the global ``lut_p95`` table for every sample (``has_families`` False).

    A question less similar to every reference than ``min_similarity`` reads as no family and gets
    the global table, as ``lut_by_family`` gives an unseen family: a kind of question the training
    never saw would otherwise take the tables of whatever family it is least unlike. The threshold
    is the ``unfamiliar_quantile`` quantile of the training questions' similarity to their closest
    reference (a reference's own row counting its second closest), lowered by its distance to their
    median: a question must be clearly less similar than almost every training question (the
    quantile alone sent about one familiar question in a hundred to the global table). None (the
    default, and the labelled table's): every question reads as a family; the cluster table
    (:mod:`trainer.clusters`) sets ``UNFAMILIAR_QUANTILE``.
    """

    def __init__(self, train: OfflineData, neighbours: int = 15, references_per_family: int = 32,
                 name: str = "lut_by_question", unfamiliar_quantile: float | None = None) -> None:
        if neighbours < 1 or references_per_family < 1:
            msg = (f"`neighbours` and `references_per_family` must be >= 1, got {neighbours!r} and "
                   f"{references_per_family!r}")
            raise ValueError(msg)
        self.name, self.neighbours = name, int(neighbours)
        self.tables = FamilyLookupTableDecider(train, name=name)
        self.action_space = self.tables.action_space
        rows = _rows_by_family(train.family)
        keep: list[int] = []
        family_index: list[int] = []
        for j, family in enumerate(self.tables.families):
            index = rows[family]
            picks = torch.linspace(0, len(index) - 1, min(references_per_family, len(index))).round().long()
            keep.extend(index[int(p)] for p in picks)
            family_index.extend([j] * len(picks))
        dim = train.lang_features.shape[1]
        self.reference_features = (torch.nn.functional.normalize(train.lang_features[keep].float(), dim=1)
                                   if keep else torch.zeros(0, dim))
        self.reference_family = torch.tensor(family_index, dtype=torch.long)
        self.min_similarity = -2.0  # below any cosine: every question reads as a family
        labelled = [i for i, f in enumerate(train.family or ()) if f is not None]
        if keep and unfamiliar_quantile is not None and labelled:
            query = torch.nn.functional.normalize(train.lang_features[labelled].float(), dim=1)
            top = torch.mm(query, self.reference_features.t()).topk(min(2, len(keep)), dim=1).values
            is_reference = torch.zeros(len(train), dtype=torch.bool)
            is_reference[keep] = True
            own = is_reference[labelled] & (top.shape[1] > 1)
            closest = torch.where(own, top[:, -1], top[:, 0])
            low, median = torch.quantile(closest.double(), torch.tensor([float(unfamiliar_quantile), 0.5],
                                                                        dtype=torch.float64)).tolist()
            self.min_similarity = low - (median - low)

    @property
    def families(self) -> tuple[str, ...]:
        return self.tables.families

    @property
    def has_families(self) -> bool:
        return bool(self.families)

    @property
    def global_table(self) -> LookupTableDecider:
        return self.tables.global_table

    def read_family(self, lang: torch.Tensor) -> list[str | None]:
        """The family each row of language features (N, L) reads as (None for all without families, and
        for a question less similar to every reference than ``min_similarity``)."""
        if not self.has_families:
            return [None] * len(lang)
        index = nearest_family(lang, self.reference_features, self.reference_family, len(self.families),
                               self.neighbours)
        familiar = (closest_similarity(lang, self.reference_features) >= self.min_similarity).tolist()
        return [self.families[int(j)] if ok else None for j, ok in zip(index, familiar)]

    def choose(self, budget: torch.Tensor, lang: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(N,) action indices for (N,) budgets in ms and (N, L) language features."""
        return self.tables.choose(budget, self.read_family(lang), mask)

    def decide(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        if data.action_space != self.action_space:
            msg = "the data's action space differs from the lookup tables' (built on other data)"
            raise ValueError(msg)
        require_allowed_actions(data)
        return self.choose(budget_vector(budget_ms, len(data)), data.lang_features, data.mask)

    def state(self) -> dict:
        """The tables and reference questions as plain values (checkpoints): :meth:`from_state` rebuilds
        the decider without the data."""
        return {"kind": "question_family", "name": self.name, "neighbours": self.neighbours,
                "tables": self.tables.state(), "reference_features": self.reference_features.tolist(),
                "reference_family": self.reference_family.tolist(), "lang_dim": int(self.reference_features.shape[1]),
                "min_similarity": self.min_similarity}

    @classmethod
    def from_state(cls, state: dict) -> QuestionFamilyTableDecider:
        decider = cls.__new__(cls)
        decider.name, decider.neighbours = state["name"], int(state["neighbours"])
        decider.tables = FamilyLookupTableDecider.from_state(state["tables"])
        decider.action_space = decider.tables.action_space
        decider.reference_features = torch.tensor(state["reference_features"], dtype=torch.float32).reshape(
            -1, int(state["lang_dim"]))
        decider.reference_family = torch.tensor(state["reference_family"], dtype=torch.long)
        decider.min_similarity = float(state.get("min_similarity", -2.0))  # absent: stored before the threshold
        return decider


def table_from_state(state: dict) -> LookupTableDecider | QuestionFamilyTableDecider:
    """The table a stored state describes: a question-family table (``kind``) or a global one."""
    if state.get("kind") == "question_family":
        return QuestionFamilyTableDecider.from_state(state)
    return LookupTableDecider.from_state(state)


class BestStaticDecider(DeterministicDecider):
    """Per budget, the one configuration that, given to every sample of the data it decides, has the
    best mean score among those over budget on at most ``max_violation_rate`` of the samples (ties ->
    lower mean latency); where none keeps that rate, the one over budget least often. Chosen with
    hindsight on the decided data itself, like the oracle: the best any static setting could do
    there, the bar a per-request decision must clear. A sample whose mask lacks the configuration
    gets its fastest allowed action (counted in the choice too)."""

    name = "best_static"

    def __init__(self, max_violation_rate: float = 0.05) -> None:
        self.max_violation_rate = float(max_violation_rate)

    def choose_configuration(self, data: OfflineData, budget_ms: float) -> int:
        """The static configuration's index at one budget (see the class docstring)."""
        require_allowed_actions(data)
        fastest = _fastest_allowed(data)
        rows = torch.arange(len(data))
        # (N, A): the outcome of giving configuration a to every sample, the fastest allowed where a is not
        score = torch.where(data.mask, data.score, data.score[rows, fastest][:, None]).double()
        latency = torch.where(data.mask, data.latency_ms, data.latency_ms[rows, fastest][:, None]).double()
        over = (latency > float(budget_ms)).double().mean(0)
        keeps = over <= self.max_violation_rate
        if bool(keeps.any()):
            best, _ = best_candidate(keeps[None], score.mean(0)[None], latency.mean(0)[None])
            return int(best[0])
        best, _ = best_candidate(torch.ones(1, len(over), dtype=torch.bool), -over[None], latency.mean(0)[None])
        return int(best[0])

    def decide(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        budget = budget_vector(budget_ms, len(data))
        out = torch.zeros(len(data), dtype=torch.long)
        for value in torch.unique(budget).tolist():
            rows = (budget == value).nonzero().flatten()
            part = data.select(rows)
            config = self.choose_configuration(part, value)
            out[rows] = torch.where(part.mask[:, config], config, _fastest_allowed(part))
        return out


class LargestDecider(DeterministicDecider):
    """The allowed action with the most crops, then top_k, then blocks (lexicographic)."""

    name = "largest"

    def decide(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        require_allowed_actions(data)
        budget_vector(budget_ms, len(data))  # validates the shape; the choice ignores the budget
        # actions are sorted lexicographically, so the largest is the highest allowed index
        rank = torch.arange(len(data.action_space), dtype=torch.float32).expand_as(data.score)
        idx, _ = best_candidate(data.mask, rank, torch.zeros_like(rank))
        return idx


class RandomDecider:
    """Uniform over each sample's allowed actions, ignoring the budget.

    Each call draws from a fresh generator seeded with ``seed``, so a call is reproducible
    and different budgets see the same draws (common random numbers across the grid).
    """

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)

    def decide(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        require_allowed_actions(data)
        budget_vector(budget_ms, len(data))
        generator = torch.Generator().manual_seed(self.seed)
        return torch.multinomial(data.mask.float(), 1, generator=generator).flatten()

    def action_probs(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        require_allowed_actions(data)
        allowed = data.mask.float()
        return allowed / allowed.sum(dim=1, keepdim=True)
