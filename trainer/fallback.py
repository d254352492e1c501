"""Safe deployment: per budget, the lookup table where held-out data shows the controller
breaking the violation goal, or losing to the table with confidence.

After training, :func:`fit_table_fallback` compares,
at every budget of the validation grid, the controller's greedy decisions with a lookup table's
(:func:`fallback_table`: by default, where the data labels question families, ``lut_by_question``,
the per-family tables with each question's family read from its nearest training questions, so
that the deployed controller answers at least as a per-family table would; where it does not,
``lut_by_cluster``, the same with families found by clustering the questions,
:mod:`trainer.clusters`; ``lut_p95``, the budget alone, on request) — exactly, since every
configuration's outcome is recorded — and picks per budget, violations first, then reward.
A cluster table first meets its own global ``lut_p95`` table by the same rule, the clusters
preferred (:func:`choose_family_table_at`): at each budget ``lut_p95`` answers for them where
held-out evidence favours it with confidence (a labelled family table answers with its families
at every budget, docs/training.md):

* the table keeps the violation target if the one-sided upper ``confidence`` bound (Wilson)
  of its violation rate on train + validation is within ``max_violation_rate`` (the 5 %
  goal). A bound, not the rate: the table's configuration is the most accurate one whose
  train p95 fits the budget, so its train rate sits just under 5 % by construction and new
  samples often push it over. In a cross-fit every sample is counted out of fold, by the
  table of a fold that did not see it: there its rate is unbiased and counts as the
  controller's does (the bound gave two generated worlds' lowest budget to a weaker network,
  docs/results.md);
* the controller keeps it if its violation rate on the validation split is within the target
  (it is trained towards a 3 % target; no bound from ~50 validation samples could certify 5 %);
* both keep it: the preferred decider (``prefers``) answers unless the other one's mean
  validation reward beats it by more than z * SE of the paired per-sample differences (a
  one-sided test at ``confidence``): a difference of one or two samples is no evidence.
  ``prefers="controller"``: the table answers only where it is better with confidence.
  ``prefers="table"``: the controller answers only where it is better with confidence (safe
  policy improvement: Thomas et al. 2015, "High-confidence off-policy evaluation"; Laroche et
  al. 2019, SPIBB). ``prefers="auto"`` (the default, :func:`resolve_prefers`): the table where
  it is ``lut_by_question``, the controller where it is ``lut_p95``. Measured on unseen generated
  worlds (docs/results.md): the budget-only table at the budgets where the two are close cost up
  to 2.4 points against the per-family table, which the controller follows there; but against
  the question-family table, preferring the controller fell below the per-family table by more
  than its standard error in four of seven worlds, preferring the table in one;
* only one keeps it: that one; neither: the lower violation rate (the controller on a tie).

At the other budgets the deployed controller answers with the table's configuration. A
budget between grid points follows the nearest grid point.

The raw network stays available (``decider="policy"`` in evaluations)
and the online phase continues the network, not the fallback.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.baselines import (
    BatchDecider,
    DeterministicDecider,
    LookupTableDecider,
    QuestionFamilyTableDecider,
    budget_vector,
    closest_similarity,
    table_from_state,
)
from trainer.clusters import CLUSTER_TABLE, cluster_table
from trainer.constraint import VIOLATION_TARGET
from trainer.data import OfflineData
from trainer.greedy import policy_greedy
from trainer.policy import (
    ControllerPolicy,
    check_fingerprint,
    check_image_feature,
    data_log_probs,
    mask_in_policy_space,
    read_checkpoint,
    request_ms_in_policy_space,
    tilings_in_policy_space,
)
from trainer.request_cost import RequestCostConfig
from trainer.request_table import REQUEST_TABLE, RequestTableDecider
from trainer.reward import RewardConfig, compute_reward
from trainer.runs import atomic_torch_save

#: the deciders a fallback may prefer where neither wins the reward test
FALLBACK_PREFERS = ("controller", "table")
#: what a caller may ask for: one of them, or ``"auto"`` (:func:`resolve_prefers`)
PREFERS_CHOICES = ("auto", *FALLBACK_PREFERS)
#: the tables a fallback may answer with (:func:`fallback_table`)
FALLBACK_TABLES = ("auto", "family", "cluster", "p95")

__all__ = ["FALLBACK_PREFERS", "FALLBACK_TABLES", "BudgetSwitch", "BudgetSwitchedTable", "PolicyDecider",
           "TableFallback", "answered_by", "attach_fallback", "choose_family_table_at", "choose_request_table_at",
           "PREFERS_CHOICES", "fallback_table", "fit_table_fallback", "read_fallback", "resolve_prefers",
           "switched_table", "table_kind", "tables_only", "wilson_upper_bound"]


@dataclass
class TableFallback:
    """Which budgets the controller keeps, and the table that answers at the others.

    grid_ms: the validation grid, ascending (ms).
    use_controller: per grid point, True where the controller decides (the rule in the
        module docstring), False where the table answers.
    controller_reward, table_reward: those mean validation rewards;
    reward_difference_se: the standard error of their paired per-sample difference;
    controller_violation_rate: the validation share of the controller's decisions over budget;
    table_violation_rate, table_violation_upper: the table's share over budget on train +
        validation, and its upper ``confidence`` bound (the evidence, kept for inspection).
    max_violation_rate: the violation rate a decider must keep to be preferred on reward.
    confidence: the level of the violation bound and of the reward test.
    table: the ``state()`` of the table that answers, fitted on the train split
        (:func:`fallback_table`): ``lut_by_question`` or ``lut_p95``.
    prefers: the decider that answers where both keep the violation goal and the other does
        not win the reward test (``"controller"`` or ``"table"``).
    family_table_at: per grid point, where ``table`` has families (``lut_by_question``,
        ``lut_by_cluster``): True where they answer, False where its global ``lut_p95`` table does
        (:func:`choose_family_table_at`); None: the families at every budget.
    request_table: the ``state()`` of the per-request table (``lut_by_request``,
        :class:`trainer.request_table.RequestTableDecider`): its cost model is deployed with the
        controller (each request's predicted latency, the server's guard) whether or not the table
        answers anywhere; None for a run without one.
    request_table_at: per grid point, True where ``request_table`` answers in ``table``'s place
        (:func:`choose_request_table_at`; all False where it may not answer).
    """

    grid_ms: list[float]
    use_controller: list[bool]
    controller_reward: list[float]
    table_reward: list[float]
    reward_difference_se: list[float]
    controller_violation_rate: list[float]
    table_violation_rate: list[float]
    table_violation_upper: list[float]
    max_violation_rate: float
    confidence: float
    table: dict[str, Any]
    prefers: str = "controller"
    family_table_at: list[bool] | None = None
    request_table: dict[str, Any] | None = None
    request_table_at: list[bool] | None = None

    def __post_init__(self) -> None:
        n = len(self.grid_ms)
        for name in ("family_table_at", "request_table_at"):
            at = getattr(self, name)
            if at is not None and len(at) != n:
                msg = f"`{name}` has {len(at)} entries for {n} grid budgets"
                raise ValueError(msg)
        if (self.request_table is None) != (self.request_table_at is None):
            msg = "`request_table` and `request_table_at` are given together or not at all"
            raise ValueError(msg)
        per_budget = (self.use_controller, self.controller_reward, self.table_reward, self.reward_difference_se,
                      self.controller_violation_rate, self.table_violation_rate, self.table_violation_upper)
        if n == 0 or any(len(x) != n for x in per_budget):
            msg = (f"`grid_ms` and the per-budget lists (use_controller, rewards, violation rates) must have "
                   f"the same non-zero length, got {n} and {[len(x) for x in per_budget]}")
            raise ValueError(msg)
        if list(self.grid_ms) != sorted(self.grid_ms):
            msg = f"`grid_ms` must be ascending, got {self.grid_ms!r}"
            raise ValueError(msg)
        if self.prefers not in FALLBACK_PREFERS:
            msg = f"`prefers` must be one of {FALLBACK_PREFERS}, got {self.prefers!r}"
            raise ValueError(msg)

    def _at_nearest(self, flags: list[bool] | None, budget_ms: torch.Tensor, missing: bool) -> torch.Tensor:
        """bool, shape of ``budget_ms``: each budget's nearest grid point's entry of ``flags`` (``missing``
        everywhere where there are none)."""
        b = torch.as_tensor(budget_ms, dtype=torch.float64)
        if flags is None:
            return torch.full(b.shape, missing, dtype=torch.bool)
        nearest = (b[..., None] - torch.tensor(self.grid_ms, dtype=torch.float64)).abs().argmin(-1)
        return torch.tensor(flags, dtype=torch.bool)[nearest]

    def controller_at(self, budget_ms: torch.Tensor) -> torch.Tensor:
        """bool, shape of ``budget_ms``: True where the controller decides (nearest grid point)."""
        return self._at_nearest(self.use_controller, budget_ms, True)

    def lookup_table(self) -> LookupTableDecider | QuestionFamilyTableDecider:
        """The stored table itself (for a family table: its families at every budget), built once per
        ``table`` state: :meth:`network_allowed` reads it on every decision."""
        cached = self.__dict__.get("_lookup")
        if cached is None or cached[0] is not self.table:
            cached = (self.table, table_from_state(self.table))
            self.__dict__["_lookup"] = cached
        return cached[1]

    def request_decider(self) -> RequestTableDecider | None:
        """The per-request table (None for a run without one), built once per ``request_table`` state."""
        if self.request_table is None:
            return None
        cached = self.__dict__.get("_request")
        if cached is None or cached[0] is not self.request_table:
            cached = (self.request_table, RequestTableDecider.from_state(self.request_table))
            self.__dict__["_request"] = cached
        return cached[1]

    def answering_table(self) -> BatchDecider:
        """The table as the fallback answers with it: a family table's global ``lut_p95`` table at the
        budgets ``family_table_at`` gives to it (:class:`BudgetSwitchedTable`), the per-request table at
        those ``request_table_at`` gives to it (:class:`BudgetSwitch`)."""
        table = switched_table(self.lookup_table(), self.grid_ms, self.family_table_at)
        request = self.request_decider()
        if request is None or self.request_table_at is None or not any(self.request_table_at):
            return table
        return BudgetSwitch(request, table, self.grid_ms, self.request_table_at)

    def requests_at(self, budget_ms: torch.Tensor) -> torch.Tensor:
        """bool, shape of ``budget_ms``: True where the per-request table answers for the table (nearest grid point)."""
        return self._at_nearest(self.request_table_at, budget_ms, False)

    @property
    def guards_network(self) -> bool:
        """True where the table is a cluster table with an unfamiliar-question threshold: a question unlike
        every training question is answered by the global table, never the network (:meth:`network_allowed`)."""
        return (self.table.get("kind") == "question_family" and self.table.get("name") == CLUSTER_TABLE
                and float(self.table.get("min_similarity", -2.0)) > -1.0 and bool(self.table.get("reference_family")))

    def network_allowed(self, lang: torch.Tensor) -> torch.Tensor:
        """(N,) bool: False for a question unlike every reference question of a cluster table (its closest
        one less similar than the table's ``min_similarity``), which the global ``lut_p95`` table answers
        at every budget: the network never saw its kind, and was measured late on such questions
        (docs/results.md); True for every question otherwise."""
        if not self.guards_network:
            return torch.ones(len(lang), dtype=torch.bool)
        table = self.lookup_table()
        return closest_similarity(lang, table.reference_features) >= table.min_similarity

    def families_at(self, budget_ms: torch.Tensor) -> torch.Tensor:
        """bool, shape of ``budget_ms``: True where a family table answers with its families (nearest grid point)."""
        return self._at_nearest(self.family_table_at, budget_ms, True)

    def budget_table(self) -> LookupTableDecider:
        """The fallback's ``lut_p95`` table (a question-family table's global one): one configuration
        per budget, and the median latencies a server calibrates against."""
        table = self.lookup_table()
        return table.global_table if isinstance(table, QuestionFamilyTableDecider) else table

    @property
    def table_kind(self) -> str:
        """``"family"``, ``"cluster"`` or ``"p95"``: the :func:`fallback_table` kind the answering table was
        fitted as."""
        if self.table.get("kind") != "question_family":
            return "p95"
        return "cluster" if self.table.get("name") == CLUSTER_TABLE else "family"

    @property
    def fallback_budgets_ms(self) -> list[float]:
        """The grid budgets where the table answers."""
        return [b for b, keep in zip(self.grid_ms, self.use_controller) if not keep]

    def describe(self) -> str:
        """One line for the terminal: which grid budgets the controller keeps, which the table answers."""
        def budgets(values: list[float]) -> str:
            return ", ".join(f"{b:.1f}" for b in values) + " ms" if values else "none"

        level = "" if math.isnan(self.confidence) else f" ({self.confidence:.0%} confidence, {self.prefers} preferred)"
        kept = [b for b, keep in zip(self.grid_ms, self.use_controller) if keep]
        name = self.table.get("name", "lut_p95")
        at = self.family_table_at or [True] * len(self.grid_ms)
        requests = self.request_table_at or [False] * len(self.grid_ms)
        tabled = [(b, fam) for b, keep, fam, req in zip(self.grid_ms, self.use_controller, at, requests)
                  if not keep and not req]
        rich, plain = [b for b, fam in tabled if fam], [b for b, fam in tabled if not fam]
        by_request = [b for b, keep, req in zip(self.grid_ms, self.use_controller, requests) if not keep and req]
        extra = f"; {REQUEST_TABLE} table at {budgets(by_request)}" if by_request else ""
        if name == "lut_p95" or not plain:
            return (f"table fallback{level}: controller at {budgets(kept)}; {name} table at {budgets(rich + plain)}"
                    + extra)
        return (f"table fallback{level}: controller at {budgets(kept)}; {name} table at {budgets(rich)}; "
                f"lut_p95 table at {budgets(plain)}" + extra)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TableFallback:
        d = dict(d)
        n = len(d.get("grid_ms", []))
        for key in ("reward_difference_se", "table_violation_upper"):  # absent from a checkpoint written without them
            d.setdefault(key, [math.nan] * n)
        d.setdefault("confidence", math.nan)
        d.setdefault("prefers", "table")  # the rule of checkpoints written before the choice existed
        d.setdefault("family_table_at", None)
        d.setdefault("request_table", None)
        d.setdefault("request_table_at", None)
        return cls(**d)


class BudgetSwitch(DeterministicDecider):
    """``first`` at the budgets whose nearest point of ``grid_ms`` has ``first_at`` True, ``other`` at the
    rest; named after ``other`` (the table it stands in for)."""

    def __init__(self, first: BatchDecider, other: BatchDecider, grid_ms: list[float], first_at: list[bool]) -> None:
        self.first, self.other, self.name = first, other, other.name
        self.grid = torch.tensor(grid_ms, dtype=torch.float64)
        self.first_at = torch.tensor(first_at, dtype=torch.bool)
        self.action_space = getattr(other, "action_space", None)

    def decide(self, data: OfflineData, budget_ms: Tensor | float) -> Tensor:
        budget = budget_vector(budget_ms, len(data))
        use = self.first_at[(budget.double()[:, None] - self.grid).abs().argmin(-1)]
        if bool(use.all()):
            return self.first.decide(data, budget)
        rest = self.other.decide(data, budget)
        if not bool(use.any()):
            return rest
        return torch.where(use, self.first.decide(data, budget), rest)


class BudgetSwitchedTable(BudgetSwitch):
    """A family table that answers with its families at some budgets and with its global
    ``lut_p95`` table at the others (nearest point of ``grid_ms``); named after the family table."""

    def __init__(self, table: QuestionFamilyTableDecider, grid_ms: list[float], family_at: list[bool]) -> None:
        super().__init__(table, table.global_table, grid_ms, family_at)
        self.table, self.name = table, table.name


def switched_table(table: BatchDecider, grid_ms: list[float], family_at: list[bool] | None) -> BatchDecider:
    """``table``, or a :class:`BudgetSwitchedTable` where it has families and ``family_at`` gives some
    budgets to its global table."""
    if (family_at is None or all(family_at) or not isinstance(table, QuestionFamilyTableDecider)
            or not table.has_families):
        return table
    return BudgetSwitchedTable(table, grid_ms, family_at)


class PolicyDecider:
    """The trained controller as a :class:`trainer.baselines.BatchDecider`: the greedy decision a server
    makes, stage 1 then stage 2 (:mod:`trainer.greedy`), inside each sample's mask.

    With a ``fallback`` (:class:`trainer.fallback.TableFallback`), the lookup table's
    configuration at the budgets where the controller did not beat the table on held-out
    data: the deployed controller. Without one, the network alone (``name="policy"`` in
    evaluations that show both).
    """

    def __init__(self, policy: ControllerPolicy, fallback: TableFallback | None = None,
                 name: str = "controller") -> None:
        self.policy, self.fallback, self.name = policy, fallback, name
        self._table = fallback.answering_table() if fallback is not None else None

    @torch.inference_mode()
    def action_probs(self, data: OfflineData, budget_ms: Tensor | float) -> Tensor:
        """pi(a | x) over ``data.action_space`` (N, A), 0 outside ``data.mask`` (the evaluation's
        expected reward); one-hot on the table's choice where the fallback answers."""
        self._check_model(data)
        with self._evaluating():
            probs = data_log_probs(self.policy, data, budget_ms).exp()
        if self.fallback is None:
            return probs
        budget = budget_vector(budget_ms, len(data))
        use = self.fallback.controller_at(budget) & self.fallback.network_allowed(data.lang_features)
        if bool(use.all()):
            return probs
        table_choice = F.one_hot(self._table.decide(data, budget), probs.shape[1]).to(probs.dtype)
        return torch.where(use[:, None], probs, table_choice)

    @torch.inference_mode()
    def decide(self, data: OfflineData, budget_ms: Tensor | float) -> Tensor:
        """(N,) indices into ``data.action_space``, always inside ``data.mask``: the network's greedy
        decision (:func:`trainer.greedy.policy_greedy`), the table's where the fallback answers."""
        budget = budget_vector(budget_ms, len(data))
        use = None if self.fallback is None else (self.fallback.controller_at(budget)
                                                  & self.fallback.network_allowed(data.lang_features))
        if use is not None and not bool(use.any()):
            return self._table.decide(data, budget)
        self._check_model(data)
        # data_log_probs' view of the data in the policy's space
        mask, to_data = mask_in_policy_space(self.policy, data)
        with self._evaluating():
            chosen = policy_greedy(self.policy, data.image_features, data.image_present, data.lang_features, budget,
                                   mask, tiling_crops=tilings_in_policy_space(self.policy, data),
                                   prompt_tokens=data.prompt_tokens,
                                   request_ms=request_ms_in_policy_space(self.policy, data))
        if to_data is not None:
            chosen = to_data[chosen]
        if use is None or bool(use.all()):
            return chosen
        return torch.where(use, chosen, self._table.decide(data, budget))

    def _check_model(self, data: OfflineData) -> None:
        """The data's features are those the policy was trained on: the same model and image feature."""
        if self.policy.model_fingerprint is not None:
            check_fingerprint(self.policy, data.model_fingerprint, "controller")
        check_image_feature(self.policy, data, "controller")

    @contextmanager
    def _evaluating(self) -> Iterator[None]:
        """The policy in eval mode for the block (no dropout), its mode restored after."""
        was_training = self.policy.training
        self.policy.eval()
        try:
            yield
        finally:
            self.policy.train(was_training)


