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
