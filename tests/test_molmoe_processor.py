"""The native Molmo processor (runtime/molmoe_processor.py) against the origin processor.

Expected values are the ORIGIN processor's outputs recorded by
``tests/fixtures/molmoe_processor/make_fixture.py`` in a separate environment (torchvision), and
the origin ``select_tiling`` itself, read out of the reference's multimodal_preprocessor.py. The
tokenizer files come from the MolmoE reference folder (``tests/molmoe_origin.reference_dir``:
``CTRL_MOLMOE_REFERENCE``, else ``../shared/molmoe_reference``); tests that need it are skipped without it.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from molmoe_origin import reference_dir

from pipeline import knobs
from runtime import molmoe_processor as mp
from runtime.base import ModelLoadError
from runtime.molmoe_processor import MolmoImageConfig, MolmoProcessor, load_molmo_tokenizer

REPO = Path(__file__).resolve().parents[1]
FIXTURE_DIR = REPO / "tests" / "fixtures" / "molmoe_processor"
FIXTURE = FIXTURE_DIR / "origin_outputs.npz"
REFERENCE = reference_dir() or Path(os.environ.get("CTRL_MOLMOE_REFERENCE",
                                                   REPO.parent / "shared" / "molmoe_reference"))
TOKENIZER_DIR = REFERENCE / "origin" / "configs" / "tokenizer"
ORIGIN_PREPROCESSOR = REFERENCE / "origin" / "molmo" / "preprocessors" / "multimodal_preprocessor.py"

needs_fixture = pytest.mark.skipif(not FIXTURE.is_file(), reason=f"origin processor fixture {FIXTURE} is absent "
                                   "(make it with tests/fixtures/molmoe_processor/make_fixture.py)")
needs_reference = pytest.mark.skipif(not TOKENIZER_DIR.is_dir() or not ORIGIN_PREPROCESSOR.is_file(),
                                     reason=f"MolmoE reference folder {REFERENCE} is absent "
                                            "(set CTRL_MOLMOE_REFERENCE to its path)")

PIXELS_PER_PATCH = 14 * 14 * 3
PIXEL_TOL = 1e-5
# sums of PIXELS_PER_PATCH values each within PIXEL_TOL; squares of values under 3 in magnitude
SUM_TOL = PIXELS_PER_PATCH * PIXEL_TOL
SQ_SUM_TOL = PIXELS_PER_PATCH * PIXEL_TOL * 6


def _load_script():
    spec = importlib.util.spec_from_file_location("molmoe_make_fixture", FIXTURE_DIR / "make_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fixture() -> tuple[dict[str, np.ndarray], dict]:
    with np.load(FIXTURE) as data:
        arrays = {k: data[k] for k in data.files}
    return arrays, json.loads(str(arrays.pop("metadata")))


def _origin_select_tiling():
    """``select_tiling`` compiled from the origin file's source alone (it needs only NumPy)."""
    source = ORIGIN_PREPROCESSOR.read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "select_tiling")
    namespace: dict = {"np": np}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(ORIGIN_PREPROCESSOR), "exec"), namespace)
    return namespace["select_tiling"]


_META = _fixture()[1] if FIXTURE.is_file() else {}
CASES = _META.get("cases", [])
TEXT_QUESTIONS = _META.get("text_only_questions", [])


@pytest.fixture(scope="module")
def origin() -> tuple[dict[str, np.ndarray], dict]:
    return _fixture()


@pytest.fixture(scope="module")
def script():
    return _load_script()


@pytest.fixture(scope="module")
def processor() -> MolmoProcessor:
    return MolmoProcessor(load_molmo_tokenizer(TOKENIZER_DIR), MolmoImageConfig.from_dir(TOKENIZER_DIR))