def answered_by(fallback: TableFallback | None, budget_ms: float) -> str:
    """Who answers for the deployed controller at ``budget_ms``: ``controller`` (the network), or the
    fallback's table there (``lut_by_question``, ``lut_by_cluster`` or ``lut_p95``)."""
    if fallback is None:
        return "controller"
    budget = torch.tensor([float(budget_ms)])
    if bool(fallback.controller_at(budget)[0]):
        return "controller"
    if bool(fallback.requests_at(budget)[0]):
        return REQUEST_TABLE
    name = str(fallback.table.get("name", "lut_p95"))
    return name if fallback.table_kind != "p95" and bool(fallback.families_at(budget)[0]) else "lut_p95"


def wilson_upper_bound(successes: int, trials: int, confidence: float) -> float:
    """One-sided upper ``confidence`` bound of a binomial rate (Wilson score interval); 1.0 without trials."""
    if trials <= 0:
        return 1.0
    z = NormalDist().inv_cdf(confidence)
    p, z2 = successes / trials, z * z
    centre = p + z2 / (2 * trials)
    spread = z * math.sqrt(p * (1.0 - p) / trials + z2 / (4 * trials * trials))
    return min(1.0, (centre + spread) / (1.0 + z2 / trials))


@torch.no_grad()
def fallback_table(train: OfflineData, kind: str = "auto", grid_ms: list[float] | None = None,
                   reward: RewardConfig | None = None,
                   seed: int = 0) -> LookupTableDecider | QuestionFamilyTableDecider:
    """The table a fallback answers with, fitted on ``train``:

    * ``"family"``: the per-family tables deciding by the family each question reads as
      (``lut_by_question``), ``lut_p95`` where ``train`` has no family labels;
    * ``"cluster"``: the per-cluster tables of questions clustered without labels
      (``lut_by_cluster``, :func:`trainer.clusters.cluster_table`; the cluster count chosen out of
      fold over ``grid_ms`` with ``reward``, seeded by ``seed``);
    * ``"auto"``: ``"family"`` where ``train`` has family labels, else ``"cluster"``;
    * ``"p95"``: the budget-only ``lut_p95`` table.
    """
    if kind not in FALLBACK_TABLES:
        msg = f"the fallback table must be one of {FALLBACK_TABLES}, got {kind!r}"
        raise ValueError(msg)
    if kind == "auto":
        kind = "family" if train.family is not None else "cluster"
    if kind == "family":
        table = QuestionFamilyTableDecider(train)
        if table.has_families:
            return table
    if kind == "cluster":
        if grid_ms is None or reward is None:
            msg = "a cluster table needs the budget grid and the reward its cluster count is chosen by"
            raise ValueError(msg)
        table = cluster_table(train, grid_ms, reward, seed=seed)
        if table.has_families:
            return table
    return LookupTableDecider(train)


