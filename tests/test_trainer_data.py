"""trainer.data / reward / baselines / evaluate on a real generated + ingested + feature-extracted workspace."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import build_feature_workspace, run_ingest
from pipeline import (
    CacheMismatchError,
    CtrlError,
    Workspace,
    build_sample_key,
    run_query,
)
from synthetic import SyntheticSpec
from trainer.baselines import (
    ClairvoyantDecider,
    LargestDecider,
    LookupTableDecider,
    OracleDecider,
    RandomDecider,
)
from trainer.data import (
    ActionSpace,
    OfflineData,
    default_budget_range,
    load_offline_data,
    split_of,
)
from trainer.evaluate import (
    EVALUATION_COLUMNS,
    default_budget_grid,
    evaluate_deciders,
    format_evaluation_table,
    write_evaluation,
)
from trainer.reward import RewardConfig, compute_reward

LOST = (10, 12, 16)  # only the rank-0 shard of this configuration survives (lost merge)
NUM_SAMPLES, EXP6_SAMPLES = 40, 30  # samples 30..39 have exp5 scores only -> config-level latency


@pytest.fixture(scope="module")
def built(tmp_path_factory, embedded_runtime):
    """Generate (2 datasets x 40 samples x 27 configs), ingest and extract features once per module."""
    spec = SyntheticSpec(num_samples=NUM_SAMPLES, exp6_num_samples=EXP6_SAMPLES, lost_merge_configs=(LOST,))
    # small chunks: one chunk can be removed to simulate samples without features
    return build_feature_workspace(tmp_path_factory.mktemp("trainer"), embedded_runtime, spec, chunk_size=16)


@pytest.fixture(scope="module")
def data(built) -> OfflineData:
    return load_offline_data(built[1])


@pytest.fixture(scope="module")
def truth_rows(built, data) -> list[int]:
    """Per data row, the sample's index in the generator's dataset order."""
    tree, _ = built
    index = {(s.dataset, build_sample_key(s.dataset, s.metadata)[0]): s.index for s in tree.samples}
    return [index[(d, k)] for d, k in zip(data.dataset, data.sample_key)]


def copy_workspace(ws: Workspace, dest: Path) -> Workspace:
    shutil.copytree(ws.root, dest)
    return Workspace(dest)


# -- split ------------------------------------------------------------------------------

def test_split_is_deterministic_with_the_requested_fractions():
    keys = [("coco_2014_vqa", f"ex:{i}") for i in range(20000)]
    splits = [split_of(d, k) for d, k in keys]
    assert splits == [split_of(d, k) for d, k in keys]
    share = {s: c / len(keys) for s, c in Counter(splits).items()}
    assert abs(share["train"] - 0.8) < 0.015 and abs(share["val"] - 0.1) < 0.01 and abs(share["test"] - 0.1) < 0.01
    assert split_of("text_vqa", "ex:1", (1.0, 0.0, 0.0)) == "train"
    assert Counter(split_of("a", f"k{i}", (0.0, 0.5, 0.5)) for i in range(1000))["train"] == 0


@pytest.mark.parametrize("fractions", [(0.8, 0.1), (0.8, 0.3, 0.1), (1.2, -0.1, -0.1)])
def test_split_rejects_bad_fractions(fractions):
    with pytest.raises(ValueError, match="fractions"):
        split_of("a", "b", fractions)


def test_loaded_split_is_by_sample_and_disjoint(data):
    ids = list(zip(data.dataset, data.sample_key))
    assert len(set(ids)) == len(ids) == 2 * NUM_SAMPLES  # one row per sample: its configurations cannot cross splits
    assert data.split == [split_of(d, k) for d, k in ids]
    parts = {s: data.subset(s) for s in ("train", "val", "test")}
    assert sum(len(p) for p in parts.values()) == len(data)
    assert set.intersection(*(set(zip(p.dataset, p.sample_key)) for p in parts.values())) == set()
    assert len(parts["train"]) > len(parts["test"]) > 0


# -- action space and loading -------------------------------------------------------------

def test_action_space(data):
    space = data.action_space
    assert len(space) == 27 and list(space.actions) == sorted(space.actions)
    assert space.max_crops_values == (2, 6, 10) and space.top_k_values == (4, 8, 12)
    assert space.num_active_blocks_values == (12, 14, 16)
    idx, values = space.knob_indices(), space.knob_values()
    assert idx.dtype == torch.long and idx.shape == (27, 3) and values.dtype == torch.float32
    assert space.index((6, 8, 14)) == 13 and values[13].tolist() == [6.0, 8.0, 14.0] and idx[13].tolist() == [1, 1, 1]
    assert ActionSpace.from_json(json.loads(json.dumps(space.to_json()))) == space
    with pytest.raises(KeyError, match="not in the action space"):
        space.index((3, 8, 14))
    with pytest.raises(ValueError, match="sorted and unique"):
        ActionSpace(((6, 8, 14), (2, 4, 12)))


def test_mask_scores_and_latencies_equal_the_recorded_groups(built, data, truth_rows):
    _, ws = built
    n, a = len(data), len(data.action_space)
    assert data.score.shape == data.latency_ms.shape == data.mask.shape == data.latency_is_sample.shape == (n, a)
    assert data.lang_features.dtype == data.image_features.dtype == torch.float32
    assert data.image_present.all() and data.mask.any(dim=1).all()
    g = pl.from_arrow(run_query(ws, "SELECT * FROM groups WHERE score IS NOT NULL AND latency_total_ms IS NOT NULL"))
    row = {k: i for i, k in enumerate(zip(data.dataset, data.sample_key))}
    r = torch.tensor([row[k] for k in zip(g["dataset"], g["sample_key"])])
    c = torch.tensor([data.action_space.index(t) for t in zip(g["max_crops"], g["top_k"], g["num_active_blocks"])])
    expected = torch.zeros(n, a, dtype=torch.bool)
    expected[r, c] = True
    assert torch.equal(data.mask, expected)
    assert torch.allclose(data.score[r, c], torch.tensor(g["score"].to_numpy(), dtype=torch.float32))
    assert torch.allclose(data.latency_ms[r, c], torch.tensor(g["latency_total_ms"].to_numpy(), dtype=torch.float32))
    # mean_score: the mean of exp5 and exp6 where both recorded, else the recorded score
    e5, e6 = g["score_exp5"].to_numpy(), g["score_exp6"].to_numpy()
    both = ~np.isnan(e5) & ~np.isnan(e6)
    assert both.any() and (~both).any()  # exp6 covers only part of the samples
    want = np.where(both, (e5 + e6) / 2, g["score"].to_numpy())
    assert torch.allclose(data.mean_score[r, c], torch.tensor(want, dtype=torch.float32))
    assert data.scores("mean") is data.mean_score and data.scores("recorded") is data.score
    assert data.mean_score[~data.mask].isnan().all() or data.latency_ms[~data.mask].isnan().all()
    # NaN (unrecorded) cells compare unequal to themselves: compare with equal_nan
    test_rows = torch.tensor([s == "test" for s in data.split])
    assert torch.allclose(data.subset("test").mean_score, data.mean_score[test_rows], equal_nan=True)
    assert torch.equal(data.latency_is_sample[r, c], torch.tensor((g["latency_source"] == "sample").to_numpy()))
    assert data.score[~data.mask].isnan().all() or data.latency_ms[~data.mask].isnan().all()
    lost = data.action_space.index(LOST)
    assert 0 < int(data.mask[:, lost].sum()) < n  # the lost merge leaves one shard recorded
    assert int((~data.mask).sum()) == n - int(data.mask[:, lost].sum())
    in_exp6 = torch.tensor([i < EXP6_SAMPLES for i in truth_rows])
    assert data.latency_is_sample[in_exp6][data.mask[in_exp6]].all()
    assert not data.latency_is_sample[~in_exp6].any()  # exp5-only samples: the config p50 substitutes, visibly
    lang = run_query(ws, "SELECT dataset, sample_key, feature FROM lang_features").to_pylist()[0]
    i = row[(lang["dataset"], lang["sample_key"])]
    assert torch.allclose(data.lang_features[i], torch.tensor(lang["feature"]))


def test_image_features_are_the_cached_global_crop_features(built, data):
    """Training reads ``global_feature`` (what stage 2 reads in deployment); the all-crops
    ``feature`` only when asked for by name, and the data says which it holds."""
    _, ws = built
    reference = load_offline_data(ws, image_feature="feature")
    assert data.image_feature == "global_feature" and reference.image_feature == "feature"
    assert data.subset("test").image_feature == "global_feature" and reference.select([0]).image_feature == "feature"
    row = {k: i for i, k in enumerate(zip(data.dataset, data.sample_key))}
    cached = run_query(ws, "SELECT dataset, sample_key, feature, global_feature FROM image_features").to_pylist()
    assert {(r["dataset"], r["sample_key"]) for r in cached} == set(row)
    for r in cached:
        i = row[(r["dataset"], r["sample_key"])]
        assert torch.equal(data.image_features[i], torch.tensor(r["global_feature"], dtype=torch.float32))
        assert torch.equal(reference.image_features[i], torch.tensor(r["feature"], dtype=torch.float32))
    assert not torch.allclose(data.image_features, reference.image_features)
    assert torch.equal(reference.mask, data.mask)
    assert torch.equal(reference.score.nan_to_num(-1), data.score.nan_to_num(-1))
    with pytest.raises(ValueError, match="image_feature must be one of"):
        load_offline_data(ws, image_feature="crops")


def test_tiling_crops_are_the_cached_tilings_of_the_action_space(built, data):
    from pipeline.catalog import connect

    con = connect(built[1])
    try:
        rows = con.sql("SELECT dataset, sample_key, max_crops, num_crops FROM image_tilings").fetchall()
    finally:
        con.close()
    cached = {(d, k, c): n for d, k, c, n in rows}
    values = data.action_space.max_crops_values
    assert data.tiling_crops.shape == (len(data), len(values))
    for i in range(len(data)):
        for j, c in enumerate(values):
            want = cached.get((data.dataset[i], data.sample_key[i], c))
            got = float(data.tiling_crops[i, j])
            assert (math.isnan(got) and want is None) or got == want, (data.sample_key[i], c)
    assert (~torch.isnan(data.tiling_crops)).any(-1).sum() == data.image_present.sum()
    torch.testing.assert_close(data.select([1, 0]).tiling_crops[0], data.tiling_crops[1], equal_nan=True)
    empty = data.select([])  # e.g. an empty split of a tiny workspace
    assert len(empty) == 0 and empty.score.shape == (0, data.score.shape[1])


def test_family_is_the_synthetic_question_template(built, data, truth_rows):
    tree, _ = built
    questions = {(s.dataset, s.index): s.metadata["question"] for s in tree.samples}
    # the synthetic templates of coco_2014_vqa and text_vqa, by a phrase of their question
    templates = [("What color is the", "color"), ("How many", "count"), ("Is there a", "presence"),
                 ("holding?", "holding"), ("Where was this picture taken?", "place"), ("What sport is", "sport"),
                 ("What brand is the", "brand"), ("What is written on the", "written_text"),
                 ("What number is on the", "number"), ("What time is shown", "clock_time"),
                 ("What is the title of the book?", "book_title")]
    assert data.family is not None and len(data.family) == len(data)
    for i, index in enumerate(truth_rows):
        question = questions[(data.dataset[i], index)]
        assert data.family[i] == next(family for text, family in templates if text in question), question
    assert data.subset("test").family == [f for f, s in zip(data.family, data.split) if s == "test"]


def test_several_fingerprints_are_refused_until_one_is_chosen(built, tmp_path):
    ws = copy_workspace(built[1], tmp_path / "ws")
    real = next(ws.features_dir.iterdir())
    fake_fp = "f" * 64
    fake = ws.features_dir / fake_fp[:16]
    shutil.copytree(real, fake)
    for path in fake.glob("chunk-*/*.parquet"):  # the same samples "extracted" by another model
        table = pq.read_table(path)
        i = table.schema.get_field_index("model_fingerprint")
        table = table.set_column(i, table.schema.field(i), pa.array([fake_fp] * table.num_rows, type=pa.string()))
        pq.write_table(table, path)
    with pytest.raises(CtrlError, match=r"features of 2 models are cached: .*ffffffff.*\nHint: .*model.fingerprint"):
        load_offline_data(ws)
    assert load_offline_data(ws, model_fingerprint=fake_fp[:16]).model_fingerprint == fake_fp
    assert load_offline_data(ws, model_fingerprint=real.name).model_fingerprint.startswith(real.name)
    with pytest.raises(CacheMismatchError, match="'0123' matches none"):
        load_offline_data(ws, model_fingerprint="0123")


def test_missing_features_are_refused_with_a_hint(built, tmp_path):
    tree, ws = built
    bare = Workspace(tmp_path / "bare")
    assert run_ingest([tree.exp5_dir, tree.exp6_dir], bare).exit_code == 0
    with pytest.raises(CtrlError, match=r"no cached features\nHint: run `ctrl extract-features"):
        load_offline_data(bare)
    partial = copy_workspace(ws, tmp_path / "partial")
    shutil.rmtree(max(next(partial.features_dir.iterdir()).glob("chunk-*")))
    with pytest.raises(CtrlError, match=r"16 of 80 samples have no language features.*\n"
                                        r"Hint: run `ctrl extract-features"):
        load_offline_data(partial)


def test_default_budget_range_rule(data):
    lo, hi = default_budget_range(data)
    train = data.subset("train")
    slowest = torch.where(train.mask, train.latency_ms, -math.inf).max(1).values
    # lo: the smallest per-configuration p98 of the train latencies, rounded up
    p98 = [torch.quantile(train.latency_ms[train.mask[:, j], j].double(), 0.98).item()
           for j in range(len(train.action_space)) if train.mask[:, j].any()]
    assert lo == math.ceil(min(p98)) and lo == int(lo)
    # so one static configuration (a decider without hindsight) violates <= 2 % of train at lo
    fits = [(train.latency_ms[train.mask[:, j], j] <= lo).double().mean().item()
            for j in range(len(train.action_space)) if train.mask[:, j].any()]
    assert max(fits) >= 0.98
    assert (slowest <= hi + 0.5).double().mean() >= 0.94
    grid = default_budget_grid(data, num=5)
    assert grid[0] == lo and grid[-1] == hi and np.allclose(np.diff(grid), (hi - lo) / 4, atol=0.1)
    assert default_budget_grid(data) == [lo + 29.0 * i for i in range(8)]  # 176-379 ms: eight budgets, 29 ms apart
    # budgets are rounded to 0.1 ms: 203 / 6 = 33.83 ms apart
    assert default_budget_grid(data, num=7) == [176.0, 209.8, 243.7, 277.5, 311.3, 345.2, 379.0]


# -- reward -------------------------------------------------------------------------------

def reward_of(score, latency, budget, knobs=(6, 8, 16), **cfg):
    out = compute_reward(torch.tensor(score), torch.tensor(latency), torch.tensor(budget),
                         torch.tensor(knobs, dtype=torch.float32), RewardConfig(**cfg))
    return {k: float(v) for k, v in out.items()}


def test_reward_by_hand():
    complexity = 0.05 * (6 / 12 + 8 / 32 + 16 / 16) / 3
    r = reward_of(1.0, 100.0, 200.0)  # half the budget
    lat_pen = 0.5 / (1 + math.exp(-10 * (100 / (200 + 1e-6) - 1)))
    assert r["acc_term"] == pytest.approx(1.0) and r["lat_pen"] == pytest.approx(lat_pen, rel=1e-5)
    assert r["viol_pen"] == 0 and r["bonus"] == pytest.approx(0.05) and r["complexity"] == pytest.approx(complexity)
    assert r["reward"] == pytest.approx(1.0 - lat_pen - complexity + 0.05, rel=1e-5)
    r = reward_of(0.5, 300.0, 200.0)  # 50 % over the budget
    assert r["lat_pen"] == pytest.approx(0.5 / (1 + math.exp(-5)), rel=1e-5) and r["bonus"] == 0
    assert r["viol_pen"] == pytest.approx(10 * 0.25, rel=1e-5)
    assert r["reward"] == pytest.approx(0.5 - 0.5 / (1 + math.exp(-5)) - 2.5 - complexity, rel=1e-5)
    r = reward_of(1.0, 200.0, 200.0)  # exactly at the budget
    assert r["lat_pen"] == pytest.approx(0.25, rel=1e-4) and r["bonus"] == 0 and r["viol_pen"] == 0


def test_reward_hard_mode_and_parts_sum():
    assert reward_of(0.7, 199.0, 200.0, mode="hard")["reward"] == pytest.approx(0.7)
    hard = reward_of(0.7, 201.0, 200.0, mode="hard", alpha=2.0, hard_violation_reward=-0.5)
    assert hard["reward"] == -0.5 and hard["viol_pen"] == pytest.approx(1.9) and hard["lat_pen"] == hard["bonus"] == 0
    for cfg in ({}, {"mode": "hard"}):
        parts = compute_reward(torch.rand(4, 5), 100 + 300 * torch.rand(4, 5), torch.full((4, 1), 250.0),
                               torch.tensor([[2.0, 4.0, 12.0]]).expand(5, 3), RewardConfig(**cfg))
        assert all(v.shape == (4, 5) for v in parts.values())
        total = parts["acc_term"] - parts["lat_pen"] - parts["viol_pen"] - parts["complexity"] + parts["bonus"]
        assert torch.allclose(total, parts["reward"], atol=1e-6)


def test_hard_mode_is_the_training_default_and_a_violation_pays_minus_one():
    from trainer.config import OfflineTrainConfig

    reward = OfflineTrainConfig().reward
    assert (reward.mode, reward.hard_violation_reward, reward.alpha) == ("hard", -1.0, 1.0)
    assert reward_of(0.0, 250.5, 250.0, mode="hard")["reward"] == -1.0  # worse than a wrong answer in time
    assert reward_of(0.0, 250.0, 250.0, mode="hard")["reward"] == 0.0


def test_reward_edges_zero_budget_float32_and_knob_shape():
    # a zero budget: every answer is late; the guarded division gives the full latency penalty, finite
    r = reward_of(1.0, 100.0, 0.0)
    assert r["lat_pen"] == 0.5 and r["bonus"] == 0 and 1e15 < r["viol_pen"] < float("inf")
    # the guard adds 1e-6 ms to the budget: 10 x (2 / (1 + 1e-6))^2 = 39.99992
    assert reward_of(1.0, 3.0, 1.0)["viol_pen"] == pytest.approx(39.99992, rel=1e-6)
    # float32 whatever the inputs' dtypes
    parts = compute_reward(torch.tensor([1.0], dtype=torch.float64), torch.tensor([120.0], dtype=torch.float64),
                           torch.tensor([200.0], dtype=torch.float64), torch.tensor([2.0, 4.0, 12.0],
                                                                                    dtype=torch.float64),
                           RewardConfig())
    assert {k: v.dtype for k, v in parts.items()} == dict.fromkeys(parts, torch.float32)
    with pytest.raises(ValueError, match=r"^`knob_values` must have shape \(\.\.\., 3\), got \(2,\)$"):
        compute_reward(torch.ones(1), torch.ones(1), 100.0, torch.tensor([2.0, 4.0]), RewardConfig())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"mode": "medium"}, "`mode` must be 'soft' or 'hard', got 'medium'"),
    ({"beta": -0.5}, "`beta` must be a finite number >= 0, got -0.5"),
    ({"gamma": float("nan")}, "`gamma` must be a finite number >= 0"),
    ({"hard_violation_reward": 0.5}, "`hard_violation_reward` must be a finite number <= 0"),
    ({"hard_violation_reward": False}, "`hard_violation_reward` must be a finite number <= 0"),
])
def test_reward_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardConfig(**kwargs)


@given(score=st.floats(0, 1), budget=st.floats(50, 1000), over=st.floats(0, 2), more=st.floats(0, 2),
       mode=st.sampled_from(["soft", "hard"]))
def test_reward_does_not_increase_with_latency_past_the_budget(score, budget, over, more, mode):
    a = budget * (1 + over)
    b = a + budget * more
    r = compute_reward(torch.tensor([score, score], dtype=torch.float64), torch.tensor([a, b], dtype=torch.float64),
                       torch.tensor(budget, dtype=torch.float64), torch.tensor([10.0, 12.0, 16.0]),
                       RewardConfig(mode=mode))["reward"]
    assert r[1] <= r[0] + 1e-6


# -- baselines ------------------------------------------------------------------------------

def all_deciders(train: OfflineData) -> list:
    return [OracleDecider(), ClairvoyantDecider(), LookupTableDecider(train),
            LookupTableDecider(train, statistic="mean", tolerance=0.05), LargestDecider(), RandomDecider(seed=3)]


def test_decisions_always_inside_the_mask(data):
    deciders = all_deciders(data.subset("train"))
    assert [d.name for d in deciders] == ["oracle", "clairvoyant", "lut_p95", "lut_mean5", "largest", "random"]
    for budget in (1.0, 150.0, 220.0, 300.0, 1e6):
        per_sample = torch.linspace(100, 400, len(data))
        for d in deciders:
            for b in (budget, per_sample):
                chosen = d.decide(data, b)
                assert chosen.dtype == torch.long and chosen.shape == (len(data),)
                assert data.mask[torch.arange(len(data)), chosen].all(), d.name
    # nothing fits at 1 ms: every decider with a fallback takes the fastest allowed action
    fastest = torch.where(data.mask, data.latency_ms, math.inf).argmin(1)
    assert torch.equal(OracleDecider().decide(data, 1.0), fastest)


def test_oracle_dominates_on_the_test_split(data):
    train, test = data.subset("train"), data.subset("test")
    budgets = default_budget_grid(data, num=6)
    frame = evaluate_deciders(test, all_deciders(train), budgets, RewardConfig())
    rows = torch.arange(len(test))
    for b in budgets:
        oracle = frame.filter((pl.col("decider") == "oracle") & (pl.col("budget_ms") == b)).row(0, named=True)
        o_choice = OracleDecider().decide(test, b)
        o_in = torch.where(test.latency_ms[rows, o_choice] <= b, test.score[rows, o_choice], 0.0)
        for d in all_deciders(train)[1:]:
            row = frame.filter((pl.col("decider") == d.name) & (pl.col("budget_ms") == b)).row(0, named=True)
            assert oracle["violation_rate"] <= row["violation_rate"], (d.name, b)
            if row["violation_rate"] <= oracle["violation_rate"]:  # equal violation: no better accuracy
                assert oracle["accuracy"] >= row["accuracy"] - 1e-9, (d.name, b)
            choice = d.decide(test, b)  # per sample: the oracle's score within budget is never beaten
            d_in = torch.where(test.latency_ms[rows, choice] <= b, test.score[rows, choice], 0.0)
            assert (o_in >= d_in).all(), (d.name, b)


def test_oracle_matches_the_ground_truth_best_configs(built, data, truth_rows):
    tree, _ = built
    space = data.action_space
    cols = [space.index(c) for c in tree.configs]
    acc = torch.full((len(data), len(space)), float("nan"))
    lat = acc.clone()
    for i, (ds, t) in enumerate(zip(data.dataset, truth_rows)):
        tab = tree.outcome_table(ds)
        acc[i, cols] = torch.tensor(tab["accuracy"][t], dtype=torch.float32)
        lat[i, cols] = torch.tensor(tab["latency_ms"][t], dtype=torch.float32)
    truth = data.clone()
    truth.score, truth.latency_ms, truth.mask = acc, lat, ~acc.isnan()
    # per-sample latency, every config
    recorded = torch.tensor([i < EXP6_SAMPLES for i in truth_rows]) & data.mask.all(1)
    rec = data.select(recorded)
    lo, hi = default_budget_range(data)
    for b in np.linspace(lo, hi, 4):
        best = [tree.best_config(ds, t, float(b)) for ds, t in zip(data.dataset, truth_rows)]
        chosen = OracleDecider().decide(truth, float(b))
        for i, cfg in enumerate(best):  # exact on the expected outcomes
            if cfg is not None:
                assert space.actions[int(chosen[i])] == cfg
        # on the recorded (noisy) outcomes, the hindsight oracle is at least as accurate as
        # the best configuration in expectation, within sampling noise
        expected_best = np.mean([tree.expected_accuracy(ds, t, *cfg) for ds, t, cfg, keep
                                 in zip(data.dataset, truth_rows, best, recorded.tolist()) if keep and cfg is not None])
        picked = OracleDecider().decide(rec, float(b))
        oracle_acc = float(rec.score[torch.arange(len(rec)), picked].mean())
        assert oracle_acc >= expected_best - 0.05, (b, oracle_acc, expected_best)


def test_lookup_table_chooses_on_train_only(data):
    train, test = data.subset("train"), data.subset("test")
    lut = LookupTableDecider(train)
    budgets = [150.0, 200.0, 250.0, 300.0, 400.0]
    before = [lut.decide(test, b) for b in budgets]
    shaken = test.clone()  # other outcomes on the same recorded configurations
    g = torch.Generator().manual_seed(0)
    shaken.score = torch.where(test.mask, torch.rand(test.score.shape, generator=g), test.score)
    shaken.latency_ms = torch.where(test.mask, 50 + 500 * torch.rand(test.score.shape, generator=g), test.latency_ms)
    assert all(torch.equal(x, lut.decide(shaken, b)) for x, b in zip(before, budgets))
    # the table itself: best train mean score among configurations whose train p95 fits
    for b in budgets:
        means, p95s = [], []
        for j in range(len(train.action_space)):
            m = train.mask[:, j]
            means.append(float(train.score[m, j].double().mean()))
            p95s.append(float(np.quantile(train.latency_ms[m, j].double().numpy(), 0.95)))
        fits = [j for j in range(len(means)) if p95s[j] <= b]
        want = max(fits, key=lambda j: (means[j], -p95s[j])) if fits else int(np.argmin(p95s))
        assert lut.lookup(b) == train.action_space.actions[want]
    # the median latency per configuration, which a server calibrates its clock against; kept in the state
    for j in range(len(train.action_space)):
        m = train.mask[:, j]
        assert float(lut.latency_median_ms[j]) == pytest.approx(float(np.median(train.latency_ms[m, j].numpy())),
                                                                rel=1e-6)
    state = lut.state()
    assert LookupTableDecider.from_state(state).latency_median_ms.tolist() == lut.latency_median_ms.tolist()
    del state["latency_median_ms"]  # a state without latency_median_ms
    assert LookupTableDecider.from_state(state).latency_median_ms is None
    mean5 = LookupTableDecider(train, statistic="mean", tolerance=0.05)
    assert mean5.name == "lut_mean5" and mean5.latency_stat_ms[0] == pytest.approx(
        float(train.latency_ms[train.mask[:, 0], 0].double().mean()), rel=1e-5)


def test_largest_and_random(data):
    largest = LargestDecider().decide(data, 200.0)
    actions = data.action_space.actions
    for i, c in enumerate(largest.tolist()):  # the most crops, then top_k, then blocks, among the recorded
        assert actions[c] == max(a for j, a in enumerate(actions) if data.mask[i, j])
    assert Counter(actions[c] for c in largest.tolist()).keys() == {(10, 12, 16), (10, 12, 14)}  # lost merge
    rnd = RandomDecider(seed=1)
    assert torch.equal(rnd.decide(data, 200.0), rnd.decide(data, 300.0))  # reproducible, budget-blind
    probs = rnd.action_probs(data, 200.0)
    assert torch.allclose(probs.sum(1), torch.ones(len(data))) and (probs[~data.mask] == 0).all()


# -- evaluation -----------------------------------------------------------------------------

def test_evaluation_frame_and_files(data, tmp_path):
    train, test = data.subset("train"), data.subset("test")
    deciders = all_deciders(train)
    budgets = default_budget_grid(data, num=3)
    frame = evaluate_deciders(test, deciders, budgets, RewardConfig())
    assert tuple(frame.columns) == EVALUATION_COLUMNS and frame.height == len(deciders) * len(budgets)
    assert frame["decider"].to_list() == [d.name for d in deciders for _ in budgets]
    assert (frame["num_samples"] == len(test)).all()
    assert frame["violation_rate"].is_between(0, 1).all() and frame["accuracy"].is_between(0, 1).all()
    det = frame.filter(pl.col("decider") != "random")
    assert np.allclose(det["expected_reward"].to_numpy(), det["reward_mean"].to_numpy(), atol=1e-9)
    for hist in frame["config_histogram"].to_list():
        counts = json.loads(hist)
        assert sum(counts.values()) == len(test) and all(len(k.split("/")) == 3 for k in counts)
    largest = frame.filter(pl.col("decider") == "largest").row(0, named=True)
    chosen = LargestDecider().decide(test, budgets[0])
    lat = test.latency_ms[torch.arange(len(test)), chosen]
    assert largest["violation_rate"] == pytest.approx(float((lat > budgets[0]).double().mean()))
    score = test.score[torch.arange(len(test)), chosen]
    assert largest["accuracy_within_budget"] == pytest.approx(float(torch.where(lat > budgets[0], 0.0, score).mean()))
    assert (frame["accuracy_within_budget"] <= frame["accuracy"] + 1e-12).all()

    parquet, png = write_evaluation(tmp_path / "20260101-000000-abc123", frame)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    back = pl.read_parquet(parquet)
    assert back["run_id"].unique().to_list() == ["20260101-000000-abc123"] and back.drop("run_id").equals(frame)
    assert format_evaluation_table(frame).row_count == frame.height
    # an evaluation read back and written under another run: one run_id column, the new one
    parquet, _ = write_evaluation(tmp_path / "other-run", back)
    again = pl.read_parquet(parquet)
    assert again.columns == ["run_id", *frame.columns] and again["run_id"].unique().to_list() == ["other-run"]


def test_evaluation_rows_get_the_documented_dtypes_whatever_they_hold():
    from trainer.evaluate import evaluation_frame

    frame = evaluation_frame([{"decider": "table", "budget_ms": 200, "num_samples": 3, "accuracy": 1}])
    assert frame.schema == {"decider": pl.String, "budget_ms": pl.Float64, "num_samples": pl.Int64,
                            "accuracy": pl.Float64, "latency_ms_mean": pl.Float64, "latency_ms_p95": pl.Float64,
                            "violation_rate": pl.Float64, "accuracy_within_budget": pl.Float64,
                            "reward_mean": pl.Float64, "expected_reward": pl.Float64, "config_histogram": pl.String,
                            "accuracy_se": pl.Float64, "accuracy_vs_table": pl.Float64,
                            "accuracy_vs_table_se": pl.Float64}
    assert frame.row(0) == ("table", 200.0, 3, 1.0, *[None] * 10)


def test_evaluation_refuses_decisions_outside_the_mask(data):
    test = data.subset("test")
    lost = data.action_space.index(LOST)
    test = test.select(~test.mask[:, lost]) if (~test.mask[:, lost]).any() else data.select(~data.mask[:, lost])

    class Always:
        name = "always"

        def decide(self, d, budget_ms):
            return torch.full((len(d),), lost)

    with pytest.raises(ValueError, match="outside the mask"):
        evaluate_deciders(test, [Always()], [200.0], RewardConfig())