def image_mismatches(images: np.ndarray, arrays: dict[str, np.ndarray], key: str) -> list[str]:
    """How an images array differs from the origin's recorded sums and sampled patches (empty: within 1e-5)."""
    problems = []
    sums = images.astype(np.float64).sum(axis=-1)
    sq_sums = np.square(images.astype(np.float64)).sum(axis=-1)
    if images.shape[:2] != arrays[key + "patch_sums"].shape:
        return [f"shape {images.shape[:2]} != {arrays[key + 'patch_sums'].shape}"]
    for name, ours, tol in (("patch_sums", sums, SUM_TOL), ("patch_sq_sums", sq_sums, SQ_SUM_TOL)):
        err = np.abs(ours - arrays[key + name])
        if err.max() > tol:
            problems.append(f"{name}: {int((err > tol).sum())} patches off, worst {err.max():.3g}")
    index = arrays[key + "sample_index"]
    err = np.abs(images[index[:, 0], index[:, 1]] - arrays[key + "sample_patches"])
    if err.max() > PIXEL_TOL:
        problems.append(f"sampled patches: worst {err.max():.3g}")
    return problems


@needs_fixture
@needs_reference
@pytest.mark.parametrize("n", range(len(CASES)),
                         ids=[f"{c['width']}x{c['height']}-k{c['max_crops']}-{c['variant']}" for c in CASES])
def test_matches_origin_processor(n: int, origin, script, processor: MolmoProcessor) -> None:
    arrays, meta = origin
    case = meta["cases"][n]
    key = f"case{n:02d}_"
    image = script.synthetic_image(case["width"], case["height"], seed=case["seed"], variant=case["variant"])
    out = processor.process(image, meta["questions"][case["question"]], case["max_crops"])

    assert out.input_ids.dtype == torch.int64 and out.image_input_idx.dtype == torch.int64
    assert out.images.dtype == torch.float32 and out.image_masks.dtype == torch.float32
    np.testing.assert_array_equal(out.input_ids.numpy(), arrays[key + "input_ids"])
    assert out.tiling == tuple(case["tiling"])
    assert out.images.shape[0] - 1 == case["crops"]
    assert list(out.images.shape) == case["images_shape"]
    np.testing.assert_array_equal(out.image_input_idx.numpy(), arrays[key + "image_input_idx"])
    np.testing.assert_array_equal(out.image_masks.numpy(), arrays[key + "image_masks"])
    assert image_mismatches(out.images.numpy(), arrays, key) == []

    prompt = arrays[f"text{case['question']}_prompt_ids"]
    assert out.num_text_tokens == len(prompt)
    np.testing.assert_array_equal(out.input_ids.numpy()[-len(prompt):], prompt)


@needs_fixture
@needs_reference
@pytest.mark.parametrize("n", range(len(TEXT_QUESTIONS)))
def test_text_only_matches_origin(n: int, origin, processor: MolmoProcessor) -> None:
    arrays, meta = origin
    out = processor.process(None, meta["text_only_questions"][n], 6)
    np.testing.assert_array_equal(out.input_ids.numpy(), arrays[f"text{n}_input_ids"])
    assert out.input_ids.dtype == torch.int64
    assert out.images is None and out.image_input_idx is None and out.image_masks is None and out.tiling is None
    assert out.num_text_tokens == len(arrays[f"text{n}_prompt_ids"])


@needs_reference
def test_num_text_tokens_is_the_prompt_alone(processor: MolmoProcessor) -> None:
    question = "What is shown in this image?"
    tokens = processor.tokenizer.encode(f" User: {question} Assistant:", add_special_tokens=False)
    out = processor.process(None, question, 1)
    assert out.num_text_tokens == len(tokens) == len(out.input_ids) - 1


@needs_fixture
def test_knobs_tiling_equals_origin_grid(origin) -> None:
    arrays, _ = origin
    sizes = arrays["grid_sizes"].astype(np.int64)
    h, w = np.meshgrid(sizes, sizes, indexing="ij")
    for a, k in enumerate(arrays["grid_max_crops"]):
        rows, cols = knobs.select_tiling(h.ravel(), w.ravel(), int(k))
        expected = arrays["grid_tiling"][a].reshape(-1, 2)
        np.testing.assert_array_equal(np.stack([rows, cols], axis=1), expected, err_msg=f"max_crops={k}")


@needs_fixture
@needs_reference
def test_processor_tiling_equals_origin_grid(origin, processor: MolmoProcessor) -> None:
    arrays, _ = origin
    sizes = arrays["grid_sizes"]
    picked = np.arange(0, len(sizes), 7)
    for a, k in enumerate(arrays["grid_max_crops"]):
        for b in picked:
            for c in picked:
                expected = tuple(int(x) for x in arrays["grid_tiling"][a, b, c])
                assert processor.tiling(int(sizes[c]), int(sizes[b]), int(k)) == expected


