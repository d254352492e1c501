"""The outcome model (``trainer.outcome``): per-sample score and latency-quantile predictions that
recover a per-family table from the features alone, and its use as the warm start of training."""

from __future__ import annotations

import pytest
import torch

from trainer.baselines import LookupTableDecider
from trainer.data import ActionSpace, OfflineData
from trainer.outcome import OutcomeConfig, OutcomeDecider, OutcomeModel, fit_outcome_model

SPACE = ActionSpace(((2, 4, 12), (2, 12, 16), (6, 4, 12)))
FAST, EXPERTS, CROPS = 0, 1, 2

# per family: (P(correct), latency ms) of FAST, EXPERTS, CROPS. "text" questions gain from crops,
# "scene" questions from experts, and their large images make crops cost 240 ms.
FAMILIES = {
    "text": ([0.2, 0.3, 0.9], [100.0, 150.0, 160.0]),
    "scene": ([0.5, 0.9, 0.5], [100.0, 150.0, 240.0]),
}
# By hand: at 200 ms a "text" sample fits CROPS (160) -> CROPS; a "scene" sample does not
# (240) -> EXPERTS (0.9). At 300 ms the same (scene's CROPS scores 0.5). At 120 ms only FAST
# fits. At 50 ms nothing fits -> the lowest latency, FAST. The global table (both families
# pooled, no features) holds CROPS at p95 240 ms, so at 200 ms it gives EXPERTS to everyone.


def make_data(families: list[str], split: str, seed: int) -> OfflineData:
    """Samples whose language features say their family (a noisy one-hot); no family labels.
    Scores are 0/1 draws with the family's P(correct); latencies +-5 % noise."""
    g = torch.Generator().manual_seed(seed)
    n = len(families)
    onehot = torch.tensor([[1.0, 0.0] if f == "text" else [0.0, 1.0] for f in families])
    lang = torch.cat([onehot, torch.zeros(n, 2)], 1) + 0.1 * torch.randn(n, 4, generator=g)
    p = torch.tensor([FAMILIES[f][0] for f in families])
    latency = torch.tensor([FAMILIES[f][1] for f in families]) * (1 + 0.05 * (2 * torch.rand(n, 3, generator=g) - 1))
    score = (torch.rand(n, 3, generator=g) < p).float()
    mask = torch.ones(n, 3, dtype=torch.bool)
    return OfflineData(action_space=SPACE, model_fingerprint="f" * 64, dataset=["d"] * n,
                       sample_key=[f"{split}{i}" for i in range(n)], example_id=[str(i) for i in range(n)],
                       split=[split] * n, image_features=torch.zeros(n, 3), image_present=torch.zeros(n, dtype=bool),
                       lang_features=lang, score=score, latency_ms=latency.float(), latency_is_sample=mask.clone(),
                       mask=mask)


@pytest.fixture(scope="module")
def fitted() -> OutcomeModel:
    train = make_data(["text", "scene"] * 100, "train", seed=1)
    val = make_data(["text", "scene"] * 25, "val", seed=2)
    return fit_outcome_model(train, val, OutcomeConfig(seed=0))


def test_predictions_recover_each_familys_scores_and_latency_quantile(fitted):
    test = make_data(["text", "scene"], "test", seed=3)
    score, latency = fitted.predict(test)
    text, scene = 0, 1
    assert score.shape == latency.shape == (2, 3)
    # the best configuration per family is the one the family's P(correct) says
    assert int(score[text].argmax()) == CROPS and int(score[scene].argmax()) == EXPERTS
    assert abs(float(score[text, CROPS]) - 0.9) < 0.12 and abs(float(score[scene, EXPERTS]) - 0.9) < 0.12
    # p95 of latency x (1 +- 5 %): 240 -> ~251 for scene's CROPS, 160 -> ~167 for text's
    assert 225.0 < float(latency[scene, CROPS]) < 265.0
    assert 150.0 < float(latency[text, CROPS]) < 180.0


def test_the_decider_chooses_per_family_where_the_global_table_cannot(fitted):
    decider = OutcomeDecider(fitted)
    test = make_data(["text", "scene", "text", "scene"], "test", seed=4)
    assert decider.name == "outcome"
    assert decider.decide(test, 200.0).tolist() == [CROPS, EXPERTS, CROPS, EXPERTS]
    assert decider.decide(test, 300.0).tolist() == [CROPS, EXPERTS, CROPS, EXPERTS]
    assert decider.decide(test, 120.0).tolist() == [FAST] * 4
    assert decider.decide(test, 50.0).tolist() == [FAST] * 4  # nothing fits: the fastest predicted
    table = LookupTableDecider(make_data(["text", "scene"] * 100, "train", seed=1))
    assert table.decide(test, 200.0).tolist() == [EXPERTS] * 4
    # per-sample budgets
    assert decider.decide(test, torch.tensor([200.0, 200.0, 120.0, 300.0])).tolist() == [CROPS, EXPERTS, FAST, EXPERTS]


def test_the_decider_stays_inside_each_samples_recorded_configurations(fitted):
    test = make_data(["text", "scene"], "test", seed=5)
    test.mask[0, CROPS] = False  # the text sample has no CROPS record: its next best that fits
    assert OutcomeDecider(fitted).decide(test, 200.0).tolist() == [EXPERTS, EXPERTS]
    test.mask[1, FAST] = False  # nothing fits 50 ms: the fastest of the scene sample's records
    assert OutcomeDecider(fitted).decide(test, 50.0).tolist() == [FAST, EXPERTS]