def table_kind(table: BatchDecider) -> str:
    """The :func:`fallback_table` kind that fits a table like ``table``: ``"family"`` (``lut_by_question``),
    ``"cluster"`` (``lut_by_cluster``), or ``"p95"`` for any other (a family table without families too)."""
    if not isinstance(table, QuestionFamilyTableDecider) or not table.has_families:
        return "p95"
    return "cluster" if table.name == CLUSTER_TABLE else "family"


def resolve_prefers(prefers: str, table: BatchDecider) -> str:
    """``prefers`` with ``"auto"`` made concrete: ``"table"`` where ``table`` reads the question's
    labelled family (``lut_by_question``), else ``"controller"`` (``lut_p95``, and ``lut_by_cluster``:
    preferred, the cluster table cost the deployed controller up to 2.1 points of mean accuracy on
    unseen label-free worlds, docs/results.md)."""
    if prefers not in PREFERS_CHOICES:
        msg = f"`prefers` must be one of {PREFERS_CHOICES}, got {prefers!r}"
        raise ValueError(msg)
    if prefers != "auto":
        return prefers
    plain = table.table if isinstance(table, BudgetSwitchedTable) else table
    return "table" if table_kind(plain) == "family" else "controller"


def fit_table_fallback(policy: ControllerPolicy, train: OfflineData, val: OfflineData, grid_ms: list[float],
                       reward: RewardConfig, max_violation_rate: float = VIOLATION_TARGET,
                       confidence: float = 0.95, prefers: str = "auto", table: str = "auto",
                       seed: int = 0, request_table: bool = False) -> TableFallback:
    """Choose, per budget of ``grid_ms``, between the controller and the table ``table``
    (:func:`fallback_table`; a family or cluster table at each budget with its families or its
    global ``lut_p95`` table, :func:`choose_family_table_at`).

    ``train`` builds the table (as in the evaluation) and, with ``val``, counts its
    violations; ``val`` carries the scores the rewards are computed from (the training
    targets, so the comparison sees the same, less noisy, scores as the model selection)
    and the controller's violations. The rule is in the module docstring.
    """
    answering = fallback_table(train, table, grid_ms, reward, seed)
    family_at = None
    if table_kind(answering) == "cluster":  # a labelled family table answers with its families at every budget
        family_at = choose_family_table_at(answering, answering.global_table, val, grid_ms, reward,
                                           confidence=confidence, max_violation_rate=max_violation_rate)
    switched = switched_table(answering, grid_ms, family_at)
    request = RequestTableDecider.fit(train, RequestCostConfig(seed=seed))
    fallback = compare_with_table(PolicyDecider(policy), switched, val, grid_ms, reward, answering.state(),
                                  also_count_table_on=train, max_violation_rate=max_violation_rate,
                                  confidence=confidence, prefers=resolve_prefers(prefers, answering))
    request_at = [False] * len(grid_ms)
    if request_table:
        request_at = tables_only(fallback.use_controller, choose_request_table_at(
            request, switched, val, grid_ms, reward, confidence=confidence, max_violation_rate=max_violation_rate))
    return replace(fallback, family_table_at=family_at, request_table=request.state(), request_table_at=request_at)


