"""The clairvoyant reference decider, the per-dataset / per-family breakdown of an evaluation,
and a run trained without one dataset (``--holdout-dataset``)."""

from __future__ import annotations

import json
from dataclasses import replace

import polars as pl
import pytest
import torch

from pipeline.errors import CtrlError
from trainer.baselines import ClairvoyantDecider, OracleDecider
from trainer.data import ActionSpace, OfflineData, hold_out_dataset
from trainer.evaluate import GROUP_COLUMNS, evaluate_deciders_by_group
from trainer.reward import RewardConfig

SPACE = ActionSpace(((2, 4, 12), (2, 12, 16), (6, 4, 12)))


def make_data(score, latency, *, mean_score=None, dataset=None, family=None) -> OfflineData:
    score, latency = torch.tensor(score), torch.tensor(latency)
    n = len(score)
    mask = torch.ones(n, len(SPACE), dtype=torch.bool)
    return OfflineData(action_space=SPACE, model_fingerprint="f" * 64, dataset=dataset or ["d"] * n,
                       sample_key=[f"k{i}" for i in range(n)], example_id=[str(i) for i in range(n)],
                       split=["test"] * n, image_features=torch.zeros(n, 2), image_present=torch.zeros(n, dtype=bool),
                       lang_features=torch.zeros(n, 2), score=score, latency_ms=latency,
                       latency_is_sample=mask.clone(), mask=mask,
                       mean_score=None if mean_score is None else torch.tensor(mean_score), family=family)


class Fixed:
    """Decides the given action per sample, whatever the budget."""

    def __init__(self, name: str, actions: list[int]) -> None:
        self.name, self.actions = name, actions

    def decide(self, data, budget_ms):
        return torch.tensor(self.actions)


# -- the clairvoyant choice ------------------------------------------------------------------

def test_clairvoyant_chooses_by_the_expected_score_the_oracle_by_the_outcome():
    data = make_data(score=[[1.0, 0.0, 0.5], [0.0, 1.0, 0.0]],
                     mean_score=[[0.5, 0.75, 0.6], [0.5, 0.5, 0.1]],
                     latency=[[100.0, 150.0, 160.0], [100.0, 150.0, 240.0]])
    # 200 ms: sample 0 fits all three, sample 1 the first two (a tie of 0.5 -> the faster one)
    assert OracleDecider().decide(data, 200.0).tolist() == [0, 1]
    assert ClairvoyantDecider().decide(data, 200.0).tolist() == [1, 0]
    # 155 ms: action 2 (160 ms) no longer fits sample 0
    assert ClairvoyantDecider().decide(data, 155.0).tolist() == [1, 0]
    # nothing fits: the fastest
    assert ClairvoyantDecider().decide(data, 50.0).tolist() == [0, 0]
    # one recorded run per configuration: it is the oracle
    single = replace(data, mean_score=None)
    assert ClairvoyantDecider().decide(single, 200.0).tolist() == OracleDecider().decide(single, 200.0).tolist()


# -- the breakdown ---------------------------------------------------------------------------