@needs_reference
@pytest.mark.parametrize(("window_px", "margin_px"), [(224, 112), (84, 28)])
def test_knobs_tiling_equals_origin_function(window_px: int, margin_px: int) -> None:
    """The origin function run here, on random sizes, for the MolmoE and the embedded model geometry."""
    origin_select_tiling = _origin_select_tiling()
    rng = np.random.default_rng(7)
    heights = np.concatenate([rng.integers(0, 3 * margin_px, 150), rng.integers(0, 4000, 150)])
    widths = np.concatenate([rng.integers(0, 4000, 150), rng.integers(0, 3 * margin_px, 150)])
    for k in range(1, 13):
        rows, cols = knobs.select_tiling(heights, widths, k, window_px=window_px, total_margin_px=margin_px)
        for h, w, r, c in zip(heights, widths, rows, cols, strict=True):
            expected = origin_select_tiling(int(h) - margin_px, int(w) - margin_px, window_px, k, tier=None,
                                            original_h=int(h), original_w=int(w))
            assert (int(r), int(c)) == tuple(int(x) for x in expected), (h, w, k)
            assert knobs.select_tiling(int(h), int(w), k, window_px=window_px, total_margin_px=margin_px) == (r, c)


@needs_fixture
@needs_reference
def test_origin_function_reproduces_fixture_grid(origin) -> None:
    """The function read from the reference is the one the fixture was recorded with."""
    arrays, _ = origin
    origin_select_tiling = _origin_select_tiling()
    sizes = arrays["grid_sizes"]
    for a, k in enumerate(arrays["grid_max_crops"]):
        for b in range(0, len(sizes), 11):
            for c in range(0, len(sizes), 5):
                h, w = int(sizes[b]), int(sizes[c])
                got = origin_select_tiling(h - 112, w - 112, 224, int(k), tier=None, original_h=h, original_w=w)
                assert tuple(int(x) for x in got) == tuple(int(x) for x in arrays["grid_tiling"][a, b, c])