def tables_only(use_controller: list[bool], request_at: list[bool]) -> list[bool]:
    """Where the per-request table answers: where it beat the table (``request_at``) and the table answers
    (not the network). It is a better table, not a better network: the network's budgets stay decided
    against the table alone, so one more per-budget test cannot take them from it by chance."""
    return [bool(r) and not bool(c) for c, r in zip(use_controller, request_at)]


def choose_request_table_at(request: BatchDecider, table: BatchDecider, val: OfflineData, grid_ms: list[float],
                            reward: RewardConfig, *, confidence: float = 0.95,
                            max_violation_rate: float = VIOLATION_TARGET) -> list[bool]:
    """Per budget of ``grid_ms`` (ascending), whether the per-request table ``request`` answers (True) in
    place of ``table`` (the family or cluster table as it answers per budget), judged on the held-out
    ``val`` by the rule of the module docstring with ``request`` in the controller's place and preferred:
    it knows what ``table`` knows (the question's group, the budget) and each request's own cost besides,
    so ``table`` answers only where it keeps the violation goal and ``request`` does not, or wins the
    reward test with confidence. Out of fold, both are the folds' tables."""
    verdict = compare_with_table(request, table, val, sorted(float(b) for b in grid_ms), reward, {},
                                 max_violation_rate=max_violation_rate, confidence=confidence, prefers="controller")
    return list(verdict.use_controller)


