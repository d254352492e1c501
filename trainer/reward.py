"""The reward of one decision: recorded score and latency against a latency budget.

Soft mode is the origin formula (``docs/origin_format.md`` §7.5, RewardFunction) with its
weights as options; hard mode is a constraint: the score when the budget is met, a fixed
penalty otherwise. Every part is returned so that training can log it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from pipeline.knobs import NUM_TOTAL_BLOCKS
from pipeline.schema import REWARD_TERMS

if TYPE_CHECKING:
    import torch

__all__ = ["REWARD_PARTS", "RewardConfig", "compute_reward"]

#: §7.5 complexity normalisers: the origin GRPOController's largest max_crops (12) and top_k
#: (32) options, and the model's block count. Fixed so the reward does not depend on the sweep.
COMPLEXITY_MAX_CROPS = 12.0
COMPLEXITY_TOP_K = 32.0
COMPLEXITY_NUM_ACTIVE_BLOCKS = float(NUM_TOTAL_BLOCKS)

#: keys of :func:`compute_reward`'s result; ``reward = acc_term - lat_pen - viol_pen - complexity + bonus``
REWARD_PARTS = ("reward", *REWARD_TERMS)

_EPS = 1e-6  # §7.5 guards the division by the budget with 1e-6


@dataclass
class RewardConfig:
    """Options of the reward (``docs/origin_format.md`` §7.5; defaults are the origin trainer's).

    > Mode
    mode: ``"soft"`` or ``"hard"``.
      - ``"soft"``: the origin formula with L = latency (ms), B = budget (ms):
        acc_term = alpha*score; lat_pen = beta*sigmoid(10*(L/B - 1));
        viol_pen = gamma*(max(0, L - B)/B)^2;
        complexity = epsilon*mean(max_crops/12, top_k/32, num_active_blocks/16);
        bonus = delta*(1 - L/B) if L <= B else 0;
        reward = acc_term - lat_pen - viol_pen - complexity + bonus.
        Use it to reproduce the origin design; it trades a little accuracy for slack.
      - ``"hard"``: reward = alpha*score if L <= B else ``hard_violation_reward``. Use it when
        the budget is a constraint: no slack bonus, no penalty for using the budget.

    > Weights (soft mode; alpha also scales the hard mode's score)
    alpha: float = 1.0, weight of the score (α).
    beta: float = 0.5, weight of the smooth latency penalty (β); ~beta/2 at L = B.
    gamma: float = 10.0, weight of the squared relative overshoot (γ).
    delta: float = 0.1, weight of the slack bonus (δ); the origin docs' "minimal" setting is 0.
    epsilon: float = 0.05, weight of the configuration-size penalty (ε); "minimal" setting 0.

    > Hard mode
    hard_violation_reward: float = -1.0, the reward of a decision whose latency exceeds the
      budget. Must be <= 0 so that a violation never beats a decision within the budget.
    """

    mode: Literal["soft", "hard"] = "soft"
    alpha: float = 1.0
    beta: float = 0.5
    gamma: float = 10.0
    delta: float = 0.1
    epsilon: float = 0.05
    hard_violation_reward: float = -1.0

    def __post_init__(self) -> None:
        if self.mode not in ("soft", "hard"):
            msg = f"`mode` must be 'soft' or 'hard', got {self.mode!r}"
            raise ValueError(msg)
        for name in ("alpha", "beta", "gamma", "delta", "epsilon"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                msg = f"`{name}` must be a finite number >= 0, got {value!r}"
                raise ValueError(msg)
            setattr(self, name, float(value))
        value = self.hard_violation_reward
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value > 0:
            msg = f"`hard_violation_reward` must be a finite number <= 0 (a violation must not pay), got {value!r}"
            raise ValueError(msg)
        self.hard_violation_reward = float(value)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RewardConfig:
        return cls(**d)


def compute_reward(score: torch.Tensor, latency_ms: torch.Tensor, budget_ms: torch.Tensor | float,
                   knob_values: torch.Tensor, config: RewardConfig) -> dict[str, torch.Tensor]:
    """Reward and its parts for broadcastable ``score``, ``latency_ms``, ``budget_ms`` (...,)
    and ``knob_values`` (..., 3) = (max_crops, top_k, num_active_blocks).

    Returns float tensors of the broadcast shape under the keys of ``REWARD_PARTS``; the
    parts always satisfy reward = acc_term - lat_pen - viol_pen - complexity + bonus. In
    hard mode lat_pen, complexity and bonus are 0 and viol_pen is the drop from alpha*score
    to ``hard_violation_reward`` on a violation. NaN inputs (unrecorded) give NaN rewards.
    """
    import torch  # here, not at the top: RewardConfig is read by `ctrl --help`, which must not load torch
    score = torch.as_tensor(score, dtype=torch.float32)
    latency = torch.as_tensor(latency_ms, dtype=torch.float32)
    budget = torch.as_tensor(budget_ms, dtype=torch.float32)
    knobs = torch.as_tensor(knob_values, dtype=torch.float32)
    if knobs.shape[-1:] != (3,):
        msg = f"`knob_values` must have shape (..., 3), got {tuple(knobs.shape)}"
        raise ValueError(msg)
    score, latency, budget = torch.broadcast_tensors(score, latency, budget)
    acc_term = config.alpha * score
    zeros = torch.zeros_like(acc_term)

    if config.mode == "hard":
        violated = latency > budget
        reward = torch.where(violated, torch.full_like(acc_term, config.hard_violation_reward), acc_term)
        reward = torch.where(torch.isnan(latency), latency, reward)  # unrecorded stays NaN
        parts = {"reward": reward, "acc_term": acc_term, "lat_pen": zeros, "viol_pen": acc_term - reward,
                 "complexity": zeros, "bonus": zeros}
        return _broadcast(parts, knobs)

    ratio = latency / (budget + _EPS)
    lat_pen = config.beta * torch.sigmoid(10.0 * (ratio - 1.0))
    viol_pen = config.gamma * (torch.clamp(latency - budget, min=0.0) / (budget + _EPS)) ** 2
    norm = torch.tensor([COMPLEXITY_MAX_CROPS, COMPLEXITY_TOP_K, COMPLEXITY_NUM_ACTIVE_BLOCKS])
    complexity = config.epsilon * (knobs / norm).mean(dim=-1)
    # §7.5 uses L/B (no epsilon) in the bonus; it is 0 at L = B, so the reward is continuous there
    bonus = torch.where(latency <= budget, config.delta * (1.0 - latency / budget), zeros)
    bonus = torch.where(torch.isnan(latency), latency, bonus)
    reward = acc_term - lat_pen - viol_pen - complexity + bonus
    parts = {"reward": reward, "acc_term": acc_term, "lat_pen": lat_pen, "viol_pen": viol_pen,
             "complexity": complexity, "bonus": bonus}
    return _broadcast(parts, knobs)


def _broadcast(parts: dict[str, torch.Tensor], knobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Give every part the same shape (knob_values may add dimensions to score/latency/budget)."""
    import torch

    shape = torch.broadcast_shapes(*(p.shape for p in parts.values()), knobs.shape[:-1])
    return {k: v if v.shape == shape else v.expand(shape).clone() for k, v in parts.items()}
