"""The testbed: the procedural VQA generator and the training of the embedded model on it."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from runtime.embedded_model import RECIPE_FILE
from runtime.registry import TestbedRecipe, cached_testbed_dir, testbed_model_dir
from testbed.dataset import read_dataset
from testbed.lowrank import LORA_FILE
from testbed.task import (
    COLORS,
    DIGITS,
    EXTRA_FAMILIES,
    FAMILIES,
    NUM_ANSWERS,
    TEXTURES,
    TaskSpec,
    generate_dataset,
    make_sample,
)
from testbed.train import evaluate_testbed, format_eval_table, train_testbed


def _tree_digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# -- the task -----------------------------------------------------------------------------------

def test_generator_is_deterministic_and_readable(tmp_path):
    a = generate_dataset(tmp_path / "a", 15, seed=3, split="val")
    b = generate_dataset(tmp_path / "b", 15, seed=3, split="val")
    assert _tree_digest(a) == _tree_digest(b)  # byte-identical, dataset.json and every PNG
    other = generate_dataset(tmp_path / "c", 15, seed=4, split="val")
    assert _tree_digest(other) != _tree_digest(a)

    ds = read_dataset(a)
    assert (ds.name, ds.split, len(ds.samples)) == ("testbed", "val", 15)
    assert {s.family for s in ds.samples} == set(FAMILIES)
    assert len({s.example_id for s in ds.samples}) == 15
    for s in ds.samples:
        path = ds.image_path(s)
        assert path.is_file()
        with Image.open(path) as img:
            assert img.mode == "RGB"
            assert 224 <= img.width <= 448 and 224 <= img.height <= 448
        assert len(s.answers) == NUM_ANSWERS and len(set(s.answers)) == 1
        answer = s.answers[0]
        expected = {"color": set(COLORS), "mix": set(COLORS), "presence": {"yes", "no"},
                    "texture": set(TEXTURES)}[s.family]
        assert answer in expected, (s.family, answer)
        assert s.metadata()["family"] == s.family


def test_extra_families(tmp_path):
    ds = read_dataset(generate_dataset(tmp_path / "x", 3 * len(EXTRA_FAMILIES), seed=5,
                                       spec=TaskSpec(families=EXTRA_FAMILIES)))
    assert [s.family for s in ds.samples] == list(EXTRA_FAMILIES) * 3
    expected = {"count": {"1", "2", "3", "4"}, "digit": set(DIGITS), "dot": set(COLORS), "speck": {"yes", "no"},
                "relation": set(COLORS)}
    for s in ds.samples:
        assert s.answers[0] in expected[s.family]
    with pytest.raises(ValueError, match="unknown"):
        TaskSpec(families=("nope",))


def test_mix_answers_follow_the_fixed_table_and_need_both_colours(tmp_path):
    """A mix answer is the table's entry for (background, asked colour); the table is fixed by its
    seed and neither colour alone decides the answer."""
    from testbed.task import mix_of

    ds = read_dataset(generate_dataset(tmp_path / "m", 12, seed=2, spec=TaskSpec(families=("mix",))))
    for s in ds.samples:
        asked = s.question.removeprefix("What color is the background mixed with ").removesuffix("?")
        with Image.open(ds.image_path(s)) as img:
            corner = img.convert("RGB").getpixel((0, 0))  # clutter keeps off the corners' pixel
        background = min(COLORS, key=lambda c: sum(abs(a - b) for a, b in zip(COLORS[c], corner)))
        assert s.answers[0] == mix_of(background, asked)
    assert (mix_of("red", "blue"), mix_of("blue", "red"), mix_of("black", "black")) == ("red", "orange", "purple")
    for first in COLORS:
        assert len({mix_of(first, c) for c in COLORS}) > 1 and len({mix_of(c, first) for c in COLORS}) > 1


def test_texture_patterns_keep_the_mean_colour_and_vanish_in_the_global_view():
    """A pattern is the background colour +- a delta (same mean), fine enough to be averaged
    away in the 112-px global view but not in 3-column crops."""
    import numpy as np

    spec = TaskSpec(families=("texture",))
    seen = set()
    for i in range(40):
        _, _, answer, image = make_sample(0, i, spec)
        seen.add(answer)
        pixels = np.asarray(image, dtype=np.int64)
        h, w, _ = pixels.shape
        even = pixels[:, : w - w % 4]  # whole periods only: the mean is exactly the background colour
        background = pixels[-1, -1] if answer == "plain" else None
        if answer == "plain":
            assert (pixels == background).all()
            continue
        colours = {tuple(p) for p in even.reshape(-1, 3)}
        assert len(colours) == 2, answer
        assert tuple(even.reshape(-1, 3).mean(0)) in {tuple(float(v) for v in c) for c in COLORS.values()}

        def high_frequency(img):
            a = np.asarray(img, dtype=np.float64)
            return np.abs(np.diff(a, axis=1)).mean() + np.abs(np.diff(a, axis=0)).mean()

        global_view = image.resize((112, 112), Image.Resampling.BICUBIC)
        crop_view = image.resize((3 * 84 + 28, 3 * 84 + 28), Image.Resampling.BICUBIC)
        assert high_frequency(global_view) < 0.25 * high_frequency(crop_view), (i, image.size)
    assert seen == set(TEXTURES)


def test_larger_set_starts_with_the_smaller_one(tmp_path):
    small = read_dataset(generate_dataset(tmp_path / "s", 5, seed=1))
    big = read_dataset(generate_dataset(tmp_path / "b", 10, seed=1))
    assert big.samples[:5] == small.samples
    for s in small.samples:
        assert small.image_path(s).read_bytes() == big.image_path(s).read_bytes()


def test_existing_dataset_is_reused(tmp_path):
    root = generate_dataset(tmp_path / "d", 5, seed=0)
    stamp = (root / "dataset.json").stat().st_mtime_ns
    generate_dataset(root, 5, seed=0)
    assert (root / "dataset.json").stat().st_mtime_ns == stamp
    generate_dataset(root, 6, seed=0)  # another set: rewritten
    assert len(read_dataset(root).samples) == 6
    (root / "images" / "tb0-train-000000.png").write_bytes(b"not this")  # not what the generator draws
    generate_dataset(root, 6, seed=0)
    assert (root / "images" / "tb0-train-000000.png").read_bytes() != b"not this"


def test_cli_generate(tmp_path):
    from cli import app

    result = CliRunner().invoke(app, ["testbed", "generate", str(tmp_path / "ds"), "--num-samples", "5", "--seed", "2"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(read_dataset(tmp_path / "ds").samples) == 5


# -- training -----------------------------------------------------------------------------------

TINY = TestbedRecipe(num_train_samples=6, steps=2, batch_size=2, crops_choices=(1, 2), warmup_steps=1,
                     vision_pretrain_steps=2)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """The tiny recipe trained twice, into two caches."""
    first = train_testbed(TINY, cache_dir=tmp_path_factory.mktemp("cache1"))
    second = train_testbed(TINY, cache_dir=tmp_path_factory.mktemp("cache2"))
    return first, second


def test_training_is_deterministic(tiny_models):
    first, second = tiny_models
    assert first.trained and second.trained
    assert len(first.losses) == TINY.steps and all(loss > 0 for loss in first.losses)
    assert first.losses == second.losses
    digest1, digest2 = _tree_digest(first.model_dir), _tree_digest(second.model_dir)
    weights = [k for k in digest1 if k.endswith(".safetensors")]
    assert {"decoder/model.safetensors", "vision/model.safetensors", "projector/projector.safetensors"} <= set(weights)
    assert {k: digest1[k] for k in weights} == {k: digest2[k] for k in weights}


def test_training_changes_the_weights(tiny_models, tmp_path):
    from safetensors.torch import load_file

    from runtime.embedded_model import write_embedded_model

    base = tmp_path / "base"
    base.mkdir()
    write_embedded_model(base, seed=TINY.base_seed)
    trained = load_file(str(tiny_models[0].model_dir / "decoder" / "model.safetensors"))
    original = load_file(str(base / "decoder" / "model.safetensors"))
    assert trained.keys() == original.keys()
    changed = {k for k in trained if not (trained[k] == original[k]).all()}
    # the routers and the attention's queries get gradients; the frozen parts (embeddings, head,
    # attention values and outputs) keep the seed's values up to the float16 rounding
    assert any(".mlp.gate." in k for k in changed) and any("q_proj" in k for k in changed)
    for k in trained:
        if any(part in k for part in ("lm_head", "embed_tokens", "v_proj", "o_proj")):
            assert torch.equal(trained[k], original[k].half().float()), k
    # every trained non-expert value is a float16 value (what the shipped weights store)
    assert all(torch.equal(trained[k].half().float(), trained[k]) for k in changed if ".mlp.experts." not in k)
    # the experts: the seed's weights plus the low-rank update of the stored float16 factors, exactly
    factors = load_file(str(tiny_models[0].model_dir / LORA_FILE))
    assert factors["layers.3.down_proj.u"].shape == (64, 64, TINY.expert_lora_rank)
    assert factors["layers.3.down_proj.u"].dtype == torch.float16
    experts = {k for k in trained if ".mlp.experts." in k}
    assert len(experts) == 16 * 2 and experts <= changed  # fused per block: gate_up_proj, down_proj
    name = "model.layers.3.mlp.experts.down_proj"
    u, v = factors["layers.3.down_proj.u"].float(), factors["layers.3.down_proj.v"].float()
    expected = original[name] + sum(u[:, :, j:j + 1] * v[:, j:j + 1, :] for j in range(u.shape[-1]))
    assert torch.allclose(trained[name], expected, atol=1e-6)
    assert not torch.equal(trained[name], original[name])

    with_experts = train_testbed(dataclasses.replace(TINY, train_experts=True, expert_lora_rank=0),
                                 cache_dir=tmp_path / "cache")
    trained = load_file(str(with_experts.model_dir / "decoder" / "model.safetensors"))
    assert all(not torch.equal(trained[k], original[k]) for k in experts)
    assert not (with_experts.model_dir / LORA_FILE).exists()


def test_recipe_parts_and_frozen_modules_are_checked(tmp_path):
    with pytest.raises(ValueError, match="train_experts and expert_lora_rank exclude each other"):
        TestbedRecipe(train_experts=True)  # the default rank is 4
    with pytest.raises(ValueError, match="expert_lora_rank must be >= 0, got -1"):
        TestbedRecipe(expert_lora_rank=-1)
    from runtime.embedded import EmbeddedRuntime
    from runtime.embedded_model import write_embedded_model
    from testbed.train import frozen_modules

    base = tmp_path / "base"
    base.mkdir()
    write_embedded_model(base, seed=0, pool=1)
    runtime = EmbeddedRuntime(base)
    assert runtime.spec.pool == 1
    modules = frozen_modules(runtime, ("attention_values",))
    assert len(modules) == 2 * 16 and modules[0] is runtime.decoder_layers[0].self_attn.v_proj
    with pytest.raises(ValueError, match="frozen: unknown parts \\['keys'\\]"):
        frozen_modules(runtime, ("keys",))
    with pytest.raises(ValueError, match="pool must be a positive integer that divides the 8-patch grid"):
        write_embedded_model(tmp_path / "other", pool=3)


def test_vision_learning_rate_applies_to_the_vision_path_only(tmp_path):
    """vision_lr=0 freezes the ViT and the projector; the decoder still trains at lr."""
    from runtime.embedded import EmbeddedRuntime
    from runtime.embedded_model import write_embedded_model
    from testbed.train import train_model

    base = tmp_path / "base"
    base.mkdir()
    write_embedded_model(base, seed=0)
    runtime = EmbeddedRuntime(base)
    before = {n: p.clone() for n, p in [*runtime.vision_backbone.named_parameters(),
                                         *runtime.decoder.named_parameters(prefix="decoder")]}
    data = generate_dataset(tmp_path / "data", 4, seed=0)
    config = TestbedRecipe(num_train_samples=4, steps=2, batch_size=2, crops_choices=(1,), warmup_steps=1,
                           vision_lr=0.0, vision_pretrain_steps=2)  # both phases, at two steps each
    train_model(runtime, data, config)
    vision = dict(runtime.vision_backbone.named_parameters())
    decoder = dict(runtime.decoder.named_parameters(prefix="decoder"))
    assert all(torch.equal(vision[n], before[n]) for n in vision)
    assert any(not torch.equal(decoder[n], before[n]) for n in decoder)
    assert TestbedRecipe(vision_lr=1e-4).recipe_hash() != TestbedRecipe().recipe_hash()


def test_periodic_patch_filters_see_fine_patterns_and_not_plain_colour(tmp_path):
    from runtime.embedded import EmbeddedRuntime
    from runtime.embedded_model import write_embedded_model
    from testbed.train import _init_vision, periodic_patch_filters

    bank = periodic_patch_filters(14, 21)
    assert bank.shape == (21, 3, 14, 14)
    plain = torch.full((3, 14, 14), 0.7)
    assert (bank * plain).sum(dim=(1, 2, 3)).abs().max() < 1e-5
    for period in (2, 4):
        for shift in range(period):  # any phase of the pattern against the patch grid
            stripes = ((torch.arange(14) + shift) // (period // 2) % 2).float()[None, None, :].expand(3, 14, 14)
            assert (bank * stripes).sum(dim=(1, 2, 3)).abs().max() > 0.5
    with pytest.raises(ValueError, match="0..21"):
        periodic_patch_filters(14, 22)

    base = tmp_path / "base"
    base.mkdir()
    write_embedded_model(base, seed=0)
    runtime = EmbeddedRuntime(base)
    weight = runtime.vision.embeddings.patch_embedding.weight
    rest = weight[21:].clone()
    _init_vision(runtime, TestbedRecipe(vision_init="periodic"))
    assert torch.allclose(weight[:21] / weight[:21].flatten(1).norm(dim=1)[:, None, None, None], bank)
    assert torch.equal(weight[21:], rest)


def test_vision_pretraining_trains_the_vision_path_only(tmp_path):
    from runtime.embedded import EmbeddedRuntime
    from runtime.embedded_model import write_embedded_model
    from testbed.train import pretrain_vision

    base = tmp_path / "base"
    base.mkdir()
    write_embedded_model(base, seed=0)
    runtime = EmbeddedRuntime(base)
    vision_before = [p.clone() for p in runtime.vision_backbone.parameters()]
    decoder_before = [p.clone() for p in runtime.decoder.parameters()]
    dataset = read_dataset(generate_dataset(tmp_path / "data", 16, seed=0))  # >1 answer per family
    with pytest.raises(ValueError, match="no training samples of the vision pretraining families"):
        pretrain_vision(runtime, dataset, TestbedRecipe(vision_pretrain_steps=3, vision_pretrain_families=("dot",)))
    # all families (the default draws texture only)
    losses = pretrain_vision(runtime, dataset, TestbedRecipe(vision_pretrain_steps=3, batch_size=2, crops_choices=(1,),
                                                           vision_pretrain_families=()))
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
    assert any(not torch.equal(a, b) for a, b in zip(runtime.vision_backbone.parameters(), vision_before))
    assert all(torch.equal(a, b) for a, b in zip(runtime.decoder.parameters(), decoder_before))
    assert not any(p.requires_grad for p in runtime.vision_backbone.parameters())  # back to inference state


def test_trained_directory_loads_generates_and_is_reused(tiny_models, tmp_path):
    from runtime import load_runtime

    report = tiny_models[0]
    cache = report.model_dir.parent
    assert report.model_dir == testbed_model_dir(TINY, cache)
    assert (report.model_dir / RECIPE_FILE).is_file()
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    again = train_testbed(TINY, cache_dir=cache)
    assert not again.trained and again.model_dir == report.model_dir
    # what --model testbed loads: the cached directory of the recipe, never a training
    assert cached_testbed_dir(TINY, cache) == report.model_dir
    assert cached_testbed_dir(dataclasses.replace(TINY, seed=TINY.seed + 1), cache) is None

    rt = load_runtime(str(report.model_dir))
    assert rt.kind == "embedded" and rt.current_top_k() == [rt.default_top_k] * rt.num_layers
    ds = read_dataset(generate_dataset(tmp_path / "ds", 5, seed=9))
    with Image.open(ds.image_path(ds.samples[0])) as img:
        inputs = rt.preprocess(img.convert("RGB"), ds.samples[0].question, max_crops=2)
    with rt.knobs(top_k=4, num_active_blocks=12):
        result = rt.generate(inputs, max_new_tokens=3)
    assert 1 <= len(result.token_ids) <= 3

    rows = evaluate_testbed(report.model_dir, ds.root, crops=(1,), top_ks=(4,), blocks=(12,), max_new_tokens=2)
    assert {r.family for r in rows} == {"all", *FAMILIES}
    assert all(0.0 <= r.accuracy <= 1.0 for r in rows)
    assert next(r for r in rows if r.family == "all").num_samples == 5
    table = format_eval_table(rows)
    assert len(table) == 3 and table[2].startswith("| 1 | 4 | 12 |")


def test_cli_train_reports_both_phases(tmp_path):
    from cli import app

    args = ["testbed", "train", "--steps", "2", "--num-train-samples", "4", "--batch-size", "2",
            "--vision-pretrain-steps", "2", "--eval-samples", "0", "--cache-dir", str(tmp_path / "cache")]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "vision pretraining step 2/2" in result.output and "step 2/2 loss" in result.output
    assert "trained in" in result.output
    again = CliRunner().invoke(app, args, catch_exceptions=False)  # the same recipe: reused from the cache
    assert again.exit_code == 0 and "vision pretraining" not in again.output and "cached:" in again.output


# -- shipped weights ----------------------------------------------------------------------------

def test_shipped_weights_rebuild_the_trained_directory_byte_for_byte(tiny_models, tmp_path):
    """pack -> materialise gives the directory training wrote; train_testbed then unpacks instead of training."""
    from testbed.shipped import pack, shipped_recipe_hash

    shipped = tmp_path / "weights.safetensors.xz"
    size = pack(tiny_models[0].model_dir, shipped)
    assert shipped.stat().st_size == size
    assert 0.5e6 < size < 3e6  # ~1 M float16 values (trained parameters, expert factors), hardly compressible
    assert shipped_recipe_hash(shipped) == TINY.recipe_hash()

    report = train_testbed(TINY, cache_dir=tmp_path / "cache", shipped=shipped)
    assert not report.trained and report.from_shipped and report.losses == []
    assert _tree_digest(report.model_dir) == _tree_digest(tiny_models[0].model_dir)
    assert cached_testbed_dir(TINY, tmp_path / "cache") == report.model_dir
    # a recipe the file was not trained with is trained, not unpacked
    other = dataclasses.replace(TINY, seed=TINY.seed + 1)
    trained = train_testbed(other, cache_dir=tmp_path / "cache", shipped=shipped)
    assert trained.trained and not trained.from_shipped
    # --force trains even when the weights are shipped
    forced = train_testbed(TINY, cache_dir=tmp_path / "cache2", shipped=shipped, force=True)
    assert forced.trained and _tree_digest(forced.model_dir) == _tree_digest(report.model_dir)


def test_damaged_or_unfit_shipped_weights_are_refused_by_name(tiny_models, tmp_path):
    import lzma

    from safetensors.torch import save

    from testbed.shipped import ShippedWeightsError, materialise, pack, shipped_recipe_hash

    garbage = tmp_path / "garbage.xz"
    garbage.write_bytes(b"not xz at all")
    with pytest.raises(ShippedWeightsError, match="garbage.xz: not a readable shipped-weights file"):
        shipped_recipe_hash(garbage)
    assert shipped_recipe_hash(tmp_path / "missing.xz") is None

    foreign = tmp_path / "foreign.xz"
    foreign.write_bytes(lzma.compress(save({"x": torch.zeros(2)}, metadata={"format": "pt"})))
    with pytest.raises(ShippedWeightsError, match="foreign.xz: not a shipped-weights file"):
        shipped_recipe_hash(foreign)

    unfit = tmp_path / "unfit.xz"
    unfit.write_bytes(lzma.compress(save({"decoder.x": torch.zeros(2, dtype=torch.float16)},
                                         metadata={"format": "ctrl-testbed-weights", "recipe_hash": "x",
                                                   "recipe_file": "{}"})))
    (tmp_path / "out").mkdir()
    with pytest.raises(ShippedWeightsError, match="unfit.xz: does not fit the embedded model"):
        materialise(tmp_path / "out", unfit)

    experts_trained = train_testbed(dataclasses.replace(TINY, train_experts=True, expert_lora_rank=0),
                                    cache_dir=tmp_path / "c")
    with pytest.raises(ShippedWeightsError, match="its experts were trained"):
        pack(experts_trained.model_dir, tmp_path / "x.xz")
    assert not (tmp_path / "x.xz").exists()


def test_the_default_recipe_is_shipped_and_unpacked_by_the_cli(tmp_path):
    """The package carries the weights of the default recipe: the README's first run does not train."""
    import json

    from cli import app
    from testbed.shipped import SHIPPED_WEIGHTS, shipped_recipe_hash

    assert shipped_recipe_hash(SHIPPED_WEIGHTS) == TestbedRecipe().recipe_hash(), (
        "the default TestbedRecipe changed: train it and re-pack (python -m testbed.shipped MODEL_DIR)")
    cache = tmp_path / "cache"
    result = CliRunner().invoke(app, ["testbed", "train", "--eval-samples", "0", "--cache-dir", str(cache)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "unpacked the shipped weights" in result.output and "vision pretraining" not in result.output
    model_dir = cached_testbed_dir(TestbedRecipe(), cache)
    assert model_dir is not None
    record = json.loads((model_dir / RECIPE_FILE).read_text())
    assert record["recipe_hash"] == TestbedRecipe().recipe_hash() and record["config"]["train_experts"] is False
