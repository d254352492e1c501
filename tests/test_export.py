"""ctrl export and the deployed controller: the same decisions as the training-time policy, its
table fallback and `ctrl predict`, from a file that torch alone loads."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from cli import app
from conftest import build_feature_workspace

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, embedded_runtime):
    """A workspace with an offline run (tilings on, as by default) and a copy of its checkpoint whose
    table fallback answers at every other grid budget, so that both sources decide."""
    from synthetic import SyntheticSpec
    from trainer.config import OfflineTrainConfig
    from trainer.fallback import attach_fallback, read_fallback
    from trainer.offline import train_offline

    root = tmp_path_factory.mktemp("export")
    _, ws = build_feature_workspace(root, embedded_runtime, SyntheticSpec(num_samples=30))
    result = train_offline(OfflineTrainConfig(workspace=ws.root, num_epochs=2, run_id="r1", cross_fit_folds=0,
                                              warm_start_steps=20, disable_evaluation=True))
    best = ws.runs_dir / "r1" / "checkpoints" / "best.pt"
    assert result.run_id == "r1" and best.exists()
    mixed = root / "mixed.pt"
    shutil.copyfile(best, mixed)
    fallback = read_fallback(mixed)
    fallback.use_controller = [i % 2 == 0 for i in range(len(fallback.grid_ms))]
    fallback.request_table = fallback.request_table_at = None  # the per-request table: its own test below
    attach_fallback(mixed, fallback)
    return ws, best, mixed


def _inputs(ws, checkpoint):
    from controller.predict import read_prediction_inputs
    from trainer.policy import ControllerPolicy

    policy = ControllerPolicy.load(checkpoint)
    feats = read_prediction_inputs(ws, policy)
    return policy, feats


def _expected_network(policy, image, present, lang, budget, tilings, crops=None):
    """The network's greedy decision from the policy's own stage outputs, (N,) action indices: the
    crops of highest log p1 (or the crops columns ``crops``), then among that crops value's actions
    the highest log p2(top_k) + log p3(blocks)."""
    with torch.inference_mode():
        crops_lp, lang_h, budget_h = policy.stage1(lang, budget, tiling_crops=tilings)
        top_k_lp, blocks_lp = policy.stage2_heads(policy.stage2_hidden(image, present, lang_h, budget_h,
                                                                       tiling_crops=tilings))
    if crops is None:
        crops = crops_lp.argmax(-1)
    knobs = policy.action_space.knob_indices()
    rows = torch.arange(len(lang))
    score = top_k_lp[rows, crops][:, knobs[:, 1]] + blocks_lp[rows, crops][:, knobs[:, 2]]
    return score.masked_fill(knobs[None, :, 0] != crops[:, None], float("-inf")).argmax(-1)


def _table_choice(table, budget, lang):
    """The training-time table's choice (N,) for budgets (N,): per question where it reads the family."""
    from trainer.baselines import QuestionFamilyTableDecider

    if isinstance(table, QuestionFamilyTableDecider):
        return table.choose(budget, lang, None)
    return table.choose(budget, None)


def _budgets(grid: list[float]) -> list[float]:
    """Grid points, the points halfway between them, and budgets below and above the range."""
    between = [(a + b) / 2 + 0.3 for a, b in zip(grid, grid[1:])]
    return [grid[0] - 80.0, *grid, *between, grid[-1] + 150.0]


def test_decisions_equal_the_policy_and_its_table_fallback(trained):
    """Expected: the training-time network's sequential greedy choice over the whole action space where
    the nearest grid budget keeps the controller, else the fallback table's choice for the budget and
    the question (lut_by_question: the data records question families)."""
    from controller.deploy import DeployedController
    from trainer.fallback import read_fallback

    ws, _, mixed = trained
    policy, f = _inputs(ws, mixed)
    fallback = read_fallback(mixed)
    table = fallback.lookup_table()
    deployed = DeployedController(policy, fallback)
    assert policy.config.use_tilings and not torch.isnan(f["tiling_crops"]).all()
    n = len(f["sample_key"])
    present = f["image_present"].clone()
    present[1::4] = False  # a missing image: its features (any values) must not count
    image = torch.where(present[:, None], f["image"], torch.randn(f["image"].shape))
    some_unknown = f["tiling_crops"].clone()
    some_unknown[::3] = float("nan")
    sources = set()
    table_varies = False  # the question-family table gives samples of one budget different configurations
    for tilings in (f["tiling_crops"], some_unknown, None):
        for budget in _budgets(fallback.grid_ms):
            b = torch.full((n,), budget, dtype=torch.float64)
            with torch.inference_mode():
                probs = policy.log_probs(image, present, f["lang"], budget, None, tiling_crops=tilings).exp()
                # the whole distribution, not only its argmax (a short training leaves near-uniform heads)
                assert torch.allclose(deployed.probabilities(f["lang"], image, present, b, tilings), probs,
                                      rtol=1e-4, atol=1e-6)
            network = _expected_network(policy, image, present, f["lang"], budget, tilings)
            use = fallback.controller_at(b)
            by_table = _table_choice(table, torch.full((n,), budget), f["lang"])
            table_varies |= len(set(by_table.tolist())) > 1
            expected = torch.where(use, network, by_table)
            with torch.inference_mode():
                actions, by_network = deployed.decide_actions(f["lang"], image, present, b, tilings)
            assert torch.equal(by_network, use), budget
            assert torch.equal(actions, expected), budget
            sources.update(use.tolist())
    assert sources == {True, False} and table_varies


