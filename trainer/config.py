"""The options of a GRPO run and their validation.

:class:`TrainingConfig` holds what the two training phases share; :class:`OfflineTrainConfig`
(here) and ``OnlineTrainConfig`` (``online.config``) extend it. Each option is documented and
checked once, here or in the phase that owns it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

from pipeline.errors import CtrlError
from pipeline.options import WORKSPACE_CLI, option
from pipeline.resources import host_available_bytes
from pipeline.workspace import Workspace
from trainer.reporting import REPORT_TO
from trainer.reward import RewardConfig

ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[ScaleRewards, ...] = ("group", "batch", "none")

T = TypeVar("T", bound="TrainingConfig")


def normalize_scale_rewards(scale_rewards: bool | str) -> ScaleRewards:
    """``True`` -> ``"group"``, ``False`` -> ``"none"`` (TRL's aliases); other values pass if valid."""
    value = {True: "group", False: "none"}[scale_rewards] if isinstance(scale_rewards, bool) else scale_rewards
    if value not in SCALE_REWARDS:
        msg = f"`scale_rewards` must be 'group', 'batch', 'none' (or True/False), got {scale_rewards!r}"
        raise ValueError(msg)
    return value  # type: ignore[return-value]


def check_int(name: str, value: Any, low: int) -> None:
    """``value`` is an integer >= ``low`` (a bool is not an integer here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        msg = f"`{name}` must be an integer >= {low}, got {value!r}"
        raise ValueError(msg)


def check_number(name: str, value: Any, *, positive: bool = False) -> None:
    """``value`` is a finite number >= 0 (> 0 with ``positive``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        msg = f"`{name}` must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}"
        raise ValueError(msg)


def offline_training_bytes(config: OfflineTrainConfig, num_actions: int, feature_dim: int) -> int:
    """A rough upper estimate of what one offline training step holds in memory: the policy's
    weights with their gradients and Adam moments (about a dozen hidden x hidden layers), and the
    step's activations, logits and sampled groups."""
    h = config.hidden_dim
    params = 12 * h * h + 4 * feature_dim * h + 4 * num_actions * h
    groups = config.batch_size * config.num_budgets_per_sample
    activations = groups * (24 * h + 8 * num_actions + 8 * config.group_size)
    return 4 * (4 * params + 3 * activations)


def check_training_memory(config: OfflineTrainConfig, num_actions: int, feature_dim: int) -> None:
    """Refuse, before anything is allocated, options whose step cannot fit in the memory left."""
    need, free = offline_training_bytes(config, num_actions, feature_dim), host_available_bytes()
    if free is not None and need > free:
        msg = (f"these options need about {need / 2**30:,.1f} GiB per training step (hidden_dim {config.hidden_dim}, "
               f"batch_size {config.batch_size} x num_budgets_per_sample {config.num_budgets_per_sample} groups of "
               f"group_size {config.group_size}), and {free / 2**30:,.1f} GiB are available\n"
               "Hint: lower --hidden-dim, --batch-size or --group-size.")
        raise CtrlError(msg)


@dataclass
class TrainingConfig:
    """Options of both ``ctrl train --offline`` and ``ctrl train --online``.

    > Data and runs
    workspace: workspace directory (Path; None = ``$CTRL_WORKSPACE`` or ``./workspace``).
    model_fingerprint: feature model (str, full or unique prefix; None = the only one cached, or
        online: the model being run). Saved in every checkpoint; other models' features are refused.
    run_id: name of the run directory (None = ``YYYYmmdd-HHMMSS-<6 hex>``).
    resume: a run id or run directory to continue from its last checkpoint (``trainer.runs``).

    > Groups and budgets
    group_size: configurations sampled per (sample, budget) group, G (int >= 2).
    budget_min_ms, budget_max_ms: the budget range in ms; each group's budget is drawn uniformly
        from it (None = from the data offline, calibrated on this machine online).

    > Optimisation
    lr: AdamW learning rate (float > 0). weight_decay: AdamW weight decay (float >= 0).
    max_grad_norm: gradient-norm clip (float > 0; None = off).
    scale_rewards: what the centred rewards r - mean_group(r) are divided by (TRL's option; True
        is an alias of "group", False of "none"; ``trainer.grpo.group_advantages``).
      - ``"group"``: the group's std (the origin JointGRPOTrainer). It amplifies groups whose
        rewards differ only by score noise as much as groups that reveal a violation.
      - ``"batch"``: the std of all rewards of the step: keeps the relative size of
        the groups' differences and is invariant to the reward scale.
      - ``"none"``: no division (Dr. GRPO); the step size then depends on the reward weights.
    reward: a ``trainer.reward.RewardConfig`` or a dict of its fields (``docs/origin_format.md`` §7.5).
    seed: seeds initialisation, data order, budgets and sampling (int): the same
        config gives the same run.
    report_to: mirror the metrics to TensorBoard, MLflow or W&B (``trainer.reporting``).
    """

    workspace: Path | None = option(None, help="Workspace directory.", shown_default="$CTRL_WORKSPACE or ./workspace",
                                    **WORKSPACE_CLI)
    model_fingerprint: str | None = option(None, help="Feature model to use (a unique prefix is enough).",
                                           shown_default="the only one cached; online: the model run")
    run_id: str | None = option(None, help="Run directory name.", shown_default="timestamp + 6 hex digits")
    resume: str | None = option(None, help="Continue a run (id or directory) from its last checkpoint; options "
                                           "given with it must be ones a resumed run may change.")
    group_size: int = option(5, help="Configurations sampled per (sample, budget) group, G.")
    budget_min_ms: float | None = option(None, help="Low end of the training budget range (ms).",
                                         shown_default="from the data; online: calibrated on this machine")
    budget_max_ms: float | None = option(None, help="High end of the training budget range (ms).",
                                         shown_default="from the data; online: calibrated on this machine")
    lr: float = option(1e-3, help="AdamW learning rate.")
    weight_decay: float = option(1e-5, help="AdamW weight decay.")
    max_grad_norm: float | None = option(1.0, help="Gradient-norm clip (None = off).")
    scale_rewards: ScaleRewards = option("batch", help="What centred rewards are divided by: group, batch or none.")
    reward: RewardConfig | None = option(None, help="Reward mode: hard (the score within the budget, -1 beyond) "
                                                    "or soft (docs/origin_format.md §7.5).",
                                         shown_default="hard")
    seed: int = option(42, help="Seed: the same options give the same run.")
    report_to: str = option("none", help="Also report the training metrics to: none, tensorboard, mlflow or wandb "
                                         "(optional extras; metrics.parquet is always written).")

    def __post_init__(self) -> None:
        if self.workspace is not None:
            self.workspace = Path(self.workspace)
        if isinstance(self.reward, dict):
            self.reward = RewardConfig.from_json(self.reward)
        check_int("group_size", self.group_size, 2)
        check_number("lr", self.lr, positive=True)
        check_number("weight_decay", self.weight_decay)
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            msg = f"`max_grad_norm` must be > 0 or None (off), got {self.max_grad_norm!r}"
            raise ValueError(msg)
        self.scale_rewards = normalize_scale_rewards(self.scale_rewards)
        if self.report_to not in REPORT_TO:
            msg = f"`report_to` must be one of {', '.join(REPORT_TO)}, got {self.report_to!r}"
            raise ValueError(msg)
        lo, hi = self.budget_min_ms, self.budget_max_ms
        for name, value in (("budget_min_ms", lo), ("budget_max_ms", hi)):
            if value is not None and not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                msg = f"`{name}` must be a finite number of milliseconds > 0, got {value!r}"
                raise ValueError(msg)
        if lo is not None and hi is not None and not hi > lo:
            msg = (f"`budget_max_ms` ({hi!r}) must be greater than `budget_min_ms` ({lo!r})\n"
                   "Hint: leave both None to derive the range from the data.")
            raise ValueError(msg)
        if any(b is not None and not b > 0 for b in (lo, hi)):
            msg = f"`budget_min_ms` and `budget_max_ms` must be > 0, got {lo!r} and {hi!r}"
            raise ValueError(msg)

    # -- config.json
    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (``asdict`` already turns the reward into a dict; paths become text)."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls: type[T], d: dict[str, Any]) -> T:
        """The config of a saved ``to_json`` (a run's config.json); unknown fields are refused."""
        renamed = getattr(cls, "RENAMED", {})  # an older run's name of an option
        d = {renamed.get(k, k): v for k, v in d.items() if k != "phase"}  # the phase is recorded beside the options
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            msg = f"unknown {cls.__name__} fields {unknown!r}"
            raise ValueError(msg)
        return cls(**d)


@dataclass
class OfflineTrainConfig(TrainingConfig):
    """Options of ``ctrl train --offline``; the shared ones are documented on ``TrainingConfig``.
    Each option's default and one-line help are on its field (``ctrl train --help`` and
    docs/cli.md show them); below is why they are what they are.

    Offline choices: ``lr`` larger than the origin's 1e-4 (which was for far larger networks);
    the hard ``reward`` (the score within the budget, -1 beyond it: the budget is a constraint;
    the origin's soft formula lets small violations through and pays for slack). ``budget_min_ms`` /
    ``budget_max_ms`` default to ``trainer.data.default_budget_range`` of the train split; the
    policy's budget encoder is normalised over that range (widened by ``budget_margin``).

    > Groups and epochs
    num_budgets_per_sample: groups per sample in each step, each with its own budget (int):
        several budgets per sample teach the budget dependence faster.
    num_epochs: passes over the train split (int).
    batch_size: samples per step (int); a step has batch_size * num_budgets_per_sample groups.
    num_iterations: gradient steps on each sampled batch, μ in TRL (int). With 1 the
        sampling policy equals the current one, so ``clip_epsilon`` only matters when > 1.

    > The training score
    score_target: the score the rewards of training (and the validation selection) use.
      - ``"mean"``: the mean of the exp5 and exp6 scores where both were recorded for the
        (sample, configuration), else the recorded one: two independent runs of the
        same configuration, half the outcome noise the policy could memorise.
      - ``"recorded"``: the ``groups`` view's ``score`` (exp6 where present), as evaluated.

    > Anchoring the policy to the static lookup table
    warm_start_steps: Adam steps (int >= 0; 0 = off) that fit the initial policy to
        a decider's choices before GRPO (cross-entropy to ``warm_start_weight`` on its choice at
        a uniform budget, the rest uniform over the sample's configurations, so sampling still
        explores). With ``kl_beta`` > 0 this warm-started policy is the KL reference: the
        controller starts from that decider and deviates per sample only where the recorded
        rewards pay for it.
    warm_start_target: the decider the policy starts from.
      - ``"outcome"``: the outcome model's per-sample choice (``trainer.outcome``: predicted
        score and latency quantile per configuration from the features, fitted on the train
        split).
      - ``"table"``: the ``lut_p95`` table of the train split (the budget alone decides).
    warm_start_weight: the decider's share of the warm-start target (float in (0, 1]).
    outcome_quantile: the latency quantile the outcome model predicts and holds within the
        budget (float in (0, 1)). The model is fitted in every run (it is also
        the evaluation decider ``outcome``) and saved as ``outcome.pt``.
    outcome_tilings: the outcome model also reads each image's tiling (crops per max_crops
        choice, ``image_tilings``; bool).
    outcome_latency_neighbours: 0: the outcome model's latency head predicts the quantile; k > 0:
        it predicts the median, and the quantile is that median times the quantile of latency /
        median (predicted out of fold) among the k training samples nearest in the features
        (int >= 0).

    > The loss
    loss_type: ``"grpo"`` or ``"pairwise"``.
      - ``"grpo"``: -mean(A * log pi(a)) with group-relative advantages.
      - ``"pairwise"``: the origin §7.6 GRPOTrainerV2 ranking loss, ties skipped; no clipping.
    clip_epsilon: PPO clip range ε of the ratio against the sampling policy (float in (0, 1);
        None = off).
    kl_beta: weight β of the exact KL(pi || initial policy) (float >= 0; 0 = off).
        The initial policy is the warm-started one. The default keeps the controller near the
        outcome model's per-sample choice: with a weaker anchor, GRPO on single recorded
        outcomes moved it to cheaper configurations that new samples then answered worse
        (docs/results.md).

    latency_jitter: each time a sample's group is drawn, its recorded latencies are multiplied by
        exp(``latency_jitter`` x N(0, 1)), one draw per configuration (float >= 0; 0 = off). A
        recorded latency is one run: without the jitter the network learns which training samples
        happened to run fast and takes configurations near the budget for them, which new samples
        of the same kind then exceed. The default is the run-to-run spread of one sample's
        end-to-end latency (lognormal sigma 0.05, docs/training.md).

    > The violation constraint (per budget: E[latency > budget] <= target; ``trainer.constraint``)
    violation_target: the share of decisions over budget allowed at each budget (float in (0, 1);
        None = off, reward shaping only). Its default sits below the 5 % goal because the
        multipliers see the train split, whose per-sample latencies the policy can partly learn
        even through ``latency_jitter``: new samples violate more. A multiplier lambda(b) >= 0
        per point of the validation budget grid (linear in between) is subtracted from the reward of every violating
        configuration; after each step it moves by ``violation_lr`` times (the sampling
        policy's exact violation probability near b - target).
    violation_lr: dual step size (float > 0).
    violation_max_multiplier: cap of lambda(b) (float > 0): below the lowest
        budget some samples violate whatever is chosen, so the constraint can be infeasible
        there and lambda would otherwise grow forever.

    > The policy (``trainer.policy.PolicyConfig``)
    hidden_dim: width of the network (int). dropout: of its layers.
    use_tilings: feed each image's tiling (crops per max_crops choice, ``image_tilings``) to
        both stages (bool; unknown tilings read as the training mean).
    request_cost_input: feed each request's predicted latency at every configuration (the per-request
        cost model of the train split, out of fold on the rows it was fitted on) to both stages (bool).
    budget_margin: the encoder's normalisation range is the budget range widened by this
        fraction on each side (float).

    > Deployment
    cross_fit_folds: K of the K-fold cross-fitting (int; 0 = off: one split decides).
        With K >= 2 the deployed network trains on every sample outside the val split, K more
        networks each without one fold (``trainer.crossfit``), and the fallback and the
        evaluation use every sample once, out of fold. Costs K more trainings.
    disable_table_fallback: deploy the network alone (bool). Otherwise, after
        training, the controller is compared with the ``lut_p95`` table at every budget of the
        validation grid, violations before reward, and the table answers wherever the
        controller does not win with confidence (safe policy improvement; the rule:
        ``trainer.fallback``). The network alone is evaluated too, as decider ``policy``.
    fallback_confidence: level of that comparison (float in [0.5, 1)): the
        table's violation rate counts by its upper bound at this level, and the reward test
        of ``fallback_prefers`` is a one-sided paired test at this level (0.5: plain point
        estimates, any positive difference).
    fallback_prefers: where both keep the violation goal, the decider that answers unless the
        other's reward beats it in that test: ``"controller"`` (the table answers only where it
        is better with confidence), ``"table"`` (safe policy improvement: the controller
        answers only where it is better with confidence) or ``"auto"``: the table where it is
        ``lut_by_question``, the controller where it is ``lut_by_cluster`` or ``lut_p95``. That default follows the
        measurements on unseen generated worlds in docs/results.md: the question-family table
        preferred keeps the deployed controller within one standard error of the per-family
        table; where only the budget-only table is at hand, the controller tracks the
        per-family choice better than it.
    fallback_table: the table that answers where the fallback does not keep the controller:
        ``"family"`` (``lut_by_question``: one table per question family, each question's family
        read from its 15 nearest training questions; ``lut_p95`` where the data has no family
        labels), ``"cluster"`` (``lut_by_cluster``: the same with families found without labels,
        clusters of the language features, their number chosen out of fold; ``trainer.clusters``),
        ``"auto"`` (``"family"`` where the data labels families, else ``"cluster"``) or ``"p95"``
        (``lut_p95``: one configuration per budget). A family or cluster table answers at each
        budget with its families or, where held-out data shows them no better, with ``lut_p95``.
    fallback_request_table: the per-request table (``lut_by_request``, ``trainer.request_table``: each
        request's own latency quantile from its tiling, prompt and question, and its cluster's score at
        the crops it gets) may answer in that table's place (bool, default False), at the budgets where
        the table answers and held-out data does not favour the table with confidence
        (``trainer.fallback.choose_request_table_at``, ``trainer.fallback.tables_only``). Its cost model is
        deployed either way (docs/results.md).
    ignore_family_labels: train, deploy and evaluate as if the data recorded no question family
        (bool): how a profile without labels behaves.

    > Evaluation
    holdout_dataset: a dataset left out of everything the run learns from (network, outcome model,
        fallback and tables) and evaluated alone: how the controller does on questions of a kind
        it never saw (None = off). Its question families are unseen too, so ``lut_by_family``
        answers it with the global table.
    num_val_budgets: budgets (evenly spaced over the budget range, ends included) at which the
        validation expected reward is computed each epoch (int).
    eval_budgets: budgets (ms) of the final test evaluation (None = the validation grid,
        rounded to 0.1 ms).
    disable_evaluation: skip the final test evaluation against the baselines (bool).

    ``resume`` continues a run from its last finished epoch (optimizer and RNG state included:
    the result equals an uninterrupted run); every other field must match that run's
    config.json, except ``num_epochs``, which may grow (:meth:`from_run`).
    """

    lr: float = option(1e-3, help="AdamW learning rate.")
    reward: RewardConfig = option(default_factory=lambda: RewardConfig(mode="hard"),
                                  help="Reward mode: hard (the score within the budget, -1 beyond) or soft "
                                       "(docs/origin_format.md §7.5).", shown_default="hard")
    num_budgets_per_sample: int = option(8, help="Groups per sample in each step, each with its own budget.")
    num_epochs: int = option(30, help="Passes over the train split (on --resume: train the run longer).")
    batch_size: int = option(32, help="Samples per step.")
    num_iterations: int = option(1, help="Gradient steps on each sampled batch (TRL's mu).")
    score_target: Literal["mean", "recorded"] = option(
        "mean", help="The training score: mean (of exp5 and exp6 where both recorded) or recorded.")
    warm_start_steps: int = option(200, help="Steps fitting the initial policy to the warm-start decider (0 = off).")
    warm_start_target: Literal["outcome", "table"] = option(
        "outcome", help="The warm-start decider: outcome (the outcome model's per-sample choice) or table (lut_p95).")
    warm_start_weight: float = option(0.7, help="The warm-start decider's share of the warm-start target.")
    outcome_quantile: float = option(0.95, help="Latency quantile the outcome model predicts and keeps in budget.")
    outcome_tilings: bool = option(True, help="The outcome model also reads each image's tiling.")
    outcome_latency_neighbours: int = option(0, help=(
        "0: the outcome model predicts the latency quantile directly; k: it predicts the median and takes "
        "the quantile of latency / median among the k nearest training samples."))
    loss_type: Literal["grpo", "pairwise"] = option(
        "grpo", help="grpo or pairwise (the origin's ranking loss, docs/origin_format.md §7.6).")
    clip_epsilon: float | None = option(None, help="PPO clip range of the ratio to the sampling policy (None = off).")
    kl_beta: float = option(1.0, help="KL weight to the initial (warm-started) policy.")
    latency_jitter: float = option(0.05, help="Training judges each recorded latency by fresh draws around it: "
                                              "recorded x exp(jitter x N(0, 1)) (0 = off).")
    violation_target: float | None = option(
        0.03, help="Allowed share of decisions over budget at each budget: a per-budget Lagrange multiplier "
                   "prices violations (0 or None = off).")
    violation_lr: float = option(1.0, help="Step size of the violation multipliers.")
    violation_max_multiplier: float = option(10.0, help="Cap of a violation multiplier.")
    hidden_dim: int = option(128, help="Width of the controller's layers: narrower decides faster in large batches "
                                       "(docs/export.md).")
    dropout: float = option(0.0, help="Dropout of the controller's layers.")
    use_tilings: bool = option(True, help="Feed each image's tiling (crops per max_crops choice) to both stages.")
    request_cost_input: bool = option(
        False, help="Feed each request's predicted latency at every configuration (the per-request cost model) "
                    "to both stages of the network.")
    budget_margin: float = option(0.0, help="Widen the budget encoder's range by this fraction on each side.")
    cross_fit_folds: int = option(5, help="K-fold cross-fitting: K more networks, each without one fold, decide the "
                                          "fallback and the evaluation on every sample out of fold (0 = off).")
    disable_table_fallback: bool = option(
        False, help="Deploy the network alone, without the fallback table answering at the budgets where the "
                    "controller does not beat it on the validation split.")
    fallback_confidence: float = option(
        0.95, help="Confidence of the fallback comparison: the table's violation bound and the controller's reward "
                   "test (0.5 = point estimates).")
    holdout_dataset: str | None = option(None, help="Train without this dataset's samples, then evaluate on "
                                                    "them alone (generalisation to an unseen dataset).")
    fallback_prefers: Literal["auto", "controller", "table"] = option(
        "auto", help="Where both keep the violation goal, who answers unless the other wins the reward test: "
                     "controller, table (safe policy improvement), or auto (table for lut_by_question, controller "
                     "for lut_by_cluster and lut_p95).")
    fallback_table: Literal["auto", "family", "cluster", "p95"] = option(
        "auto", help="The table the fallback answers with: family (lut_by_question, one table per labelled question "
                     "family, read from the question), cluster (lut_by_cluster, families found by clustering the "
                     "questions), auto (family where the data labels families, else cluster) or p95 (lut_p95).")
    fallback_request_table: bool = option(
        False, help="The per-request table (lut_by_request: each request's own latency from its tiling, prompt and "
                    "question) may answer in the fallback table's place where the table answers and held-out data "
                    "does not favour the table.")
    ignore_family_labels: bool = option(
        False, help="Train, deploy and evaluate as if the data recorded no question family.")
    num_val_budgets: int = option(8, help="Budgets of the validation grid.")
    eval_budgets: list[float] | None = option(None, help="Budgets (ms) of the final evaluation.",
                                              shown_default="the validation grid")
    disable_evaluation: bool = option(False, help="Skip the final evaluation against the baselines.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eval_budgets is not None:
            self.eval_budgets = [float(b) for b in self.eval_budgets]
        for name, low in (("num_budgets_per_sample", 1), ("num_epochs", 1), ("batch_size", 1), ("num_iterations", 1),
                          ("hidden_dim", 1), ("num_val_budgets", 1), ("warm_start_steps", 0),
                          ("cross_fit_folds", 0)):
            check_int(name, getattr(self, name), low)
        for name in ("kl_beta", "budget_margin", "latency_jitter"):
            check_number(name, getattr(self, name))
        for name in ("violation_lr", "violation_max_multiplier"):
            check_number(name, getattr(self, name), positive=True)
        self._check_ranges()
        self._check_choices()

    def _check_ranges(self) -> None:
        checks = (
            ("violation_target", self.violation_target is None or 0.0 < self.violation_target < 1.0,
             "in (0, 1) or None (off)"),
            ("clip_epsilon", self.clip_epsilon is None or 0.0 < self.clip_epsilon < 1.0, "in (0, 1) or None (off)"),
            ("dropout", 0.0 <= self.dropout < 1.0, "in [0, 1)"),
            ("warm_start_weight", 0.0 < self.warm_start_weight <= 1.0, "in (0, 1]"),
            ("outcome_quantile", isinstance(self.outcome_quantile, (int, float))
             and 0.0 < self.outcome_quantile < 1.0, "in (0, 1)"),
            ("outcome_latency_neighbours", isinstance(self.outcome_latency_neighbours, int)
             and not isinstance(self.outcome_latency_neighbours, bool) and self.outcome_latency_neighbours >= 0,
             "an integer >= 0"),
            ("fallback_confidence", isinstance(self.fallback_confidence, (int, float))
             and 0.5 <= self.fallback_confidence < 1.0, "in [0.5, 1)"),
        )
        for name, ok, allowed in checks:
            if not ok:
                msg = f"`{name}` must be {allowed}, got {getattr(self, name)!r}"
                raise ValueError(msg)
        if self.cross_fit_folds == 1:
            msg = "`cross_fit_folds` must be 0 (off) or at least 2, got 1"
            raise ValueError(msg)
        if self.eval_budgets is not None and (not self.eval_budgets or min(self.eval_budgets) <= 0):
            msg = f"`eval_budgets` must be a non-empty list of budgets > 0 ms, got {self.eval_budgets!r}"
            raise ValueError(msg)

    def _check_choices(self) -> None:
        if self.warm_start_target not in ("outcome", "table"):
            msg = f"`warm_start_target` must be 'outcome' or 'table', got {self.warm_start_target!r}"
            raise ValueError(msg)
        if self.score_target not in ("mean", "recorded"):
            msg = f"`score_target` must be 'mean' or 'recorded', got {self.score_target!r}"
            raise ValueError(msg)
        if self.fallback_prefers not in ("auto", "controller", "table"):
            msg = f"`fallback_prefers` must be 'auto', 'controller' or 'table', got {self.fallback_prefers!r}"
            raise ValueError(msg)
        if self.fallback_table not in ("auto", "family", "cluster", "p95"):
            msg = f"`fallback_table` must be 'auto', 'family', 'cluster' or 'p95', got {self.fallback_table!r}"
            raise ValueError(msg)
        if self.loss_type not in ("grpo", "pairwise"):
            msg = f"`loss_type` must be 'grpo' or 'pairwise', got {self.loss_type!r}"
            raise ValueError(msg)
        if self.loss_type == "pairwise" and self.clip_epsilon is not None:
            msg = (f"`clip_epsilon` ({self.clip_epsilon!r}) has no effect with `loss_type`='pairwise'\n"
                   "Hint: set clip_epsilon=None, or use loss_type='grpo'.")
            raise ValueError(msg)

    @classmethod
    def from_run(cls, run: str | Path, workspace: str | Path | None = None, **overrides: Any) -> OfflineTrainConfig:
        """The saved config of a run, set up to resume it (``overrides``, e.g. ``num_epochs``)."""
        from trainer.runs import RunDir  # torch: not for `ctrl --help`, which reads these fields

        run_dir = RunDir.resolve(Workspace(workspace), run)
        try:
            return cls.from_json({**run_dir.read_config(), "resume": str(run_dir.path), **overrides})
        except (TypeError, ValueError) as err:  # a config.json edited or damaged into other fields/values
            msg = f"{run_dir.config_path}: not a valid offline run config ({err})"
            raise CtrlError(msg) from None
