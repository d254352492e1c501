"""The model runtime: knobs act on the execution path, caches stay correct, builds are reproducible.

The embedded model is built once per session into a temporary cache. The same knob checks run
on the native MolmoE runtime: over a tiny checkpoint with the real layout built from the origin
reference, or over a real MolmoE-1B checkpoint when ``CTRL_MOLMOE_PATH`` names one.
Knob effects are observed with forward hooks on the modules that do the work (routers/experts,
decoder blocks), never by reading the knob attribute back.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download

from pipeline import knobs
from pipeline.errors import KnobError
from runtime import (
    ModelInputs,
    ModelLoadError,
    build_embedded_model,
    load_runtime,
)
from runtime.embedded import EmbeddedRuntime
from runtime.embedded_model import is_embedded_dir

MOLMOE_PATH = os.environ.get("CTRL_MOLMOE_PATH")
QUESTION = "What is the color of the cat on the table?"


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth deterministic test image (gradients + a few blocks), not just noise."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    arr = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    for _ in range(4):
        x0, y0 = rng.randint(0, width // 2), rng.randint(0, height // 2)
        arr[y0:y0 + height // 3, x0:x0 + width // 3] = rng.randint(0, 255, size=3)
    return Image.fromarray(arr.clip(0, 255).astype(np.uint8))


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ctrl-cache")


@pytest.fixture(scope="session")
def embedded_dir(cache_root: Path) -> Path:
    return build_embedded_model(seed=0, cache_dir=cache_root)


@pytest.fixture(scope="session")
def embedded(embedded_dir: Path) -> EmbeddedRuntime:
    return EmbeddedRuntime(embedded_dir)


@pytest.fixture(scope="session")
def molmoe(request: pytest.FixtureRequest):
    """The native MolmoE runtime: a real checkpoint from CTRL_MOLMOE_PATH, else the tiny one."""
    from runtime.molmoe import MolmoERuntime

    path = MOLMOE_PATH or request.getfixturevalue("tiny_molmoe_dir")
    return MolmoERuntime(path, device="cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(params=["embedded", "molmoe"])
def rt(request: pytest.FixtureRequest):
    """Every knob test runs on the embedded model and on the native MolmoE runtime."""
    return request.getfixturevalue(request.param)


@pytest.fixture
def image_inputs(rt) -> ModelInputs:
    return rt.preprocess(make_image(320, 240), QUESTION, 4)


# -- hook helpers -----------------------------------------------------------------------------

@contextmanager
def count_block_calls(rt):
    """calls[i] = how many times decoder block i ran."""
    calls: dict[int, int] = defaultdict(int)
    handles = [layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
               for i, layer in enumerate(rt.decoder_layers)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


@contextmanager
def count_experts_per_token(rt):
    """per_layer[i] = list of the number of distinct experts each token was sent to in block i
    (the routing indices the experts module of block i receives)."""
    per_layer: dict[int, list[int]] = defaultdict(list)
    handles = []
    for i, layer in enumerate(rt.decoder_layers):
        def hook(_module, args, _out, i=i):
            top_k_index = args[1]
            per_layer[i] += [len(set(row.tolist())) for row in top_k_index]
        handles.append(layer.mlp.experts.register_forward_hook(hook))
    try:
        yield per_layer
    finally:
        for h in handles:
            h.remove()


# -- preprocessing: crops -------------------------------------------------------------------------

CROP_CASES = [((320, 240), 1), ((400, 150), 2), ((640, 480), 4), ((300, 300), 6), ((1000, 250), 8),
              ((800, 600), 12), ((150, 150), 12)]


@pytest.mark.parametrize(("size", "max_crops"), CROP_CASES)
def test_image_arrays_are_crops_plus_one(rt, size, max_crops):
    inputs = rt.preprocess(make_image(*size), QUESTION, max_crops)
    rows, cols = inputs.tiling
    assert (rows, cols) == rt.tiling(size[0], size[1], max_crops)
    assert 1 <= rows * cols <= max_crops
    assert inputs.images.shape[0] == rows * cols + 1 == inputs.num_crops + 1
    assert inputs.images.dtype == torch.float32
    if rt.kind == "embedded":
        assert inputs.images.shape[1] == 3
    assert inputs.input_ids.dtype == torch.int64 and inputs.input_ids.shape[0] == 1
    assert inputs.attention_mask.shape == inputs.input_ids.shape
    positions = inputs.image_token_positions
    assert positions.dtype == torch.int64 and positions.unique().numel() == positions.numel()
    if rt.kind == "embedded":
        # one placeholder per pooled token per image array, nothing else is a placeholder
        assert positions.numel() == inputs.images.shape[0] * rt.spec.tokens_per_image
        assert torch.equal(positions, (inputs.input_ids[0] == rt.image_patch_id).nonzero().flatten())
    else:
        # every placed image token lands on an <im_patch> token, and every <im_patch> gets one
        patch_id = rt.tokenizer.convert_tokens_to_ids("<im_patch>")
        assert torch.equal(positions.sort().values, (inputs.input_ids[0] == patch_id).nonzero().flatten())


def test_some_crop_case_uses_exactly_max_crops(rt):
    """Origin defect D11 (docs/origin_format.md) drops the last crop when rows*cols == max_crops: cover that case."""
    exact = [(size, mc) for size, mc in CROP_CASES if np.prod(rt.tiling(size[0], size[1], mc)) == mc and mc > 1]
    assert exact, "no test case uses a tiling with exactly max_crops crops"
    for size, mc in exact:
        assert rt.preprocess(make_image(*size), QUESTION, mc).images.shape[0] == mc + 1


def test_embedded_tiling_is_the_molmo_rule_on_the_small_geometry(embedded):
    for (w, h), mc in CROP_CASES:
        assert embedded.tiling(w, h, mc) == knobs.select_tiling(h, w, mc, window_px=84, total_margin_px=28)
    with pytest.raises(KnobError):
        embedded.tiling(100, 100, 0)


def test_embedded_prompt_format_and_global_image_first(embedded):
    assert embedded.format_prompt("What is it?") == " User: What is it? Assistant:"
    image = make_image(400, 150)
    inputs = embedded.preprocess(image, "What is it?", 2)
    ids = inputs.input_ids[0].tolist()
    n_arrays, per = inputs.images.shape[0], embedded.spec.tokens_per_image + 2
    assert ids[0] == embedded.image_start_id and ids[n_arrays * per - 1] == embedded.image_end_id
    assert embedded.tokenizer.decode(ids[n_arrays * per:]) == inputs.prompt == " User: What is it? Assistant:"
    # the global image (whole image squeezed to one crop) comes first
    glob = embedded._to_tensor(image.convert("RGB").resize((112, 112), Image.Resampling.BICUBIC))
    assert torch.equal(inputs.images[0], glob)
    text_only = embedded.preprocess(None, "What is it?", 6)
    assert text_only.images is None and text_only.tiling is None and text_only.num_crops == 0
    assert embedded.image_patch_id not in text_only.input_ids[0].tolist()


# -- knobs on the execution path ----------------------------------------------------------------

def test_router_uses_k_experts_where_set_and_default_elsewhere(rt, image_inputs):
    """On the eager path, whose experts module is called with the routing (the fast path's own
    routing is counted in tests/test_fast_decoder.py)."""
    saved = rt.fast is not None
    rt.set_execution(False)
    try:
        _router_uses_k_experts(rt, image_inputs)
    finally:
        rt.set_execution(saved)


def _router_uses_k_experts(rt, image_inputs):
    special = {1: 2, 5: 12, 9: 4}
    with rt.knobs(top_k=special), count_experts_per_token(rt) as per_layer:
        rt.generate(image_inputs, max_new_tokens=2)
    assert sorted(per_layer) == list(range(rt.num_layers))
    for i, counts in per_layer.items():
        assert set(counts) == {special.get(i, rt.default_top_k)}, f"block {i}"
    with rt.knobs(top_k=3), count_experts_per_token(rt) as per_layer:
        rt.generate(image_inputs, max_new_tokens=2)
    assert {c for counts in per_layer.values() for c in counts} == {3}


def test_skipped_blocks_do_not_execute(rt, image_inputs):
    for knob in ({"num_active_blocks": 12}, {"active_blocks": [0, 2, 5, 15]}):
        with rt.knobs(**knob):
            active = set(rt.current_active_blocks())
            with count_block_calls(rt) as calls:
                rt.generate(image_inputs, max_new_tokens=4)
        steps = calls[0]
        assert steps >= 1
        assert {i for i, n in calls.items() if n} == active
        assert all(calls[i] == steps for i in active)
    assert active == {0, 2, 5, 15}
    with count_block_calls(rt) as calls:  # restored: every block runs again
        rt.generate(image_inputs, max_new_tokens=2)
    assert sorted(calls) == list(range(rt.num_layers))


def test_num_active_blocks_uses_the_documented_rule(rt):
    for n in (1, 8, 12, 15, 16):
        with rt.knobs(num_active_blocks=n):
            assert rt.current_active_blocks() == list(knobs.select_active_blocks(n, rt.num_layers))


def test_importance_scores_choose_the_blocks(embedded_dir, tmp_path):
    scores = {str(b): float((b * 7) % 16) for b in range(16)}
    path = tmp_path / "scores.json"
    path.write_text(json.dumps({"merged_scores": scores}))
    runtime = load_runtime(str(embedded_dir), importance_scores=path)
    expected = knobs.select_active_blocks(12, 16, {int(k): v for k, v in scores.items()})
    assert runtime.blocks_for(12) == expected and 0 in expected
    with runtime.knobs(num_active_blocks=12):
        assert tuple(runtime.current_active_blocks()) == expected


def test_outputs_change_with_top_k_and_blocks(rt, image_inputs):
    base_logits = rt.forward_logits(image_inputs)
    base_text = rt.generate(image_inputs, max_new_tokens=8)
    for knob in ({"top_k": 2}, {"top_k": 12}, {"num_active_blocks": 12}, {"num_active_blocks": 14}):
        with rt.knobs(**knob):
            logits = rt.forward_logits(image_inputs)
            result = rt.generate(image_inputs, max_new_tokens=8)
        rel = float((logits - base_logits).norm() / base_logits.norm())
        assert rel > (0.1 if rt.kind == "embedded" else 1e-3), f"{knob}: relative logit change {rel:.4f}"
        if rt.kind == "embedded":  # a random model has no stable answer: greedy text must move too
            assert result.token_ids != base_text.token_ids, knob
    # and nothing changes when the knobs are back at their defaults
    assert torch.equal(rt.forward_logits(image_inputs), base_logits)


def test_knobs_restored_even_when_the_body_raises(rt, image_inputs):
    before_k, before_blocks = rt.current_top_k(), rt.current_active_blocks()
    with pytest.raises(RuntimeError, match="boom"), rt.knobs(top_k={0: 8, 3: 2}, num_active_blocks=10):
        assert rt.current_top_k()[3] == 2 and len(rt.current_active_blocks()) == 10
        msg = "boom"
        raise RuntimeError(msg)
    assert rt.current_top_k() == before_k and rt.current_active_blocks() == before_blocks
    # a failure inside a forward with blocks skipped also leaves the full block list in place
    handle = rt.decoder_layers[1].register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("hook")))
    try:
        with pytest.raises(RuntimeError, match="hook"), rt.knobs(active_blocks=[0, 1, 15]):
            rt.generate(image_inputs, max_new_tokens=2)
    finally:
        handle.remove()
    assert rt.current_active_blocks() == list(range(rt.num_layers))
    with count_block_calls(rt) as calls:
        rt.generate(image_inputs, max_new_tokens=1)
    assert sorted(calls) == list(range(rt.num_layers))
    # nested scopes restore in order
    with rt.knobs(top_k=4):
        with rt.knobs(top_k={2: 6}, active_blocks=[0, 15]):
            assert rt.current_top_k()[:3] == [4, 4, 6]
        assert rt.current_top_k() == [4] * rt.num_layers and rt.current_active_blocks() == before_blocks
    assert rt.current_top_k() == before_k


def test_invalid_knobs_are_refused(rt):
    for bad in (0, rt.num_experts + 1, True, 2.5, {99: 4}, {0: 0}):
        with pytest.raises(KnobError):
            rt.set_top_k(bad)
    for bad in ([1, 2, 3], [], [0, rt.num_layers], [0, -1, 2], [0, True]):
        with pytest.raises(KnobError):
            rt.set_active_blocks(bad)
    for bad in (0, rt.num_layers + 1):
        with pytest.raises(KnobError):
            rt.blocks_for(bad)
    with pytest.raises(ValueError), rt.knobs(num_active_blocks=12, active_blocks=[0, 1]):
        pass
    assert rt.current_top_k() == [rt.default_top_k] * rt.num_layers
    assert rt.current_active_blocks() == list(range(rt.num_layers))


@pytest.mark.parametrize("with_image", [True, False])
def test_kv_cache_matches_recomputation_with_blocks_skipped(rt, with_image):
    """Greedy decoding with the KV cache == re-running the whole sequence at every step, token for token."""
    inputs = rt.preprocess(make_image(400, 300) if with_image else None, QUESTION, 6)
    with rt.knobs(top_k={0: 8, 4: 2, 15: 4}, active_blocks=[0, 3, 4, 7, 11, 15]):
        cached = rt.generate(inputs, max_new_tokens=10)
        recomputed: list[int] = []
        while len(recomputed) < len(cached.token_ids):
            recomputed.append(int(rt.forward_logits(inputs, recomputed)[-1].argmax()))
    assert cached.token_ids == recomputed
    assert len(cached.token_ids) >= (10 if rt.kind == "embedded" else 1)
    if rt.kind == "embedded":  # the knobs really mattered for this sequence
        assert rt.generate(inputs, max_new_tokens=10).token_ids != cached.token_ids


# -- features -----------------------------------------------------------------------------------

def test_image_and_lang_features(rt):
    batch = [rt.preprocess(make_image(*size, seed=i), QUESTION, mc)
             for i, (size, mc) in enumerate([((320, 240), 6), ((400, 150), 2), ((800, 600), 12)])]
    batch.append(rt.preprocess(None, QUESTION, 6))
    feats = rt.image_features(batch)
    assert feats.shape == (4, rt.image_feature_dim) and feats.dtype == torch.float32
    assert torch.isfinite(feats).all() and feats[:3].abs().sum(1).gt(0).all()
    assert torch.equal(feats[3], torch.zeros(rt.image_feature_dim))  # text-only: no image tokens
    assert torch.equal(rt.image_features(batch), feats)  # deterministic
    torch.testing.assert_close(rt.image_features(batch[1:2])[0], feats[1], rtol=1e-4, atol=1e-5)  # batch-independent
    assert not torch.allclose(feats[0], feats[1])

    questions = [QUESTION, "How many dogs are there?", "Is it raining?"]
    lang = rt.lang_features(questions)
    assert lang.shape == (3, rt.lang_feature_dim) and lang.dtype == torch.float32
    assert torch.equal(rt.lang_features(questions), lang)
    assert not torch.allclose(lang[0], lang[1])
    # the mean input embedding of the formatted prompt's text tokens (no image placeholders)
    ids = rt.tokenizer.encode(rt.format_prompt(questions[1]), add_special_tokens=False)
    emb = rt.text_embeddings(torch.tensor([ids]))
    assert emb.shape == (1, len(ids), rt.lang_feature_dim)
    torch.testing.assert_close(lang[1], emb[0].float().mean(0).cpu())


def _global_crop_expected(rt, image: Image.Image) -> torch.Tensor:
    """The global image's tokens as the vision module's plain forward computes them at max_crops 1,
    mean-pooled: at one crop the global array is the only one besides the crop, and (MolmoE) the
    first mask row is the global image's own."""
    inputs = rt.preprocess(image, QUESTION, 1)
    with torch.inference_mode():
        if rt.kind == "molmoe":
            tokens = rt.vision_module(inputs.images[None], inputs.image_masks[None])[0][0, 0]
        else:
            tokens = rt.vision_module(inputs.images[:1])[0]
    return tokens.float().mean(0)


