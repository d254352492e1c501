"""The per-family lookup table (``lut_by_family``) and the question family of OfflineData."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_ingest
from features import FeatureConfig, extract_features
from pipeline import Workspace
from trainer.baselines import FamilyLookupTableDecider, LookupTableDecider
from trainer.data import ActionSpace, OfflineData, family_of, load_offline_data
from trainer.reward import RewardConfig

SPACE = ActionSpace(((2, 4, 12), (2, 12, 16), (6, 4, 12)))
FAST, EXPERTS, CROPS = 0, 1, 2  # action indices in SPACE

# per family: recorded (score, latency ms) of FAST, EXPERTS, CROPS on every training sample.
# "text" samples gain from crops; "scene" samples gain from experts and their images are larger,
# so crops cost them 240 ms.
TRAIN_ROWS = {
    "text": ([0.2, 0.3, 0.9], [100.0, 150.0, 160.0]),
    "scene": ([0.5, 0.9, 0.5], [100.0, 150.0, 240.0]),
    None: ([0.0, 0.0, 1.0], [100.0, 150.0, 160.0]),
}
TRAIN_FAMILIES = ["text"] * 4 + ["scene"] * 4 + [None]
# What the tables hold, worked out by hand from TRAIN_ROWS:
# * global (9 samples): mean score FAST 0.311, EXPERTS 0.533, CROPS 0.733; p95 latency of CROPS is
#   240 (four of nine samples at 240), so at 200 ms CROPS does not fit -> EXPERTS; at 300 -> CROPS;
# * text: CROPS (0.9, p95 160) at 200 and 300 ms;
# * scene: EXPERTS (0.9, p95 150) at 200 and 300 ms;
# * at 120 ms only FAST (p95 100) fits any table; at 50 ms nothing fits -> the lowest p95, FAST.


def make_data(families: list[str | None] | None, split: str, mask: torch.Tensor | None = None,
              rows: list[str | None] | None = None) -> OfflineData:
    """One sample per entry of ``rows`` (keys of TRAIN_ROWS; default: ``families``)."""
    rows = families if rows is None else rows
    n = len(rows)
    score = torch.tensor([TRAIN_ROWS[r][0] for r in rows], dtype=torch.float32)
    latency = torch.tensor([TRAIN_ROWS[r][1] for r in rows], dtype=torch.float32)
    mask = torch.ones(n, len(SPACE), dtype=torch.bool) if mask is None else mask
    return OfflineData(action_space=SPACE, model_fingerprint="f" * 64, dataset=["d"] * n,
                       sample_key=[f"k{i}" for i in range(n)], example_id=[str(i) for i in range(n)],
                       split=[split] * n, image_features=torch.zeros(n, 2), image_present=torch.zeros(n, dtype=bool),
                       lang_features=torch.zeros(n, 2), score=torch.where(mask, score, float("nan")),
                       latency_ms=torch.where(mask, latency, float("nan")), latency_is_sample=mask.clone(), mask=mask,
                       family=families)


@pytest.fixture
def train() -> OfflineData:
    return make_data(TRAIN_FAMILIES, "train")


# test samples: the outcomes are never read by a table, only the family and the mask
TEST_FAMILIES = ["text", "scene", "other", None]


@pytest.fixture
def test_data() -> OfflineData:
    return make_data(TEST_FAMILIES, "test", rows=["text", "scene", "text", "scene"])


# -- the decider ---------------------------------------------------------------------------

def test_each_family_gets_its_own_best_and_the_rest_the_global_choice(train, test_data):
    by_family, table = FamilyLookupTableDecider(train), LookupTableDecider(train)
    assert by_family.name == "lut_by_family" and by_family.families == ("scene", "text")
    # text, scene, an unseen family, no family
    assert by_family.decide(test_data, 200.0).tolist() == [CROPS, EXPERTS, EXPERTS, EXPERTS]
    assert table.decide(test_data, 200.0).tolist() == [EXPERTS] * 4
    assert by_family.decide(test_data, 300.0).tolist() == [CROPS, EXPERTS, CROPS, CROPS]
    assert table.decide(test_data, 300.0).tolist() == [CROPS] * 4
    assert by_family.decide(test_data, 120.0).tolist() == [FAST] * 4
    assert by_family.decide(test_data, 50.0).tolist() == [FAST] * 4  # nothing fits: the lowest p95
    per_sample = torch.tensor([200.0, 300.0, 300.0, 200.0])
    assert by_family.decide(test_data, per_sample).tolist() == [CROPS, EXPERTS, CROPS, EXPERTS]
    assert by_family.action_probs(test_data, 300.0).tolist() == [[0, 0, 1], [0, 1, 0], [0, 0, 1], [0, 0, 1]]


def test_lookup_per_family(train):
    by_family = FamilyLookupTableDecider(train)
    assert by_family.lookup(200.0, "text") == (6, 4, 12)
    assert by_family.lookup(200.0, "scene") == (2, 12, 16)
    assert by_family.lookup(200.0, "other") == by_family.lookup(200.0) == (2, 12, 16)
    assert by_family.table_for("other") is by_family.table_for(None) is by_family.global_table


def test_the_choice_stays_inside_the_mask(train):
    mask = torch.tensor([[True, False, True]])  # EXPERTS not recorded for this scene sample
    data = make_data(["scene"], "test", mask=mask)
    # scene's table without EXPERTS: FAST and CROPS tie at 0.5 -> the lower p95 (100 ms)
    assert FamilyLookupTableDecider(train).decide(data, 300.0).tolist() == [FAST]


def test_mean_statistic_applies_to_every_table(train, test_data):
    # mean latency of CROPS: global (5 x 160 + 4 x 240) / 9 = 195.6 <= 210, scene 240 > 210
    by_family = FamilyLookupTableDecider(train, statistic="mean", tolerance=0.05)
    assert by_family.decide(test_data, 200.0).tolist() == [CROPS, EXPERTS, CROPS, CROPS]


def test_training_data_without_families_gives_the_global_table(test_data):
    train = make_data(None, "train", rows=TRAIN_FAMILIES)
    by_family = FamilyLookupTableDecider(train)
    assert by_family.families == ()
    for budget in (50.0, 120.0, 200.0, 300.0):
        assert by_family.decide(test_data, budget).tolist() == LookupTableDecider(train).decide(test_data,
                                                                                              budget).tolist()


def test_state_round_trip(train, test_data):
    by_family = FamilyLookupTableDecider(train)
    rebuilt = FamilyLookupTableDecider.from_state(json.loads(json.dumps(by_family.state())))
    assert rebuilt.name == "lut_by_family" and rebuilt.families == ("scene", "text")
    for budget in (120.0, 200.0, 300.0):
        assert rebuilt.decide(test_data, budget).tolist() == by_family.decide(test_data, budget).tolist()


def test_refuses_other_action_spaces_and_label_counts(train):
    other = ActionSpace(((2, 4, 12), (6, 4, 12)))
    data = OfflineData(action_space=other, model_fingerprint="f" * 64, dataset=["d"], sample_key=["k"],
                       example_id=[None], split=["test"], image_features=torch.zeros(1, 2),
                       image_present=torch.zeros(1, dtype=bool), lang_features=torch.zeros(1, 2),
                       score=torch.zeros(1, 2), latency_ms=torch.zeros(1, 2),
                       latency_is_sample=torch.ones(1, 2, dtype=torch.bool), mask=torch.ones(1, 2, dtype=torch.bool))
    by_family = FamilyLookupTableDecider(train)
    with pytest.raises(ValueError, match="action space"):
        by_family.decide(data, 200.0)
    with pytest.raises(ValueError, match="2 labels for 1 budgets"):
        by_family.choose(torch.tensor([200.0]), ["text", "scene"])


# -- the family field ----------------------------------------------------------------------

def test_family_field_is_checked_and_follows_selection(train):
    assert train.subset("train").family == TRAIN_FAMILIES
    assert train.select([8, 0, 4]).family == [None, "text", "scene"]
    assert train.clone().family == TRAIN_FAMILIES
    assert make_data(None, "train", rows=["text"]).select([0]).family is None
    with pytest.raises(ValueError, match="`family` has 2 entries, `dataset` has 1"):
        make_data(["text", "scene"], "train", rows=["text"])
    with pytest.raises(TypeError, match="str or None"):
        make_data([3], "train", rows=["text"])


@pytest.mark.parametrize(("metadata", "family"), [
    ({"family": "color", "question_type": "what color is the", "answer_type": "other"}, "color"),
    ({"question_type": "how many", "answer_type": "number"}, "how many"),
    ({"answer_type": "yes/no"}, "yes/no"),
    ({"family": "  ", "question_type": None, "answer_type": "number"}, "number"),
    ({"family": 3, "question_type": " what is the "}, "what is the"),
    ({"image_source": "coco"}, None),
    ({}, None),
])
def test_family_of_metadata(metadata, family):
    assert family_of(json.dumps(metadata)) == family


def test_family_of_missing_metadata():
    assert family_of(None) is None and family_of("") is None and family_of("[1, 2]") is None


# -- loading from a workspace --------------------------------------------------------------

#: extra metadata per sample index of the conftest small tree (example_id 500000 + i)
EXTRA_METADATA = {
    0: {"family": "color", "question_type": "what color is the", "answer_type": "other"},
    1: {"question_type": "how many", "answer_type": "number"},
    2: {"answer_type": "yes/no"},
    3: {},
    4: {"family": "", "question_type": "what is the"},
}
LOADED_FAMILIES = {"ex:500000": "color", "ex:500001": "how many", "ex:500002": "yes/no", "ex:500003": None,
                   "ex:500004": "what is the"}


def _add_metadata(node: object) -> None:
    if isinstance(node, dict):
        meta = node.get("metadata")
        if isinstance(meta, dict) and "example_id" in meta:
            meta.update(EXTRA_METADATA[meta["example_id"] - 500000])
        for value in node.values():
            _add_metadata(value)
    elif isinstance(node, list):
        for value in node:
            _add_metadata(value)


def _load(tree: Path, root: Path, runtime) -> OfflineData:
    workspace = Workspace(root)
    assert run_ingest([tree], workspace).exit_code == 0
    extract_features(FeatureConfig(workspace=workspace.root), runtime=runtime)
    return load_offline_data(workspace)


def test_families_load_from_the_metadata_in_order(small_tree, tmp_path, embedded_runtime):
    for path in small_tree.rglob("*.json"):
        doc = json.loads(path.read_text())
        _add_metadata(doc)
        path.write_text(json.dumps(doc, indent=2))
    data = _load(small_tree, tmp_path / "ws-families", embedded_runtime)
    assert dict(zip(data.sample_key, data.family)) == LOADED_FAMILIES


def test_no_family_recorded_gives_none(small_tree, tmp_path, embedded_runtime):
    data = _load(small_tree, tmp_path / "ws-plain", embedded_runtime)
    assert len(data) == 5 and data.family is None


# -- the family read from the question (lut_by_question) ---------------------------------------

def with_questions(data: OfflineData, lang: list[list[float]]) -> OfflineData:
    from dataclasses import replace

    return replace(data, lang_features=torch.tensor(lang, dtype=torch.float32))


# the training questions: text ones point along x, scene ones along y, the unlabelled one between
TRAIN_QUESTIONS = [[1.0, 0.1], [1.0, 0.0], [0.9, 0.1], [1.0, 0.2], [0.1, 1.0], [0.0, 1.0], [0.2, 0.9], [0.1, 0.8],
                   [1.0, 1.0]]


def test_the_family_comes_from_the_question_not_the_label(train, test_data):
    from trainer.baselines import QuestionFamilyTableDecider

    table = QuestionFamilyTableDecider(with_questions(train, TRAIN_QUESTIONS), neighbours=3)
    assert table.name == "lut_by_question" and table.families == ("scene", "text")
    # labels text, scene, other, None; the questions read as scene, text, text, scene
    unseen = with_questions(test_data, [[0.0, 2.0], [3.0, 0.1], [0.8, 0.3], [0.3, 0.7]])
    assert table.read_family(unseen.lang_features) == ["scene", "text", "text", "scene"]
    assert table.decide(unseen, 200.0).tolist() == [EXPERTS, CROPS, CROPS, EXPERTS]
    assert table.decide(unseen, 120.0).tolist() == [FAST] * 4
    # the label-reading table answers by the labels instead
    assert FamilyLookupTableDecider(train).decide(unseen, 200.0).tolist() == [CROPS, EXPERTS, EXPERTS, EXPERTS]


def test_the_nearest_questions_vote_and_a_tie_goes_to_the_first_family():
    from trainer.baselines import nearest_family

    references = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]]), dim=1)
    family = torch.tensor([0, 0, 1])
    query = torch.tensor([[0.1, 1.0]])  # nearest: [0, 1] (family 1), then [0.8, 0.6], then [1, 0]
    assert nearest_family(query, references, family, 2, 1).tolist() == [1]
    assert nearest_family(query, references, family, 2, 2).tolist() == [0]  # one vote each: the first family
    assert nearest_family(query, references, family, 2, 3).tolist() == [0]  # two votes to one
    assert nearest_family(query, references, family, 2, 50).tolist() == [0]  # more neighbours than references


def test_references_are_spread_over_each_family_and_capped(train):
    from trainer.baselines import QuestionFamilyTableDecider

    table = QuestionFamilyTableDecider(with_questions(train, TRAIN_QUESTIONS), references_per_family=2)
    # scene rows 4..7 and text rows 0..3: the first and the last of each; the unlabelled row never
    expected = torch.nn.functional.normalize(torch.tensor([TRAIN_QUESTIONS[i] for i in (4, 7, 0, 3)]), dim=1)
    assert torch.allclose(table.reference_features, expected)
    assert table.reference_family.tolist() == [0, 0, 1, 1]


def test_question_table_state_round_trip_and_no_families(train, test_data):
    from trainer.baselines import QuestionFamilyTableDecider, table_from_state

    table = QuestionFamilyTableDecider(with_questions(train, TRAIN_QUESTIONS), neighbours=3)
    unseen = with_questions(test_data, [[0.0, 2.0], [3.0, 0.1], [0.8, 0.3], [0.3, 0.7]])
    rebuilt = table_from_state(table.state())
    assert isinstance(rebuilt, QuestionFamilyTableDecider) and rebuilt.neighbours == 3
    for budget in (50.0, 120.0, 200.0, 300.0):
        assert torch.equal(rebuilt.decide(unseen, budget), table.decide(unseen, budget))
    assert isinstance(table_from_state(LookupTableDecider(train).state()), LookupTableDecider)
    unlabelled = QuestionFamilyTableDecider(make_data(None, "train", rows=TRAIN_FAMILIES))
    assert not unlabelled.has_families
    assert unlabelled.decide(unseen, 200.0).tolist() == [EXPERTS] * 4  # the global table


def test_the_fallback_table_is_the_question_table_where_families_exist(train):
    from trainer.baselines import QuestionFamilyTableDecider
    from trainer.fallback import fallback_table

    assert isinstance(fallback_table(train), QuestionFamilyTableDecider)
    assert fallback_table(train, "p95").name == "lut_p95"
    unlabelled = make_data(None, "train", rows=TRAIN_FAMILIES)
    assert fallback_table(unlabelled, "family").name == "lut_p95"
    with pytest.raises(ValueError, match="needs the budget grid"):  # auto without labels: clusters
        fallback_table(unlabelled)
    # nine samples are too few to cluster (fewer than two per fold): the global table
    assert fallback_table(unlabelled, "auto", [120.0, 200.0], RewardConfig()).name == "lut_p95"
    with pytest.raises(ValueError, match="fallback table must be one of"):
        fallback_table(train, "median")


def test_auto_prefers_the_question_table_and_the_controller_over_lut_p95(train):
    from trainer.baselines import QuestionFamilyTableDecider
    from trainer.fallback import resolve_prefers

    question = QuestionFamilyTableDecider(with_questions(train, TRAIN_QUESTIONS))
    assert resolve_prefers("auto", question) == "table"
    assert resolve_prefers("auto", LookupTableDecider(train)) == "controller"
    assert resolve_prefers("auto", QuestionFamilyTableDecider(make_data(None, "train", rows=TRAIN_FAMILIES))) == \
        "controller"  # no families: the table is the global one
    assert resolve_prefers("controller", question) == "controller"
    with pytest.raises(ValueError, match="`prefers` must be one of"):
        resolve_prefers("oracle", question)
