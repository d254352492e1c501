"""Deciders that read each request's own cost and expected score (:mod:`trainer.request_cost`).

* :class:`RequestTableDecider` (``"lut_by_request"``): among the request's allowed configurations whose
  predicted latency quantile fits the budget, the highest expected score of its question cluster at the
  configuration's effect (top-K, blocks, crops used); ties -> the lower predicted median, then the lower
  ``max_crops`` (a configuration that gives the image no more crops than a cheaper one is never chosen over
  it). When none fits, the lowest predicted quantile. A table a server can run: it reads the tiling, the
  prompt's length and the question, all known before the vision pass.
* :class:`LatencyClairvoyantDecider` (``"latency_clairvoyant"``): the same expected scores, but each
  request's *measured* latency known: the ceiling of what knowing a request's cost buys a table, where
  ``clairvoyant`` (the outcome distribution known) measures what knowing its answer would buy.
"""

from __future__ import annotations

import torch

from trainer.baselines import DeterministicDecider, best_candidate, budget_vector, require_allowed_actions
from trainer.data import OfflineData
from trainer.request_cost import RequestCostConfig, RequestCostModel, RequestScoreTable, fit_request_cost

__all__ = ["REQUEST_TABLE", "LatencyClairvoyantDecider", "RequestTableDecider", "request_table_choice"]

#: the name of the per-request table in evaluations and fallbacks
REQUEST_TABLE = "lut_by_request"


def request_table_choice(median: torch.Tensor, quantile: torch.Tensor, score: torch.Tensor, budget_ms: torch.Tensor,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) action indices: among the allowed actions (``mask`` (B, A); None: all) whose ``quantile`` fits
    ``budget_ms`` (B,), the highest ``score``, ties -> lower ``median`` (then the lower index: the lower
    ``max_crops``); none fits -> the lowest ``quantile``. TorchScript-compatible (the deployed controller's)."""
    allowed = torch.ones_like(score, dtype=torch.bool) if mask is None else mask
    fits = allowed & (quantile <= budget_ms.float()[:, None])
    best, found = best_candidate(fits, score, median)
    fastest, _ = best_candidate(allowed, -quantile, torch.zeros_like(quantile))
    return torch.where(found, best, fastest)


def _check_space(data: OfflineData, model: RequestCostModel) -> None:
    if data.action_space != model.action_space:
        msg = "the data's action space differs from the request cost model's (fitted on other data)"
        raise ValueError(msg)
    require_allowed_actions(data)


class RequestTableDecider(DeterministicDecider):
    """``"lut_by_request"``: the most accurate configuration whose per-request latency quantile fits."""

    def __init__(self, model: RequestCostModel, scores: RequestScoreTable, name: str = REQUEST_TABLE) -> None:
        self.model, self.scores, self.name = model, scores, name
        self.action_space = model.action_space

    def decide(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        _check_space(data, self.model)
        median, quantile, _, _ = self.model.predict(data)
        score = self.scores.expected_score(data.lang_features, data.tiling_crops)
        return request_table_choice(median, quantile, score, budget_vector(budget_ms, len(data)), data.mask)

    def state(self) -> dict:
        """The table as plain values (checkpoints; compared as values): :meth:`from_state` rebuilds it
        without the data."""
        model = self.model.to_state()
        model["state_dict"] = {name: {"values": t.tolist(), "dtype": str(t.dtype).removeprefix("torch.")}
                               for name, t in model["state_dict"].items()}
        return {"kind": "request", "name": self.name, "cost_model": model,
                "score_cells": self.scores.cells.tolist(), "score_by_action": self.scores.by_action.tolist()}

    @classmethod
    def from_state(cls, state: dict) -> RequestTableDecider:
        stored = dict(state["cost_model"])
        # a run written before the state held plain values stored the tensors themselves: both load
        stored["state_dict"] = {name: t if isinstance(t, torch.Tensor)
                                else torch.tensor(t["values"], dtype=getattr(torch, t["dtype"]))
                                for name, t in stored["state_dict"].items()}
        model = RequestCostModel.from_state(stored)
        scores = RequestScoreTable.from_cells(model, torch.tensor(state["score_cells"], dtype=torch.float32),
                                              torch.tensor(state["score_by_action"], dtype=torch.float32))
        return cls(model, scores, name=state.get("name", REQUEST_TABLE))

    @classmethod
    def fit(cls, train: OfflineData, config: RequestCostConfig | None = None) -> RequestTableDecider:
        """The cost model and score table of ``train``, as a decider."""
        model = fit_request_cost(train, config)
        return cls(model, RequestScoreTable(train, model))


class LatencyClairvoyantDecider(DeterministicDecider):
    """``"latency_clairvoyant"``: the highest expected score (``scores``) among the request's allowed
    configurations whose measured latency fits; when none fits, the fastest measured one."""

    name = "latency_clairvoyant"

    def __init__(self, scores: RequestScoreTable) -> None:
        self.scores = scores
        self.action_space = scores.model.action_space

    def decide(self, data: OfflineData, budget_ms: torch.Tensor | float) -> torch.Tensor:
        _check_space(data, self.scores.model)
        score = self.scores.expected_score(data.lang_features, data.tiling_crops)
        budget = budget_vector(budget_ms, len(data))
        fits = data.mask & (data.latency_ms <= budget[:, None])
        best, found = best_candidate(fits, score, data.latency_ms)
        fastest, _ = best_candidate(data.mask, -data.latency_ms, torch.zeros_like(data.latency_ms))
        return torch.where(found, best, fastest)
