"""The per-request cost model (``trainer.request_cost``) and the deciders that read it
(``trainer.request_table``), on hand-built profiles whose latency law is written below."""

from __future__ import annotations

import warnings

import pytest
import torch

from trainer.data import ActionSpace, OfflineData
from trainer.request_cost import RequestCostConfig, RequestScoreTable, cost_quality, fit_request_cost
from trainer.request_table import LatencyClairvoyantDecider, RequestTableDecider

SPACE = ActionSpace(((4, 4, 16), (4, 8, 16), (10, 4, 16), (10, 8, 16)))
C4K4, C4K8, C10K4, C10K8 = range(4)
# the latency law per top-K: fixed + per image array x (crops + 1) + per prompt token + per generated token
LAW = {4: (20.0, 5.0, 0.5, 2.0), 8: (30.0, 6.0, 0.6, 3.0)}
SHORT, LONG = 0, 1  # question clusters: one-word answers (2 tokens) and long ones (8 on average)


def law(crops: torch.Tensor, prompt: torch.Tensor, tokens: torch.Tensor, top_k: int) -> torch.Tensor:
    fixed, image, per_prompt, per_token = LAW[top_k]
    return fixed + image * (crops + 1) + per_prompt * prompt + per_token * tokens


def make_world(n: int, seed: int, *, noise: float = 0.0, crops_at_10: tuple[int, int] = (1, 9),
               split: str = "train", prompts: bool = True) -> OfflineData:
    """``n`` requests: half of each cluster (language features say which); crops at max_crops 4 in 1..4,
    at 10 at least that; prompt 10..60 tokens; answers of SHORT 2 tokens, of LONG 4..12 (noise > 0) or 8.
    Latency by ``LAW`` x a lognormal of sigma ``noise``. Expected score: SHORT 0.8 everywhere; LONG
    0.3 + 0.06 x crops used + 0.1 at top-K 8."""
    g = torch.Generator().manual_seed(seed)
    cluster = torch.arange(n) % 2
    lang = torch.nn.functional.one_hot(cluster, 2).float() + 0.05 * torch.randn(n, 2, generator=g)
    c4 = torch.randint(1, 5, (n,), generator=g).float()
    c10 = torch.maximum(c4, torch.randint(crops_at_10[0], crops_at_10[1], (n,), generator=g).float())
    prompt = torch.randint(10, 61, (n,), generator=g).float()
    crops = torch.stack([c4, c4, c10, c10], 1)
    if noise:
        long_tokens = torch.randint(4, 13, (n, 4), generator=g).float()
    else:
        long_tokens = torch.full((n, 4), 8.0)
    tokens = torch.where(cluster[:, None] == SHORT, 2.0, long_tokens)
    latency = torch.stack([law(crops[:, a], prompt, tokens[:, a], SPACE.actions[a][1]) for a in range(4)], 1)
    if noise:
        latency = latency * torch.exp(noise * torch.randn(n, 4, generator=g))
    top8 = torch.tensor([0.0, 0.1, 0.0, 0.1])
    score = torch.where(cluster[:, None] == SHORT, 0.8, 0.3 + 0.06 * crops + top8[None, :])
    mask = torch.ones(n, 4, dtype=torch.bool)
    return OfflineData(action_space=SPACE, model_fingerprint="f" * 64, dataset=["d"] * n,
                       sample_key=[f"{split}{seed}-{i}" for i in range(n)], example_id=[str(i) for i in range(n)],
                       split=[split] * n, image_features=torch.zeros(n, 3), image_present=torch.ones(n, dtype=bool),
                       lang_features=lang, score=score, mean_score=score, latency_ms=latency.float(),
                       latency_is_sample=mask.clone(), mask=mask, tiling_crops=torch.stack([c4, c10], 1),
                       prompt_tokens=prompt if prompts else None, output_tokens=tokens)


def request(cluster: int, crops_at_4: float, crops_at_10: float, prompt: float) -> tuple[torch.Tensor, ...]:
    lang = torch.nn.functional.one_hot(torch.tensor([cluster]), 2).float()
    return lang, torch.tensor([[crops_at_4, crops_at_10]]), torch.tensor([prompt])


@pytest.fixture(scope="module")
def exact():
    return fit_request_cost(make_world(200, seed=1), RequestCostConfig(clusters=2))


def test_the_fit_recovers_the_latency_law(exact):
    # per top-K group: (fixed, per image array, per prompt token, per generated token), as written in LAW
    assert exact.coef.flatten().tolist() == pytest.approx([*LAW[4], *LAW[8]], rel=1e-3, abs=1e-3)
    assert exact.unmodelled == []