def test_the_exported_file_carries_the_median_training_latency_per_configuration(trained, tmp_path):
    """What a server calibrates its latency scale against: per action, the median recorded latency of
    the training split (the split the fallback's table was built on); NaN where train never recorded it."""
    import numpy as np

    from controller.deploy import DeployedController, load_deployed, save_deployed
    from trainer.data import load_offline_data
    from trainer.fallback import read_fallback
    from trainer.policy import ControllerPolicy

    ws, best, _ = trained
    policy = ControllerPolicy.load(best)
    exported = load_deployed(save_deployed(DeployedController(policy, read_fallback(best)), tmp_path / "c.pt"))
    train = load_offline_data(ws).subset("train")
    by_action = dict(zip(train.action_space.actions, range(len(train.action_space))))
    reference = exported.reference_latency_ms
    assert reference.dtype == torch.float64 and len(reference) == len(policy.action_space)
    for action, got in zip(policy.action_space.actions, reference.tolist()):
        j = by_action[action]
        recorded = train.latency_ms[train.mask[:, j], j].double().numpy()
        if len(recorded) == 0:
            assert np.isnan(got)
        else:
            assert got == pytest.approx(float(np.median(recorded)), rel=1e-6)
    assert not torch.isnan(reference).all()
    without = DeployedController(policy, None)
    assert without.reference_latency_ms.numel() == 0


def test_without_a_fallback_the_network_decides_every_budget(trained):
    from controller.deploy import DeployedController

    ws, best, _ = trained
    policy, f = _inputs(ws, best)
    deployed = DeployedController(policy, None)
    for budget in (120.0, 260.0, 900.0):
        b = torch.full((len(f["lang"]),), budget)
        expected = _expected_network(policy, f["image"], f["image_present"], f["lang"], budget, f["tiling_crops"])
        with torch.inference_mode():
            actions, by_network = deployed.decide_actions(f["lang"], f["image"], f["image_present"], b,
                                                          f["tiling_crops"])
        assert by_network.all() and torch.equal(actions, expected)


def test_the_exported_files_two_stages_are_the_sequential_decision_and_the_evaluations(trained, tmp_path):
    """The loaded TorchScript file, as a server calls it: stage1 alone is the argmax of the policy's
    log p1(crops) (with tilings) or the table's crops; stage2 at any crops value is the argmax of the
    policy's stage-2 log-probs over that value's actions, or the table's top_k and blocks; decide is
    stage1 then stage2, and what PolicyDecider (ctrl evaluate's controller) decides."""
    from controller.deploy import DeployedController, load_deployed, save_deployed
    from trainer.data import load_offline_data
    from trainer.fallback import PolicyDecider, read_fallback

    ws, _, mixed = trained
    policy, f = _inputs(ws, mixed)
    fallback = read_fallback(mixed)
    table = fallback.lookup_table()
    exported = load_deployed(save_deployed(DeployedController(policy, fallback), tmp_path / "controller.pt"))
    values = torch.tensor(policy.action_space.max_crops_values)
    actions = torch.tensor(policy.action_space.actions)
    n = len(f["sample_key"])
    lang, image, present = f["lang"], f["image"], f["image_present"]
    seen = set()
    for tilings in (f["tiling_crops"], None):
        for budget in _budgets(fallback.grid_ms):
            b = torch.full((n,), budget)
            use = fallback.controller_at(b)
            table_action = actions[_table_choice(table, b, lang)]
            with torch.inference_mode():
                crops_lp = policy.crops_log_probs(lang, budget, tiling_crops=tilings)
                crops = exported.stage1(lang, b, tilings)
            assert crops.dtype == torch.int64 and crops.shape == (n,)
            assert torch.equal(exported.network_decides(b), use)
            assert torch.equal(crops, torch.where(use, values[crops_lp.argmax(-1)], table_action[:, 0])), budget
            for column, value in enumerate(values.tolist()):
                expected = actions[_expected_network(policy, image, present, lang, budget, tilings,
                                                     torch.full((n,), column))]
                with torch.inference_mode():
                    top_k, blocks = exported.stage2(lang, image, present, b, torch.full((n,), value), tilings)
                assert top_k.dtype == blocks.dtype == torch.int64
                expected = torch.where(use[:, None], expected[:, 1:], table_action[:, 1:])
                assert torch.equal(torch.stack([top_k, blocks], 1), expected), (budget, value)
            with torch.inference_mode():
                top_k, blocks = exported.stage2(lang, image, present, b, crops, tilings)
                decided = torch.stack(exported.decide(lang, image, present, b, tilings), 1)
            assert torch.equal(decided, torch.stack([crops, top_k, blocks], 1)), budget
            seen.update(use.tolist())
    assert seen == {True, False}

    data = load_offline_data(ws, policy.model_fingerprint)
    assert data.action_space == policy.action_space and data.tiling_crops is not None
    full = data.mask.all(-1)  # a server ranges over every configuration; the evaluation over the recorded ones
    assert int(full.sum()) >= len(data) // 2
    rows = torch.arange(len(data))[full]
    decider = PolicyDecider(policy, fallback)
    for budget in _budgets(fallback.grid_ms):
        b = torch.full((len(data),), budget)
        with torch.inference_mode():
            decided = torch.stack(exported.decide(data.lang_features, data.image_features, data.image_present, b,
                                                  data.tiling_crops), 1)
        assert torch.equal(decided[rows], actions[decider.decide(data, budget)][rows]), budget