def test_save_and_load_give_the_same_predictions(fitted, tmp_path):
    test = make_data(["text", "scene"] * 3, "test", seed=6)
    loaded = OutcomeModel.load(fitted.save(tmp_path / "outcome.pt"))
    for a, b in zip(fitted.predict(test), loaded.predict(test)):
        assert torch.equal(a, b)
    assert loaded.config == fitted.config and loaded.action_space == SPACE


def test_fitting_is_deterministic_for_a_seed():
    train = make_data(["text", "scene"] * 20, "train", seed=1)
    val = make_data(["text", "scene"] * 5, "val", seed=2)
    a, b = (fit_outcome_model(train, val, OutcomeConfig(seed=3, max_epochs=5)) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="`quantile` must be in"):
        OutcomeConfig(quantile=1.0)
    with pytest.raises(ValueError, match="`patience` must be an integer"):
        OutcomeConfig(patience=0)
    from trainer.config import OfflineTrainConfig

    with pytest.raises(ValueError, match="warm_start_target"):
        OfflineTrainConfig(workspace=".", warm_start_target="oracle")
    with pytest.raises(ValueError, match="outcome_quantile"):
        OfflineTrainConfig(workspace=".", outcome_quantile=0.0)


def make_sized_data(large: list[bool], split: str, seed: int) -> OfflineData:
    """"text" samples whose features say nothing; a large image tiles into 6 crops at max_crops 6
    (2 small) and makes CROPS cost 240 ms instead of 160 ms: only the tiling tells them apart."""
    data = make_data(["text"] * len(large), split, seed)
    big = torch.tensor(large)
    data.latency_ms[:, CROPS] = torch.where(big, 240.0, 160.0) * (data.latency_ms[:, CROPS] / 160.0)
    data.tiling_crops = torch.stack([torch.full((len(large),), 2.0), torch.where(big, 6.0, 2.0)], 1)
    return data


def test_the_image_tiling_tells_the_crops_cost_apart():
    train = make_sized_data([True, False] * 100, "train", seed=1)
    val = make_sized_data([True, False] * 25, "val", seed=2)
    test = make_sized_data([True, False, True, False], "test", seed=3)
    with_tilings = OutcomeDecider(fit_outcome_model(train, val, OutcomeConfig(seed=0)))
    # at 200 ms a small image fits CROPS (0.9); a large one does not: EXPERTS (0.3) beats FAST (0.2)
    assert with_tilings.decide(test, 200.0).tolist() == [EXPERTS, CROPS, EXPERTS, CROPS]
    blind = OutcomeDecider(fit_outcome_model(train, val, OutcomeConfig(seed=0, use_tilings=False)))
    assert len(set(blind.decide(test, 200.0).tolist())) == 1  # the same choice for every image
    unknown = make_sized_data([True, False], "test", seed=4)
    unknown.tiling_crops[0] = float("nan")  # no readable image: the training mean, not an error
    assert with_tilings.decide(unknown, 200.0)[1] == CROPS
    unknown.tiling_crops = None
    assert with_tilings.decide(unknown, 50.0).tolist() == [FAST, FAST]


def test_a_model_saved_before_tilings_were_read_still_loads(tmp_path):
    train = make_data(["text", "scene"] * 20, "train", seed=1)
    val = make_data(["text", "scene"] * 5, "val", seed=2)
    model = fit_outcome_model(train, val, OutcomeConfig(seed=0, max_epochs=3, use_tilings=False))
    state = torch.load(model.save(tmp_path / "outcome.pt"), weights_only=True)
    del state["config"]["use_tilings"]  # the key older runs lack
    torch.save(state, tmp_path / "old.pt")
    loaded = OutcomeModel.load(tmp_path / "old.pt")
    assert loaded.config.use_tilings is False
    test = make_data(["text", "scene"], "test", seed=3)
    assert torch.equal(loaded.predict(test)[1], model.predict(test)[1])


def make_spread_data(families: list[str], split: str, seed: int) -> OfflineData:
    """"text" and "scene" features, the same scores and median latencies for both, but the
    latency noise is +-1 % for "text" and +-20 % for "scene"."""
    data = make_data(families, split, seed)
    g = torch.Generator().manual_seed(seed + 100)
    width = torch.tensor([0.01 if f == "text" else 0.20 for f in families])[:, None]
    noise = 1 + width * (2 * torch.rand(len(families), 3, generator=g) - 1)
    data.latency_ms = (torch.tensor([100.0, 150.0, 160.0]) * noise).float()
    data.score = (torch.rand(len(families), 3, generator=g) < torch.tensor([0.3, 0.9, 0.5])).float()
    return data


def test_neighbour_latency_holds_each_question_type_to_its_own_spread(tmp_path):
    train = make_spread_data(["text", "scene"] * 150, "train", seed=1)
    val = make_spread_data(["text", "scene"] * 25, "val", seed=2)
    test = make_spread_data(["text", "scene"], "test", seed=3)
    model = fit_outcome_model(train, val, OutcomeConfig(seed=0, latency_neighbours=30))
    _, latency = model.predict(test)
    # the p95 of 150 ms +-1 % is 151.4 ms, of 150 ms +-20 % is 177 ms
    assert 149.0 < float(latency[0, EXPERTS]) < 154.0
    assert 168.0 < float(latency[1, EXPERTS]) < 186.0
    # at 155 ms the tight question keeps EXPERTS (0.9); the spread one falls back to FAST
    assert OutcomeDecider(model).decide(test, 155.0).tolist() == [EXPERTS, FAST]
    loaded = OutcomeModel.load(model.save(tmp_path / "outcome.pt"))
    assert torch.equal(loaded.predict(test)[1], latency) and loaded.config.latency_neighbours == 30
    with pytest.raises(ValueError, match="`latency_neighbours` must be an integer >= 0"):
        OutcomeConfig(latency_neighbours=-1)
