"""Question families found without labels: k-means on language features, the cluster count chosen
out of fold, the per-cluster table (``lut_by_cluster``) and its place in the fallback and export."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.baselines import LookupTableDecider, QuestionFamilyTableDecider
from trainer.clusters import CLUSTER_TABLE, choose_num_clusters, cluster_names, cluster_table, kmeans, leading_words
from trainer.data import ActionSpace, OfflineData
from trainer.reward import RewardConfig

SPACE = ActionSpace(((2, 4, 12), (2, 12, 16), (6, 4, 12)))
FAST, EXPERTS, CROPS = 0, 1, 2
# per family: (score, latency ms) of FAST, EXPERTS, CROPS. "sign" questions gain from crops, "count"
# questions from experts; both fit a 200 ms budget, so a table per family beats one for both.
ROWS = {"sign": ([0.2, 0.3, 0.9], [100.0, 150.0, 160.0]), "count": ([0.5, 0.9, 0.5], [100.0, 150.0, 160.0])}
QUESTIONS = {"sign": "What does the sign say?", "count": "How many people are there?"}
GRID = [120.0, 200.0]


def unlabelled(families: list[str], seed: int = 0, same_outcomes: bool = False) -> OfflineData:
    """One sample per entry of ``families``, no family labels: each family's language features point
    along their own axis (with noise), its questions start with the family's words."""
    n = len(families)
    g = torch.Generator().manual_seed(seed)
    axis = {"sign": 0, "count": 1}
    lang = 0.1 * torch.randn(n, 8, generator=g)
    for i, f in enumerate(families):
        lang[i, axis[f]] += 1.0
    rows = ["sign" if same_outcomes else f for f in families]
    score = torch.tensor([ROWS[r][0] for r in rows])
    latency = torch.tensor([ROWS[r][1] for r in rows])
    mask = torch.ones(n, len(SPACE), dtype=torch.bool)
    return OfflineData(action_space=SPACE, model_fingerprint="f" * 64, dataset=["d"] * n,
                       sample_key=[f"k{seed}-{i}" for i in range(n)], example_id=[str(i) for i in range(n)],
                       split=["train"] * n, image_features=torch.zeros(n, 2), image_present=torch.zeros(n, dtype=bool),
                       lang_features=lang, score=score, latency_ms=latency, latency_is_sample=mask.clone(), mask=mask,
                       question=[QUESTIONS[f] + f" ({i})" for i, f in enumerate(families)])


FAMILIES = ["sign", "count"] * 40


def test_kmeans_finds_the_groups_and_is_seeded():
    data = unlabelled(FAMILIES)
    assign = kmeans(data.lang_features, 2, seed=3)
    # the first row is cluster 0 (numbered by first appearance): every "sign" row 0, every "count" row 1
    assert assign.tolist() == [0, 1] * 40
    assert torch.equal(kmeans(data.lang_features, 2, seed=3), assign)


def test_kmeans_dissolves_clusters_too_small_for_a_table():
    data = unlabelled(["sign"] * 40 + ["count"] * 5)
    assert kmeans(data.lang_features, 2, min_cluster_size=20).tolist() == [0] * 45
    assert kmeans(data.lang_features, 2, min_cluster_size=5).tolist() == [0] * 40 + [1] * 5
    assert kmeans(data.lang_features, 1).tolist() == [0] * 45
    with pytest.raises(ValueError, match="`k` must be >= 1"):
        kmeans(data.lang_features, 0)


def test_clusters_are_named_by_their_questions_leading_words():
    assert leading_words("What's the  SIGN say? Really") == ("what's", "the", "sign", "say")
    assert leading_words(None) == ()
    assign = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])
    questions = ["How many dogs?", "How many cats are here?", "Is it red?", "What color is the bus?",
                 "What color is it?", "What color is it?", "What color is the sky?", "Why?"]
    # cluster 0: two of three start "how many" (the longest phrase most of them share); 1 and 2 share a name
    assert cluster_names(assign, questions) == ["how many ...", "what color is ... #1", "what color is ... #2",
                                                "why ..."]
    assert cluster_names(assign, None) == ["cluster 0", "cluster 1", "cluster 2", "cluster 3"]


def test_the_cluster_count_is_chosen_by_the_tables_out_of_fold_score():
    reward = RewardConfig()
    choice = choose_num_clusters(unlabelled(FAMILIES), GRID, reward, candidates=(1, 2))
    assert choice.num_clusters == 2
    assert choice.mean_reward[1] > choice.mean_reward[0]  # a table per cluster beats lut_p95 out of fold
    # families that do not differ in their outcomes: every table decides alike, the smaller count wins
    same = choose_num_clusters(unlabelled(FAMILIES, same_outcomes=True), GRID, reward, candidates=(1, 2))
    assert same.num_clusters == 1


