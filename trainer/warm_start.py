"""The policy an offline run starts from: a fresh network (:func:`build_policy`), then fitted to a
decider's choices before GRPO (:func:`warm_start`).

With ``kl_beta`` > 0 the warm-started policy is also the KL reference of the run, so the
controller starts from that decider (the outcome model's per-sample choice or the ``lut_p95``
table) and deviates per sample only where the recorded rewards pay for it.
"""

from __future__ import annotations

import torch

from trainer.baselines import BatchDecider, LookupTableDecider
from trainer.config import OfflineTrainConfig
from trainer.data import OfflineData
from trainer.grpo import rows_log_probs
from trainer.policy import ControllerPolicy, PolicyConfig, budget_normalization_range
from trainer.request_cost import RequestCostModel

__all__ = ["build_policy", "warm_start"]


def build_policy(config: OfflineTrainConfig, train: OfflineData, request_cost: RequestCostModel | None = None
                 ) -> ControllerPolicy:
    """A fresh policy for ``train``'s features and action space (weights from ``config.seed``); with
    ``config.request_cost_input``, it reads ``request_cost`` (its input standardised over
    ``train.request_latency_ms``, the predictions it trains on)."""
    lo, hi = budget_normalization_range(config.budget_min_ms, config.budget_max_ms, config.budget_margin)
    policy_config = PolicyConfig(lang_feature_dim=train.lang_features.shape[1],
                                 image_feature_dim=train.image_features.shape[1], budget_min_ms=lo, budget_max_ms=hi,
                                 hidden_dim=config.hidden_dim, dropout=config.dropout, use_tilings=config.use_tilings,
                                 image_feature=train.image_feature, use_request_cost=config.request_cost_input)
    torch.manual_seed(config.seed)  # initial weights depend on the seed only
    policy = ControllerPolicy(policy_config, train.action_space, train.model_fingerprint)
    policy.set_feature_normalization(train.image_features, train.image_present, train.lang_features, train.tiling_crops)
    if config.request_cost_input:
        if request_cost is None:
            msg = "request_cost_input needs the train split's request cost model"
            raise ValueError(msg)
        policy.attach_request_cost(request_cost, train.request_latency_ms)
    return policy


def warm_start(policy: ControllerPolicy, train: OfflineData, config: OfflineTrainConfig,
               start: BatchDecider | None = None) -> None:
    """Fit the policy to ``start``'s choices (default: the ``lut_p95`` table of ``train``) before GRPO.

    ``config.warm_start_steps`` Adam steps of cross-entropy to a target distribution over each
    sample's allowed configurations: ``warm_start_weight`` on the decider's choice at the
    sampled budget, the rest uniform (so GRPO still samples every configuration). Budgets are
    uniform over the training range, seeded by ``config.seed``.
    """
    if config.warm_start_steps == 0:
        return
    table = start if start is not None else LookupTableDecider(train)
    generator = torch.Generator().manual_seed(config.seed + 1)
    optimizer = torch.optim.Adam(policy.parameters(), lr=config.lr)
    lo, hi = config.budget_min_ms, config.budget_max_ms
    batch = config.batch_size * config.num_budgets_per_sample
    policy.train()
    for _ in range(config.warm_start_steps):
        index = torch.randint(len(train), (batch,), generator=generator)
        budgets = lo + (hi - lo) * torch.rand(batch, generator=generator)
        rows = train.select(index)
        choice = table.decide(rows, budgets)
        allowed = rows.mask.float()
        target = (1.0 - config.warm_start_weight) * allowed / allowed.sum(1, keepdim=True)
        target[torch.arange(batch), choice] += config.warm_start_weight
        log_probs = rows_log_probs(policy, train, index, budgets)
        loss = -(target * torch.where(rows.mask, log_probs, 0.0)).sum(1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