def choose_family_table_at(families: BatchDecider, plain: BatchDecider, val: OfflineData, grid_ms: list[float],
                           reward: RewardConfig, *, confidence: float = 0.95,
                           max_violation_rate: float = VIOLATION_TARGET) -> list[bool]:
    """Per budget of ``grid_ms`` (ascending), whether a family (or cluster) table answers with its
    families (True) or with its global ``lut_p95`` table ``plain`` (False), judged on the held-out
    ``val`` by the rule of the module docstring with the families in the controller's place and
    preferred: ``plain`` answers where it keeps the violation goal and the families do not, or where
    it wins the reward test with confidence (point estimates switched on noise and cost up to 3.5
    standard errors on unseen worlds, docs/results.md). Out of fold, both are the folds' tables."""
    verdict = compare_with_table(families, plain, val, sorted(float(b) for b in grid_ms), reward, {},
                                 max_violation_rate=max_violation_rate, confidence=confidence, prefers="controller")
    return list(verdict.use_controller)


def compare_with_table(network: BatchDecider, table: BatchDecider, val: OfflineData, grid_ms: list[float],
                       reward: RewardConfig,
                       table_state: dict, *, also_count_table_on: OfflineData | None = None,
                       max_violation_rate: float = VIOLATION_TARGET, confidence: float = 0.95,
                       prefers: str = "controller") -> TableFallback:
    """The per-budget rule of the module docstring, from the decisions of ``network`` and ``table`` on
    ``val`` (held-out samples; for a cross-fit, every sample decided out of fold). The table's
    violations are also counted on ``also_count_table_on`` (the samples it was fitted on: it is
    the same table there), and then judged by their upper bound; without it, by their rate.
    ``table_state`` is the deployed table the fallback will answer with."""
    if len(val) == 0:
        msg = "`val` has no samples: the fallback needs held-out data"
        raise ValueError(msg)
    if not 0.0 <= max_violation_rate <= 1.0:
        msg = f"`max_violation_rate` must be in [0, 1], got {max_violation_rate!r}"
        raise ValueError(msg)
    if not 0.5 <= confidence < 1.0:
        msg = f"`confidence` must be in [0.5, 1), got {confidence!r}"
        raise ValueError(msg)
    if prefers not in FALLBACK_PREFERS:
        msg = f"`prefers` must be one of {FALLBACK_PREFERS}, got {prefers!r}"
        raise ValueError(msg)
    z = NormalDist().inv_cdf(confidence)
    knobs = val.action_space.knob_values().float()
    grid = sorted(float(b) for b in grid_ms)

    def over_budget(data: OfflineData, decisions: torch.Tensor, budget: float) -> torch.Tensor:
        return data.latency_ms[torch.arange(len(data)), decisions] > budget

    keys = ("keep", "r_ctrl", "r_table", "se", "v_ctrl", "v_table", "v_table_upper")
    out: dict[str, list] = {k: [] for k in keys}
    rows = torch.arange(len(val))
    pooled = len(val) + (0 if also_count_table_on is None else len(also_count_table_on))
    for budget in grid:
        rewards = compute_reward(val.score, val.latency_ms, torch.full((len(val), 1), budget), knobs[None],
                                 reward)["reward"].double()
        ours, theirs = network.decide(val, budget), table.decide(val, budget)
        r_ours, r_theirs = rewards[rows, ours], rewards[rows, theirs]
        difference = r_ours - r_theirs
        r_ctrl, r_table = float(r_ours.mean()), float(r_theirs.mean())
        se = float(difference.std() / math.sqrt(len(val))) if len(val) > 1 else math.inf
        v_ctrl = float(over_budget(val, ours, budget).double().mean())
        table_over = int(over_budget(val, theirs, budget).sum())
        if also_count_table_on is not None:
            table_over += int(over_budget(also_count_table_on, table.decide(also_count_table_on, budget), budget).sum())
        v_table = table_over / pooled
        v_table_upper = wilson_upper_bound(table_over, pooled, confidence)
        # the bound where the table is also counted on the samples it was fitted on; out of fold its
        # rate is as unbiased as the controller's, and is judged as the controller's is
        table_counted = v_table_upper if also_count_table_on is not None else v_table
        ok_ctrl, ok_table = v_ctrl <= max_violation_rate, table_counted <= max_violation_rate
        if ok_ctrl and ok_table:  # the preferred decider answers unless the other wins with confidence
            keep = r_ctrl - r_table >= -z * se if prefers == "controller" else r_ctrl - r_table > z * se
        elif ok_ctrl or ok_table:
            keep = ok_ctrl
        else:
            keep = v_ctrl <= v_table
        for key, value in zip(keys, (keep, r_ctrl, r_table, se, v_ctrl, v_table, v_table_upper)):
            out[key].append(value)
    return TableFallback(grid_ms=grid, use_controller=out["keep"], controller_reward=out["r_ctrl"],
                         table_reward=out["r_table"], reward_difference_se=out["se"],
                         controller_violation_rate=out["v_ctrl"], table_violation_rate=out["v_table"],
                         table_violation_upper=out["v_table_upper"], max_violation_rate=float(max_violation_rate),
                         confidence=float(confidence), table=table_state, prefers=prefers)


def read_fallback(checkpoint: str | Path) -> TableFallback | None:
    """The fallback stored in a controller checkpoint (None: trained without one)."""
    stored = read_checkpoint(checkpoint).get("fallback")
    return None if stored is None else TableFallback.from_json(stored)


def attach_fallback(checkpoint: str | Path, fallback: TableFallback) -> None:
    """Store ``fallback`` in an existing checkpoint (atomically rewritten, everything else kept)."""
    payload = read_checkpoint(checkpoint)
    payload["fallback"] = fallback.to_json()
    atomic_torch_save(payload, Path(checkpoint))
