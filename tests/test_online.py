"""The online phase: two-stage execution on the real embedded model, hook timing, rollouts,
GRPO steps, resume and a 2-process (gloo) run. Sections (§) and defect labels (D1 ..) cite
docs/origin_format.md."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
import torch

from conftest import build_offline_workspace
from pipeline import knobs
from runtime.fast_decoder import FastPrefixCache


@pytest.fixture(scope="module")
def online_ws(tmp_path_factory, embedded_runtime):
    """A small workspace (ingested + features) and an offline run to continue from."""
    return build_offline_workspace(tmp_path_factory.mktemp("online"), embedded_runtime, 24)


@pytest.fixture(scope="module")
def executor(online_ws, embedded_runtime):
    from online.config import OnlineTrainConfig
    from online.data import load_online_samples
    from online.rollout import RolloutExecutor
    from online.train import build_controller

    _, ws = online_ws
    samples = load_online_samples(ws, embedded_runtime.fingerprint)
    controller, _, _ = build_controller(OnlineTrainConfig(workspace=ws.root), ws, embedded_runtime, samples,
                                        (50.0, 150.0))
    ex = RolloutExecutor(embedded_runtime, controller, samples, max_new_tokens=4)
    yield ex
    ex.close()


def _image_sample(samples) -> int:
    return next(i for i in range(len(samples)) if samples.image_present[i])


# -- the knob space ---------------------------------------------------------------------------

def test_insertion_options_follow_the_origin_table():
    # origin §2.3: options depend on the insertion position p
    assert [knobs.insertion_block_options(p) for p in knobs.INSERTION_POSITIONS] == [
        (12, 13, 14, 15, 16), (13, 14, 15, 16), (14, 15, 16), (15, 16), (16,)]
    with pytest.raises(ValueError, match="insertion position"):
        knobs.insertion_block_options(0)
    # blocks before the insertion point always run, block choice only among later blocks
    blocks = knobs.select_active_blocks(13, scores={b: -b for b in range(16)}, first_kept=4)
    assert blocks[:4] == (0, 1, 2, 3) and len(blocks) == 13
    assert set(range(16)) - set(blocks) == {13, 14, 15}  # the lowest-scoring blocks after p


def test_controller_masks_block_counts_the_insertion_position_forbids(executor):
    ctrl = executor.controller
    values = ctrl.num_active_blocks_values
    for pi, p in enumerate(ctrl.insertion_positions):
        allowed = set(knobs.insertion_block_options(p))
        assert [bool(v) for v in ctrl.blocks_valid[pi]] == [b in allowed for b in values]
    s1 = ctrl.stage1(executor.samples.lang[:3], torch.tensor([60.0, 90.0, 140.0]))
    # positions without any allowed block count of the action space get no probability
    assert torch.all(s1.insertion_log_probs[:, ~ctrl.insertion_valid] == float("-inf"))
    for pi in range(len(ctrl.insertion_positions)):
        if not ctrl.insertion_valid[pi]:
            continue
        n = 3
        idx = torch.full((n,), pi, dtype=torch.long)
        _, blocks_lp = ctrl.stage2(s1, executor.samples.image[:n], executor.samples.image_present[:n],
                                   torch.zeros(n, dtype=torch.long), idx, torch.randn(n, ctrl.two_stage.hidden_size))
        probs = blocks_lp.exp()
        assert torch.allclose(probs.sum(-1), torch.ones(n))
        assert torch.all(probs[:, ~ctrl.blocks_valid[pi]] == 0)


def test_new_stage2_terms_start_at_zero_so_the_offline_policy_is_kept(executor):
    ctrl = executor.controller
    s1 = ctrl.stage1(executor.samples.lang[:2], torch.tensor([80.0, 120.0]))
    crops = torch.tensor([0, 1])
    top_a, _ = ctrl.stage2(s1, executor.samples.image[:2], executor.samples.image_present[:2], crops,
                           torch.tensor([0, 0]), torch.randn(2, ctrl.two_stage.hidden_size))
    top_b, _ = ctrl.stage2(s1, executor.samples.image[:2], executor.samples.image_present[:2], crops,
                           torch.tensor([0, 0]), torch.randn(2, ctrl.two_stage.hidden_size) * 5)
    offline_top, _ = ctrl.policy.stage2_heads(
        ctrl.policy.stage2_hidden(executor.samples.image[:2], executor.samples.image_present[:2], s1.lang_h,
                                  s1.budget_h)[torch.arange(2), crops])
    assert torch.allclose(top_a, top_b) and torch.allclose(top_a, offline_top)
    # and stage 1 prefers insertion position 1 (top-K on every block after block 0, like the
    # offline data), so the greedy controller at step 0 is the offline policy deployed as is
    assert torch.all(s1.insertion_log_probs.argmax(-1) == ctrl.insertion_positions.index(1))
    assert torch.all(s1.insertion_log_probs.exp().max(-1).values > 0.5)


# -- two-stage execution on the model ---------------------------------------------------------

@pytest.mark.parametrize(("p", "blocks", "top_k"), [(1, 12, 4), (3, 14, 12), (5, 16, 6)])
def test_split_prefill_generates_what_generate_does(embedded_runtime, executor, p, blocks, top_k):
    rt = embedded_runtime
    s = _image_sample(executor.samples)
    inputs = executor._model_inputs(s, 6)
    top = {i: top_k for i in range(p, rt.num_layers)}  # blocks before p keep the default top-K
    active = rt.blocks_for(blocks, first_kept=p)
    with rt.knobs(top_k=top, active_blocks=active):
        reference = rt.generate(inputs, max_new_tokens=5).token_ids
    prefix = rt.prefill_prefix(inputs, p)
    with rt.knobs(top_k=top):
        state = rt.prefill_suffix(prefix, active)
        tokens = [int(state.logits.argmax())]
        while len(tokens) < 5 and tokens[-1] != rt.eos_id:
            rt.decode_step(state, tokens[-1])
            tokens.append(int(state.logits.argmax()))
    assert tokens == reference


def test_budget_token_is_read_by_stage_2_and_leaves_the_answer_alone(embedded_runtime, executor):
    """The budget token is one extra prefill position up to block p-1 (its hidden state is the
    latency token); the rest of the prefill and the decoding run on the prompt alone, so the
    tokens are those of generate with the same knobs, and cached decoding equals recomputing
    prompt + generated tokens without a cache."""
    rt = embedded_runtime
    inputs = executor._model_inputs(_image_sample(executor.samples), 2)
    token = torch.randn(rt.hidden_size) * rt.embedding_rms()
    prefix = rt.prefill_prefix(inputs, 2, token)
    assert prefix.seq_len == inputs.input_ids.shape[1] + 1 and prefix.extra_tokens == 1
    assert torch.equal(prefix.embeds[0, -1], token)
    plain = rt.prefill_prefix(inputs, 2)
    assert not torch.equal(prefix.latency_token, plain.latency_token)  # stage 2 reads the budget
    torch.testing.assert_close(prefix.hidden[:, :-1], plain.hidden)  # the prompt never reads it (causal)
    state = rt.prefill_suffix(prefix, list(range(16)))
    generated = [int(state.logits.argmax())]
    for _ in range(3):
        rt.decode_step(state, generated[-1])
        generated.append(int(state.logits.argmax()))
    assert state.positions == inputs.input_ids.shape[1] + 3  # prompt + generated tokens
    reference = rt.generate(inputs, max_new_tokens=4).token_ids  # stops at EOS; the loop above does not
    assert reference and generated[:len(reference)] == reference
    with torch.no_grad():
        ids = torch.tensor([generated[:-1]])
        full = torch.cat([plain.embeds, rt.text_embeddings(ids)], dim=1)
        logits = rt.decoder(inputs_embeds=full, attention_mask=torch.ones(full.shape[:2], dtype=torch.long)).logits[0]
    assert int(logits[-1].argmax()) == generated[-1]
    assert torch.allclose(logits[-1].float(), state.logits, atol=1e-4)


def test_stage_2_reads_the_cached_global_feature_which_the_request_computes_itself(embedded_runtime, executor,
                                                                                   monkeypatch):
    """Online stage 2 reads the cached global-crop feature (as offline training does); the request's
    own vision pass gives the same vector at the crops stage 1 chose (what a server reads)."""
    rt, ctrl, samples = embedded_runtime, executor.controller, executor.samples
    with_image = [i for i in range(len(samples)) if samples.image_present[i]][:3]
    for s in with_image:
        for max_crops in (2, 10):
            state = rt.prefill_prefix(executor._model_inputs(s, max_crops), 2)
            torch.testing.assert_close(state.image_feature, samples.image[s], rtol=1e-5, atol=1e-6)
    seen = []
    stage2 = type(ctrl).stage2
    monkeypatch.setattr(type(ctrl), "stage2", lambda self, s1, image, *a: seen.append(image.clone())
                        or stage2(self, s1, image, *a))
    s = with_image[0]
    executor.run_fixed([s], (ctrl.max_crops_values.index(10), 0, 0, 0))
    assert len(seen) == 1 and torch.equal(seen[0][0].cpu(), samples.image[s])


def _prefix_keys(prefix, block: int) -> torch.Tensor:
    """The keys a prefix state holds for one of its blocks, on either execution path."""
    cache = prefix.cache
    return cache.keys[block] if isinstance(cache, FastPrefixCache) else cache.layers[block].keys


@pytest.mark.parametrize("compile", [False, True])
def test_prefix_is_shared_and_not_modified_by_members(embedded_runtime, executor, compile):
    rt = embedded_runtime
    saved = rt.fast is not None
    rt.set_execution(compile)
    try:
        prefix = rt.prefill_prefix(executor._model_inputs(_image_sample(executor.samples), 2), 3)
        keys = [_prefix_keys(prefix, i).clone() for i in range(3)]
        first = rt.prefill_suffix(prefix, rt.blocks_for(14, first_kept=3))
        rt.decode_step(first, int(first.logits.argmax()))
        second = rt.prefill_suffix(prefix, rt.blocks_for(14, first_kept=3))
        assert all(torch.equal(_prefix_keys(prefix, i), k) for i, k in enumerate(keys))
        assert torch.equal(second.logits, rt.prefill_suffix(prefix, rt.blocks_for(14, first_kept=3)).logits)
    finally:
        rt.set_execution(saved)


def test_latency_token_recompute_carries_gradient_to_the_budget_token(embedded_runtime, executor):
    rt = embedded_runtime
    prefix = rt.prefill_prefix(executor._model_inputs(_image_sample(executor.samples), 2), 2,
                               torch.zeros(rt.hidden_size))
    budget = torch.randn(1, 1, rt.hidden_size, requires_grad=True)
    latency = rt.latency_token(torch.cat([prefix.embeds[:, :-1], budget], dim=1), 2)
    latency.sum().backward()
    assert budget.grad is not None and budget.grad.abs().sum() > 0
    with torch.no_grad():  # the recompute equals the measured prefix's latency token
        again = rt.prefill_prefix(prefix.inputs, 2, budget[0, 0])
    assert torch.allclose(again.latency_token, latency.detach(), atol=1e-5)


@pytest.mark.parametrize("compile", [False, True])
def test_knobs_are_applied_on_the_execution_path(embedded_runtime, executor, compile):
    """Crops through the preprocessor (crops + 1 image arrays), top-K only after the insertion
    position (block 0 keeps the default: each router's top-K as its block runs), skipped blocks
    never run; on both execution paths (the fast one calls the blocks' hooks itself)."""
    rt, ctrl = embedded_runtime, executor.controller
    s = _image_sample(executor.samples)
    seen = {"images": [], "calls": [], "top_k": {}}
    saved = rt.fast is not None
    rt.set_execution(compile)

    def block_runs(module, _args, i: int) -> None:
        seen["calls"].append(i)
        seen["top_k"].setdefault(i, set()).add(int(module.mlp.gate.top_k))

    handles = [rt.vision_module.register_forward_pre_hook(lambda m, a: seen["images"].append(a[0].shape[0]))]
    for i, layer in enumerate(rt.decoder_layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: block_runs(m, a, i)))
    try:
        c = ctrl.max_crops_values.index(10)
        pi = ctrl.insertion_positions.index(2)
        k = ctrl.top_k_values.index(4)
        b = ctrl.num_active_blocks_values.index(14)
        executor._warm.add(("prefix", 10, 2))  # measured run only: hooks see one execution
        executor._warm.add((10, 2, 4, 14))
        (rollout,) = executor.run_fixed([s], (c, pi, k, b))
    finally:
        for h in handles:
            h.remove()
        rt.set_execution(saved)
    assert (rollout.max_crops, rollout.insertion_position, rollout.top_k, rollout.num_active_blocks) == (10, 2, 4, 14)
    assert seen["images"] == [rollout.num_crops + 1] and 1 < rollout.num_crops <= 10
    active = rt.blocks_for(14, first_kept=2)
    assert rollout.active_blocks == active and 0 in active and len(active) == 14
    steps = rollout.num_output_tokens  # prefill pass + N-1 decode steps, each through the active blocks only
    assert seen["calls"] == list(active) * steps
    assert seen["top_k"][0] == {knobs.DEFAULT_TOP_K} and seen["top_k"][1] == {knobs.DEFAULT_TOP_K}
    assert all(seen["top_k"][i] == {4} for i in active if i >= 2)
    assert rt.current_top_k() == [knobs.DEFAULT_TOP_K] * 16  # restored afterwards


def test_stage_times_are_measured_segments_of_the_request(embedded_runtime, executor):
    s = _image_sample(executor.samples)
    c = executor.controller.max_crops_values.index(2)
    (r,) = executor.run_fixed([s], (c, 0, 0, executor.controller.blocks_valid[0].nonzero()[0].item()))
    names = [seg[0] for seg in r.segments]
    assert names[:4] == ["stage1", "prefix", "stage2", "suffix"]
    assert names[4:] == ["decode"] * (r.num_output_tokens - 1)  # N tokens: N-1 decode steps (D3)
    assert len(r.decode_step_ms) == r.num_output_tokens - 1
    walls = [seg[1] for seg in r.segments]
    assert all(w > 0 for w in walls)
    assert r.latency_total_ms == pytest.approx(sum(walls))  # segments partition the request
    # prefill = first block entry .. last block exit of the prefill pass only: its two parts ran
    # the active blocks once each, no decode step contributes (D1)
    prefix_seg, suffix_seg = r.segments[1], r.segments[3]
    assert prefix_seg[3] + suffix_seg[3] == r.num_active_blocks
    assert r.latency_prefill_ms == pytest.approx(prefix_seg[2] + suffix_seg[2])
    assert 0 < r.latency_prefill_ms < prefix_seg[1] + suffix_seg[1]
    assert all(seg[3] == r.num_active_blocks for seg in r.segments[4:])
    assert 0 < r.latency_vision_ms < prefix_seg[1]
    assert r.latency_controller_ms == pytest.approx(walls[0] + walls[2]) and r.latency_controller_ms > 0


def test_timer_hooks_record_nothing_outside_a_segment(embedded_runtime):
    from runtime.timing import RequestTiming, StageTimer

    rt = embedded_runtime
    inputs = rt.preprocess(None, "What is it?", 2)
    with StageTimer(rt.vision_module, list(rt.decoder_layers), rt.device) as timer:
        rt.generate(inputs, max_new_tokens=2)  # untimed: no segment open
        timing = RequestTiming()
        with timer.segment("prefix", timing):
            rt.prefill_prefix(inputs, 3)
        timer.resolve(timing)
    (seg,) = timing.segments
    assert seg.blocks_calls == 3 and seg.vision_ms is None and 0 < seg.blocks_ms <= seg.wall_ms


# -- training ---------------------------------------------------------------------------------

def _config(ws, **kw):
    from online.config import OnlineTrainConfig

    base = dict(workspace=ws.root, steps=2, samples_per_step=2, group_size=3, max_new_tokens=3,
                budget_min_ms=30.0, budget_max_ms=300.0, checkpoint_every=1, run_id=None, evaluate=False)
    return OnlineTrainConfig(**{**base, **kw})


def test_calibration_scales_the_offline_range_by_the_measured_speed_ratio(online_ws, embedded_runtime, executor):
    import math

    from online.calibrate import BudgetReference, budget_reference, calibrate_budget_range, calibration_configs
    from trainer.data import load_offline_data

    _, ws = online_ws
    samples = executor.samples
    parent = json.loads((ws.runs_dir / "offline-run" / "config.json").read_text())
    reference = budget_reference(ws, embedded_runtime, samples, parent)
    assert reference.range_ms == (parent["budget_min_ms"], parent["budget_max_ms"])
    data = load_offline_data(ws, embedded_runtime.fingerprint)  # the recorded latencies, looked up by key
    row = data.sample_key.index(samples.sample_key[0])
    for a, knobs_ in enumerate(data.action_space.actions):
        recorded = float(data.latency_ms[row, a])
        assert reference.recorded_ms(0, knobs_) == recorded or (math.isnan(recorded)
                                                                 and math.isnan(reference.recorded_ms(0, knobs_)))

    rows = [0, 1, 2]
    fastest, slowest = calibration_configs(executor.controller)
    assert fastest[0] == 0 and slowest[0] == len(executor.controller.max_crops_values) - 1
    flat = BudgetReference(range_ms=(100.0, 250.0), latency_ms={k: 1000.0 for k in reference.latency_ms},
                           keys=reference.keys)
    lo, hi = calibrate_budget_range(executor, executor.controller, rows, flat)  # the real model, measured
    assert 0 < lo < hi

    class Timed:  # the rule's arithmetic with known latencies
        def __init__(self, fastest_ms, slowest_ms):
            self.ms = {fastest: fastest_ms, slowest: slowest_ms}

        def run_fixed(self, rows_, force):
            from types import SimpleNamespace

            c, _, k, b = force
            ctrl = executor.controller
            return [SimpleNamespace(latency_total_ms=self.ms[force][i], max_crops=ctrl.max_crops_values[c],
                                    top_k=ctrl.top_k_values[k], num_active_blocks=ctrl.num_active_blocks_values[b])
                    for i, _ in enumerate(rows_)]

    # a uniformly slower machine: each end scaled by its own configuration's ratio, 1,200 x 1.5, 2,500 x 1.0
    # (the low end above the floor, 1.1 x the fastest configuration's 1,500 ms here: 1,650)
    wide = BudgetReference(range_ms=(1200.0, 2500.0), latency_ms=flat.latency_ms, keys=reference.keys)
    uniform = Timed([1500.0, 1500.0, 1500.0], [1000.0, 1000.0, 1000.0])
    assert calibrate_budget_range(uniform, executor.controller, rows, wide) == (1800.0, 2500.0)
    # a machine that stretches long requests more: sample 2 was recorded at 2,000 ms (a long answer) and
    # runs at 6,000 here, the others as recorded; the median ratio would be 1, the tail's (90th
    # percentiles: 6,000 against 2,000) is 3, for the fastest (2,500 x 3, above the floor, 1.1 x the
    # 98th percentile of the six runs, 6,600, where the median ratio would leave it); the slowest runs as recorded
    tail = BudgetReference(range_ms=(2500.0, 10000.0),
                           latency_ms={k: 2000.0 if k[:2] == reference.keys[2] else 1000.0
                                       for k in reference.latency_ms}, keys=reference.keys)
    stretched = Timed([1000.0, 1000.0, 6000.0], [1000.0, 1000.0, 2000.0])
    assert calibrate_budget_range(stretched, executor.controller, rows, tail) == (7500.0, 10000.0)
    # nothing recorded: this machine's own quantiles
    empty = BudgetReference(range_ms=(100.0, 250.0), latency_ms={}, keys=reference.keys)
    lo, hi = calibrate_budget_range(executor, executor.controller, rows, empty)
    assert 0 < lo < hi


def test_the_calibration_reference_reads_its_own_models_features_among_several(online_ws, embedded_runtime,
                                                                               executor, tmp_path):
    import shutil

    from online.calibrate import budget_reference
    from pipeline.workspace import Workspace

    _, ws = online_ws
    copy = Workspace(tmp_path / "ws")
    shutil.copytree(ws.root, copy.root)
    own = copy.features_dir / embedded_runtime.fingerprint[:16]
    other = copy.features_dir / ("0" * 16)  # features of another model, cached alongside
    shutil.copytree(own, other)
    for path in other.rglob("*.parquet"):
        table = pq.read_table(path)
        if "model_fingerprint" in table.column_names:
            i = table.column_names.index("model_fingerprint")
            table = table.set_column(i, table.schema.field(i), [["0" * 64] * table.num_rows])
            pq.write_table(table, path)
    parent = json.loads((copy.runs_dir / "offline-run" / "config.json").read_text())
    reference = budget_reference(copy, embedded_runtime, executor.samples, parent)
    assert reference is not None and reference.range_ms == (parent["budget_min_ms"], parent["budget_max_ms"])
    assert reference.latency_ms == budget_reference(ws, embedded_runtime, executor.samples, parent).latency_ms


def test_online_run_writes_rollouts_steps_and_checkpoint(online_ws, embedded_runtime):
    from online.train import train_online
    from pipeline.catalog import run_query
    from pipeline.schema import ONLINE_STEPS, ROLLOUTS
    from pipeline.workspace import check_table_schema
    from trainer.two_stage import TwoStageController

    _, ws = online_ws
    result = train_online(_config(ws, run_id="online-a"), runtime=embedded_runtime)
    run = result.run_dir
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["phase"] == "online" and cfg["parent_run_id"] == "offline-run" and cfg["reward"]["mode"] == "hard"
    assert len(result.steps) == 2 and result.steps["rollouts"].to_list() == [6, 6]
    for path, schema in ((run / "online_steps.parquet", ONLINE_STEPS),
                         (run / "rollouts" / "step-000001.parquet", ROLLOUTS)):
        check_table_schema(pq.read_schema(path), schema, path)
    rows = run_query(ws, """SELECT experiment, count(*) AS n, min(latency_total_ms) > 0 AS positive,
                                   bool_and(latency_controller_ms < latency_total_ms) AS ctrl_inside,
                                   bool_and(violated = (latency_total_ms > budget_ms)) AS viol_ok
                            FROM measurements WHERE run_id = 'online-a' GROUP BY 1""").to_pylist()
    assert rows == [{"experiment": "online", "n": 12, "positive": True, "ctrl_inside": True, "viol_ok": True}]
    # offline rows are still there, side by side
    assert run_query(ws, "SELECT count(*) AS n FROM measurements WHERE experiment = 'exp6'").to_pylist()[0]["n"] > 0
    ctrl = TwoStageController.load(result.checkpoint, embedded_runtime.fingerprint)
    # the budget encoder spans exactly the run's budget range (outside it, budgets read as its ends)
    assert (ctrl.policy.config.budget_min_ms, ctrl.policy.config.budget_max_ms) == (30.0, 300.0)


def test_loss_reaches_every_controller_part_through_the_decoder(embedded_runtime, executor):
    """Both stages learn from the shared reward: the rollouts' log-probabilities carry gradient
    into the stage-1 heads, the stage-2 heads and, through the recomputed latency token
    (decoder blocks 0..p-1), into the budget token."""
    ctrl = executor.controller
    with torch.no_grad():  # as after a first update: a zero projection would block the path
        ctrl.latency_proj.weight.normal_(0, 0.1)
    groups = [(i, 90.0) for i in range(2)]
    step = executor.run_groups(groups, 3, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1))
    assert len(step.rollouts) == 6 and 1 <= len(step.prefix_embeds) <= 6
    ctrl.train()
    ctrl.zero_grad()
    log_probs = ctrl(step.batch(executor.samples, embedded_runtime.device, executor.tiling_crops),
                     embedded_runtime.latency_token)
    sampled = torch.tensor([r.log_prob for r in step.rollouts])
    assert torch.allclose(log_probs.detach(), sampled, atol=1e-4)  # the loss scores what was sampled
    advantages = torch.linspace(-1, 1, len(log_probs))
    (-(advantages * log_probs).sum()).backward()
    for name in ("policy.crops_head.0.weight", "insertion_head.0.weight", "policy.top_k_head.0.weight",
                 "policy.blocks_head.0.weight", "budget_token_proj.weight", "latency_proj.weight"):
        grad = dict(ctrl.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    with torch.no_grad():
        ctrl.latency_proj.weight.zero_()
    ctrl.zero_grad()
    ctrl.eval()


def test_resume_continues_from_the_checkpoint(online_ws, embedded_runtime):
    from online.train import train_online

    _, ws = online_ws
    first = train_online(_config(ws, run_id="online-r", steps=2), runtime=embedded_runtime)
    saved = torch.load(first.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["step"] == 2
    # a step written after the last checkpoint (a crash before the next one) is redone, not duplicated
    rollouts = first.run_dir / "rollouts"
    (rollouts / "step-000003.parquet").write_bytes((rollouts / "step-000002.parquet").read_bytes())
    resumed = train_online(_config(ws, steps=4, resume="online-r"), runtime=embedded_runtime)
    assert resumed.run_id == "online-r" and resumed.steps["step"].to_list() == [1, 2, 3, 4]
    assert resumed.steps["loss"][:2].to_list() == first.steps["loss"].to_list()
    files = sorted(p.name for p in (first.run_dir / "rollouts").glob("*.parquet"))
    assert files == [f"step-00000{i}.parquet" for i in range(1, 5)]
    assert [set(pq.read_table(rollouts / f)["step"].to_pylist()) for f in files] == [{1}, {2}, {3}, {4}]
    run = pq.read_table(first.run_dir / "run.parquet").to_pylist()[0]
    assert run["status"] == "completed" and run["steps"] == 4


def test_a_tiling_aware_offline_policy_continues_online(online_ws, embedded_runtime):
    """Policies trained with --use-tilings read the image's tiling per crops choice; online
    computes it from the image size with the runtime's tiling rule."""
    from online.train import train_online
    from trainer import OfflineTrainConfig, RewardConfig, train_offline

    _, ws = online_ws
    train_offline(OfflineTrainConfig(workspace=ws.root, num_epochs=1, batch_size=16, run_id="offline-tilings",
                                     cross_fit_folds=0, use_tilings=True, reward=RewardConfig(mode="hard"),
                                     disable_evaluation=True))
    result = train_online(_config(ws, run_id="online-tilings", steps=1, from_run="offline-tilings"),
                          runtime=embedded_runtime)
    assert result.controller.policy.config.use_tilings and len(result.steps) == 1
    crops = result.controller.max_crops_values
    from online.data import load_online_samples

    samples = load_online_samples(ws, embedded_runtime.fingerprint)
    tiling = samples.tiling_crops(embedded_runtime, crops)
    with_image = samples.image_present
    assert torch.isnan(tiling[~with_image]).all() and not torch.isnan(tiling[with_image]).any()
    assert torch.all(tiling[with_image] <= torch.tensor(crops, dtype=torch.float32))


def test_online_run_is_evaluated_with_the_model_against_its_offline_start(online_ws, embedded_runtime, monkeypatch):
    from online.evaluate import evaluate_online_run
    from online.train import train_online
    from pipeline.catalog import run_query

    _, ws = online_ws
    train_online(_config(ws, run_id="online-eval", steps=1), runtime=embedded_runtime)
    from online.rollout import RolloutExecutor

    calls = []
    original = RolloutExecutor.run_groups

    def recording(self, groups, *args, **kwargs):
        calls.append((groups[0], id(kwargs["controller"])))
        return original(self, groups, *args, **kwargs)

    monkeypatch.setattr(RolloutExecutor, "run_groups", recording)
    frame = evaluate_online_run(ws, "online-eval", [40.0, 250.0], max_samples=2, runtime=embedded_runtime)
    # paired: each (sample, budget) runs both deciders back to back, the first one alternating
    assert len(calls) == 8
    pairs = [calls[i:i + 2] for i in range(0, 8, 2)]
    assert all(a[0] == b[0] and a[1] != b[1] for a, b in pairs)
    assert pairs[0][0][1] != pairs[1][0][1] and pairs[0][0][0] != pairs[1][0][0]
    # sample by sample, each sample's budgets back to back; the first decider alternates every request
    groups = [p[0][0] for p in pairs]
    assert [b for _, b in groups] == [40.0, 250.0, 40.0, 250.0]
    assert groups[0][0] == groups[1][0] != groups[2][0] == groups[3][0]
    firsts = [p[0][1] for p in pairs]
    assert firsts[0] == firsts[2] != firsts[1] == firsts[3]
    assert frame["decider"].to_list() == ["controller"] * 2 + ["offline_start"] * 2
    assert frame["num_samples"].to_list() == [2] * 4
    for row in frame.iter_rows(named=True):
        assert row["latency_ms_mean"] > 0 and 0 <= row["accuracy"] <= 1
        hist = json.loads(row["config_histogram"])
        assert sum(hist.values()) == 2
        if row["decider"] == "offline_start":  # deployed as is: insertion position 1
            assert all(label.endswith("@1") for label in hist)
    stored = run_query(ws, "SELECT count(*) AS n FROM evaluations WHERE run_id = 'online-eval'").to_pylist()
    assert stored == [{"n": 4}] and (ws.runs_dir / "online-eval" / "evaluation.png").exists()


def test_a_static_configuration_is_measured_paired_beside_a_controller(online_ws, embedded_runtime, executor):
    from online.calibrate import calibration_configs
    from online.evaluate import measure_paired

    fastest, _ = calibration_configs(executor.controller)
    rows = executor.samples.rows("test")[:2]
    out = measure_paired(executor, [("controller", executor.controller, None), ("fastest", fastest, None)], rows,
                         [40.0, 250.0])
    ctrl = executor.controller
    knobs = (ctrl.max_crops_values[fastest[0]], ctrl.top_k_values[fastest[2]],
             ctrl.num_active_blocks_values[fastest[3]])
    for budget in (40.0, 250.0):  # the same configuration at every budget, on the same samples
        static = out[("fastest", budget)]
        assert [r.sample for r in static] == rows == [r.sample for r in out[("controller", budget)]]
        assert {(r.max_crops, r.top_k, r.num_active_blocks) for r in static} == {knobs}
        assert {r.insertion_position for r in static} == {ctrl.insertion_positions[fastest[1]]}


def test_clear_errors_for_missing_runs_and_features(online_ws, embedded_runtime, tmp_path):
    from online.train import train_online
    from pipeline import CtrlError
    from pipeline.workspace import Workspace

    _, ws = online_ws
    with pytest.raises(CtrlError, match="not found"):
        train_online(_config(ws, from_run="no-such-run"), runtime=embedded_runtime)
    with pytest.raises(CtrlError, match="ctrl ingest"):
        train_online(_config(Workspace(tmp_path / "empty")), runtime=embedded_runtime)
    with pytest.raises(CtrlError, match="not an online run"):
        train_online(_config(ws, resume="offline-run"), runtime=embedded_runtime)


def test_cli_online_run_and_resume(online_ws, embedded_runtime):
    from typer.testing import CliRunner

    from cli import app

    _, ws = online_ws
    runner = CliRunner()
    args = ["train", "--online", "-w", str(ws.root), "--steps", "1", "--samples-per-step", "1", "--group-size", "2",
            "--max-new-tokens", "2", "--budget-min-ms", "30", "--budget-max-ms", "300", "--run-id", "online-cli",
            "--eval-max-samples", "1"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "online run online-cli: 1 steps, budget range 30.0-300.0 ms" in first.stdout
    assert "next: `ctrl evaluate online-cli`" in first.stdout
    assert "offline_start" in first.stdout  # the final evaluation's table
    resumed = runner.invoke(app, ["train", "--online", "-w", str(ws.root), "--steps", "2", "--resume", "online-cli",
                                  "--no-evaluate"])
    assert resumed.exit_code == 0, resumed.output
    assert "online run online-cli: 2 steps" in resumed.stdout
    bad = runner.invoke(app, ["train", "--online", "-w", str(ws.root), "--budget-min-ms", "30"])
    assert bad.exit_code == 1 and "pass both budget_min_ms and budget_max_ms" in bad.stderr


# -- distributed ------------------------------------------------------------------------------

def _dist_worker(rank: int, ws_root: str, out: str) -> None:
    from online.config import OnlineTrainConfig
    from online.train import train_online

    config = OnlineTrainConfig(workspace=ws_root, steps=2, samples_per_step=2, group_size=3, max_new_tokens=3,
                               budget_min_ms=30.0, budget_max_ms=300.0, run_id="online-ddp", lr=1e-2, evaluate=False)
    result = train_online(config)
    torch.save({"steps": result.steps["step"].to_list(), "state": result.controller.state_dict()},
               f"{out}/rank{rank}.pt")


def test_two_process_gloo_run(online_ws, tmp_path):
    from torchrun import run_ranks

    _, ws = online_ws
    run_ranks(_dist_worker, (str(ws.root), str(tmp_path)), env={"CTRL_CACHE_DIR": os.environ.get("CTRL_CACHE_DIR", "")})
    done = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert [d["steps"] for d in done] == [[1, 2], [1, 2]]
    # DDP kept the two ranks' controllers identical
    assert all(torch.equal(v, done[1]["state"][k]) for k, v in done[0]["state"].items())
    rollouts = pq.read_table(ws.runs_dir / "online-ddp" / "rollouts" / "step-000001.parquet").to_pylist()
    assert sorted({r["rank"] for r in rollouts}) == [0, 1]  # both ranks ran members
    assert len(rollouts) == 6 and sorted((r["group_index"], r["member"]) for r in rollouts) == [
        (g, m) for g in range(2) for m in range(3)]
    assert all(r["world_size"] == 2 for r in rollouts)


def test_a_runtime_without_two_stage_execution_is_refused_with_one_line(online_ws, embedded_runtime):
    """A backend that lacks the split prefill (the interface's defaults) stops the online phase
    with a CtrlError naming the runtime, not a traceback from deep inside a rollout."""
    from online.train import train_online
    from pipeline import CtrlError
    from runtime.base import ModelRuntime

    class NoSplitPrefill(type(embedded_runtime)):
        kind = "no-split"
        hidden_size = ModelRuntime.hidden_size
        embedding_rms = ModelRuntime.embedding_rms
        prefill_prefix = ModelRuntime.prefill_prefix

    runtime = object.__new__(NoSplitPrefill)
    runtime.__dict__.update(embedded_runtime.__dict__)
    _, ws = online_ws
    with pytest.raises(CtrlError, match=r"^the no-split runtime does not implement two-stage") as info:
        train_online(_config(ws, fresh=True), runtime=runtime)
    assert "\n" not in str(info.value)


def test_a_rollout_part_that_captured_a_graph_is_timed_again(executor, embedded_runtime):
    """A rollout's prefix or answer that captured a CUDA graph (a new shape) is run again and the
    second run timed, so no reward reads a capture. The rerun backend stands in for a GPU's graphs."""
    from runtime.cuda_graphs import GraphCache, RerunBackend
    from runtime.fast_decoder import CpuFormulation, CudaFormulation

    decoder = embedded_runtime.fast
    decoder.use(CudaFormulation(decoder, grouped=True), GraphCache(RerunBackend()), GraphCache(RerunBackend()))
    calls: list[tuple[str, bool]] = []
    inner = executor.executor
    originals = {"prefix": inner.prefix, "answer": inner.answer}

    def counted(name):
        def call(*args, **kwargs):
            before = embedded_runtime.graph_captures
            result = originals[name](*args, **kwargs)
            calls.append((name, embedded_runtime.graph_captures > before))
            return result
        return call

    inner.prefix, inner.answer = counted("prefix"), counted("answer")
    try:
        sample = _image_sample(executor.samples)
        ctrl = executor.controller
        knobs_ = (ctrl.max_crops_values.index(10), 0, 0, int(ctrl.blocks_valid[0].nonzero()[0].item()))
        executor.run_fixed([sample], knobs_)  # warms this configuration up (its warm-ups capture)
        decoder.graphs.clear()  # as a sample of a shape the warm-up did not see finds them
        decoder.prefill_graphs.clear()
        calls.clear()
        rollouts = executor.run_fixed([sample], knobs_)
    finally:
        inner.prefix, inner.answer = originals["prefix"], originals["answer"]
        decoder.use(CpuFormulation(decoder))
    assert len(rollouts) == 1 and [name for name, captured in calls if captured] == ["prefix", "answer"]
    for (name, captured), (next_name, next_captured) in zip(calls, calls[1:]):
        if captured:  # the same part again, and that run captured nothing
            assert next_name == name and not next_captured
    assert not calls[-1][1]


# -- batched rollouts ---------------------------------------------------------------------------
def _seed_latency_model(model, top_k_values, blocks_values, tokens=(40, 120, 300)):
    """Hand-made observations for every top-K: suffix = 2 + 0.01 x blocks x tokens, step = 1 + 0.5 x active blocks."""
    from online.latency_model import MemberShape

    for k in top_k_values:
        for blocks, t in zip(blocks_values, tokens, strict=False):
            model.observe(MemberShape(k, blocks - 1, blocks, t), 2 + 0.01 * (blocks - 1) * t, None,
                          [1 + 0.5 * blocks] * 2)


def test_batched_rollouts_draw_and_answer_what_batch_1_does(online_ws, embedded_runtime, executor):
    """--rollout-batch N: the same knobs, log-probabilities and answers as every member alone; the
    members that ran batched carry the latency model's suffix and decode steps (known here: the
    model holds hand-made observations only), the ones timed alone their own measurements."""
    from online.rollout import RolloutExecutor

    groups = [(s, 120.0) for s in range(6)]

    def run(batch_rows):
        ex = RolloutExecutor(embedded_runtime, executor.controller, executor.samples, max_new_tokens=4)
        ctrl = ex.controller
        _seed_latency_model(ex.latency_model, ctrl.top_k_values, ctrl.num_active_blocks_values)
        ex.latency_model.observe = lambda *args: None  # the model stays the hand-made one: its predictions are known
        try:
            return ex, ex.run_groups(groups, 4, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2),
                                     batch_rows=batch_rows, timed_generator=torch.Generator().manual_seed(3))
        finally:
            ex.close()

    _, alone = run(1)
    ex, batched = run(4)
    key = ("group", "member", "sample", "crops_index", "insertion_index", "top_k_index", "blocks_index", "text",
           "active_blocks", "num_output_tokens", "prefix")
    assert [[getattr(r, k) for k in key] for r in batched.rollouts] == [[getattr(r, k) for k in key]
                                                                       for r in alone.rollouts]
    assert [r.log_prob for r in batched.rollouts] == pytest.approx([r.log_prob for r in alone.rollouts])
    assert batched.prefix_first_member == alone.prefix_first_member
    assert not any(r.latency_modeled for r in alone.rollouts) and alone.latency_model_errors
    modeled = [r for r in batched.rollouts if r.latency_modeled]
    timed = [r for r in batched.rollouts if not r.latency_modeled]
    assert modeled and timed and len(batched.latency_model_errors) == len(timed) and batched.modeled == len(modeled)
    for r in modeled:
        tokens = ex._model_inputs(r.sample, r.max_crops).input_ids.shape[-1]
        suffix_blocks = sum(b >= r.insertion_position for b in r.active_blocks)
        step = 1 + 0.5 * len(r.active_blocks)
        suffix = next(wall for name, wall, _, _ in r.segments if name == "suffix")
        assert suffix == pytest.approx(2 + 0.01 * suffix_blocks * tokens)
        assert r.decode_step_ms == pytest.approx([step] * (r.num_output_tokens - 1))
        measured = sum(wall for name, wall, _, _ in r.segments if name in ("stage1", "prefix", "stage2"))
        assert r.latency_total_ms == pytest.approx(measured + suffix + step * (r.num_output_tokens - 1))
    for r in timed:  # its own hook measurements: decode steps of a real model are not all equal to the line
        assert r.latency_total_ms == pytest.approx(sum(wall for _, wall, _, _ in r.segments))


def test_rollout_batch_is_auto_or_a_positive_count(embedded_runtime):
    from online.config import OnlineTrainConfig
    from online.rollout import rollout_rows
    from pipeline import CtrlError
    from runtime.base import ModelRuntime

    assert OnlineTrainConfig().rollout_batch == "auto" and OnlineTrainConfig(rollout_batch=4).rollout_batch == "4"
    for bad in ("0", "-2", "many", True):
        with pytest.raises(ValueError, match="rollout_batch must be 'auto' or a positive integer"):
            OnlineTrainConfig(rollout_batch=bad)
    assert rollout_rows("auto", embedded_runtime) is None  # as many rows as fit, on a CPU too
    assert rollout_rows("6", embedded_runtime) == 6

    class NoBatches(type(embedded_runtime)):
        kind = "no-batches"
        batches = ModelRuntime.batches

    runtime = object.__new__(NoBatches)
    runtime.__dict__.update(embedded_runtime.__dict__)
    assert rollout_rows("auto", runtime) == 1 and rollout_rows("1", runtime) == 1
    with pytest.raises(CtrlError, match="--rollout-batch 3: the no-batches runtime does not run batched"):
        rollout_rows("3", runtime)


def test_a_batched_online_run_records_which_latencies_were_modeled(online_ws, embedded_runtime):
    from online.train import train_online
    from pipeline.catalog import run_query

    _, ws = online_ws
    result = train_online(_config(ws, run_id="online-batched", rollout_batch="4", steps=3, group_size=4),
                          runtime=embedded_runtime)
    rows = run_query(ws, """SELECT step, count(*) FILTER (WHERE latency_modeled) AS modeled,
                                   count(*) FILTER (WHERE NOT latency_modeled) AS timed
                            FROM rollouts WHERE run_id = 'online-batched' GROUP BY step ORDER BY step""").to_pylist()
    steps = result.steps.sort("step")
    assert [r["modeled"] for r in rows] == steps["rollouts_modeled"].to_list()
    assert [r["modeled"] + r["timed"] for r in rows] == [8, 8, 8]
    assert json.loads((result.run_dir / "config.json").read_text())["rollout_batch"] == "4"
