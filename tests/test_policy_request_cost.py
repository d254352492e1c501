"""A controller network that reads the per-request cost model (``use_request_cost``): what it reads, that
every place the decision runs reads the same, and that training feeds it out-of-fold predictions."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from test_request_cost import C10K8, SPACE, make_world

from trainer.config import OfflineTrainConfig
from trainer.greedy import policy_greedy
from trainer.policy import ControllerPolicy, PolicyConfig
from trainer.request_cost import RequestCostConfig, fit_request_cost, fit_request_cost_out_of_fold


@pytest.fixture(scope="module")
def fitted():
    train = make_world(300, seed=11, noise=0.1)
    model, out_of_fold = fit_request_cost_out_of_fold(train, RequestCostConfig(clusters=2))
    return train, model, out_of_fold


def reading_policy(train, model, out_of_fold, seed: int = 0) -> ControllerPolicy:
    torch.manual_seed(seed)
    config = PolicyConfig(lang_feature_dim=2, image_feature_dim=3, budget_min_ms=50.0, budget_max_ms=300.0,
                          hidden_dim=16, use_tilings=True, use_request_cost=True)
    policy = ControllerPolicy(config, SPACE, train.model_fingerprint)
    policy.set_feature_normalization(train.image_features, train.image_present, train.lang_features,
                                     train.tiling_crops)
    policy.attach_request_cost(model, out_of_fold)
    with torch.no_grad():  # a non-uniform network, so that equalities below are not trivially true
        for p in policy.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return policy.eval()


def test_the_out_of_fold_fit_is_the_plain_fit_and_its_predictions_did_not_see_the_row(fitted):
    train, model, out_of_fold = fitted
    plain = fit_request_cost(train, RequestCostConfig(clusters=2))
    assert torch.equal(model.coef, plain.coef) and torch.equal(model.conformal_score, plain.conformal_score)
    in_sample = model.predict(train)[0]
    assert out_of_fold.shape == in_sample.shape and not torch.isnan(out_of_fold).any()
    # under noise, a fit without the row predicts it differently (though close: the law is linear)
    assert not torch.equal(out_of_fold, in_sample)
    assert float(((out_of_fold - in_sample).abs() / in_sample).median()) < 0.05


def test_a_request_without_a_tiling_reads_its_configurations_profile_median():
    train = make_world(200, seed=12, noise=0.1)
    train.tiling_crops[:5] = float("nan")
    model, out_of_fold = fit_request_cost_out_of_fold(train, RequestCostConfig(clusters=2))
    assert torch.equal(out_of_fold[:5], model.profile_median_ms[None, :].expand(5, -1))


def test_the_network_reads_the_standardised_log_of_the_predicted_median(fitted):
    train, model, out_of_fold = fitted
    policy = reading_policy(train, model, out_of_fold)
    logs = torch.log(out_of_fold)
    assert float(policy.cost_mean) == pytest.approx(float(logs.mean()), rel=1e-5)
    assert float(policy.cost_std) == pytest.approx(float(logs.std(correction=0)), rel=1e-5)
    test = make_world(40, seed=13, split="test")
    args = (test.image_features, test.image_present, test.lang_features, 150.0)
    own = policy.log_probs(*args, tiling_crops=test.tiling_crops, prompt_tokens=test.prompt_tokens)
    predicted = model.predict(test)[0]
    given = policy.log_probs(*args, tiling_crops=test.tiling_crops, request_ms=predicted)
    torch.testing.assert_close(own, given)  # its own prediction is the cost model's, at each request's prompt
    # a request whose prompt is 200 tokens longer costs more at every configuration, and the network sees it
    longer = policy.log_probs(*args, tiling_crops=test.tiling_crops, prompt_tokens=test.prompt_tokens + 200)
    assert not torch.allclose(own, longer)
    # ... through that input alone: with its columns of the language projection zeroed, the prompt changes nothing
    with torch.no_grad():
        policy.lang_proj[0].weight[:, 2:] = 0.0
    blind = policy.log_probs(*args, tiling_crops=test.tiling_crops, prompt_tokens=test.prompt_tokens)
    torch.testing.assert_close(blind, policy.log_probs(*args, tiling_crops=test.tiling_crops,
                                                       prompt_tokens=test.prompt_tokens + 200))


def test_a_policy_without_an_attached_model_refuses_to_guess():
    config = PolicyConfig(lang_feature_dim=2, image_feature_dim=3, budget_min_ms=50.0, budget_max_ms=300.0,
                          use_request_cost=True)
    policy = ControllerPolicy(config, SPACE, "f" * 64)
    test = make_world(4, seed=14, split="test")
    with pytest.raises(Exception, match="attach_request_cost"):
        policy.log_probs(test.image_features, test.image_present, test.lang_features, 100.0)
    plain = ControllerPolicy(PolicyConfig(lang_feature_dim=2, image_feature_dim=3, budget_min_ms=50.0,
                                          budget_max_ms=300.0), SPACE, "f" * 64)
    with pytest.raises(ValueError, match="without use_request_cost"):
        plain.attach_request_cost(fit_request_cost(make_world(50, seed=1), RequestCostConfig(clusters=2)))


def test_checkpoint_and_export_decide_as_the_network_does(fitted, tmp_path):
    from controller.deploy import DeployedController, load_deployed, save_deployed

    train, model, out_of_fold = fitted
    policy = reading_policy(train, model, out_of_fold, seed=3)
    policy.save(tmp_path / "p.pt")
    loaded = ControllerPolicy.load(tmp_path / "p.pt")
    test = make_world(60, seed=15, split="test")
    budget = torch.linspace(60.0, 290.0, 60)
    args = (test.image_features, test.image_present, test.lang_features, budget)
    want = policy_greedy(policy, *args, tiling_crops=test.tiling_crops, prompt_tokens=test.prompt_tokens)
    assert torch.equal(policy_greedy(loaded, *args, tiling_crops=test.tiling_crops,
                                     prompt_tokens=test.prompt_tokens), want)
    assert torch.equal(loaded.request_cost.predict(test)[0], model.predict(test)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is what ctrl export writes
        save_deployed(DeployedController(loaded, None), tmp_path / "c.pt")
        deployed = load_deployed(tmp_path / "c.pt")
    assert bool(deployed.reads_prompt_tokens)
    knobs = torch.stack(deployed.decide(test.lang_features, test.image_features, test.image_present, budget,
                                        test.tiling_crops, test.prompt_tokens), 1)
    assert [SPACE.actions.index(tuple(k)) for k in knobs.tolist()] == want.tolist()
    crops = deployed.stage1(test.lang_features, budget, test.tiling_crops, test.prompt_tokens)
    assert crops.tolist() == [SPACE.actions[a][0] for a in want.tolist()]
    probs = deployed.probabilities(test.lang_features, test.image_features, test.image_present, budget,
                                   test.tiling_crops, test.prompt_tokens)
    with torch.no_grad():
        torch.testing.assert_close(probs, policy.log_probs(*args, tiling_crops=test.tiling_crops,
                                                           prompt_tokens=test.prompt_tokens).exp())
    # an unknown prompt reads as the profile's median length in both
    unknown = torch.full((60,), math.nan)
    knobs = torch.stack(deployed.decide(test.lang_features, test.image_features, test.image_present, budget,
                                        test.tiling_crops, unknown), 1)
    assert [SPACE.actions.index(tuple(k)) for k in knobs.tolist()] == policy_greedy(
        policy, *args, tiling_crops=test.tiling_crops).tolist()
    assert C10K8 in want.tolist() or len(set(want.tolist())) > 1  # the budgets span more than one decision


def test_a_run_with_request_cost_input_trains_on_out_of_fold_predictions(tmp_path):
    from trainer.offline import OfflineTrainer

    data = make_world(120, seed=16, noise=0.1)
    data.split[:] = ["train"] * 80 + ["val"] * 20 + ["test"] * 20
    trainer = OfflineTrainer(OfflineTrainConfig(workspace=tmp_path / "ws", num_epochs=1, batch_size=16,
                                                cross_fit_folds=0, disable_evaluation=True, warm_start_steps=5,
                                                request_cost_input=True, budget_min_ms=60.0, budget_max_ms=250.0,
                                                seed=5),
                             data=data)
    result = trainer.train()
    # the cost model of the train split, fitted with the run's seed; the rows read the folds without them
    _, want = fit_request_cost_out_of_fold(data.subset("train"), RequestCostConfig(seed=5))
    assert torch.equal(trainer.train_split.request_latency_ms, want)
    best = ControllerPolicy.load(result.best_checkpoint)
    assert best.config.use_request_cost
    torch.testing.assert_close(best.cost_mean, torch.log(want).mean())
    assert torch.equal(best.request_cost.coef, trainer.request_cost.coef)