@pytest.mark.parametrize("with_fallback", [False, True])
def test_every_tensor_the_module_makes_follows_its_device(trained, with_fallback):
    """On the meta device a tensor made on the CPU meets the module's own and fails: what lets the
    module run where it is moved (CUDA). Tilings left out and the fallback off exercise the tensors
    the module makes itself; the fallback's data-dependent branch cannot run on meta."""
    from controller.deploy import DeployedController
    from trainer.fallback import read_fallback

    ws, best, mixed = trained
    policy, f = _inputs(ws, best)
    deployed = DeployedController(policy, read_fallback(mixed) if with_fallback else None).to("meta")
    n = 4
    args = (torch.zeros(n, deployed.lang_dim, device="meta"), torch.zeros(n, deployed.image_dim, device="meta"),
            torch.ones(n, dtype=torch.bool, device="meta"), torch.full((n,), 200.0, device="meta"))
    with torch.inference_mode():
        probs = deployed.probabilities(*args)
        assert probs.device.type == "meta" and probs.shape == (n, len(policy.action_space.actions))
        if not with_fallback:
            actions, by_network = deployed.decide_actions(*args)
            assert actions.device.type == by_network.device.type == "meta"
        else:
            table_device = deployed._table_choice(args[0], args[3]).device.type
            assert table_device == deployed._use_network(args[0], args[3]).device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_exported_file_decides_on_cuda_as_on_the_cpu(trained, tmp_path):
    from controller.deploy import DeployedController, load_compiled, save_compiled
    from trainer.fallback import read_fallback

    ws, _, mixed = trained
    policy, f = _inputs(ws, mixed)
    out = tmp_path / "controller.pt"
    assert runner.invoke(app, ["export", str(mixed), "-w", str(ws.root), "--out", str(out)]).exit_code == 0
    on_cpu = torch.jit.load(str(out))
    on_cuda = torch.jit.load(str(out), map_location="cuda")
    package = load_compiled(save_compiled(DeployedController(policy, read_fallback(mixed)), tmp_path / "c.pt2",
                                          device="cuda"))
    inputs = (f["lang"], f["image"], f["image_present"])
    for budget in _budgets(read_fallback(mixed).grid_ms):
        b = torch.full((len(f["lang"]),), budget)
        with torch.inference_mode():
            expected = torch.stack(on_cpu.decide(*inputs, b, f["tiling_crops"]), 1)
            cuda_args = [t.cuda() for t in (*inputs, b, f["tiling_crops"])]
            got = torch.stack(on_cuda.decide(*cuda_args), 1)
            compiled = torch.stack(package(*cuda_args), 1)
        assert got.device.type == compiled.device.type == "cuda"
        assert torch.equal(got.cpu(), expected) and torch.equal(compiled.cpu(), expected), budget


@given(stats=st.lists(st.one_of(st.none(), st.sampled_from([120.0, 150.0, 150.0, 180.5, 240.0])), min_size=2,
                      max_size=8),
       scores=st.lists(st.sampled_from([0.2, 0.5, 0.5, 0.9]), min_size=8, max_size=8),
       tolerance=st.sampled_from([0.0, 0.05]))
def test_table_steps_give_the_tables_choice_at_every_budget(stats, scores, tolerance):
    """The table as a step function of the budget: equal to LookupTableDecider.choose, ties and
    configurations never seen in training included."""
    from controller.deploy import step_lookup, table_steps
    from trainer.baselines import LookupTableDecider
    from trainer.data import ActionSpace

    if all(s is None for s in stats):
        stats[0] = 200.0
    n = len(stats)
    table = LookupTableDecider.__new__(LookupTableDecider)
    table.action_space = ActionSpace(tuple((2, 8, 10 + i) for i in range(n)))
    table.statistic, table.quantile, table.tolerance, table.name = "quantile", 0.95, tolerance, "t"
    table.num_samples = torch.tensor([0 if s is None else 5 for s in stats])
    table.mean_score = torch.tensor([float("nan") if s is None else v for s, v in zip(stats, scores)],
                                    dtype=torch.float64)
    table.latency_stat_ms = torch.tensor([float("nan") if s is None else s for s in stats], dtype=torch.float64)
    thresholds, choices = table_steps(table)
    budgets = torch.tensor([50.0, 119.9, 120.0, 142.0, 149.99, 150.0, 171.9, 180.5, 200.0, 239.0, 240.0, 1e4])
    assert torch.equal(step_lookup(thresholds, choices, budgets, tolerance), table.choose(budgets, None))