def test_the_cluster_table_decides_as_the_labelled_family_table_would():
    train = unlabelled(FAMILIES)
    table = cluster_table(train, GRID, RewardConfig())
    assert table.name == CLUSTER_TABLE
    assert sorted(table.families) == ["how many people are ...", "what does the sign ..."]
    new = unlabelled(["count", "sign", "sign"], seed=9)
    # at 200 ms: "count" -> EXPERTS, "sign" -> CROPS (worked out from ROWS); lut_p95 gives CROPS to all
    assert table.decide(new, 200.0).tolist() == [EXPERTS, CROPS, CROPS]
    assert LookupTableDecider(train).decide(new, 200.0).tolist() == [CROPS] * 3
    assert table.read_family(new.lang_features) == ["how many people are ...", "what does the sign ...",
                                                    "what does the sign ..."]
    labelled = QuestionFamilyTableDecider(replace(train, family=FAMILIES))
    assert torch.equal(labelled.decide(new, 200.0), table.decide(new, 200.0))
    one = cluster_table(train, GRID, RewardConfig(), num_clusters=1)
    assert not one.has_families and one.decide(new, 200.0).tolist() == [CROPS] * 3


def test_a_fallback_switches_a_family_table_to_lut_p95_per_budget():
    from trainer.fallback import BudgetSwitchedTable, switched_table

    train = unlabelled(FAMILIES)
    table = cluster_table(train, GRID, RewardConfig())
    new = unlabelled(["count", "sign"], seed=9)
    switched = switched_table(table, GRID, [False, True])
    assert isinstance(switched, BudgetSwitchedTable)
    # at 200 ms the clusters answer; at 190 (nearest 200) too; at 130 (nearest 120) the global table
    assert switched.decide(new, 200.0).tolist() == [EXPERTS, CROPS]
    assert switched.decide(new, 190.0).tolist() == [EXPERTS, CROPS]
    both = torch.tensor([130.0, 200.0])
    assert switched.decide(new, both).tolist() == [FAST, CROPS]
    assert switched_table(table, GRID, [True, True]) is table
    assert switched_table(LookupTableDecider(train), GRID, [False, True]).name == "lut_p95"


def test_the_clusters_answer_only_where_held_out_data_does_not_favour_lut_p95():
    from trainer.fallback import choose_family_table_at

    reward = RewardConfig()
    table = cluster_table(unlabelled(FAMILIES), GRID, reward)
    held_out = unlabelled(FAMILIES, seed=5)
    # at 120 ms both tables choose FAST (a tie: the clusters answer); at 200 ms the clusters' per-family
    # choice (EXPERTS for "count", CROPS for "sign") beats lut_p95's CROPS for everyone
    assert choose_family_table_at(table, table.global_table, held_out, GRID, reward) == [True, True]
    # held-out "count" questions that behave like "sign" ones: the clusters' EXPERTS now loses at 200 ms
    sign_like = replace(held_out, score=torch.tensor([ROWS["sign"][0]] * len(held_out)))
    assert choose_family_table_at(table, table.global_table, sign_like, GRID, reward) == [True, False]


def test_a_question_unlike_every_cluster_gets_the_global_table():
    train = unlabelled(FAMILIES)
    table = cluster_table(train, GRID, RewardConfig())
    # the training questions lie within 0.1 of their own axis: their closest reference is far above 0.5
    assert 0.5 < table.min_similarity < 1.0
    new = unlabelled(["count", "sign", "count"], seed=9)
    lang = new.lang_features.clone()
    lang[2] = torch.zeros(8)
    lang[2, 5] = 1.0  # a third kind of question, along an axis no cluster has
    new = replace(new, lang_features=lang)
    assert table.read_family(lang)[2] is None
    # at 200 ms: the clusters' choices for the first two, lut_p95's (CROPS) for the unfamiliar one
    assert table.decide(new, 200.0).tolist() == [EXPERTS, CROPS, CROPS]
    state = table.state()
    assert state["min_similarity"] == table.min_similarity
    del state["min_similarity"]  # a table stored before the threshold: every question reads as a cluster
    from trainer.baselines import QuestionFamilyTableDecider

    assert QuestionFamilyTableDecider.from_state(state).read_family(lang)[2] is not None


def test_auto_prefers_the_network_over_a_cluster_table():
    from trainer.fallback import resolve_prefers

    table = cluster_table(unlabelled(FAMILIES), GRID, RewardConfig())
    assert table.has_families and resolve_prefers("auto", table) == "controller"
    assert resolve_prefers("table", table) == "table"
