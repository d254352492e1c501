"""Controller policy, GRPO loss, offline training runs and prediction."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import build_feature_workspace
from pipeline import CacheMismatchError, CtrlError, Workspace
from trainer.config import OfflineTrainConfig
from trainer.constraint import ViolationConstraint
from trainer.data import ActionSpace, OfflineData
from trainer.fallback import PolicyDecider
from trainer.grpo import (
    GroupSamples,
    exact_kl,
    group_advantages,
    grpo_objective,
    pairwise_objective,
    policy_loss,
    sample_groups,
)
from trainer.offline import train_offline
from trainer.policy import CHECKPOINT_FORMAT, ControllerPolicy, PolicyConfig, expected_reward
from trainer.reward import RewardConfig, compute_reward

ACTIONS = tuple(itertools.product((2, 6, 10), (4, 8, 12), (12, 14, 16)))  # the full 27-configuration product
DIM = 8


def make_data(n: int = 12, seed: int = 0, full_mask: bool = False) -> OfflineData:
    """Random features and outcomes; a few configurations unrecorded per sample unless full_mask."""
    g = torch.Generator().manual_seed(seed)
    space = ActionSpace(ACTIONS)
    knobs = space.knob_values()
    latency = ((100 + 10 * knobs[:, 0] + 5 * knobs[:, 1] + 3 * knobs[:, 2])[None, :]
               * (0.8 + 0.4 * torch.rand(n, 1, generator=g)))
    score = (torch.rand(n, len(space), generator=g) < 0.3 + knobs[:, 0] / 20).float()
    mask = torch.ones(n, len(space), dtype=torch.bool) if full_mask else torch.rand(n, len(space), generator=g) > 0.3
    mask[:, 0] = True  # every sample keeps at least one configuration
    present = torch.arange(n) % 4 != 0
    image = torch.randn(n, DIM, generator=g) * present[:, None]
    return OfflineData(action_space=space, model_fingerprint="f" * 64, dataset=["d"] * n,
                       sample_key=[f"k{i}" for i in range(n)], example_id=[str(i) for i in range(n)],
                       split=["train"] * n, image_features=image, image_present=present,
                       lang_features=torch.randn(n, DIM, generator=g), score=torch.where(mask, score, float("nan")),
                       latency_ms=torch.where(mask, latency, float("nan")), latency_is_sample=mask.clone(), mask=mask)


def make_policy(data: OfflineData, seed: int = 0, use_tilings: bool = False) -> ControllerPolicy:
    torch.manual_seed(seed)
    config = PolicyConfig(lang_feature_dim=DIM, image_feature_dim=DIM, budget_min_ms=150.0, budget_max_ms=350.0,
                          hidden_dim=32, use_tilings=use_tilings)
    policy = ControllerPolicy(config, data.action_space, data.model_fingerprint)
    with torch.no_grad():  # a non-uniform policy, so that the checks below are not trivially true
        for p in policy.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return policy.eval()


def inputs(data: OfflineData) -> tuple:
    return data.image_features, data.image_present, data.lang_features


# -- the policy --------------------------------------------------------------------------------

def test_masked_probabilities_sum_to_one_and_vanish_outside_the_mask():
    data = make_data()
    policy = make_policy(data)
    budgets = torch.linspace(100, 400, len(data))
    lp = policy.log_probs(*inputs(data), budgets, data.mask)
    probs = lp.exp()
    assert lp.shape == (len(data), len(ACTIONS))
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(data)))
    assert (probs[~data.mask] == 0).all() and torch.isneginf(lp[~data.mask]).all()
    assert (probs[data.mask] > 0).all()
    chosen = PolicyDecider(policy).decide(data, budgets)
    assert data.mask[torch.arange(len(data)), chosen].all()


def test_budgets_beyond_the_training_range_read_as_its_ends():
    from trainer.warm_start import build_policy

    data = make_data()
    policy = build_policy(OfflineTrainConfig(budget_min_ms=150.0, budget_max_ms=350.0), data)
    # by default the encoder spans exactly the training range, no margin
    assert (policy.config.budget_min_ms, policy.config.budget_max_ms) == (150.0, 350.0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5 * torch.randn_like(p))
    policy.eval()

    def probs(budget: float) -> torch.Tensor:
        return policy.log_probs(*inputs(data), budget, data.mask).exp()

    torch.testing.assert_close(probs(351.0), probs(350.0))
    torch.testing.assert_close(probs(5000.0), probs(350.0))
    torch.testing.assert_close(probs(20.0), probs(150.0))
    assert not torch.allclose(probs(340.0), probs(350.0))  # inside the range budgets still differ
    widened = build_policy(OfflineTrainConfig(budget_min_ms=150.0, budget_max_ms=350.0, budget_margin=0.1), data)
    assert (widened.config.budget_min_ms, widened.config.budget_max_ms) == (130.0, 370.0)


def test_empty_mask_row_is_refused():
    data = make_data(n=3)
    mask = data.mask.clone()
    mask[1] = False
    with pytest.raises(CtrlError, match="empty action mask"):
        make_policy(data).log_probs(*inputs(data), 200.0, mask)


def test_stage1_does_not_read_image_features():
    data = make_data(full_mask=True)
    policy = make_policy(data)
    image, present, lang = inputs(data)
    other_image, other_present = torch.randn_like(image) * 10, ~present

    def crops_marginal(img, pres):
        probs = policy.log_probs(img, pres, lang, 250.0, data.mask).exp()
        crops = policy.knob_indices[:, 0]
        return torch.zeros(len(data), 3).index_add_(1, crops, probs)

    torch.testing.assert_close(crops_marginal(image, present), crops_marginal(other_image, other_present))
    torch.testing.assert_close(crops_marginal(image, present), policy.crops_log_probs(lang, 250.0).exp())
    # ... while stage 2 does read them (otherwise the check above would be vacuous)
    joint_a = policy.log_probs(image, present, lang, 250.0, data.mask)
    joint_b = policy.log_probs(other_image, other_present, lang, 250.0, data.mask)
    assert not torch.allclose(joint_a, joint_b)
    # and the budget moves stage 1
    assert not torch.allclose(policy.crops_log_probs(lang, 160.0), policy.crops_log_probs(lang, 340.0))


def tilings(n: int, seed: int = 1) -> torch.Tensor:
    """Plausible crops per max_crops value (2, 6, 10): one row per sample, a few unknown."""
    g = torch.Generator().manual_seed(seed)
    t = torch.stack([torch.randint(1, 3, (n,), generator=g), torch.randint(3, 7, (n,), generator=g),
                     torch.randint(6, 11, (n,), generator=g)], dim=1).float()
    t[0] = float("nan")
    return t


def test_tilings_move_both_stages_only_when_enabled():
    data = make_data(full_mask=True)
    image, present, lang = inputs(data)
    t = tilings(len(data))
    policy = make_policy(data, use_tilings=True)
    policy.set_feature_normalization(image, present, lang, t)
    assert torch.isfinite(policy.tiling_mean).all() and (policy.tiling_std > 0).all()
    other = t.flip(0)
    other[0] = float("nan")
    # stage 1 reads the tilings (it may: they come from the image size, before the vision tower) ...
    assert not torch.allclose(policy.crops_log_probs(lang, 250.0, tiling_crops=t),
                              policy.crops_log_probs(lang, 250.0, tiling_crops=other))
    # ... and so does stage 2, for a fixed crops choice
    _, lang_h, budget_h = policy.stage1(lang, 250.0, tiling_crops=t)
    h_a = policy.stage2_hidden(image, present, lang_h, budget_h, tiling_crops=t)
    h_b = policy.stage2_hidden(image, present, lang_h, budget_h, tiling_crops=other)
    assert h_a.shape == (len(data), 3, 32) and not torch.allclose(h_a[1:], h_b[1:])
    # unknown (NaN) rows and None read the same: the training mean
    all_nan = torch.full_like(t, float("nan"))
    torch.testing.assert_close(policy.log_probs(image, present, lang, 250.0, tiling_crops=all_nan),
                               policy.log_probs(image, present, lang, 250.0))
    torch.testing.assert_close(h_a[0], policy.stage2_hidden(image, present, lang_h, budget_h)[0])
    with pytest.raises(ValueError, match=r"tiling_crops must have shape \(12, 3\)"):
        policy.log_probs(image, present, lang, 250.0, tiling_crops=t[:, :2])
    # a policy without tiling inputs ignores them entirely
    plain = make_policy(data)
    torch.testing.assert_close(plain.log_probs(image, present, lang, 250.0, tiling_crops=t),
                               plain.log_probs(image, present, lang, 250.0))
    # OfflineData carries them (and data_log_probs passes them on)
    data.tiling_crops = t
    torch.testing.assert_close(PolicyDecider(policy).action_probs(data, 250.0),
                               policy.log_probs(image, present, lang, 250.0, data.mask, tiling_crops=t).exp())


def test_old_checkpoint_format_is_refused_with_a_hint(tmp_path):
    """Format 2 and older read the all-crops image feature in stage 2, which a server cannot have."""
    data = make_data()
    path = make_policy(data).save(tmp_path / "p.pt")
    payload = torch.load(path, weights_only=True)
    assert CHECKPOINT_FORMAT == 3
    old = {k: v for k, v in payload.items() if k != "image_feature"}
    old["config"] = {k: v for k, v in payload["config"].items() if k != "image_feature"}
    torch.save({**old, "format": 2}, tmp_path / "old.pt")
    with pytest.raises(CtrlError, match=r"checkpoint format 2, this ctrl reads format 3 \(its stage 2 read the "
                                        r"all-crops image feature, which a server does not have\)\nHint: "
                                        r".*train a new run with `ctrl train --offline`\.$"):
        ControllerPolicy.load(tmp_path / "old.pt")
    torch.save({**payload, "format": 4}, tmp_path / "newer.pt")
    with pytest.raises(CtrlError, match=r"checkpoint format 4, this ctrl reads format 3\nHint: "):
        ControllerPolicy.load(tmp_path / "newer.pt")


def test_the_checkpoint_records_the_image_feature_and_data_of_another_is_refused(tmp_path):
    from dataclasses import replace

    from trainer.policy import data_log_probs

    data = make_data()
    policy = make_policy(data)
    assert policy.config.image_feature == "global_feature" and data.image_feature == "global_feature"
    path = policy.save(tmp_path / "p.pt")
    payload = torch.load(path, weights_only=True)
    assert payload["image_feature"] == payload["config"]["image_feature"] == "global_feature"
    assert ControllerPolicy.load(path).config.image_feature == "global_feature"
    reference = replace(data, image_feature="feature")  # the all-crops feature, loaded for a comparison
    for decide in (lambda: data_log_probs(policy, reference, 200.0),
                   lambda: PolicyDecider(policy).decide(reference, 200.0)):
        with pytest.raises(CacheMismatchError, match=r"^(policy|controller): trained on the image feature "
                                                     r"'global_feature', but the data holds 'feature'\nHint: "):
            decide()
    with pytest.raises(ValueError, match="`image_feature` must be one of"):
        replace(policy.config, image_feature="crops")
    with pytest.raises(ValueError, match="`image_feature` must be one of"):
        replace(data, image_feature="crops")


def test_violation_constraint_interpolates_and_ascends():
    c = ViolationConstraint([100.0, 200.0, 300.0], target=0.05, lr=2.0, max_value=1.0)
    w = c.weights(torch.tensor([100.0, 150.0, 275.0, 50.0, 400.0]))
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.25, 0.75],
                                                [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64))
    # violations only at the low budget: its multiplier rises, the others stay at 0 (clipped below)
    c.update(torch.tensor([100.0, 300.0]), torch.tensor([0.30, 0.0]))
    torch.testing.assert_close(c.values, torch.tensor([0.5, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(c.penalty(torch.tensor([100.0, 150.0, 300.0])), torch.tensor([0.5, 0.25, 0.0]))
    for _ in range(5):  # capped at max_value
        c.update(torch.tensor([100.0]), torch.tensor([0.30]))
    assert float(c.values[0]) == 1.0
    c.update(torch.tensor([100.0]), torch.tensor([0.0]))  # below the target: it falls again
    assert float(c.values[0]) == pytest.approx(0.9)
    off = ViolationConstraint([100.0, 200.0], target=None)
    off.update(torch.tensor([100.0]), torch.tensor([1.0]))
    assert not off.values.any()


def test_checkpoint_round_trip_and_fingerprint_refusal(tmp_path):
    data = make_data()
    policy = make_policy(data)
    path = policy.save(tmp_path / "p.pt")
    loaded = ControllerPolicy.load(path, model_fingerprint=data.model_fingerprint)
    torch.testing.assert_close(loaded.log_probs(*inputs(data), 220.0, data.mask),
                               policy.log_probs(*inputs(data), 220.0, data.mask))
    assert loaded.action_space == data.action_space and loaded.config == policy.config
    with pytest.raises(CacheMismatchError, match="trained on features of model ffffffffffffffff"):
        ControllerPolicy.load(path, model_fingerprint="0" * 64)
    with pytest.raises(CacheMismatchError, match="do not fit this policy"):
        loaded.log_probs(torch.zeros(2, DIM + 1), torch.ones(2, dtype=torch.bool), torch.zeros(2, DIM), 200.0)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CtrlError, match="not a ctrl checkpoint"):
        ControllerPolicy.load(tmp_path / "junk.pt")


def test_expected_reward_is_the_exact_sum():
    data = make_data()
    policy = make_policy(data)
    reward = RewardConfig()
    budgets = [180.0, 300.0]
    got = expected_reward(policy, data, budgets, reward)
    want = 0.0
    for b in budgets:
        probs = policy.log_probs(*inputs(data), b, data.mask).exp().detach()
        r = compute_reward(data.score, data.latency_ms, b, data.action_space.knob_values()[None], reward)["reward"]
        want += float(sum(probs[i, a] * r[i, a] for i in range(len(data)) for a in range(len(ACTIONS))
                          if data.mask[i, a]))
    assert got == pytest.approx(want / (len(budgets) * len(data)), rel=1e-5)


# -- the loss ------------------------------------------------------------------------------------

@given(st.lists(st.lists(st.floats(-10, 10, allow_nan=False), min_size=5, max_size=5), min_size=1, max_size=20),
       st.sampled_from(["group", "batch", "none"]))
def test_group_advantages_sum_to_zero(rows, scale):
    rewards = torch.tensor(rows, dtype=torch.float32)
    advantages, valid = group_advantages(rewards, scale)
    assert advantages.shape == rewards.shape
    assert torch.allclose(advantages.sum(1), torch.zeros(len(rows)),
                          atol=1e-3 * max(1.0, float(advantages.abs().max())))
    assert (advantages[~valid] == 0).all()


def test_zero_variance_groups_are_dropped_and_counted():
    data = make_data(full_mask=True)
    policy = make_policy(data).train()
    index = torch.tensor([0, 1, 2, 3])
    budgets = torch.full((4,), 250.0)
    actions = torch.tensor([[0, 1, 2, 3, 4], [5, 5, 5, 5, 5], [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]])
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.2, 0.1], [0.3] * 5, [0.7] * 5, [0.0, 1.0, 0.0, 1.0, 1.0]])
    parts = {"reward": rewards}
    groups = GroupSamples(index, budgets, actions, torch.zeros(4, 5), rewards, parts)
    out = policy_loss(policy, data, groups, scale_rewards="group")
    assert out.num_groups == 4 and out.num_zero_variance_groups == 2
    lp = policy.log_probs(*(t[index] for t in inputs(data)), budgets, data.mask[index]).gather(1, actions)
    adv = (rewards - rewards.mean(1, keepdim=True)) / rewards.std(1, keepdim=True)
    want = -(adv[[0, 3]] * lp[[0, 3]]).mean()  # only the two groups with variance, averaged over their members
    torch.testing.assert_close(out.loss, want)
    all_flat = GroupSamples(index, budgets, actions, torch.zeros(4, 5), torch.ones(4, 5), {"reward": torch.ones(4, 5)})
    out = policy_loss(policy, data, all_flat)
    assert out.num_zero_variance_groups == 4 and out.loss.item() == 0.0
    out.loss.backward()  # no signal is a zero gradient, not an error


def test_pairwise_loss_on_a_hand_example():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]], requires_grad=True)
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.4, 0.4, 0.4]])  # row 2: all tied, no pair counts
    loss, valid = pairwise_objective(lp, rewards)
    nls = lambda x: -math.log(1 / (1 + math.exp(-x)))  # noqa: E731
    # pairs of row 1: (0,1) r0 > r1 -> -logsig(lp0 - lp1); (1,2) r1 < r2 -> -logsig(lp2 - lp1); (0,2) tied: skipped
    want = (nls(-1.0 - -2.0) + nls(-0.5 - -2.0)) / 2
    assert valid.tolist() == [True, False]
    assert loss.item() == pytest.approx(want, rel=1e-6)
    # groups are rows: their order never mixes members of different groups (origin defect D21, docs/origin_format.md §9)
    loss_swapped, _ = pairwise_objective(lp.flip(0), rewards.flip(0))
    assert loss_swapped.item() == pytest.approx(want, rel=1e-6)


def test_clipped_ratio_matches_plain_loss_on_policy_and_kl():
    lp = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.2, 0.2]])).requires_grad_(True)
    adv, valid = group_advantages(torch.tensor([[1.0, 0.0, 0.5, 0.2, 0.1]]), "group")
    plain, _ = grpo_objective(lp, adv, valid)
    (g_plain,) = torch.autograd.grad(plain, lp)
    clipped, ratio = grpo_objective(lp, adv, valid, lp.detach(), clip_epsilon=0.2)
    (g_clip,) = torch.autograd.grad(clipped, lp)
    torch.testing.assert_close(g_plain, g_clip)  # at ratio 1 the surrogate has the plain gradient
    assert ratio == 0.0
    _, ratio = grpo_objective(lp, adv, valid, lp.detach() - 1.0, clip_epsilon=0.2)  # rho = e: clipped where A > 0
    assert ratio == pytest.approx(float((adv > 0).float().mean()))
    p = torch.log(torch.tensor([[0.5, 0.5, 0.0]]))
    q = torch.log(torch.tensor([[0.25, 0.75, 0.0]]))
    assert float(exact_kl(p, p)) == 0.0
    assert float(exact_kl(p, q)) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75), rel=1e-5)


def test_sampled_groups_report_violations_exactly():
    data = make_data(n=6)
    policy = make_policy(data)
    index, budgets = torch.arange(6), torch.full((6,), 220.0)
    groups = sample_groups(policy, data, index, budgets, 4, RewardConfig(mode="hard"), torch.Generator().manual_seed(0))
    over = data.latency_ms > 220.0
    torch.testing.assert_close(groups.violated, over.gather(1, groups.actions))
    probs = policy.log_probs(*inputs(data), 220.0, data.mask).exp()
    torch.testing.assert_close(groups.expected_violation, (probs * over).sum(-1))


def test_sampled_groups_are_judged_by_the_latencies_given():
    data = make_data(n=6, full_mask=True)
    policy = make_policy(data)
    index, budgets = torch.arange(6), torch.full((6,), 220.0)
    # every configuration of even samples 300 ms, of odd samples 100 ms, whatever was recorded
    latency = torch.where(index[:, None] % 2 == 0, 300.0, 100.0).expand(6, len(data.action_space)).clone()
    groups = sample_groups(policy, data, index, budgets, 4, RewardConfig(mode="hard"),
                           torch.Generator().manual_seed(0), latency_ms=latency)
    assert groups.violated.tolist() == [[True] * 4, [False] * 4] * 3
    assert groups.expected_violation.tolist() == pytest.approx([1.0, 0.0] * 3)
    # hard reward: -1 where late, the score where in time
    scores = data.score[index[:, None], groups.actions]
    expected = torch.where(torch.tensor([[True], [False]] * 3), -1.0, scores)
    torch.testing.assert_close(groups.rewards, expected)


def test_training_jitters_the_recorded_latencies(tmp_path):
    from trainer.offline import OfflineTrainer

    data = make_data(n=24, full_mask=True)
    data.split = ["train"] * 16 + ["val"] * 4 + ["test"] * 4
    trainer = OfflineTrainer(OfflineTrainConfig(workspace=tmp_path, num_epochs=1, warm_start_steps=0, batch_size=4,
                                                cross_fit_folds=0, budget_min_ms=150.0, budget_max_ms=350.0,
                                                latency_jitter=0.05, seed=1), data=data)
    seen = []

    def record(*args, latency_ms=None, **kwargs):
        seen.append(latency_ms)
        return real(*args, latency_ms=latency_ms, **kwargs)

    import trainer.offline as offline

    real = offline.sample_groups
    trainer.policy = make_policy(trainer.train_split)
    trainer._optimisation()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(offline, "sample_groups", record)
        trainer.step(torch.arange(4), torch.full((4,), 250.0))
        trainer.config.latency_jitter = 0.0
        trainer.step(torch.arange(4), torch.full((4,), 250.0))
    recorded = trainer.train_split.latency_ms[:4]
    ratio = (seen[0] / recorded).log()
    # one lognormal factor per (sample, configuration): spread about 0.05, never all the same
    assert 0.02 < float(ratio.std()) < 0.1 and len(set(ratio.flatten().tolist())) == ratio.numel()
    assert torch.equal(seen[1], recorded)  # 0 turns it off


def test_sampled_groups_stay_inside_the_mask():
    data = make_data(n=20)
    policy = make_policy(data)
    g = torch.Generator().manual_seed(0)
    index = torch.arange(20).repeat_interleave(3)
    groups = sample_groups(policy, data, index, torch.full((60,), 220.0), 5, RewardConfig(), g)
    assert groups.actions.shape == (60, 5)
    assert data.mask[index[:, None], groups.actions].all()
    assert torch.isfinite(groups.rewards).all()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"group_size": 1}, "`group_size` must be an integer >= 2"),
    ({"lr": 0.0}, "`lr` must be a finite number > 0"),
    ({"clip_epsilon": 1.5}, "`clip_epsilon` must be in"),
    ({"loss_type": "pairwise", "clip_epsilon": 0.2}, "`clip_epsilon` .* no effect with `loss_type`='pairwise'"),
    ({"budget_min_ms": 300.0, "budget_max_ms": 200.0}, "`budget_max_ms` .* must be greater than `budget_min_ms`"),
    ({"scale_rewards": "always"}, "`scale_rewards` must be"),
    ({"loss_type": "ppo"}, "`loss_type` must be"),
    ({"reward": {"mode": "soft", "gamma": -1.0}}, "`gamma` must be"),
    ({"fallback_confidence": 1.0}, r"`fallback_confidence` must be in \[0.5, 1\)"),
    ({"fallback_confidence": 0.3}, r"`fallback_confidence` must be in \[0.5, 1\)"),
])
def test_invalid_configs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OfflineTrainConfig(**kwargs)


def test_scale_rewards_aliases():
    assert OfflineTrainConfig(scale_rewards=True).scale_rewards == "group"
    assert OfflineTrainConfig(scale_rewards=False).scale_rewards == "none"


# -- training runs on a real workspace --------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_ws(tmp_path_factory, embedded_runtime) -> Workspace:
    return build_feature_workspace(tmp_path_factory.mktemp("trainer"), embedded_runtime)[1]


def run_config(ws: Workspace, **kwargs) -> OfflineTrainConfig:
    return OfflineTrainConfig(**{"workspace": ws.root, "num_epochs": 2, "batch_size": 16, "disable_evaluation": True,
                                 "cross_fit_folds": 0,
                                 **kwargs})


def comparable(metrics: pl.DataFrame) -> pl.DataFrame:
    return metrics.drop("run_id", "wall_time_s")


def test_train_offline_moves_every_parameter_and_improves(trained_ws):
    from trainer.policy import ControllerPolicy

    updates: list[dict] = []
    result = train_offline(run_config(trained_ws, disable_evaluation=False, eval_budgets=[180.0, 260.0]),
                           progress=updates.append)
    start = _initial_state(trained_ws, result)
    last = torch.load(result.last_checkpoint, weights_only=True)["state_dict"]
    trainable = [n for n, p in ControllerPolicy.load(result.best_checkpoint).named_parameters() if p.requires_grad]
    assert len(trainable) > 20
    for name in trainable:
        assert not torch.equal(start[name], last[name]), f"parameter {name} did not change"
    epochs = result.metrics.filter(pl.col("kind") == "epoch").sort("epoch")
    assert epochs["epoch"].to_list() == [0, 1, 2]
    assert epochs["val/expected_reward"][-1] > epochs["val/expected_reward"][0]
    assert result.best_val_expected_reward > result.initial_val_expected_reward
    assert torch.load(result.best_checkpoint, weights_only=True)["epoch"] >= 1
    run = pl.read_parquet(result.run_dir / "run.parquet")
    assert run.height == 1 and run["status"][0] == "completed" and run["run_id"][0] == result.run_id
    assert run["model_fingerprint"][0] == ControllerPolicy.load(result.best_checkpoint).model_fingerprint
    config = json.loads((result.run_dir / "config.json").read_text())
    assert config["budget_min_ms"] < config["budget_max_ms"] and config["eval_budgets"] == [180.0, 260.0]
    metrics = pl.read_parquet(result.run_dir / "metrics.parquet")
    assert set(metrics["run_id"]) == {result.run_id} and "reward/viol_pen" in metrics.columns
    steps = metrics.filter(pl.col("kind") == "step")
    assert (steps["groups"] > 0).all() and steps["zero_variance_groups"].min() >= 0
    evaluation = pl.read_parquet(result.run_dir / "evaluation.parquet")
    # the synthetic tree records each question's template family, so the per-family table is scored
    # too; the run's outcome model (outcome.pt) is a decider of its own
    assert (result.run_dir / "outcome.pt").exists()
    assert {"controller", "policy", "outcome", "oracle", "clairvoyant", "best_static", "lut_p95", "lut_by_family",
            "lut_by_question", "lut_by_cluster", "lut_by_request", "latency_clairvoyant", "lut_mean5", "largest",
            "random"} == set(evaluation["decider"])
    from trainer.data import budget_grid
    from trainer.fallback import read_fallback

    fallback = read_fallback(result.best_checkpoint)  # fitted on the val grid after training
    assert fallback.grid_ms == budget_grid(config["budget_min_ms"], config["budget_max_ms"], config["num_val_budgets"])
    controller = evaluation.filter(pl.col("decider") == "controller")
    assert controller.height == 2 and controller["expected_reward"].is_not_null().all()
    assert (result.run_dir / "evaluation.png").stat().st_size > 0
    steps = [u for u in updates if u.get("phase") == "train"]
    assert steps and {"loss", "reward", "val_expected_reward"} <= steps[0].keys()
    assert [u["model"] for u in updates if u.get("phase") == "fit"] == ["outcome model", "request cost model"]


def _initial_state(ws: Workspace, result) -> dict:
    """The policy as train_offline initialised it (same seed, same data)."""
    from trainer.data import load_offline_data
    from trainer.warm_start import build_policy

    config = OfflineTrainConfig.from_json(json.loads((result.run_dir / "config.json").read_text()))
    return build_policy(config, load_offline_data(ws).subset("train")).state_dict()


def test_same_seed_gives_identical_metrics(trained_ws):
    first = train_offline(run_config(trained_ws, seed=7, kl_beta=0.05, clip_epsilon=0.2, num_iterations=2))
    second = train_offline(run_config(trained_ws, seed=7, kl_beta=0.05, clip_epsilon=0.2, num_iterations=2))
    assert first.run_id != second.run_id
    assert comparable(first.metrics).equals(comparable(second.metrics))
    other = train_offline(run_config(trained_ws, seed=8, kl_beta=0.05, clip_epsilon=0.2, num_iterations=2))
    assert not comparable(first.metrics).equals(comparable(other.metrics))


def test_resume_equals_uninterrupted(trained_ws):
    options = {"num_epochs": 3, "loss_type": "pairwise", "violation_target": 0.01, "use_tilings": True}
    full = train_offline(run_config(trained_ws, **options))

    def stop_in_epoch_2(update: dict) -> None:
        if update.get("phase") == "train" and update["epoch"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_offline(run_config(trained_ws, **options, run_id="interrupted"), progress=stop_in_epoch_2)
    run_dir = trained_ws.root / "runs" / "interrupted"
    assert pl.read_parquet(run_dir / "run.parquet")["status"][0] == "interrupted"
    with pytest.raises(CtrlError, match="options differ"):
        train_offline(run_config(trained_ws, **{**options, "loss_type": "grpo"}, resume="interrupted"))
    resumed = train_offline(OfflineTrainConfig.from_run("interrupted", workspace=trained_ws.root))
    assert resumed.run_id == "interrupted"
    a = torch.load(full.last_checkpoint, weights_only=True)["state_dict"]
    b = torch.load(resumed.last_checkpoint, weights_only=True)["state_dict"]
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"
    assert comparable(full.metrics).equals(comparable(resumed.metrics))
    assert pl.read_parquet(run_dir / "run.parquet")["status"][0] == "completed"
    multipliers = torch.load(full.last_checkpoint, weights_only=True)["violation_multipliers"]
    torch.testing.assert_close(multipliers,
                               torch.load(resumed.last_checkpoint, weights_only=True)["violation_multipliers"])
    assert float(multipliers.max()) > 0  # the initial, near-uniform policy violates more than 1 % at low budgets
    assert ControllerPolicy.load(resumed.best_checkpoint).config.use_tilings


def test_predict_columns_and_fingerprint_refusal(trained_ws, tmp_path):
    from controller.predict import PREDICTION_COLUMNS, predict, read_prediction_inputs

    result = train_offline(run_config(trained_ws, num_epochs=1))
    frame = predict(trained_ws.root, result.run_id, [170.0, 300.0], tmp_path / "out.csv")
    assert tuple(frame.columns) == PREDICTION_COLUMNS
    assert frame.height == 2 * 80 and ((frame["probability"] > 0) & (frame["probability"] <= 1)).all()
    from trainer.fallback import read_fallback

    fallback = read_fallback(result.best_checkpoint)
    for budget in (170.0, 300.0):
        rows = frame.filter(pl.col("budget_ms") == budget)
        if bool(fallback.controller_at(torch.tensor(budget))):
            assert set(rows["source"]) == {"controller"}
        else:  # the table answers: the configuration of the family each question reads as, deterministically
            assert set(rows["source"]) == {"table"} and (rows["probability"] == 1.0).all()
            table = fallback.lookup_table()
            assert table.name == "lut_by_question"  # the sample data records question families
            inputs = read_prediction_inputs(trained_ws, ControllerPolicy.load(result.best_checkpoint))
            chosen = table.choose(torch.full((len(inputs["lang"]),), budget), inputs["lang"])
            expected = {key: table.action_space.actions[i] for key, i in zip(inputs["sample_key"], chosen.tolist())}
            assert {row[0]: tuple(row[1:]) for row in rows.select("sample_key", "max_crops", "top_k",
                                                                  "num_active_blocks").rows()} == expected
    assert pl.read_csv(tmp_path / "out.csv").height == frame.height
    by_dir = predict(trained_ws.root, result.run_dir, [170.0, 300.0], tmp_path / "out.parquet")
    assert by_dir.equals(pl.read_parquet(tmp_path / "out.parquet")) and by_dir.equals(frame)
    with pytest.raises(CtrlError, match=r"\.parquet or \.csv"):
        predict(trained_ws.root, result.best_checkpoint, [200.0], tmp_path / "out.json")
    foreign = ControllerPolicy.load(result.best_checkpoint)
    foreign.model_fingerprint = "0" * 64
    path = foreign.save(tmp_path / "foreign.pt")
    with pytest.raises(CacheMismatchError, match="trained on features of model 0000000000000000"):
        predict(trained_ws.root, path, [200.0], None)
    with pytest.raises(CtrlError, match="not found"):
        predict(trained_ws.root, "no-such-run", [200.0], None)
    assert not list(tmp_path.glob(".*.tmp"))
    assert np.isfinite(frame["budget_ms"].to_numpy()).all()


# -- training targets and the lookup-table warm start ------------------------------------------

def test_training_targets_use_the_mean_score_only_when_asked():
    from trainer.data import training_targets

    data = make_data(n=10)
    data.mean_score = torch.where(data.mask, (data.score + 0.5) / 2, float("nan"))
    mean = training_targets(data, "mean")
    assert torch.equal(mean.score.nan_to_num(-1), data.mean_score.nan_to_num(-1))
    assert torch.equal(training_targets(data, "recorded").score.nan_to_num(-1), data.score.nan_to_num(-1))
    assert torch.equal(mean.latency_ms.nan_to_num(-1), data.latency_ms.nan_to_num(-1))  # latencies never change
    assert not torch.equal(data.score.nan_to_num(-1), mean.score.nan_to_num(-1))  # the input is not modified
    data.mean_score = None  # data without a mean (e.g. benchmarks): the recorded score
    assert torch.equal(training_targets(data, "mean").score.nan_to_num(-1), data.score.nan_to_num(-1))


def test_warm_start_makes_the_greedy_decision_the_lookup_table():
    from trainer.baselines import LookupTableDecider
    from trainer.warm_start import warm_start

    data = make_data(n=40, full_mask=True)
    policy = make_policy(data).train()
    config = OfflineTrainConfig(budget_min_ms=150.0, budget_max_ms=350.0, warm_start_steps=150, batch_size=8)
    table = LookupTableDecider(data)
    budgets = [160.0, 250.0, 340.0]
    before = [float((PolicyDecider(policy).decide(data, b) == table.decide(data, b)).float().mean()) for b in budgets]
    warm_start(policy, data, config)
    after = [float((PolicyDecider(policy).decide(data, b) == table.decide(data, b)).float().mean()) for b in budgets]
    assert min(after) >= 0.9 and sum(after) > sum(before)
    probs = PolicyDecider(policy).action_probs(data, 250.0)
    # 30 % of the target is spread over the other configurations: sampling still explores
    assert float(probs.max(-1).values.mean()) < 0.9


# -- the table fallback (safe deployment) -----------------------------------------------------------

def test_table_fallback_keeps_the_controller_exactly_where_it_wins_on_val(tmp_path):
    from trainer.baselines import LookupTableDecider
    from trainer.fallback import attach_fallback, fit_table_fallback, read_fallback, wilson_upper_bound
    from trainer.warm_start import warm_start

    train, val = make_data(n=60, seed=0, full_mask=True), make_data(n=40, seed=1)
    policy = make_policy(train, seed=2).train()  # near the table (warm start): wins some budgets, loses others
    warm_start(policy, train, OfflineTrainConfig(budget_min_ms=150.0, budget_max_ms=350.0, warm_start_steps=40,
                                                 batch_size=8))
    policy.eval()
    reward = RewardConfig(mode="hard")
    grid = [330.0, 180.0, 230.0, 280.0]  # unsorted on purpose
    table, network = LookupTableDecider(train), PolicyDecider(policy)
    rows, knobs = torch.arange(len(val)), val.action_space.knob_values().float()
    cases = set()
    for (confidence, z), prefers in itertools.product(((0.5, 0.0), (0.8, 0.8416), (0.95, 1.6449)),
                                                      ("table", "controller")):
        fallback = fit_table_fallback(policy, train, val, grid, reward, confidence=confidence, prefers=prefers)
        assert fallback.grid_ms == sorted(grid) and fallback.confidence == confidence
        for i, budget in enumerate(fallback.grid_ms):
            r = compute_reward(val.score, val.latency_ms, torch.full((len(val), 1), budget), knobs[None],
                               reward)["reward"]
            ours, theirs = network.decide(val, budget), table.decide(val, budget)
            difference = (r[rows, ours] - r[rows, theirs]).double()
            se = float(difference.std()) / len(val) ** 0.5
            v_ctrl = float((val.latency_ms[rows, ours] > budget).double().mean())
            # the table's violations: train and val pooled, judged by their upper bound
            table_over = int((val.latency_ms[rows, theirs] > budget).sum()) + int(
                (train.latency_ms[torch.arange(len(train)), table.decide(train, budget)] > budget).sum())
            v_table = table_over / (len(train) + len(val))
            v_upper = wilson_upper_bound(table_over, len(train) + len(val), confidence)
            assert fallback.reward_difference_se[i] == pytest.approx(se)
            assert float(difference.mean()) == pytest.approx(fallback.controller_reward[i] - fallback.table_reward[i],
                                                             abs=1e-6)
            assert ((fallback.controller_violation_rate[i], fallback.table_violation_rate[i])
                    == pytest.approx((v_ctrl, v_table)))
            assert fallback.table_violation_upper[i] == pytest.approx(v_upper) and v_upper >= v_table
            if v_ctrl <= 0.05 and v_upper <= 0.05 and prefers == "table":  # the controller must win the test
                expected, case = float(difference.mean()) > z * se, "reward"
            elif v_ctrl <= 0.05 and v_upper <= 0.05:  # the table must win the paired test
                expected, case = float(difference.mean()) >= -z * se, "reward, controller preferred"
            elif v_ctrl <= 0.05 or v_upper <= 0.05:  # only one within: that one
                expected, case = v_ctrl <= 0.05, "violation"
            else:
                expected, case = v_ctrl <= v_table, "neither"
            assert fallback.use_controller[i] == expected, (confidence, prefers, budget)
            cases.add((case, expected, float(difference.mean()) > 0))
        if confidence < 0.95 and prefers == "table":
            assert True in fallback.use_controller and False in fallback.use_controller  # this seed exercises both
    assert len(cases) >= 4, cases
    assert ("reward", False, True) in cases  # a better mean that is not significant keeps the table
    # preferred, the controller keeps a budget where it is behind, but not significantly
    assert ("reward, controller preferred", True, False) in cases
    # the defaults: 0.95, and "auto" prefers the controller where the table is lut_p95 (no family labels here)
    fallback = fit_table_fallback(policy, train, val, grid, reward)
    assert fallback.confidence == 0.95 and fallback.prefers == "controller"
    # the per-request table may take the table's place, never the network's: the network keeps its budgets
    with_request = fit_table_fallback(policy, train, val, grid, reward, request_table=True)
    assert with_request.use_controller == fallback.use_controller
    assert not any(r and c for r, c in zip(with_request.request_table_at, with_request.use_controller))

    deployed = PolicyDecider(policy, fallback)
    for budget, keep in zip(fallback.grid_ms, fallback.use_controller):
        for probe in (budget - 10.0, budget, budget + 10.0):  # within 25 ms: the nearest grid point decides
            expected = network.decide(val, probe) if keep else table.decide(val, probe)
            assert torch.equal(deployed.decide(val, probe), expected)
    probs = deployed.action_probs(val, fallback.fallback_budgets_ms[0])
    assert torch.equal(probs.max(-1).values, torch.ones(len(val)))  # one-hot where the table answers

    checkpoint = policy.save(tmp_path / "best.pt", extra={"epoch": 3})
    assert read_fallback(checkpoint) is None
    attach_fallback(checkpoint, fallback)
    loaded = read_fallback(checkpoint)
    assert loaded == fallback and torch.load(checkpoint, weights_only=True)["epoch"] == 3
    rebuilt = loaded.lookup_table()
    for budget in (150.0, 250.0, 400.0):
        assert torch.equal(rebuilt.decide(val, budget), table.decide(val, budget))
    assert rebuilt.name == "lut_p95"


def test_table_fallback_refuses_inconsistent_fields():
    from trainer.fallback import TableFallback

    def make(grid, n):
        return TableFallback(grid_ms=grid, use_controller=[True] * n, controller_reward=[0.0] * n,
                             table_reward=[0.0] * n, reward_difference_se=[0.0] * n,
                             controller_violation_rate=[0.0] * n, table_violation_rate=[0.0] * n,
                             table_violation_upper=[0.0] * n, max_violation_rate=0.05, confidence=0.95, table={})

    with pytest.raises(ValueError, match="same non-zero length"):
        make([1.0, 2.0], 1)
    with pytest.raises(ValueError, match="ascending"):
        make([2.0, 1.0], 2)
    assert make([1.0, 2.0], 2).fallback_budgets_ms == []
    assert make([1.0, 2.0], 2).describe() == ("table fallback (95% confidence, controller preferred): controller at "
                                              "1.0, 2.0 ms; lut_p95 table at none")
    unrated = make([1.0, 2.0], 2)
    unrated.confidence = math.nan  # a fallback stored before the confidence rule
    assert unrated.describe() == "table fallback: controller at 1.0, 2.0 ms; lut_p95 table at none"
    mixed = make([100.0, 150.5], 2)
    mixed.use_controller = [False, True]
    mixed.prefers = "table"
    assert mixed.describe() == ("table fallback (95% confidence, table preferred): controller at 150.5 ms; "
                                "lut_p95 table at 100.0 ms")
    with pytest.raises(ValueError, match="`prefers` must be one of"):
        TableFallback.from_json({**mixed.to_json(), "prefers": "oracle"})
    # a fallback stored before the confidence rule (no bound, no SE) still loads; its choices stand
    stored = make([1.0, 2.0], 2).to_json()
    for key in ("reward_difference_se", "table_violation_upper", "confidence", "prefers"):
        del stored[key]
    old = TableFallback.from_json(stored)
    assert old.use_controller == [True, True] and all(math.isnan(x) for x in old.table_violation_upper)
    assert old.prefers == "table"  # the only rule there was


def test_wilson_upper_bound_solves_the_score_equation():
    from statistics import NormalDist

    from trainer.fallback import wilson_upper_bound

    z = NormalDist().inv_cdf(0.95)
    for k, n in ((0, 100), (5, 100), (24, 532), (1, 57)):
        u = wilson_upper_bound(k, n, 0.95)
        # the Wilson bound is the root above k/n of (u - k/n)^2 = z^2 u (1 - u) / n
        assert u > k / n and (u - k / n) ** 2 == pytest.approx(z * z * u * (1 - u) / n)
    assert wilson_upper_bound(0, 100, 0.95) == pytest.approx(z * z / (100 + z * z))
    assert wilson_upper_bound(5, 100, 0.5) == pytest.approx(0.05)  # z = 0: the point estimate
    assert wilson_upper_bound(24, 532, 0.95) > 0.05 > wilson_upper_bound(15, 532, 0.95)  # 4.5 % is not safe, 2.8 % is
    assert wilson_upper_bound(0, 0, 0.95) == 1.0 and wilson_upper_bound(10, 10, 0.95) == 1.0


def test_the_per_request_table_answers_only_where_the_table_would():
    from trainer.fallback import tables_only

    # network at budgets 0 and 3; the per-request table beat the table at 0 and 1
    assert tables_only([True, False, False, True], [True, True, False, False]) == [False, True, False, False]