def test_exported_files_decide_like_predict_in_a_process_without_ctrl(trained, tmp_path):
    """The TorchScript file and the compiled package, loaded where no project code can be imported."""
    from trainer.fallback import read_fallback

    ws, best, _ = trained
    out, compiled = tmp_path / "controller.pt", tmp_path / "controller.pt2"
    for path, extra, loader in ((out, [], "torch.jit.load(FILE).stage1("),
                                (compiled, ["--compiled"], "torch._inductor.aoti_load_package(FILE)(")):
        exported = runner.invoke(app, ["export", "latest", "-w", str(ws.root), "--out", str(path), *extra])
        assert exported.exit_code == 0, exported.output
        assert str(path) in exported.stdout and "KiB" in exported.stdout and loader in exported.stdout
        assert "tiling_crops [B, 3]" in exported.stdout
        # a per-request table that answers at some budget also reads the prompts' lengths
        uses_prompt = any(read_fallback(best).request_table_at or [])
        assert ("prompt_tokens [B]" in exported.stdout) == uses_prompt
        assert ".expected_latency(" in exported.stdout  # every run deploys its cost model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["controller.pt", "controller.pt2"]  # no temporary file
    policy, f = _inputs(ws, best)
    from trainer.fallback import read_fallback

    budgets = _budgets(read_fallback(best).grid_ms)
    decisions = tmp_path / "decisions.parquet"
    args = ["predict", "--run", "r1", "-w", str(ws.root), "--out", str(decisions)]
    for b in budgets:
        args += ["--budget-ms", str(b)]
    assert runner.invoke(app, args).exit_code == 0
    inputs = tmp_path / "inputs.pt"
    torch.save({k: f[k] for k in ("lang", "image", "image_present", "tiling_crops", "prompt_tokens")} | {
        "budgets": torch.tensor(budgets, dtype=torch.float64)}, inputs)
    site = Path(torch.__file__).resolve().parents[1]
    script = f"""
import importlib.util, sys
sys.path.append({str(site)!r})  # torch's site-packages only: -I -S leaves the project and its .pth files out
assert [m for m in ("cli", "pipeline", "trainer", "runtime") if importlib.util.find_spec(m)] == [], sys.path
import torch
import torch._inductor
x = torch.load({str(inputs)!r})
n = x["lang"].shape[0]
for name, decide in (("torchscript", torch.jit.load({str(out)!r}).decide),
                     ("compiled", torch._inductor.aoti_load_package({str(compiled)!r}))):
    result = []
    for b in x["budgets"].tolist():
        extra = (x["prompt_tokens"],) if {uses_prompt} else ()
        knobs = decide(x["lang"], x["image"], x["image_present"], torch.full((n,), b), x["tiling_crops"], *extra)
        assert all(k.dtype == torch.int64 and k.shape == (n,) for k in knobs)
        result.append(torch.stack(knobs, 1))
    torch.save(torch.stack(result), {str(tmp_path)!r} + "/" + name + ".pt")
"""
    # -I ignores PYTHONPYCACHEPREFIX: without the session's bytecode it compiles torch again
    prefix = ["-X", f"pycache_prefix={sys.pycache_prefix}"] if sys.pycache_prefix else []
    done = subprocess.run([sys.executable, "-I", "-S", *prefix, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    frame = pl.read_parquet(decisions)
    assert frame.height == len(budgets) * len(f["sample_key"])
    for name in ("torchscript", "compiled"):
        got = torch.load(tmp_path / f"{name}.pt")  # (budgets, samples, 3)
        for i, budget in enumerate(budgets):
            rows = frame.filter(pl.col("budget_ms") == budget)
            assert rows["sample_key"].to_list() == f["sample_key"]
            expected = rows.select("max_crops", "top_k", "num_active_blocks").to_torch()
            assert torch.equal(got[i], expected), (name, budget)


def test_predict_reports_the_networks_probability_and_the_source(trained, tmp_path):
    from controller.predict import predict
    from trainer.fallback import read_fallback

    ws, _, mixed = trained
    policy, f = _inputs(ws, mixed)
    fallback = read_fallback(mixed)
    budgets = fallback.grid_ms[:2]  # the first keeps the controller, the second answers with the table
    frame = predict(ws, mixed, budgets, None)
    first = frame.filter(pl.col("budget_ms") == budgets[0])
    with torch.inference_mode():
        probs = policy.log_probs(f["image"], f["image_present"], f["lang"], budgets[0], None,
                                 tiling_crops=f["tiling_crops"]).exp()
    chosen = _expected_network(policy, f["image"], f["image_present"], f["lang"], budgets[0], f["tiling_crops"])
    assert first["source"].unique().to_list() == ["controller"]
    assert first["probability"].to_list() == pytest.approx(probs.gather(1, chosen[:, None])[:, 0].tolist(), rel=1e-5)
    second = frame.filter(pl.col("budget_ms") == budgets[1])
    assert second["source"].unique().to_list() == ["table"] and second["probability"].unique().to_list() == [1.0]
    by_table = _table_choice(fallback.lookup_table(), torch.full((len(f["lang"]),), budgets[1]), f["lang"])
    expected = {key: policy.action_space.actions[i] for key, i in zip(f["sample_key"], by_table.tolist())}
    assert {row[0]: tuple(row[1:]) for row in second.select("sample_key", "max_crops", "top_k",
                                                            "num_active_blocks").rows()} == expected


def test_export_errors_are_one_line(trained, tmp_path):
    ws, _, _ = trained
    missing = runner.invoke(app, ["export", "no-such-run", "-w", str(ws.root), "--out", str(tmp_path / "c.pt")])
    assert missing.exit_code == 1 and "run 'no-such-run' not found" in missing.stderr
    inside = runner.invoke(app, ["export", "r1", "-w", str(ws.root), "--out", str(ws.runs_dir / "r1" / "c.pt")])
    assert inside.exit_code == 1 and "refusing to write the exported controller over the workspace" in inside.stderr
    assert not (ws.runs_dir / "r1" / "c.pt").exists()
    cases = [(["--device", "cuda:0"], "--device cuda:0: only a compiled package is built for a device"),
             (["--device", "tpu", "--compiled"], "--device tpu: not a device to compile the controller for")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda", "--compiled"], "--device cuda: CUDA is not available here"))
    for options, message in cases:
        done = runner.invoke(app, ["export", "r1", "-w", str(ws.root), "--out", str(tmp_path / "d.pt"), *options])
        assert done.exit_code == 1 and message in done.stderr, options
        assert len(done.stderr.strip().splitlines()) == 2  # the error and its hint
    assert not (tmp_path / "d.pt").exists()


def test_compiled_export_without_a_compiler_says_so(trained, tmp_path, monkeypatch):
    ws, _, _ = trained
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++, g++ or clang++ to be found
    monkeypatch.delenv("CXX", raising=False)
    done = runner.invoke(app, ["export", "r1", "-w", str(ws.root), "--out", str(tmp_path / "c.pt2"), "--compiled"])
    assert done.exit_code == 1 and "no C++ compiler to compile the controller with" in done.stderr
    assert "Hint: install g++ or clang, or export without --compiled" in done.stderr
    assert not (tmp_path / "c.pt2").exists()


@pytest.mark.parametrize("drop", [(), ((6, 8, 12), (2, 4, 16))])
def test_full_and_partial_action_spaces_without_tilings(drop):
    """A policy over all 2 x 2 x 2 configurations and one over six of them, tilings off."""
    import itertools

    from controller.deploy import DeployedController
    from trainer.data import ActionSpace
    from trainer.policy import ControllerPolicy, PolicyConfig

    torch.manual_seed(3)
    actions = tuple(a for a in itertools.product((2, 6), (4, 8), (12, 16)) if a not in drop)
    policy = ControllerPolicy(PolicyConfig(lang_feature_dim=5, image_feature_dim=3, budget_min_ms=100.0,
                                           budget_max_ms=300.0), ActionSpace(actions)).eval()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    deployed = DeployedController(policy, None)
    assert deployed.full_product == (drop == ())
    n = 64
    lang, image, present = torch.randn(n, 5), torch.randn(n, 3), torch.rand(n) > 0.3
    budget = 50.0 + 300.0 * torch.rand(n)
    with torch.inference_mode():
        probs = policy.log_probs(image, present, lang, budget, None).exp()
        assert torch.allclose(deployed.probabilities(lang, image, present, budget), probs, rtol=1e-4, atol=1e-6)
        knobs = torch.stack(deployed(lang, image, present, budget), 1)
        crops = deployed.stage1(lang, budget)
        top_k, blocks = deployed.stage2(lang, image, present, budget, crops)
    assert torch.equal(knobs, torch.tensor(actions)[_expected_network(policy, image, present, lang, budget, None)])
    assert torch.equal(torch.stack([crops, top_k, blocks], 1), knobs)


def test_latest_is_the_newest_offline_run_and_online_runs_are_refused(trained, tmp_path):
    """Two offline runs and a newer online run: `latest` is the newer offline one; predict and export
    refuse the online run with one line."""
    import json
    import os

    ws, _, _ = trained
    newer = ws.runs_dir / "r2"
    shutil.copytree(ws.runs_dir / "r1", newer)
    online = ws.runs_dir / "o1"
    online.mkdir()
    (online / "config.json").write_text(json.dumps({"phase": "online", "run_id": "o1"}))
    now = (ws.runs_dir / "r1" / "config.json").stat().st_mtime_ns
    os.utime(newer / "config.json", ns=(now + 10**9, now + 10**9))
    os.utime(online / "config.json", ns=(now + 2 * 10**9, now + 2 * 10**9))
    try:
        out = tmp_path / "c.pt"
        exported = runner.invoke(app, ["export", "latest", "-w", str(ws.root), "--out", str(out)])
        assert exported.exit_code == 0, exported.output
        assert f"from {newer.resolve() / 'checkpoints' / 'best.pt'}" in exported.stdout
        for args in (["predict", "--run", "o1", "--budget-ms", "200", "--out", str(tmp_path / "d.csv")],
                     ["export", "o1", "--out", str(tmp_path / "c2.pt")]):
            refused = runner.invoke(app, [*args, "-w", str(ws.root)])
            assert refused.exit_code == 1 and "o1 is an online run" in refused.stderr
            assert len(refused.stderr.strip().splitlines()) == 2  # the error and its hint
    finally:
        shutil.rmtree(newer)
        shutil.rmtree(online)


# -- the decision rule on a policy whose decisions are known by construction -------------------------

FULL_PRODUCT = tuple((c, k, b) for c in (2, 6, 10) for k in (4, 8, 12) for b in (12, 14, 16))


def _hand_set_policy(actions):
    """The same distribution for every input: p1(crops 2, 6, 10) = (0.3, 0.5, 0.2); at crops 2,
    top_k 4 and 12 blocks almost surely; at crops 6, every top_k and every block count equally
    likely (exact ties); at crops 10, top_k 12 and 14 blocks almost surely.

    The joint mode is therefore (2, 4, 12) (0.3 against at most 0.5 / 9 for a crops-6 action); the
    sequential greedy decision is crops 6, and on its tie the first crops-6 action."""
    from trainer.data import ActionSpace
    from trainer.policy import ControllerPolicy, PolicyConfig

    policy = ControllerPolicy(PolicyConfig(lang_feature_dim=2, image_feature_dim=2, budget_min_ms=100.0,
                                           budget_max_ms=300.0, hidden_dim=4, crops_embedding_dim=4),
                              ActionSpace(actions)).eval()
    with torch.no_grad():
        policy.crops_head[2].weight.zero_()
        policy.crops_head[2].bias.copy_(torch.tensor([0.3, 0.5, 0.2]).log())
        # stage 2's hidden state is the crops choice alone: after its LayerNorm and ReLU, 1.73 in
        # coordinate c for crops column c, 0 elsewhere
        policy.stage2_context.weight.zero_()
        policy.stage2_context.bias.zero_()
        policy.stage2_choice.weight.copy_(torch.eye(4))
        policy.crops_embedding.weight.copy_(torch.eye(3, 4) * 4.0 - 1.0)
        for head, favourite in ((policy.top_k_head, {0: 0, 2: 2}), (policy.blocks_head, {0: 0, 2: 1})):
            head[0].weight.copy_(torch.eye(4))
            head[0].bias.zero_()
            head[2].weight.zero_()
            head[2].bias.zero_()
            for crops_column, value_column in favourite.items():
                head[2].weight[value_column, crops_column] = 5.0
    return policy


def _hand_set_data(policy, mask):
    from trainer.data import OfflineData

    n, a = mask.shape
    return OfflineData(action_space=policy.action_space, model_fingerprint="f" * 64, dataset=["d"] * n,
                       sample_key=[f"k{i}" for i in range(n)], example_id=[str(i) for i in range(n)],
                       split=["test"] * n, image_features=torch.randn(n, 2), image_present=torch.rand(n) > 0.3,
                       lang_features=torch.randn(n, 2), score=torch.where(mask, 0.5, float("nan")),
                       latency_ms=torch.where(mask, 100.0, float("nan")), latency_is_sample=mask.clone(), mask=mask)


def test_the_decision_is_sequential_not_the_joint_mode(tmp_path):
    """Stage 1 keeps the most probable crops value even where another value has the most probable
    configuration; stage 2 breaks its exact tie towards the smallest top_k, then the fewest blocks."""
    from controller.deploy import DeployedController, load_deployed, save_deployed
    from trainer.fallback import PolicyDecider

    policy = _hand_set_policy(FULL_PRODUCT)
    n = 5
    data = _hand_set_data(policy, torch.ones(n, len(FULL_PRODUCT), dtype=torch.bool))
    budget = torch.linspace(50.0, 400.0, n)
    inputs = (data.lang_features, data.image_features, data.image_present)
    joint = policy.log_probs(data.image_features, data.image_present, data.lang_features, budget).argmax(-1)
    assert {FULL_PRODUCT[int(i)] for i in joint} == {(2, 4, 12)}  # the construction holds
    module = DeployedController(policy, None)
    assert module.full_product
    exported = load_deployed(save_deployed(module, tmp_path / "controller.pt"))
    for deployed in (module, exported):
        with torch.inference_mode():
            assert deployed.stage1(data.lang_features, budget).tolist() == [6] * n
            for crops, expected in ((2, (4, 12)), (6, (4, 12)), (10, (12, 14))):
                top_k, blocks = deployed.stage2(*inputs, budget, torch.full((n,), crops))
                assert list(zip(top_k.tolist(), blocks.tolist())) == [expected] * n, crops
            decided = torch.stack(deployed.decide(*inputs, budget), 1)
        assert [tuple(r) for r in decided.tolist()] == [(6, 4, 12)] * n
    assert [FULL_PRODUCT[int(i)] for i in PolicyDecider(policy).decide(data, budget)] == [(6, 4, 12)] * n


def test_the_decision_stays_inside_a_masked_action_space(tmp_path):
    """An action space that is not a full product (the deployed module) and per-sample masks (the
    evaluation): stage 2 ranges over the actions of the chosen crops that exist, and stage 1 over
    the crops values that have one."""
    from controller.deploy import DeployedController, load_deployed, save_deployed
    from trainer.fallback import PolicyDecider

    actions = tuple(a for a in FULL_PRODUCT if a not in {(6, 4, 12), (6, 8, 12), (2, 4, 12)})
    policy = _hand_set_policy(actions)
    module = DeployedController(policy, None)
    assert not module.full_product
    exported = load_deployed(save_deployed(module, tmp_path / "controller.pt"))
    n = 3
    lang, image, present, budget = torch.randn(n, 2), torch.randn(n, 2), torch.ones(n, dtype=torch.bool), \
        torch.full((n,), 200.0)
    for deployed in (module, exported):
        with torch.inference_mode():
            assert deployed.stage1(lang, budget).tolist() == [6] * n
            # crops 6 ties everywhere: its first recorded action; crops 2 lost (2, 4, 12), and its two
            # next best, (2, 4, 14) and (2, 8, 12), tie: the smaller top_k
            for crops, expected in ((6, (4, 14)), (2, (4, 14)), (10, (12, 14))):
                top_k, blocks = deployed.stage2(lang, image, present, budget, torch.full((n,), crops))
                assert list(zip(top_k.tolist(), blocks.tolist())) == [expected] * n, crops
            assert [tuple(r) for r in torch.stack(deployed.decide(lang, image, present, budget), 1).tolist()] \
                == [(6, 4, 14)] * n

    # per-sample masks: no crops-6 action -> crops 2 (p1's second); neither crops 6 nor 2 -> crops 10;
    # only crops 6's last action -> that one
    def without(*crops_values):
        return torch.tensor([a[0] not in crops_values for a in actions])

    only_last_six = torch.tensor([a == (6, 12, 16) for a in actions]) | without(6)
    mask = torch.stack([torch.ones(len(actions), dtype=torch.bool), without(6), without(6, 2), only_last_six])
    data = _hand_set_data(policy, mask)
    chosen = [actions[int(i)] for i in PolicyDecider(policy).decide(data, 200.0)]
    assert chosen == [(6, 4, 14), (2, 4, 14), (10, 12, 14), (6, 12, 16)]


def test_the_evaluations_decision_refuses_data_of_another_image_feature():
    from dataclasses import replace

    from pipeline import CacheMismatchError
    from trainer.fallback import PolicyDecider

    policy = _hand_set_policy(FULL_PRODUCT)
    data = replace(_hand_set_data(policy, torch.ones(2, len(FULL_PRODUCT), dtype=torch.bool)), image_feature="feature")
    with pytest.raises(CacheMismatchError, match=r"^controller: trained on the image feature 'global_feature', "
                                                 r"but the data holds 'feature'"):
        PolicyDecider(policy).decide(data, 200.0)


@pytest.mark.parametrize("max_crops", [5, 0, 11, -3])
def test_stage2_refuses_a_crops_value_outside_the_action_space(tmp_path, max_crops):
    from controller.deploy import DeployedController, load_deployed, save_deployed

    module = DeployedController(_hand_set_policy(FULL_PRODUCT), None)
    exported = load_deployed(save_deployed(module, tmp_path / "controller.pt"))
    args = (torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2, dtype=torch.bool), torch.full((2,), 200.0),
            torch.tensor([6, max_crops]))
    message = rf"max_crops {max_crops} is not in the controller's action space \(max_crops values 2, 6, 10\)"
    with pytest.raises(ValueError, match=message):
        module.stage2(*args)
    with pytest.raises(torch.jit.Error, match=message):
        exported.stage2(*args)


@pytest.mark.parametrize("change", ["activation", "moved", "gelu", "eps"])
def test_a_changed_policy_layer_breaks_the_export_by_name(change):
    """The export builds from the policy's named parts (ControllerPolicy.parts): a layer whose kind,
    position or arithmetic changes is an error naming it, never a silently different module."""
    from torch import nn

    from controller.deploy import DeployedController

    policy = _hand_set_policy(FULL_PRODUCT)
    if change == "activation":
        policy.lang_proj[2] = nn.GELU()
    elif change == "moved":
        policy.crops_head = nn.Sequential(nn.ReLU(), *policy.crops_head)
    elif change == "gelu":
        policy.budget_encoder.mlp[2] = nn.GELU(approximate="tanh")
    else:
        policy.stage2_norm[0].eps = 1e-3
    expected = {"activation": r"policy layers lang_proj are \['Linear', 'LayerNorm', 'GELU', 'Dropout'\]",
                "moved": r"policy layers crops_head are \['ReLU', 'Linear', 'ReLU', 'Linear'\]",
                "gelu": r"budget_encoder.mlp: the export computes the exact \(erf\) GELU",
                "eps": r"LayerNorms have different eps"}[change]
    with pytest.raises((TypeError, ValueError), match=expected):
        DeployedController(policy, None)


@pytest.mark.parametrize("kind", ["family", "cluster"])
def test_a_family_or_cluster_table_answers_per_budget_with_its_groups_or_lut_p95(trained, tmp_path, kind):
    """Expected, where the fallback answers: the family (or cluster) table's choice for the question at
    the budgets ``family_table_at`` gives it, the global lut_p95 table's at the others; the network
    elsewhere. The question's group is the one the table reads, in the module and in its exported file."""
    from dataclasses import replace

    from controller.deploy import DeployedController, group_names_of, load_deployed, save_deployed
    from trainer.clusters import CLUSTER_TABLE, cluster_table
    from trainer.data import load_offline_data
    from trainer.fallback import PolicyDecider, read_fallback
    from trainer.reward import RewardConfig

    ws, _, mixed = trained
    policy, f = _inputs(ws, mixed)
    fallback = read_fallback(mixed)
    if kind == "cluster":
        train = load_offline_data(ws.root).subset("train").without_family_labels()
        table = cluster_table(train, fallback.grid_ms, RewardConfig(), num_clusters=3, min_cluster_size=5)
        assert table.name == CLUSTER_TABLE
        fallback = replace(fallback, table=table.state())
    table = fallback.lookup_table()
    assert table.has_families
    grid = fallback.grid_ms
    fallback = replace(fallback, use_controller=[i % 4 == 0 for i in range(len(grid))],
                       family_table_at=[i % 2 == 1 for i in range(len(grid))])
    deployed = DeployedController(policy, fallback)
    n = len(f["sample_key"])
    seen = set()
    for budget in _budgets(grid):
        b = torch.full((n,), budget, dtype=torch.float64)
        # the network never answers a question unlike every clustered one (only a cluster table guards it)
        use = fallback.controller_at(b) & fallback.network_allowed(f["lang"])
        families = fallback.families_at(b)
        by_table = torch.where(families, table.choose(torch.full((n,), budget), f["lang"], None),
                               table.global_table.choose(torch.full((n,), budget), None))
        network = _expected_network(policy, f["image"], f["image_present"], f["lang"], budget, f["tiling_crops"])
        with torch.inference_mode():
            actions, by_network = deployed.decide_actions(f["lang"], f["image"], f["image_present"], b,
                                                          f["tiling_crops"])
        assert torch.equal(by_network, use) and torch.equal(actions, torch.where(use, network, by_table)), budget
        seen.update(zip(use.tolist(), families.tolist()))
    # every source answered somewhere: the families, the global table, the network
    assert {(False, True), (False, False)} <= seen and any(use for use, _ in seen)
    # the evaluation's decider (PolicyDecider) follows the same per-budget switch
    from trainer.data import load_offline_data as load

    data = load(ws.root)
    decider = PolicyDecider(policy, fallback)
    for budget in grid:
        b = torch.full((len(data),), budget, dtype=torch.float64)
        expected, _ = deployed.decide_actions(data.lang_features, data.image_features, data.image_present, b,
                                              data.tiling_crops)
        assert torch.equal(decider.decide(data, budget), expected), budget
    if kind == "cluster":  # a question unlike every clustered one goes to lut_p95, never to the network
        odd = -f["lang"][:1]
        first = torch.tensor([grid[0]], dtype=torch.float64)  # a budget the network keeps
        assert not bool(fallback.network_allowed(odd)[0]) and bool(deployed.network_decides(first)[0])
        assert not bool(deployed.network_decides(first, odd)[0])
        with torch.inference_mode():
            actions, by_network = deployed.decide_actions(odd, f["image"][:1], f["image_present"][:1], first,
                                                          f["tiling_crops"][:1])
        assert not bool(by_network[0])
        assert int(actions[0]) == int(table.global_table.choose(first.float(), None)[0])
        assert int(deployed.question_group(odd)[0]) == -1
    names = deployed.group_names()
    assert names == list(table.families)
    read = [names[j] if j >= 0 else None for j in deployed.question_group(f["lang"]).tolist()]
    assert read == table.read_family(f["lang"])
    loaded = load_deployed(save_deployed(deployed, tmp_path / "c.pt"))
    assert group_names_of(loaded) == names and torch.equal(loaded.question_group(f["lang"]),
                                                           deployed.question_group(f["lang"]))


def test_the_deployed_per_request_table_decides_as_the_training_time_one(trained, tmp_path):
    """Expected: where the per-request table answers, the deployed module's choice is the training-time
    ``lut_by_request`` decision for the same request (tiling, prompt length, question, budget), over the
    whole action space; its expected latency is the cost model's prediction at that choice."""
    from dataclasses import replace

    from controller.deploy import DeployedController, cost_basis, load_deployed, save_deployed
    from trainer.data import load_offline_data
    from trainer.fallback import attach_fallback, read_fallback
    from trainer.request_table import RequestTableDecider

    ws, best, _ = trained
    data = load_offline_data(ws.root)
    data = replace(data, mask=torch.ones_like(data.mask))  # the deployed module decides over every action
    request = RequestTableDecider.fit(data.subset("train"))
    path = tmp_path / "request.pt"
    shutil.copyfile(best, path)
    fallback = read_fallback(path)
    fallback.use_controller = [False] * len(fallback.grid_ms)
    fallback.request_table = request.state()
    fallback.request_table_at = [i % 2 == 1 for i in range(len(fallback.grid_ms))]
    attach_fallback(path, fallback)
    policy, f = _inputs(ws, path)
    assert f["sample_key"] == data.sample_key and torch.equal(f["prompt_tokens"], data.prompt_tokens)
    deployed = DeployedController(policy, read_fallback(path))
    scripted = load_deployed(save_deployed(deployed, tmp_path / "request-export.pt"))
    n = len(data)
    image, present = f["image"], f["image_present"]
    plain = read_fallback(path).lookup_table()
    for i, budget in enumerate(fallback.grid_ms):
        b = torch.full((n,), budget, dtype=torch.float64)
        want = request.decide(data, budget) if i % 2 == 1 else _table_choice(plain, b.float(), f["lang"])
        for module in (deployed, scripted):
            got, by_network = module.decide_actions(f["lang"], image, present, b, f["tiling_crops"], f["prompt_tokens"])
            assert not by_network.any() and torch.equal(got, want), budget
    median, quantile, own, far = deployed.expected_latency(f["lang"], f["tiling_crops"], f["prompt_tokens"])
    want_median, want_quantile, want_own, want_far = request.model.predict(data)
    assert torch.equal(median, want_median) and torch.equal(quantile, want_quantile) and torch.equal(own, want_own)
    assert torch.equal(far, want_far)
    # an image tiling into more crops than any the cost model was fitted on: read along the line, flagged
    beyond = torch.full_like(f["tiling_crops"], float(deployed.request_cost.fit_max_crops) + 3.0)
    _, _, own_beyond, far_beyond = deployed.expected_latency(f["lang"], beyond, f["prompt_tokens"])
    assert own_beyond.all() and far_beyond.all()
    assert [cost_basis(True, False), cost_basis(True, True), cost_basis(False, True)] == [
        "request", "extrapolated", "configuration"]
