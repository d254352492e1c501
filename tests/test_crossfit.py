"""K-fold cross-fitting: folds, out-of-fold decisions, the cross-fitted run and its evaluation."""

from __future__ import annotations

import collections
from dataclasses import replace

import polars as pl
import pytest
import torch
from test_trainer_policy import make_data

from conftest import build_feature_workspace
from pipeline.catalog import run_query
from pipeline.workspace import Workspace
from trainer.config import OfflineTrainConfig
from trainer.crossfit import OutOfFold, deployed_data, fold_data, fold_of, folds_of
from trainer.data import load_offline_data
from trainer.evaluate import evaluate_deciders, evaluate_run
from trainer.offline import train_offline
from trainer.reward import RewardConfig


def test_folds_are_stable_balanced_and_partition_the_samples():
    keys = [f"sample-{i}" for i in range(2000)]
    folds = [fold_of("vqa", k, 5) for k in keys]
    assert folds == [fold_of("vqa", k, 5) for k in keys]  # a hash: the same in every run
    counts = collections.Counter(folds)
    assert sorted(counts) == [0, 1, 2, 3, 4] and min(counts.values()) > 340 and max(counts.values()) < 460


def test_fold_and_deployed_labels():
    data = replace(make_data(n=40), split=["val" if i % 10 == 0 else ("test" if i % 10 == 1 else "train")
                                           for i in range(40)])
    fold = folds_of(data, 4).tolist()
    for k in range(4):
        labelled = fold_data(data, k, 4)
        for i, split in enumerate(labelled.split):
            expected = "test" if fold[i] == k else ("val" if data.split[i] == "val" else "train")
            assert split == expected
    assert deployed_data(data).split == ["val" if s == "val" else "train" for s in data.split]


class Constant:
    """Decides action ``value`` for every sample, and records how many samples it was asked about."""

    def __init__(self, value: int) -> None:
        self.name, self.value, self.seen = f"const{value}", value, []

    def decide(self, data, budget_ms):
        self.seen.append((len(data), torch.as_tensor(budget_ms).clone()))
        return torch.full((len(data),), self.value, dtype=torch.long)


def test_out_of_fold_asks_each_fold_about_its_own_samples_only():
    data = make_data(n=30, full_mask=True)
    fold = torch.tensor([i % 3 for i in range(30)])
    deciders = [Constant(4), Constant(7), Constant(9)]
    oof = OutOfFold("oof", deciders, fold)
    budgets = torch.arange(30, dtype=torch.float32) + 100
    chosen = oof.decide(data, budgets)
    assert chosen.tolist() == [(4, 7, 9)[i % 3] for i in range(30)]
    for k, decider in enumerate(deciders):
        n, seen_budgets = decider.seen[0]
        assert n == 10 and seen_budgets.tolist() == [100.0 + i for i in range(k, 30, 3)]
    with pytest.raises(ValueError, match="built for 30"):
        oof.decide(data.select(list(range(10))), 150.0)


def test_paired_difference_to_the_table_and_standard_errors():
    data = make_data(n=4, full_mask=True)
    data.score[:] = 0.0
    data.score[:, 1] = torch.tensor([1.0, 1.0, 0.0, 0.0])
    data.score[:, 2] = torch.tensor([1.0, 1.0, 1.0, 0.0])

    class Fixed(Constant):
        def __init__(self, name, value):
            super().__init__(value)
            self.name = name

    frame = evaluate_deciders(data, [Fixed("lut_p95", 1), Fixed("mine", 2)], [1000.0], RewardConfig(mode="hard"))
    mine = frame.filter(pl.col("decider") == "mine").row(0, named=True)
    table = frame.filter(pl.col("decider") == "lut_p95").row(0, named=True)
    assert mine["accuracy"] == pytest.approx(0.75) and table["accuracy"] == pytest.approx(0.5)
    # paired differences (0, 0, 1, 0): mean 0.25, sd 0.5, se 0.25
    assert mine["accuracy_vs_table"] == pytest.approx(0.25) and mine["accuracy_vs_table_se"] == pytest.approx(0.25)
    # scores (1, 1, 1, 0): sd 0.5, se 0.25
    assert mine["accuracy_se"] == pytest.approx(0.25)
    assert table["accuracy_vs_table"] == 0.0 and table["accuracy_vs_table_se"] == 0.0


@pytest.fixture(scope="module")
def crossfit_ws(tmp_path_factory, embedded_runtime) -> Workspace:
    return build_feature_workspace(tmp_path_factory.mktemp("crossfit"), embedded_runtime)[1]