def test_breakdown_per_dataset_and_family():
    data = make_data(score=[[1.0, 0.0, 0.5], [0.0, 1.0, 0.0], [0.5, 0.5, 1.0], [0.0, 0.0, 1.0]],
                     latency=[[100.0, 150.0, 160.0], [100.0, 150.0, 240.0], [90.0, 120.0, 300.0],
                              [100.0, 100.0, 100.0]],
                     dataset=["a", "a", "b", "b"], family=["x", None, "x", "y"])
    chosen = Fixed("mine", [2, 1, 2, 0])  # scores 0.5, 1.0, 1.0, 0.0; latencies 160, 150, 300, 100
    frame, groups = evaluate_deciders_by_group(data, [chosen], [200.0], RewardConfig(mode="hard"))
    assert frame["accuracy"].to_list() == [0.625]
    assert groups.columns == list(GROUP_COLUMNS)
    rows = {(r["group_by"], r["group"]): r for r in groups.iter_rows(named=True)}
    assert sorted(rows) == [("dataset", "a"), ("dataset", "b"), ("family", "(none)"), ("family", "x"),
                            ("family", "y")]
    a, b = rows[("dataset", "a")], rows[("dataset", "b")]
    assert (a["num_samples"], a["accuracy"], a["violation_rate"]) == (2, 0.75, 0.0)
    assert (b["num_samples"], b["accuracy"], b["violation_rate"], b["accuracy_within_budget"]) == (2, 0.5, 0.5, 0.0)
    x = rows[("family", "x")]  # samples 0 and 2
    assert (x["num_samples"], x["accuracy"], x["violation_rate"]) == (2, 0.75, 0.5)
    assert json.loads(x["config_histogram"]) == {"6/4/12": 2}
    assert rows[("family", "(none)")]["num_samples"] == 1 and rows[("family", "(none)")]["accuracy"] == 1.0
    assert json.loads(rows[("family", "y")]["config_histogram"]) == {"2/4/12": 1}
    assert a["accuracy_se"] == pytest.approx(0.25)  # std of (0.5, 1.0) / sqrt(2)


def test_breakdown_without_families_has_datasets_only():
    data = make_data(score=[[1.0, 0.0, 0.0]], latency=[[100.0, 100.0, 100.0]])
    _, groups = evaluate_deciders_by_group(data, [Fixed("mine", [0])], [150.0, 250.0], RewardConfig(mode="hard"))
    assert groups.select("group_by", "group", "budget_ms").rows() == [("dataset", "d", 150.0), ("dataset", "d", 250.0)]


# -- a dataset left out ----------------------------------------------------------------------

def test_hold_out_dataset_splits_and_names_the_datasets():
    data = make_data(score=[[1.0, 0.0, 0.0]] * 3, latency=[[100.0, 100.0, 100.0]] * 3, dataset=["a", "b", "a"])
    held, rest = hold_out_dataset(data, "a")
    assert held.sample_key == ["k0", "k2"] and rest.sample_key == ["k1"]
    with pytest.raises(CtrlError, match=r"--holdout-dataset c: the dataset has no samples \(datasets: a, b\)"):
        hold_out_dataset(data, "c")
    with pytest.raises(CtrlError, match="only dataset"):
        hold_out_dataset(hold_out_dataset(data, "a")[0], "a")


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory, embedded_runtime):
    from conftest import build_feature_workspace
    from synthetic import SyntheticSpec

    spec = SyntheticSpec(datasets=("coco_2014_vqa", "text_vqa"), num_samples=40)
    return build_feature_workspace(tmp_path_factory.mktemp("holdout"), embedded_runtime, spec)[1]


def test_a_run_without_one_dataset_is_evaluated_on_it(two_datasets):
    from pipeline.catalog import run_query
    from trainer.config import OfflineTrainConfig
    from trainer.offline import train_offline
    from trainer.runs import RunDir

    result = train_offline(OfflineTrainConfig(workspace=two_datasets.root, holdout_dataset="text_vqa", num_epochs=1,
                                              warm_start_steps=5, cross_fit_folds=2, run_id="no-text"))
    assert RunDir(result.run_dir).read_config()["holdout_dataset"] == "text_vqa"
    # trained on coco's 40 samples only
    run = run_query(two_datasets, "SELECT num_train_samples + num_val_samples + num_test_samples AS n FROM runs")
    assert run["n"].to_pylist() == [40]
    evaluation = result.evaluation
    assert set(evaluation["num_samples"].to_list()) == {40}  # every text_vqa sample, none of coco's
    assert {"controller", "clairvoyant", "lut_p95"} <= set(evaluation["decider"].to_list())
    groups = pl.read_parquet(result.run_dir / "evaluation_groups.parquet")
    assert set(groups.filter(pl.col("group_by") == "dataset")["group"].to_list()) == {"text_vqa"}
    # the view over every run's breakdown
    counts = run_query(two_datasets, "SELECT DISTINCT \"group\" FROM evaluation_groups WHERE group_by = 'dataset'")
    assert counts["group"].to_pylist() == ["text_vqa"]