GLOBAL_SIZES = [(640, 480), (1000, 300), (1500, 1500)]


def test_the_global_crop_feature_is_the_same_at_every_crop_count(rt):
    """The feature stage 2 reads: the mean of the global crop's tokens, from the vision pass of any
    max_crops (the tower encodes each array on its own); the all-crops mean is not."""
    for i, size in enumerate(GLOBAL_SIZES):
        image = make_image(*size, seed=i)
        expected = _global_crop_expected(rt, image)
        batch = [rt.preprocess(image, QUESTION, c) for c in (1, 6, 12)]
        both = rt.encode_images(batch + [rt.preprocess(None, QUESTION, 6)])
        assert both.global_crop.shape == both.all_tokens.shape == (4, rt.image_feature_dim)
        assert both.global_crop.dtype == torch.float32 and both.global_crop.device.type == "cpu"
        for row in range(3):
            torch.testing.assert_close(both.global_crop[row], expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(both.global_crop[3], torch.zeros(rt.image_feature_dim))  # text only
        assert torch.equal(both.all_tokens, rt.image_features(batch + [rt.preprocess(None, QUESTION, 6)]))
        if size == (1500, 1500):  # three tilings: the all-crops mean moves with them
            assert len({inputs.tiling for inputs in batch}) == 3
            assert not torch.allclose(both.all_tokens[1], both.all_tokens[2], atol=1e-4)


def test_molmoe_global_crop_takes_its_own_padding_mask(molmoe):
    """Molmo's image_masks rows are shifted by one (row 0 is the first crop's), so in the decoder's
    tokens the global image gets the first crop's padding; the feature uses its own, the row it
    has at max_crops 1."""
    image = make_image(640, 480, seed=0)  # wider than tall: padding above and below
    one, six = molmoe.preprocess(image, QUESTION, 1), molmoe.preprocess(image, QUESTION, 6)
    assert torch.equal(one.global_image_mask, one.image_masks[0])
    assert torch.equal(six.global_image_mask, one.global_image_mask)
    assert not torch.equal(six.image_masks[0], six.global_image_mask) and six.tiling != (1, 1)
    with torch.inference_mode():
        decoder_tokens, _ = molmoe.vision_module(six.images[None], six.image_masks[None])
    expected = _global_crop_expected(molmoe, image)
    if molmoe.vision_module.pad_embed is not None:  # the padding embeddings make the masks matter
        assert not torch.allclose(decoder_tokens[0, 0].float().mean(0), expected, atol=1e-3)
    torch.testing.assert_close(molmoe.global_image_features([six])[0], expected, rtol=1e-5, atol=1e-6)


def test_the_request_carries_its_global_crop_feature(rt):
    """``prefill_prefix`` returns the global-crop feature of the request's own vision pass, at any
    crops and insertion position: what extract-features caches (there at the reference crops)."""
    from runtime import REFERENCE_MAX_CROPS

    image = make_image(800, 600, seed=5)
    cached = rt.global_image_features([rt.preprocess(make_image(300, 500, seed=6), "", REFERENCE_MAX_CROPS),
                                       rt.preprocess(image, "", REFERENCE_MAX_CROPS)])[1]
    for max_crops, p, token in ((1, 1, None), (6, 3, torch.randn(rt.hidden_size)), (12, 0, None)):
        state = rt.prefill_prefix(rt.preprocess(image, QUESTION, max_crops), p, token)
        feature = state.image_feature
        assert feature.shape == (rt.image_feature_dim,) and feature.dtype == torch.float32
        assert feature.device.type == "cpu"
        torch.testing.assert_close(feature, cached, rtol=1e-5, atol=1e-6)
    assert rt.prefill_prefix(rt.preprocess(None, QUESTION, 6), 1).image_feature is None


def test_insertion_position_zero_leaves_every_block_to_stage_2(rt, image_inputs):
    """p = 0: the prefix is the vision tower and the embeddings only, and the suffix runs every
    active block with the top-K chosen afterwards: the tokens of generate with those knobs."""
    with count_block_calls(rt) as calls:
        prefix = rt.prefill_prefix(image_inputs, 0)
    assert dict(calls) == {} and prefix.insertion_position == 0
    assert torch.equal(prefix.hidden, prefix.embeds) and prefix.image_feature is not None
    active = rt.blocks_for(12)
    with rt.knobs(top_k=4, active_blocks=active):
        reference = rt.generate(image_inputs, max_new_tokens=6).token_ids
    with rt.knobs(top_k=4):
        with count_block_calls(rt) as calls:
            state = rt.prefill_suffix(prefix, active)
        assert dict(calls) == {b: 1 for b in active}
        tokens = [int(state.logits.argmax())]
        while len(tokens) < 6 and tokens[-1] != rt.eos_id:
            rt.decode_step(state, tokens[-1])
            tokens.append(int(state.logits.argmax()))
    assert tokens == reference
    with pytest.raises(KnobError, match=r"insertion position must be in 1\.\.15, got 0 \(position 0 runs no block"):
        rt.prefill_prefix(image_inputs, 0, torch.zeros(rt.hidden_size))
    with pytest.raises(KnobError, match=r"insertion position must be in 0\.\.15, got 16"):
        rt.prefill_prefix(image_inputs, 16)


# -- build, save / load, fingerprint ---------------------------------------------------------------

def test_save_load_round_trip_gives_identical_outputs(embedded, embedded_dir, tmp_path):
    inputs = embedded.preprocess(make_image(320, 240), QUESTION, 4)
    copy = tmp_path / "elsewhere"
    shutil.copytree(embedded_dir, copy)
    for path in (embedded_dir, copy):
        other = load_runtime(str(path))
        assert isinstance(other, EmbeddedRuntime) and other.kind == "embedded"
        assert other.fingerprint == embedded.fingerprint
        assert torch.equal(other.forward_logits(inputs), embedded.forward_logits(inputs))
        assert other.generate(inputs, 6) == embedded.generate(inputs, 6)
        assert (other.num_layers, other.num_experts, other.default_top_k) == (16, 64, 8)


def test_the_decoder_is_stored_fused_and_the_per_expert_layout_still_loads(embedded, embedded_dir, tmp_path):
    """The decoder file holds the experts as two fused tensors per block (it loads without
    transformers' per-expert conversion); a directory in the per-expert layout transformers
    writes by default loads to the same model."""
    from safetensors.torch import load_file

    stored = load_file(str(embedded_dir / "decoder" / "model.safetensors"))
    experts = sorted(k for k in stored if ".mlp.experts." in k)
    assert experts[:2] == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"]
    assert len(experts) == 16 * 2 and tuple(stored[experts[1]].shape) == (64, 2 * 32, 64)
    legacy = tmp_path / "legacy"
    shutil.copytree(embedded_dir, legacy)
    shutil.rmtree(legacy / "decoder")
    # a model built in memory (not loaded from a fused file) is saved in transformers' default layout
    fresh = type(embedded.decoder)(embedded.decoder.config)
    fresh.load_state_dict(embedded.decoder.state_dict())
    fresh.save_pretrained(legacy / "decoder")
    assert sum(".mlp.experts." in k for k in load_file(str(legacy / "decoder" / "model.safetensors"))) == 16 * 64 * 3
    other = load_runtime(str(legacy))
    inputs = embedded.preprocess(make_image(320, 240), QUESTION, 4)
    assert torch.equal(other.forward_logits(inputs), embedded.forward_logits(inputs))


def test_build_is_deterministic_and_reused(embedded, embedded_dir, cache_root, tmp_path):
    mtime = (embedded_dir / "decoder" / "model.safetensors").stat().st_mtime_ns
    assert build_embedded_model(seed=0, cache_dir=cache_root) == embedded_dir  # reused, not rebuilt
    assert (embedded_dir / "decoder" / "model.safetensors").stat().st_mtime_ns == mtime
    again = build_embedded_model(seed=0, cache_dir=tmp_path)
    assert again != embedded_dir and is_embedded_dir(again)
    assert EmbeddedRuntime(again).fingerprint == embedded.fingerprint
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    other_seed = EmbeddedRuntime(build_embedded_model(seed=1, cache_dir=tmp_path))
    assert other_seed.fingerprint != embedded.fingerprint


def test_default_cache_dir_comes_from_the_environment(monkeypatch, embedded_dir, cache_root):
    monkeypatch.setenv("CTRL_CACHE_DIR", str(cache_root))
    assert build_embedded_model() == embedded_dir
    runtime = load_runtime("embedded")
    assert runtime.path == embedded_dir


def test_sizes(embedded):
    sizes = embedded.num_parameters()
    assert sizes["decoder"] > sizes["vision"] > 0 and sum(sizes.values()) < 20_000_000
    assert embedded.image_feature_dim == embedded.lang_feature_dim == embedded.decoder.config.hidden_size
    assert len(embedded.decoder_layers) == 16


def test_vision_module_brackets_the_vision_path(rt, image_inputs):
    """A hook on vision_module sees the projected tokens: once per image request, never for text."""
    seen = []
    handle = rt.vision_module.register_forward_hook(lambda _m, _a, out: seen.append(out))
    try:
        rt.generate(image_inputs, max_new_tokens=3)
        rt.generate(rt.preprocess(None, QUESTION, 4), max_new_tokens=3)
    finally:
        handle.remove()
    assert len(seen) == 1  # prefill only: decode steps do not re-run the vision tower
    out = seen[0][0] if isinstance(seen[0], tuple) else seen[0]
    assert out.shape[-1] == rt.image_feature_dim


# -- loading errors and devices --------------------------------------------------------------------

def test_non_checkpoint_directories_give_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_runtime(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="neither an embedded model nor a MolmoE checkpoint"):
        load_runtime(str(tmp_path))
    with pytest.raises(ModelLoadError, match="no such model directory"):
        load_runtime(str(tmp_path / "missing"))


def test_embedded_directory_with_a_missing_weight_file_is_refused(embedded_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(embedded_dir, broken)
    (broken / "projector" / "projector.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="cannot load"):
        EmbeddedRuntime(broken)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when CUDA is absent")
def test_cuda_without_cuda_is_a_clear_error(embedded_dir):
    with pytest.raises(ModelLoadError, match="CUDA"):
        EmbeddedRuntime(embedded_dir, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(embedded, embedded_dir):
    gpu = EmbeddedRuntime(embedded_dir, device="cuda", dtype="float32")  # auto would be bfloat16 on a GPU
    inputs = embedded.preprocess(make_image(320, 240), QUESTION, 4)
    torch.testing.assert_close(gpu.forward_logits(inputs), embedded.forward_logits(inputs), rtol=1e-3, atol=1e-3)
    assert gpu.image_features([inputs]).shape == (1, gpu.image_feature_dim)
    gpu.generate(inputs, 4)


def test_the_embedded_model_in_bfloat16_computes_close_to_float32(embedded, embedded_dir):
    """Every weight-reading op of its CLIP tower and OLMoE decoder (conv, layer norm, linear,
    embeddings) runs over bf16 weights; features stay within bf16 precision of float32's."""
    half = EmbeddedRuntime(embedded_dir, dtype="bfloat16")
    assert {p.dtype for m in (half.vision_backbone, half.decoder) for p in m.parameters()} == {torch.bfloat16}
    assert half.fingerprint != embedded.fingerprint
    inputs = [embedded.preprocess(make_image(320, 240, seed=s), QUESTION, 4) for s in range(3)]
    exact, rounded = embedded.image_features(inputs), half.image_features(inputs)
    assert rounded.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(exact, rounded).min() > 0.99
    lang = half.lang_features([QUESTION])
    assert torch.nn.functional.cosine_similarity(lang, embedded.lang_features([QUESTION])).item() > 0.999
    assert len(half.generate(inputs[0], 4).token_ids) >= 1


def test_molmoe_layout(molmoe):
    assert molmoe.kind == "molmoe" and molmoe.num_layers == knobs.NUM_TOTAL_BLOCKS
    assert molmoe.num_experts == knobs.NUM_EXPERTS and molmoe.default_top_k == knobs.DEFAULT_TOP_K
    assert molmoe.tiling(640, 480, 12) == knobs.select_tiling(480, 640, 12)