def test_cross_fitted_run_scores_every_sample_out_of_fold_and_resumes_a_fold(crossfit_ws):
    ws = crossfit_ws
    config = OfflineTrainConfig(workspace=ws.root, num_epochs=1, batch_size=16, warm_start_steps=10,
                                cross_fit_folds=2, run_id="cf")
    result = train_offline(config)
    data = load_offline_data(ws)
    folds = ws.runs_dir / "cf" / "folds"
    assert sorted(p.name for p in folds.iterdir()) == ["fold-0", "fold-1"]
    for k in range(2):
        held_out = [i for i, f in enumerate(folds_of(data, 2).tolist()) if f == k]
        row = pl.read_parquet(folds / f"fold-{k}" / "run.parquet").row(0, named=True)
        assert row["status"] == "completed"
        assert row["num_test_samples"] == len(held_out)  # fold k's samples were its test split
    # the deployed network learnt from every sample outside the val split
    run = pl.read_parquet(ws.runs_dir / "cf" / "run.parquet").row(0, named=True)
    assert run["num_train_samples"] == sum(s != "val" for s in data.split)
    # the deployed table reads the family from the question and was fitted on every sample (the folds'
    # tables judged it): each configuration counts every sample that recorded it
    from trainer.fallback import read_fallback

    table = read_fallback(result.best_checkpoint).lookup_table()
    assert table.name == "lut_by_question" and set(table.families) == {f for f in data.family if f is not None}
    assert table.global_table.num_samples.tolist() == data.mask.sum(0).tolist()
    frame = result.evaluation
    assert set(frame["num_samples"].to_list()) == {len(data)}
    assert {"controller", "policy", "lut_p95", "oracle"} <= set(frame["decider"].to_list())
    # only the parent run is a run of the workspace
    assert run_query(ws, "SELECT run_id FROM runs").to_pylist() == [{"run_id": "cf"}]
    # evaluating again gives the same numbers (the folds' checkpoints are reloaded)
    assert evaluate_run(ws, "cf").equals(frame)

    # an interrupted fold is trained again on resume; a finished one is kept
    fold0, fold1 = folds / "fold-0" / "checkpoints" / "best.pt", folds / "fold-1" / "metrics.parquet"
    stamp0 = fold0.stat().st_mtime_ns
    fold1.unlink()
    train_offline(OfflineTrainConfig.from_run("cf", ws.root))
    assert fold0.stat().st_mtime_ns == stamp0 and fold1.exists()


def test_one_fold_is_refused():
    with pytest.raises(ValueError, match="cross_fit_folds"):
        OfflineTrainConfig(cross_fit_folds=1)


def test_fallback_rule_on_one_sample_and_at_the_violation_ceiling():
    from trainer.fallback import compare_with_table

    val = make_data(n=1, full_mask=True)
    with pytest.raises(ValueError, match=r"^`val` has no samples: the fallback needs held-out data$"):
        compare_with_table(Constant(0), Constant(1), val.select([]), [100.0], RewardConfig(mode="hard"), {})
    # a 1 ms budget: both deciders violate on the one sample, the table's rate and bound are 1;
    # a ceiling of 1 holds both, and one paired sample has no standard error: the preferred one stays
    for prefers, kept in (("table", False), ("controller", True)):
        fallback = compare_with_table(Constant(0), Constant(1), val, [1.0], RewardConfig(mode="hard"), {},
                                      max_violation_rate=1.0, prefers=prefers)
        assert fallback.table_violation_upper == [1.0] and fallback.controller_violation_rate == [1.0]
        assert fallback.reward_difference_se == [float("inf")] and fallback.use_controller == [kept]


def test_out_of_fold_the_table_is_judged_by_its_violation_rate_in_sample_by_its_bound():
    """One late answer in 25 is a 4 % rate within the 5 % goal, and a one-sided 95 % Wilson bound of
    about 17 %: counted out of fold (no in-sample counts) the table keeps the goal and, preferred,
    answers; counted also on its own samples it is judged by the bound and the controller answers."""
    from test_family_table import CROPS, FAST
    from test_family_table import make_data as family_data

    from trainer.fallback import compare_with_table

    val = family_data(None, "val", rows=["text"] * 24 + ["scene"])  # CROPS runs 160 ms, 240 for the scene row
    rule = {"max_violation_rate": 0.05, "prefers": "table"}
    out_of_fold = compare_with_table(Constant(FAST), Constant(CROPS), val, [200.0], RewardConfig(mode="hard"), {},
                                     **rule)
    assert out_of_fold.table_violation_rate == [pytest.approx(0.04)] and out_of_fold.table_violation_upper[0] > 0.15
    assert out_of_fold.use_controller == [False]
    in_sample = compare_with_table(Constant(FAST), Constant(CROPS), val, [200.0], RewardConfig(mode="hard"), {},
                                   also_count_table_on=val, **rule)
    assert in_sample.table_violation_rate == [pytest.approx(0.04)] and in_sample.use_controller == [True]
