"""The short summary after training: the best static configuration (with hindsight), who answered
for the deployed controller at each budget, and the best table beside it."""

from __future__ import annotations

import math

import torch

from trainer.baselines import BestStaticDecider
from trainer.clusters import cluster_table
from trainer.data import ActionSpace, OfflineData
from trainer.evaluate import evaluation_frame, format_summary_table, summarize_evaluation
from trainer.fallback import TableFallback
from trainer.reward import RewardConfig

SPACE = ActionSpace(((2, 4, 12), (2, 12, 16), (6, 4, 12)))
FAST, MID, BIG = 0, 1, 2


def four_samples(mask: torch.Tensor | None = None) -> OfflineData:
    # FAST: mean score 0.5, always 100 ms; MID: 0.75, 300 ms on the last sample; BIG: 1.0, always 250 ms
    score = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    latency = torch.tensor([[100.0, 150.0, 250.0]] * 3 + [[100.0, 300.0, 250.0]])
    mask = torch.ones(4, 3, dtype=torch.bool) if mask is None else mask
    return OfflineData(action_space=SPACE, model_fingerprint="f" * 64, dataset=["d"] * 4,
                       sample_key=[f"k{i}" for i in range(4)], example_id=[None] * 4, split=["test"] * 4,
                       image_features=torch.zeros(4, 2), image_present=torch.zeros(4, dtype=torch.bool),
                       lang_features=torch.zeros(4, 2), score=torch.where(mask, score, math.nan),
                       latency_ms=torch.where(mask, latency, math.nan), latency_is_sample=mask.clone(), mask=mask)


def test_the_best_static_configuration_is_the_most_accurate_one_that_keeps_the_goal():
    data = four_samples()
    static = BestStaticDecider()
    # 200 ms: MID is late for one sample of four (25 %), BIG for all: FAST is the one within 5 %
    assert static.decide(data, 200.0).tolist() == [FAST] * 4
    assert BestStaticDecider(max_violation_rate=0.3).decide(data, 200.0).tolist() == [MID] * 4
    assert static.decide(data, 300.0).tolist() == [BIG] * 4
    # 50 ms: every configuration is always late; the lowest mean latency wins the tie
    assert static.decide(data, 50.0).tolist() == [FAST] * 4
    # per-sample budgets: each budget's own choice on its own samples. 200 ms, samples 0 and 2: MID (mean
    # 0.5, never late) beats FAST (0.0); 300 ms, samples 1 and 3: all three score 1.0, the fastest wins
    assert static.decide(data, torch.tensor([200.0, 300.0, 200.0, 300.0])).tolist() == [MID, FAST, MID, FAST]
    # a sample that never recorded BIG counts as its fastest allowed one (FAST, score 0): BIG's mean falls
    # to 0.75, level with MID's, and MID's lower mean latency (187.5 against 212.5 ms) wins at 300 ms
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[2, BIG] = False
    assert static.decide(four_samples(mask), 300.0).tolist() == [MID] * 4
    # where the chosen configuration is missing for a sample, that sample gets its fastest allowed one
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[2, MID] = False
    assert BestStaticDecider(max_violation_rate=0.3).decide(four_samples(mask), 200.0).tolist() == [MID, MID, FAST,
                                                                                                     MID]


def cluster_fallback(use_controller: list[bool], family_table_at: list[bool]) -> TableFallback:
    """A fallback over the grid 100/200/300 ms whose table is a cluster table with two clusters."""
    from test_clusters import FAMILIES, GRID, unlabelled

    table = cluster_table(unlabelled(FAMILIES), GRID, RewardConfig())
    assert table.has_families
    zeros = [0.0] * 3
    return TableFallback(grid_ms=[100.0, 200.0, 300.0], use_controller=use_controller, controller_reward=zeros,
                         table_reward=zeros, reward_difference_se=zeros, controller_violation_rate=zeros,
                         table_violation_rate=zeros, table_violation_upper=zeros, max_violation_rate=0.05,
                         confidence=0.95, table=table.state(), prefers="table", family_table_at=family_table_at)


def _row(decider: str, budget: float, accuracy: float, violation: float, config: str = "2/4/12") -> dict:
    return {"decider": decider, "budget_ms": budget, "num_samples": 100, "accuracy": accuracy, "accuracy_se": 0.01,
            "violation_rate": violation, "latency_ms_mean": 1.0, "latency_ms_p95": 1.0,
            "accuracy_within_budget": accuracy, "reward_mean": 0.0, "expected_reward": 0.0,
            "config_histogram": f'{{"{config}": 100}}'}


def test_the_summary_names_who_answered_and_the_best_table_within_the_goal():
    frame = evaluation_frame([
        _row("controller", 100.0, 0.60, 0.03), _row("controller", 200.0, 0.70, 0.02),
        _row("controller", 300.0, 0.80, 0.01),
        *(_row("best_static", b, 0.5, 0.0, "6/4/12") for b in (100.0, 200.0, 300.0)),
        *(_row("lut_p95", b, 0.55, 0.04) for b in (100.0, 200.0, 300.0)),
        # lut_by_family is the most accurate but late too often; lut_mean5 is the best within 5 %
        *(_row("lut_by_family", b, 0.90, 0.10) for b in (100.0, 200.0, 300.0)),
        *(_row("lut_by_cluster", b, 0.70, 0.02) for b in (100.0, 200.0, 300.0)),
        *(_row("lut_mean5", b, 0.75, 0.04) for b in (100.0, 200.0, 300.0)),
    ])
    fallback = cluster_fallback(use_controller=[False, True, False], family_table_at=[False, True, True])
    summary = summarize_evaluation(frame, fallback)
    # 100 ms: the table answers, its global lut_p95 there; 200: the network; 300: the cluster table
    assert [r["answered_by"] for r in summary] == ["lut_p95", "controller", "lut_by_cluster"]
    assert [r["best_table"]["decider"] for r in summary] == ["lut_mean5"] * 3
    assert summary[0]["controller"]["accuracy"] == 0.60 and summary[0]["best_static"]["accuracy"] == 0.5
    assert [r["answered_by"] for r in summarize_evaluation(frame, None)] == ["controller"] * 3
    text = format_summary_table(summary).columns
    assert [c.header for c in text] == ["budget ms", "answered by", "controller", "best static configuration",
                                        "lut_p95", "best table"]
    assert list(text[3].cells)[0] == "0.500 ± 0.010, 0.0% late (6/4/12)"


def test_a_cluster_fallback_keeps_unfamiliar_questions_from_the_network():
    fallback = cluster_fallback(use_controller=[True, True, True], family_table_at=[True, True, True])
    assert fallback.guards_network
    lang = torch.zeros(3, 8)
    lang[0, 0], lang[1, 1], lang[2, 5] = 1.0, 1.0, 1.0  # "sign", "count", and a kind no cluster has
    assert fallback.network_allowed(lang).tolist() == [True, True, False]
    # a labelled family table sets no threshold: every question may go to the network
    from dataclasses import replace

    labelled = replace(fallback, table={**fallback.table, "name": "lut_by_question", "min_similarity": -2.0})
    assert not labelled.guards_network and labelled.network_allowed(lang).tolist() == [True] * 3