def test_a_requests_prediction_follows_its_crops_prompt_and_cluster(exact):
    lang, tiling, prompt = request(SHORT, 3, 3, 40)
    median, _, basis, extrapolated = exact(lang, tiling, prompt)
    # by hand: 20 + 5*4 + 0.5*40 + 2*2 = 64 at top-K 4; 30 + 6*4 + 0.6*40 + 3*2 = 84 at top-K 8 (the
    # answer length is a shrunk mean of the cluster's: within 0.05 tokens of 2)
    assert median[0].tolist() == pytest.approx([64.0, 84.0, 64.0, 84.0], abs=0.15)
    assert basis.all() and not extrapolated.any()
    # the same crops at max_crops 4 and 10: the same image cost
    parts = exact.parts(lang, tiling, prompt)
    assert float(parts["image"][0, C4K4]) == float(parts["image"][0, C10K4]) == pytest.approx(20.0, abs=1e-3)
    # a long answer: 8 tokens instead of 2 -> + 6 x 2 ms at top-K 4
    long_median, _, _, _ = exact(*request(LONG, 3, 3, 40))
    assert float(long_median[0, C4K4]) == pytest.approx(76.0, abs=0.15)


def test_the_prediction_is_the_sum_of_its_parts():
    # a noisy profile, so that the median and the quantile of the answer length differ
    model = fit_request_cost(make_world(300, seed=11, noise=0.1), RequestCostConfig(clusters=2))
    test = make_world(40, seed=12, split="test")
    test.prompt_tokens[:3] = float("nan")  # read as the profile's median in both
    median, quantile, _, _ = model.predict(test)
    parts = model.parts(test.lang_features, test.tiling_crops, test.prompt_tokens)
    before_decode = parts["fixed"] + parts["image"] + parts["prompt"]
    torch.testing.assert_close(median, before_decode + parts["decode"], rtol=0, atol=1e-4)
    torch.testing.assert_close(quantile, before_decode + parts["decode_high"] + model.conformal_score * median,
                               rtol=0, atol=1e-4)
    assert not torch.equal(parts["answer_tokens"], parts["answer_tokens_high"])


def test_a_long_prompt_raises_the_predicted_prefill(exact):
    short, _, _, _ = exact(*request(SHORT, 2, 6, 40))
    long, _, _, _ = exact(*request(SHORT, 2, 6, 200))
    # 160 more prompt tokens: + 0.5 x 160 at top-K 4, + 0.6 x 160 at top-K 8
    assert (long - short)[0].tolist() == pytest.approx([80.0, 96.0, 80.0, 96.0], abs=0.05)


def test_a_tiling_beyond_the_profile_is_extrapolated_along_the_line_and_flagged(exact):
    # the profile saw at most 8 crops at max_crops 10; 12 crops: 5 x 13 = 65 ms of image cost at top-K 4
    median, _, basis, extrapolated = exact(*request(SHORT, 4, 12, 40))
    assert float(exact.fit_max_crops) == 8.0
    assert float(median[0, C10K4]) == pytest.approx(20 + 65 + 20 + 4, abs=0.15)
    assert extrapolated[0].tolist() == [False, False, True, True] and basis.all()


def test_an_unknown_tiling_is_costed_from_the_configurations_spread():
    train = make_world(200, seed=1)
    model = fit_request_cost(train, RequestCostConfig(clusters=2))
    lang, _, prompt = request(SHORT, 1, 1, 40)
    median, quantile, basis, _ = model(lang, torch.full((1, 2), float("nan")), prompt)
    assert not basis.any()
    expected = torch.quantile(train.latency_ms.double(), torch.tensor([0.5, 0.95], dtype=torch.float64), dim=0)
    assert median[0].tolist() == pytest.approx(expected[0].tolist(), rel=1e-5)
    assert quantile[0].tolist() == pytest.approx(expected[1].tolist(), rel=1e-5)


def test_the_quantile_covers_its_nominal_share_of_unseen_requests():
    model = fit_request_cost(make_world(400, seed=2, noise=0.05), RequestCostConfig(clusters=2, quantile=0.95))
    quality = cost_quality(model, make_world(2000, seed=3, noise=0.05, split="test"))
    assert quality.num_measurements == 8000
    assert 0.93 <= quality.coverage <= 0.97
    assert quality.median_abs_error < 0.05
    # a long, variable answer is held to a wider bound than a one-word one: the noise alone gives
    # about 1 + 1.7 x 0.05; LONG's answers add 2 ms x sd 2.6 tokens to ~71 ms
    ratio = {}
    for cluster in (SHORT, LONG):
        median, quantile, _, _ = model(*request(cluster, 2, 6, 40))
        ratio[cluster] = float(quantile[0, C4K4] / median[0, C4K4])
    assert ratio[SHORT] < 1.10 < ratio[LONG]


def test_a_profile_without_prompt_lengths_names_what_it_could_not_model():
    model = fit_request_cost(make_world(200, seed=1, prompts=False), RequestCostConfig(clusters=2))
    assert model.unmodelled == ["prompt lengths"]
    assert model.coef[:, 2].tolist() == [0.0, 0.0]


