"""Offline GRPO: sample groups from the policy, look their outcomes up, turn them into a loss.

Every tensor here is shaped (num_groups, G): row m is one group, i.e. one (sample, budget)
pair with G configurations drawn from the current policy under that sample's mask. A group
is *indexed explicitly* by ``GroupSamples.sample_index`` - rewards, log-probs and advantages
of a group always stay in its row, never in contiguous slices of a flat batch (origin
``docs/origin_format.md`` §9 D21).

Losses (``loss_type``):

* ``"grpo"``: A = r - mean(r) per group, optionally divided by a std (``scale_rewards``:
  the group's, as the origin's JointGRPOTrainer; the batch's, as TRL's "batch"; or none); loss = -mean(A * log pi(a)),
  or with ``clip_epsilon`` the PPO clipped surrogate -mean(min(rho A, clip(rho, 1-eps, 1+eps) A))
  with rho = pi(a) / pi_old(a) (the sampling policy). Groups whose rewards have zero variance
  carry no signal and are dropped (and counted).
* ``"pairwise"``: origin §7.6 GRPOTrainerV2: for every pair (i, j) of a group with
  r_i != r_j, -logsigmoid((log pi(a_i) - log pi(a_j)) * sign(r_i - r_j)); tied pairs are
  skipped (the origin's sign 0 made them a constant log 2, D21), averaged per group, then
  over groups.

Optional KL to the reference (initial) policy, weighted by ``kl_beta``: computed *exactly*
over the masked action space, KL(pi || pi_ref) = sum_a pi(a) (log pi(a) - log pi_ref(a)),
because the full distribution is cheap here (no k3 estimator needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.config import ScaleRewards, normalize_scale_rewards
from trainer.data import OfflineData
from trainer.policy import ControllerPolicy, data_log_probs
from trainer.reward import RewardConfig, compute_reward

LossType = Literal["grpo", "pairwise"]
#: a group whose reward std is below this is "zero variance"
ZERO_VARIANCE_STD = 1e-8


@dataclass
class GroupSamples:
    """G sampled configurations per (sample, budget) group, with their looked-up outcomes.

    sample_index: long (M,), the data row of each group; budget_ms: float (M,);
    actions: long (M, G), indices into ``data.action_space``; old_log_probs: (M, G) under the
    sampling policy; rewards: (M, G); parts: reward parts, each (M, G) (``compute_reward`` keys);
    violated: bool (M, G), latency > budget; expected_violation: (M,), the sampling policy's exact
    probability of a violation, sum_a pi(a) [L(a) > B] (the constraint's measurement).
    """

    sample_index: Tensor
    budget_ms: Tensor
    actions: Tensor
    old_log_probs: Tensor
    rewards: Tensor
    parts: dict[str, Tensor]
    violated: Tensor | None = None
    expected_violation: Tensor | None = None

    @property
    def num_groups(self) -> int:
        return int(self.actions.shape[0])


@dataclass
class LossOutput:
    """The loss and what to log about it (plain floats except ``loss``)."""

    loss: Tensor
    num_groups: int
    num_zero_variance_groups: int
    kl: float = 0.0
    clip_ratio: float = 0.0


def rows_log_probs(policy: ControllerPolicy, data: OfflineData, sample_index: Tensor, budget_ms: Tensor) -> Tensor:
    """log pi over ``data.action_space`` for the given rows and budgets: (M, A)."""
    return data_log_probs(policy, _rows(data, sample_index), budget_ms)


class _Rows:
    """A view of selected rows of OfflineData (only what the policy reads), without copying labels."""

    def __init__(self, data: OfflineData, index: Tensor) -> None:
        self.action_space = data.action_space
        self.image_feature = data.image_feature
        self.image_features = data.image_features[index]
        self.image_present = data.image_present[index]
        self.lang_features = data.lang_features[index]
        self.mask = data.mask[index]
        tilings = getattr(data, "tiling_crops", None)
        self.tiling_crops = None if tilings is None else tilings[index]
        prompt, predicted = getattr(data, "prompt_tokens", None), getattr(data, "request_latency_ms", None)
        self.prompt_tokens = None if prompt is None else prompt[index]
        self.request_latency_ms = None if predicted is None else predicted[index]

    def __len__(self) -> int:
        return int(self.mask.shape[0])


def _rows(data: OfflineData, index: Tensor) -> OfflineData:
    return _Rows(data, index)  # type: ignore[return-value]


def lookup_rewards(data: OfflineData, sample_index: Tensor, actions: Tensor, budget_ms: Tensor,
                   reward: RewardConfig, latency_ms: Tensor | None = None) -> dict[str, Tensor]:
    """Recorded outcomes of ``actions`` (M, G) for rows ``sample_index`` (M,) -> reward parts (M, G);
    ``latency_ms`` (M, A) replaces the rows' recorded latencies where given."""
    rows = sample_index[:, None]
    score = data.score[rows, actions]
    latencies = data.latency_ms[sample_index] if latency_ms is None else latency_ms
    latency_ms = latencies.gather(1, actions)
    if not bool(data.mask[rows, actions].all()):
        msg = "sampled a configuration outside the sample's mask (not recorded): this is a bug"
        raise AssertionError(msg)
    knobs = data.action_space.knob_values().float()[actions]  # (M, G, 3)
    return compute_reward(score, latency_ms, budget_ms.float()[:, None], knobs, reward)


@torch.no_grad()
def sample_groups(policy: ControllerPolicy, data: OfflineData, sample_index: Tensor, budget_ms: Tensor,
                  group_size: int, reward: RewardConfig, generator: torch.Generator | None = None,
                  latency_ms: Tensor | None = None) -> GroupSamples:
    """Draw ``group_size`` configurations (i.i.d., with replacement) per (sample, budget) from pi.

    The sampling policy runs in eval mode; its log-probs are the "old" policy of the clipped ratio.
    ``latency_ms`` (M, A): the latencies the rewards and violations are judged by, in place of the
    rows' recorded ones (the trainer's jittered draws).
    """
    was_training = policy.training
    policy.eval()
    try:
        log_probs = rows_log_probs(policy, data, sample_index, budget_ms)
    finally:
        policy.train(was_training)
    probs = log_probs.exp()
    actions = torch.multinomial(probs, group_size, replacement=True, generator=generator)
    latencies = data.latency_ms[sample_index] if latency_ms is None else latency_ms
    parts = lookup_rewards(data, sample_index, actions, budget_ms, reward, latencies)
    over = latencies > budget_ms.float()[:, None]  # (M, A); NaN (unrecorded) compares False
    return GroupSamples(sample_index=sample_index, budget_ms=budget_ms, actions=actions,
                        old_log_probs=log_probs.gather(1, actions), rewards=parts["reward"], parts=parts,
                        violated=over.gather(1, actions), expected_violation=(probs * over).sum(-1))


def group_advantages(rewards: Tensor, scale_rewards: bool | ScaleRewards = "batch") -> tuple[Tensor, Tensor]:
    """Group-relative advantages (M, G) and the mask of groups with non-zero variance (M,).

    A = r - mean_group(r), then divided by (``scale_rewards``):
    ``"group"`` the group's std (unbiased; origin JointGRPOTrainer), ``"batch"`` the std of all
    rewards of the batch (TRL ``scale_rewards="batch"``), ``"none"`` nothing (Dr. GRPO).
    Zero-variance groups get A = 0 and ``valid = False``.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        msg = f"rewards must have shape (num_groups, G) with G >= 2, got {tuple(rewards.shape)}"
        raise ValueError(msg)
    scale = normalize_scale_rewards(scale_rewards)
    dtype, rewards = rewards.dtype, rewards.double()  # float32 centring error, divided by a tiny std, is not ~0
    std = rewards.std(dim=1, keepdim=True)
    valid = std[:, 0] > ZERO_VARIANCE_STD
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / std.clamp_min(ZERO_VARIANCE_STD)
    elif scale == "batch":
        advantages = advantages / rewards.std().clamp_min(ZERO_VARIANCE_STD)
    return torch.where(valid[:, None], advantages, torch.zeros_like(advantages)).to(dtype), valid


def grpo_objective(log_probs: Tensor, advantages: Tensor, valid: Tensor, old_log_probs: Tensor | None = None,
                   clip_epsilon: float | None = None) -> tuple[Tensor, float]:
    """-mean over valid groups and members of A * log pi (or the clipped surrogate); and the clip ratio."""
    if not bool(valid.any()):
        return log_probs.sum() * 0.0, 0.0  # keeps the graph so backward() is a no-op, not an error
    lp, adv = log_probs[valid], advantages[valid]
    if clip_epsilon is None:
        return -(adv * lp).mean(), 0.0
    ratio = torch.exp(lp - old_log_probs[valid])
    clipped = ratio.clamp(1.0 - clip_epsilon, 1.0 + clip_epsilon)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    clip_ratio = float(((ratio * adv) > (clipped * adv)).float().mean())
    return -surrogate.mean(), clip_ratio


def pairwise_objective(log_probs: Tensor, rewards: Tensor) -> tuple[Tensor, Tensor]:
    """Origin §7.6 pairwise ranking loss over each row's pairs, ties skipped; and the valid-group mask.

    For every unordered pair i < j within a group with r_i != r_j:
    -logsigmoid((log pi_i - log pi_j) * sign(r_i - r_j)); mean per group, then over groups.
    """
    g = rewards.shape[1]
    upper = torch.triu(torch.ones(g, g, dtype=torch.bool), diagonal=1)  # i < j
    sign = torch.sign(rewards[:, :, None] - rewards[:, None, :])  # (M, G, G)
    pairs = upper[None] & (sign != 0)
    diff = log_probs[:, :, None] - log_probs[:, None, :]
    losses = torch.where(pairs, -F.logsigmoid(diff * sign), torch.zeros_like(diff))
    num_pairs = pairs.sum(dim=(1, 2))
    valid = num_pairs > 0
    if not bool(valid.any()):
        return log_probs.sum() * 0.0, valid
    per_group = losses.sum(dim=(1, 2))[valid] / num_pairs[valid]
    return per_group.mean(), valid


def exact_kl(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """KL(pi || pi_ref) per row over the allowed actions (both -inf outside the same mask): (M,)."""
    allowed = torch.isfinite(log_probs)
    # replace -inf before the arithmetic: 0 * (-inf - -inf) would put NaN into the gradient
    lp = torch.where(allowed, log_probs, torch.zeros_like(log_probs))
    ref = torch.where(allowed, ref_log_probs, torch.zeros_like(ref_log_probs))
    return torch.where(allowed, lp.exp() * (lp - ref), torch.zeros_like(lp)).sum(-1)


def policy_loss(policy: ControllerPolicy, data: OfflineData, groups: GroupSamples, *, loss_type: LossType = "grpo",
                scale_rewards: bool | ScaleRewards = "batch", clip_epsilon: float | None = None, kl_beta: float = 0.0,
                ref_policy: ControllerPolicy | None = None) -> LossOutput:
    """The training loss on sampled groups under the current policy (with gradient)."""
    full = rows_log_probs(policy, data, groups.sample_index, groups.budget_ms)  # (M, A)
    log_probs = full.gather(1, groups.actions)  # (M, G)
    if loss_type == "grpo":
        advantages, valid = group_advantages(groups.rewards, scale_rewards)
        loss, clip_ratio = grpo_objective(log_probs, advantages, valid, groups.old_log_probs, clip_epsilon)
    elif loss_type == "pairwise":
        loss, valid = pairwise_objective(log_probs, groups.rewards)
        clip_ratio = 0.0
    else:
        msg = f"loss_type must be 'grpo' or 'pairwise', got {loss_type!r}"
        raise ValueError(msg)
    kl_value = 0.0
    if kl_beta > 0.0:
        if ref_policy is None:
            msg = "kl_beta > 0 needs ref_policy (the initial policy)"
            raise ValueError(msg)
        with torch.no_grad():
            ref = rows_log_probs(ref_policy, data, groups.sample_index, groups.budget_ms)
        kl = exact_kl(full, ref).mean()
        loss = loss + kl_beta * kl
        kl_value = float(kl.detach())
    num_valid = int(valid.sum())
    return LossOutput(loss=loss, num_groups=groups.num_groups, num_zero_variance_groups=groups.num_groups - num_valid,
                      kl=kl_value, clip_ratio=clip_ratio)