@needs_fixture
@needs_reference
@pytest.mark.parametrize("wrong_mode", ["bicubic", "no-antialias"])
def test_image_checks_detect_a_different_resize(wrong_mode: str, origin, script, processor: MolmoProcessor,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorded sums and samples are tight enough to tell a wrong resampling apart."""
    arrays, meta = origin
    real = torch.nn.functional.interpolate

    def wrong(x, size, mode, align_corners, antialias):
        if wrong_mode == "bicubic":
            return real(x, size=size, mode="bicubic", align_corners=align_corners, antialias=antialias)
        return real(x, size=size, mode=mode, align_corners=align_corners, antialias=False)

    monkeypatch.setattr(mp.torch.nn.functional, "interpolate", wrong)
    n = next(i for i, c in enumerate(meta["cases"]) if c["width"] == 1000 and c["height"] == 1000)
    case = meta["cases"][n]
    image = script.synthetic_image(case["width"], case["height"], seed=case["seed"], variant=case["variant"])
    out = processor.process(image, meta["questions"][case["question"]], case["max_crops"])
    assert image_mismatches(out.images.numpy(), arrays, f"case{n:02d}_") != []


@needs_reference
def test_config_from_reference_file_is_the_default() -> None:
    data = json.loads((TOKENIZER_DIR / "preprocessor_config.json").read_text())
    config = MolmoImageConfig.from_dir(TOKENIZER_DIR)
    assert config == MolmoImageConfig()
    assert (config.crop_px, config.crop_px) == tuple(data["base_image_input_size"])
    assert config.patch_px == data["image_patch_size"]
    assert config.overlap_margins == tuple(data["overlap_margins"])
    assert (config.tokens_h, config.tokens_w) == (data["image_token_length_h"], data["image_token_length_w"])
    assert config.image_mean == tuple(data["image_mean"]) and config.image_std == tuple(data["image_std"])
    assert config.max_crops == data["max_crops"]
    # the origin's derived sizes: crop_window_size, total_margin_pixels, tokens_per_image, 24x24 patches
    assert (config.window_px, config.total_margin_px) == (knobs.MOLMO_CROP_WINDOW_PX, knobs.MOLMO_TOTAL_MARGIN_PX)
    assert (config.tokens_per_image, config.patches_per_crop) == (knobs.TOKENS_PER_CROP, 576)


def test_config_without_file_is_the_default(tmp_path: Path) -> None:
    assert MolmoImageConfig.from_dir(tmp_path) == MolmoImageConfig()


@pytest.mark.parametrize(("field", "value"), [
    ("overlap_margins", [3, 4]),
    ("overlap_margins", "4,4"),
    ("image_patch_size", 0),
    ("image_token_length_w", 10),
    ("base_image_input_size", [336, 224]),
    ("image_std", [0.2, 0.0, 0.2]),
    ("image_mean", [0.5, 0.5]),
    ("max_crops", True),
])
def test_config_bad_values_name_file_and_field(tmp_path: Path, field: str, value) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({field: value}))
    with pytest.raises(ModelLoadError, match=rf"preprocessor_config\.json.*{field}"):
        MolmoImageConfig.from_dir(tmp_path)


def test_tokenizer_missing_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_molmo_tokenizer(tmp_path)


def _resize_and_pad_unfused(config: MolmoImageConfig, image: np.ndarray, out_h: int,
                            out_w: int) -> tuple[np.ndarray, np.ndarray]:
    """The resize-and-pad step by step (every step its own tensor): what the in-place one must equal bit for bit."""
    height, width = image.shape[:2]
    scale = min(np.float32(out_w) / np.float32(width), np.float32(out_h) / np.float32(height))
    scaled_h, scaled_w = int(np.float32(height) * scale), int(np.float32(width) * scale)
    pixels = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).to(torch.float32) / 255.0
    if (scaled_h, scaled_w) != (height, width):
        pixels = torch.nn.functional.interpolate(pixels[None], size=[scaled_h, scaled_w], mode="bilinear",
                                                 align_corners=False, antialias=True)[0]
    mean = torch.tensor(config.image_mean, dtype=torch.float32)
    std = torch.tensor(config.image_std, dtype=torch.float32)
    top, left = (out_h - scaled_h) // 2, (out_w - scaled_w) // 2
    padded = ((torch.zeros(3) - mean) / std).expand(out_h, out_w, 3).contiguous()
    padded[top:top + scaled_h, left:left + scaled_w] = (torch.clip(pixels, 0.0, 1.0).permute(1, 2, 0) - mean) / std
    mask = np.zeros((out_h, out_w), dtype=bool)
    mask[top:top + scaled_h, left:left + scaled_w] = True
    return padded.numpy(), mask


@pytest.mark.parametrize("size", [(640, 480), (480, 640), (336, 336), (1000, 250), (150, 150), (17, 900)])
def test_resize_and_pad_equals_the_unfused_formulation_bit_for_bit(size) -> None:
    """Every canvas the crops are cut from (each tiling up to 12 crops, and the global image) is the
    same float32 array as the step-by-step formulation's, including images that need no resize."""
    config = MolmoImageConfig()
    processor = object.__new__(MolmoProcessor)
    processor.config = config
    width, height = size
    image = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    shapes = {(config.crop_px, config.crop_px), (height, width)}
    for max_crops in (1, 4, 10, 12):
        rows, cols = knobs.select_tiling(height, width, max_crops, window_px=config.window_px,
                                         total_margin_px=config.total_margin_px)
        shapes.add((rows * config.window_px + config.total_margin_px, cols * config.window_px + config.total_margin_px))
    pixels = processor._unit_pixels(image)
    before = pixels.clone()
    for out_h, out_w in sorted(shapes):
        canvas, mask = processor._resize_and_pad(pixels, out_h, out_w)
        expected, expected_mask = _resize_and_pad_unfused(config, image, out_h, out_w)
        assert canvas.dtype == np.float32 and canvas.shape == (out_h, out_w, 3)
        np.testing.assert_array_equal(canvas, expected)
        np.testing.assert_array_equal(mask, expected_mask)
    assert torch.equal(pixels, before)  # one conversion serves every resize of the request
