"""The controller's greedy decision: stage 1 (crops), then stage 2 (top_k and blocks) at those crops.

The deployed system cannot take the joint argmax over (crops, top_k, blocks): stage 1 runs before
the vision tower and reads the language features, the budget and the image's tiling only; stage 2
runs after the vision pass at the crops stage 1 chose. So the greedy decision is sequential:

1. crops: the argmax of log p1(crops | lang, budget, tiling) over the crops values that have at
   least one allowed action;
2. among the allowed actions with those crops, the argmax of
   log p2(top_k | x, crops) + log p3(blocks | x, crops).

It differs from the joint mode where a crops value that stage 1 finds less likely has a
stage-2 configuration so much more likely that its product p1 p2 p3 is the larger.

Ties go to the first maximum (``torch.argmax``): the fewest crops, then, among the actions of
those crops (sorted, :class:`trainer.data.ActionSpace`), the smallest top_k and then the fewest
blocks, i.e. the cheaper configuration.

Both scores may be shifted by any per-row constant (per crops value for stage 2) without moving
the decision, so the deployed module (:mod:`controller.deploy`) passes raw logits; the functions
are written for TorchScript, which compiles them into the exported file.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.errors import CtrlError
from trainer.policy import ControllerPolicy

__all__ = ["greedy_crops", "greedy_within_crops", "policy_greedy", "sequential_greedy"]


def greedy_crops(crops_scores: Tensor, crops_allowed: Tensor | None = None) -> Tensor:
    """Stage 1: (N,) column of the best crops value, from ``crops_scores`` (N, C) (log p1 up to a per-row
    constant) over ``crops_allowed`` ((N, C) or (C,) bool; None = every value); ties: the lowest column."""
    if crops_allowed is None:
        return crops_scores.argmax(-1)
    return crops_scores.masked_fill(~crops_allowed, float("-inf")).argmax(-1)


def greedy_within_crops(top_k_scores: Tensor, blocks_scores: Tensor, action_top_k: Tensor, action_blocks: Tensor,
                        candidates: Tensor) -> Tensor:
    """Stage 2: (N,) action index, the argmax of ``top_k_scores[k(a)] + blocks_scores[b(a)]`` over the
    ``candidates`` (N, A) bool (the allowed actions of the chosen crops; at least one per row).

    ``top_k_scores`` (N, K) and ``blocks_scores`` (N, B): log p2 and log p3 at the chosen crops
    (each up to a per-row constant); ``action_top_k``, ``action_blocks`` (A,): each action's
    column in them. Ties: the lowest action index."""
    joint = top_k_scores.index_select(1, action_top_k) + blocks_scores.index_select(1, action_blocks)
    return joint.masked_fill(~candidates, float("-inf")).argmax(-1)


def sequential_greedy(crops_scores: Tensor, top_k_scores: Tensor, blocks_scores: Tensor, knob_indices: Tensor,
                      allowed: Tensor | None = None) -> Tensor:
    """The greedy decision, (N,) action indices, from both stages' scores at every crops value.

    ``crops_scores`` (N, C); ``top_k_scores`` (N, C, K) and ``blocks_scores`` (N, C, B): stage 2 at
    each crops value; ``knob_indices`` (A, 3): per action its crops, top_k and blocks columns
    (:meth:`trainer.data.ActionSpace.knob_indices`); ``allowed`` (N, A) bool: the actions each row
    may take (None = all; every row needs one)."""
    crops_of, top_k_of, blocks_of = knob_indices[:, 0], knob_indices[:, 1], knob_indices[:, 2]
    n, num_crops = crops_scores.shape[0], crops_scores.shape[1]
    if allowed is None:
        allowed = torch.ones(n, knob_indices.shape[0], dtype=torch.bool, device=crops_scores.device)
    # a crops value is allowed where any of its actions is
    crops_allowed = crops_scores.new_zeros((n, num_crops)).index_add_(1, crops_of, allowed.to(crops_scores.dtype)) > 0
    crops = greedy_crops(crops_scores, crops_allowed)
    rows = torch.arange(n, device=crops_scores.device)
    candidates = allowed & (crops_of.unsqueeze(0) == crops.unsqueeze(1))
    return greedy_within_crops(top_k_scores[rows, crops], blocks_scores[rows, crops], top_k_of, blocks_of, candidates)


@torch.no_grad()
def policy_greedy(policy: ControllerPolicy, image: Tensor, image_present: Tensor, lang: Tensor,
                  budget_ms: Tensor | float, allowed: Tensor | None = None, *,
                  tiling_crops: Tensor | None = None, prompt_tokens: Tensor | None = None,
                  request_ms: Tensor | None = None) -> Tensor:
    """The policy's greedy decision, (N,) indices into ``policy.action_space``, over ``allowed`` (N, A)
    (None = the whole action space). Inputs as for :meth:`ControllerPolicy.log_probs`."""
    if allowed is not None and not bool(allowed.any(-1).all()):
        empty = int((~allowed.any(-1)).sum())
        msg = f"{empty} of {len(allowed)} rows have an empty action mask: no recorded configuration to choose from"
        raise CtrlError(msg)
    crops_lp, lang_h, budget_h = policy.stage1(lang, budget_ms, tiling_crops=tiling_crops, prompt_tokens=prompt_tokens,
                                               request_ms=request_ms)
    hidden = policy.stage2_hidden(image, image_present, lang_h, budget_h, tiling_crops=tiling_crops)
    top_k_lp, blocks_lp = policy.stage2_heads(hidden)
    return sequential_greedy(crops_lp, top_k_lp, blocks_lp, policy.knob_indices, allowed)
