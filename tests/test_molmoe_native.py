"""The native MolmoE runtime equals the origin model code, and refuses what it cannot load.

The origin ``MolmoForCausalLM`` (../shared/molmoe_reference, imported in-process as its builder
does) and the native runtime load the same tiny checkpoint; every expected value here comes from
the origin modules. Preprocessing is checked against the origin processor in
tests/test_molmoe_processor.py (its fixture), so both models are given the native inputs here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from molmoe_origin import build_tiny, load_origin_model, origin_forward, origin_greedy
from safetensors.torch import load_file, save_file
from test_model_runtime import QUESTION, make_image

from runtime import ModelLoadError, load_runtime
from runtime.molmoe import MolmoERuntime, checkpoint_fingerprint

# the origin code calls torch and transformers APIs that are deprecated today
pytestmark = [pytest.mark.filterwarnings("ignore:torch.is_autocast_cpu_enabled:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:torch.get_autocast_cpu_dtype:DeprecationWarning")]

# sizes and crop limits that give 1x1 up to 3x4 tilings, a tall and a wide image, one under 112 px
CASES = [((320, 240), 4), ((640, 480), 12), ((50, 700), 6), ((1000, 300), 9), ((90, 90), 3)]


@pytest.fixture(scope="module")
def native(tiny_molmoe_dir: Path) -> MolmoERuntime:
    return MolmoERuntime(tiny_molmoe_dir)


@pytest.fixture(scope="module")
def origin(tiny_molmoe_dir: Path):
    return load_origin_model(tiny_molmoe_dir)


def set_origin_top_k(origin, k: int) -> None:
    for block in origin.model.transformer.blocks:
        block.mlp.top_k = k


@pytest.mark.parametrize(("size", "max_crops"), CASES)
def test_logits_equal_the_origin_at_default_knobs(native, origin, size, max_crops):
    inputs = native.preprocess(make_image(*size, seed=max_crops), QUESTION, max_crops)
    expected = origin_forward(origin, inputs).logits[0]
    got = native.forward_logits(inputs)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


# expert routing does not depend on the image size: two of the image cases suffice
@pytest.mark.parametrize(("size", "max_crops"), [CASES[0], CASES[2]])
def test_logits_equal_the_origin_at_top_k_4(native, origin, size, max_crops):
    inputs = native.preprocess(make_image(*size, seed=max_crops), QUESTION, max_crops)
    expected = origin_forward(origin, inputs).logits[0]
    set_origin_top_k(origin, 4)
    try:
        expected_k4 = origin_forward(origin, inputs).logits[0]
    finally:
        set_origin_top_k(origin, 8)
    with native.knobs(top_k=4):
        got_k4 = native.forward_logits(inputs)
    torch.testing.assert_close(got_k4, expected_k4, rtol=0, atol=1e-4)
    assert (expected_k4 - expected).abs().max() > 1e-2  # the knob mattered


def test_text_only_logits_equal_the_origin(native, origin):
    inputs = native.preprocess(None, QUESTION, 6)
    torch.testing.assert_close(native.forward_logits(inputs), origin_forward(origin, inputs).logits[0],
                               rtol=0, atol=1e-4)


def test_greedy_generation_equals_the_origin(native, origin):
    for size, max_crops in CASES[:3]:
        inputs = native.preprocess(make_image(*size, seed=1), QUESTION, max_crops)
        tokens = native.generate(inputs, max_new_tokens=16).token_ids
        assert tokens == origin_greedy(origin, inputs, 16, native.eos_id)
        assert len(tokens) == 16 or tokens[-1] == native.eos_id


def test_skipped_blocks_equal_the_origin_without_those_blocks(native, origin):
    """The origin's forward run over a block list without the skipped blocks is the reference for
    Knob3 (what the origin's controller meant; its mask wrapper faked K/V instead, D24 in docs/origin_format.md)."""
    inputs = native.preprocess(make_image(400, 300), QUESTION, 6)
    active = [0, 2, 3, 7, 8, 11, 14, 15]
    blocks = origin.model.transformer.blocks
    origin.model.transformer.blocks = torch.nn.ModuleList([blocks[i] for i in active])
    origin.config.n_layers = len(active)
    try:
        expected = origin_forward(origin, inputs).logits[0]
    finally:
        origin.model.transformer.blocks = blocks
        origin.config.n_layers = 16
    with native.knobs(active_blocks=active):
        got = native.forward_logits(inputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_features_equal_the_origin_modules(native, origin):
    inputs = [native.preprocess(make_image(*size, seed=i), QUESTION, mc) for i, (size, mc) in enumerate(CASES)]
    feats = native.image_features(inputs)
    for row, item in zip(feats, inputs):
        with torch.no_grad():
            tokens, _ = origin.model.vision_backbone(item.images[None], item.image_masks[None])
        expected = tokens[0][item.image_input_idx >= 0].mean(0)
        torch.testing.assert_close(row, expected, rtol=0, atol=1e-5)
    questions = [QUESTION, "Wie viele Hunde sind da?", "Is it raining?"]
    lang = native.lang_features(questions)
    for row, question in zip(lang, questions):
        ids = native.tokenizer.encode(f" User: {question} Assistant:", add_special_tokens=False)
        with torch.no_grad():
            expected = origin.model.transformer.wte(torch.tensor(ids)).mean(0)
        torch.testing.assert_close(row, expected, rtol=0, atol=1e-6)


def test_another_seed_and_other_widths_load_and_match(tmp_path):
    """The name mapping is not tied to one size: d_model 96, a 4-layer ViT of width 48, 32 experts top-4."""
    ckpt = build_tiny(tmp_path / "wide", "--seed", "7", "--d-model", "96", "--vit-width", "48",
                      "--vit-layers", "4", "--experts", "32", "--top-k", "4")
    native = MolmoERuntime(ckpt)
    assert (native.num_experts, native.default_top_k, native.image_feature_dim) == (32, 4, 96)
    inputs = native.preprocess(make_image(500, 260), QUESTION, 5)
    expected = origin_forward(load_origin_model(ckpt), inputs).logits[0]
    torch.testing.assert_close(native.forward_logits(inputs), expected, rtol=0, atol=1e-4)


# -- weight files and errors ----------------------------------------------------------------------

def copy_without_weights(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    return dst


def test_sharded_safetensors_and_bin_weights_load_the_same_model(native, tiny_molmoe_dir, tmp_path):
    state = load_file(str(tiny_molmoe_dir / "model.safetensors"))
    names = sorted(state)
    sharded = copy_without_weights(tiny_molmoe_dir, tmp_path / "sharded")
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(sharded / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    binary = copy_without_weights(tiny_molmoe_dir, tmp_path / "bin")
    torch.save(state, binary / "pytorch_model.bin")
    inputs = native.preprocess(make_image(320, 240), QUESTION, 4)
    expected = native.forward_logits(inputs)
    for path in (sharded, binary):
        other = load_runtime(str(path))
        assert other.kind == "molmoe"
        assert torch.equal(other.forward_logits(inputs), expected)


def test_missing_and_mismatched_weights_name_the_tensor(tiny_molmoe_dir, tmp_path):
    state = load_file(str(tiny_molmoe_dir / "model.safetensors"))
    missing = copy_without_weights(tiny_molmoe_dir, tmp_path / "missing")
    name = "model.transformer.blocks.3.mlp.experts.5.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != name}, str(missing / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"lacks 1 of .*blocks\.3\.mlp\.experts\.5\.up_proj"):
        MolmoERuntime(missing)
    shaped = copy_without_weights(tiny_molmoe_dir, tmp_path / "shaped")
    bad = dict(state)
    bad["model.transformer.ln_f.weight"] = torch.ones(65)
    save_file(bad, str(shaped / "model.safetensors"))
    # named as the checkpoint stores it, so that it can be found in the weight files
    with pytest.raises(ModelLoadError, match=r"weight model\.transformer\.ln_f\.weight has shape \(65,\), "
                                             r"config\.json implies \(64,\)"):
        MolmoERuntime(shaped)
    extra = copy_without_weights(tiny_molmoe_dir, tmp_path / "extra")
    save_file({**state, "model.transformer.blocks.16.attn.att_proj.weight": torch.zeros(3)},
              str(extra / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"does not use, e\.g\. \['model\.transformer\.blocks\.16"):
        MolmoERuntime(extra)
    damaged = copy_without_weights(tiny_molmoe_dir, tmp_path / "damaged")
    (damaged / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="cannot read weights"):
        MolmoERuntime(damaged)


def test_unsupported_configs_are_refused_by_name(tiny_molmoe_dir, tmp_path):
    for field, value in (("block_type", "sequential"), ("weight_tying", True), ("image_pooling_2d", "attention")):
        bad = tmp_path / field
        shutil.copytree(tiny_molmoe_dir, bad, ignore=shutil.ignore_patterns("*.safetensors"))
        (bad / "model.safetensors").symlink_to(tiny_molmoe_dir / "model.safetensors")
        cfg = json.loads((bad / "config.json").read_text())
        cfg[field] = value
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match=f"{field}={value!r} is not supported"):
            MolmoERuntime(bad)


def test_the_checkpoints_python_files_are_never_needed(native, tiny_molmoe_dir, tmp_path):
    """The directory without its .py files (or with broken ones) loads and computes the same."""
    bare = tmp_path / "bare"
    shutil.copytree(tiny_molmoe_dir, bare, ignore=shutil.ignore_patterns("*.py"))
    assert not list(bare.glob("*.py"))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_molmoe_dir, broken)
    (broken / "modeling_molmoe.py").write_text("raise SystemExit('remote code executed')\n")
    inputs = native.preprocess(make_image(320, 240), QUESTION, 4)
    for path in (bare, broken):
        other = MolmoERuntime(path)
        assert other.fingerprint == native.fingerprint  # the .py files do not enter it
        assert torch.equal(other.forward_logits(inputs), native.forward_logits(inputs))


def test_fingerprint_follows_the_weights(tiny_molmoe_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_molmoe_dir, copy)
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(tiny_molmoe_dir)
    state = load_file(str(copy / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * 2
    save_file(state, str(copy / "model.safetensors"))
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(tiny_molmoe_dir)


def test_two_stage_prefill_equals_the_full_forward(native):
    """Split at the insertion position p (the online controller's), with blocks skipped after it:
    the first token's logits equal one uncached forward with the same active blocks."""
    inputs = native.preprocess(make_image(400, 300), QUESTION, 6)
    active = (0, 1, 2, 3, 5, 9, 12, 15)
    prefix = native.prefill_prefix(inputs, 4)
    state = native.prefill_suffix(prefix, active)
    with native.knobs(active_blocks=active):
        full = native.forward_logits(inputs)
    torch.testing.assert_close(state.logits, full[-1], rtol=0, atol=1e-4)
    with_budget = native.prefill_prefix(inputs, 4, extra_embedding=torch.randn(native.hidden_size))
    assert with_budget.seq_len == prefix.seq_len + 1
    torch.testing.assert_close(native.prefill_suffix(with_budget, active).logits, state.logits, rtol=0, atol=1e-4)


def test_decoded_text_is_cleaned_up_as_the_origin_tokenizer_did(native):
    """tokenizer_config.json asks for clean_up_tokenization_spaces, which transformers 4.4x applied
    when the origin decoded an answer (transformers 5 skips it for BPE tokenizers)."""
    ids = native.tokenizer.encode(" yes . It 's a cat , isn't it ?", add_special_tokens=False)
    assert native.decode_text([*ids, native.eos_id]) == " yes. It's a cat, isn't it?"


def per_expert_where(experts, hidden: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The origin's loop: per used expert in ascending order, its (slot, token) pairs from torch.where."""
    out = torch.zeros_like(hidden)
    inter = experts.intermediate
    mask = torch.nn.functional.one_hot(top_k_index, num_classes=experts.num_experts).permute(2, 1, 0)
    for expert in range(experts.num_experts):
        slot, token = torch.where(mask[expert])
        if not len(token):
            continue
        x, w = hidden[token], experts.gate_up_proj[expert]
        h = torch.nn.functional.silu(x @ w[:inter].t()) * (x @ w[inter:].t())
        h = (h @ experts.down_proj[expert].t()) * weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37])
def test_the_experts_equal_the_per_expert_loop_bit_for_bit(dtype, tokens):
    from runtime.molmoe_model import MolmoEExperts

    g = torch.Generator().manual_seed(tokens)
    experts = MolmoEExperts(num_experts=16, hidden=24, intermediate=12)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(16, 24, 24, generator=g))
        experts.down_proj.copy_(torch.randn(16, 24, 12, generator=g))
    experts = experts.to(dtype)
    hidden = torch.randn(tokens, 24, generator=g).to(dtype)
    # top-4 of 16 without repeats per token; some experts get no token at all
    top_k_index = torch.stack([torch.randperm(10, generator=g)[:4] for _ in range(tokens)])
    weights = torch.rand(tokens, 4, generator=g).to(dtype)
    with torch.no_grad():
        expected = per_expert_where(experts, hidden, top_k_index, weights)
        assert torch.equal(experts(hidden, top_k_index, weights), expected)


@pytest.mark.parametrize("float32_attention", [True, False])
def test_the_vision_tower_attends_as_the_origin_configured_so(native, origin, float32_attention):
    """In bfloat16, the vision tower attending in float32 (the checkpoint's setting) or in bfloat16 (the
    fast path on a GPU) gives the origin's tokens bit for bit with its ``float32_attention`` set alike;
    the two settings give different tokens."""
    import copy

    reference = copy.deepcopy(origin.model.vision_backbone).to(torch.bfloat16)
    for module in reference.modules():
        if hasattr(module, "config") and hasattr(module.config, "float32_attention"):
            module.config.float32_attention = float32_attention
    ours = copy.deepcopy(native.vision_backbone).to(torch.bfloat16)
    ours.set_float32_attention(float32_attention)
    assert ours.float32_attention is float32_attention
    item = native.preprocess(make_image(640, 480, seed=3), QUESTION, 6)
    images, masks = item.images[None].to(torch.bfloat16), item.image_masks[None].to(torch.bfloat16)
    with torch.no_grad():
        expected, _ = reference(images, masks)
        got, _ = ours(images, masks)
        ours.set_float32_attention(not float32_attention)
        other, _ = ours(images, masks)
    assert torch.equal(got, expected)
    assert not torch.equal(other, got)