def test_lut_by_request_never_pays_for_crops_the_image_does_not_get():
    train = make_world(400, seed=4)
    model = fit_request_cost(train, RequestCostConfig(clusters=2))
    decider = RequestTableDecider(model, RequestScoreTable(train, model))
    test = make_world(200, seed=5, split="test")
    same = test.tiling_crops[:, 0] == test.tiling_crops[:, 1]
    assert 0 < int(same.sum()) < len(test)
    for budget in (80.0, 120.0, 200.0, 1000.0):
        chosen = decider.decide(test, budget)
        crops = torch.tensor([SPACE.actions[a][0] for a in chosen.tolist()])
        assert (crops[same] == 4).all()
    # with room, a LONG question whose image gets more crops at 10 takes them, at top-K 8 (+0.1)
    chosen = decider.decide(test, 1000.0)
    gains = (~same) & (torch.arange(len(test)) % 2 == LONG)
    assert (chosen[gains] == C10K8).all()


def test_lut_by_request_holds_each_request_to_its_own_quantile():
    train = make_world(400, seed=6)
    model = fit_request_cost(train, RequestCostConfig(clusters=2))
    decider = RequestTableDecider(model, RequestScoreTable(train, model))
    test = make_world(50, seed=7, split="test")
    _, quantile, _, _ = model.predict(test)
    for budget in (70.0, 100.0, 150.0):
        chosen = decider.decide(test, budget)
        fits = quantile[torch.arange(len(test)), chosen] <= budget
        nothing_fits = (quantile > budget).all(1)
        assert (fits | nothing_fits).all()
        # where nothing fits: the lowest predicted quantile
        assert (chosen[nothing_fits] == quantile[nothing_fits].argmin(1)).all()


def test_a_request_table_state_with_tensors_loads_as_one_with_plain_values():
    train = make_world(200, seed=4)
    model = fit_request_cost(train, RequestCostConfig(clusters=2))
    decider = RequestTableDecider(model, RequestScoreTable(train, model))
    state = decider.state()
    # the layout runs stored before the state held plain values: the cost model's tensors themselves
    older = {**state, "cost_model": {**state["cost_model"], "state_dict": model.to_state()["state_dict"]}}
    test = make_world(50, seed=5, split="test")
    for budget in (80.0, 200.0):
        want = decider.decide(test, budget)
        assert torch.equal(RequestTableDecider.from_state(older).decide(test, budget), want)
        assert torch.equal(RequestTableDecider.from_state(state).decide(test, budget), want)


def test_latency_clairvoyant_reads_the_measured_latency():
    train = make_world(100, seed=8)
    model = fit_request_cost(train, RequestCostConfig(clusters=2))
    decider = LatencyClairvoyantDecider(RequestScoreTable(train, model))
    test = make_world(2, seed=9, split="test")  # row 1 is a LONG question
    latency = test.latency_ms[1]
    # a budget just at C10K8's measured latency admits it (LONG gains from crops and experts) when 10
    # gives more crops; just below it, the next best measured configuration that fits
    budget = torch.tensor([1e6, float(latency[C10K8])])
    chosen = decider.decide(test, budget)
    assert int(chosen[1]) == (C10K8 if test.tiling_crops[1, 1] > test.tiling_crops[1, 0] else C4K8)
    below = decider.decide(test, torch.tensor([1e6, float(latency[C10K8]) - 0.01]))
    assert int(below[1]) != C10K8


def test_the_model_scripts_and_round_trips(exact):
    lang, tiling, prompt = request(LONG, 2, 7, 33)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is what ctrl export writes
        scripted = torch.jit.script(exact)
    rebuilt = type(exact).from_state(exact.to_state())
    for out in (scripted(lang, tiling, prompt), rebuilt(lang, tiling, prompt)):
        for got, want in zip(out, exact(lang, tiling, prompt)):
            assert torch.equal(got, want)


def test_an_online_guard_reading_the_cost_model_takes_the_prompts_length(exact):
    from controller.latency_guard import LatencyGuard

    # every configuration twice as dear here as in the profile, slack 1.0: the guard's base is the
    # quantile at each configuration x 2
    guard = LatencyGuard(exact, torch.full((4,), 2.0), 1.0, {}, 4, predictor_name="request_cost")
    assert guard.reads_prompt_tokens
    lang, tiling, _ = request(SHORT, 2, 6, 40)
    short = guard.grid(lang[0], tiling[0], 1e6, prompt_tokens=40.0)
    long = guard.grid(lang[0], tiling[0], 1e6, prompt_tokens=200.0)
    # 160 more prompt tokens: + 0.5 x 160 at top-K 4, + 0.6 x 160 at top-K 8 in the profile, twice that here
    assert [long.expected(a) - short.expected(a) for a in SPACE.actions] == pytest.approx(
        [160.0, 192.0, 160.0, 192.0], rel=0.02)
