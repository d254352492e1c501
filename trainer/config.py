"""What the two training phases share: the options of a GRPO run and their validation.

:class:`OfflineTrainConfig` (``trainer.offline``) and ``OnlineTrainConfig`` (``online.config``)
extend :class:`TrainingConfig`; each option is documented and checked once, here or in the
phase that owns it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

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
    group_size: configurations sampled per (sample, budget) group, G (int >= 2, default 5 as the
        origin JointGRPOTrainer).
    budget_min_ms, budget_max_ms: the budget range in ms; each group's budget is drawn uniformly
        from it (None = from the data offline, calibrated on this machine online).

    > Optimisation
    lr: AdamW learning rate (float > 0). weight_decay: AdamW weight decay (float >= 0, default 1e-5).
    max_grad_norm: gradient-norm clip (float > 0, default 1.0; None = off).
    scale_rewards: what the centred rewards r - mean_group(r) are divided by (TRL's option; True
        is an alias of "group", False of "none"; ``trainer.grpo.group_advantages``).
      - ``"group"``: the group's std (the origin JointGRPOTrainer). It amplifies groups whose
        rewards differ only by score noise as much as groups that reveal a violation.
      - ``"batch"``: the std of all rewards of the step (default): keeps the relative size of
        the groups' differences and is invariant to the reward scale.
      - ``"none"``: no division (Dr. GRPO); the step size then depends on the reward weights.
    reward: a ``trainer.reward.RewardConfig`` or a dict of its fields (``origin_formats.md`` §7.5).
    seed: seeds initialisation, data order, budgets and sampling (int, default 42): the same
        config gives the same run.
    """

    workspace: Path | None = None
    model_fingerprint: str | None = None
    run_id: str | None = None
    resume: str | None = None
    group_size: int = 5
    budget_min_ms: float | None = None
    budget_max_ms: float | None = None
    lr: float = 1e-3
    weight_decay: float = 1e-5
    max_grad_norm: float | None = 1.0
    scale_rewards: ScaleRewards = "batch"
    reward: RewardConfig | None = None
    seed: int = 42

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
        lo, hi = self.budget_min_ms, self.budget_max_ms
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
        d = {k: v for k, v in d.items() if k != "phase"}  # the run's phase, recorded beside the options
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            msg = f"unknown {cls.__name__} fields {unknown!r}"
            raise ValueError(msg)
        return cls(**d)
