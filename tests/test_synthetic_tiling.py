"""The synthetic generator's opt-in fields for worlds whose tilings the features observe: images written
at a scale the embedded preprocessor tiles as Molmo's rule tiles the original (``image_scale``), the
real sets' size spread (``image_sizes``) and prompts with context (``prompt_context``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from synthetic import SyntheticSpec, generate_tree, spec_fingerprint
from synthetic.truth import (
    EMBEDDED_TOTAL_MARGIN_PX,
    EMBEDDED_WINDOW_PX,
    TILING_CHECK_MAX_CROPS,
    TILING_IMAGE_SCALE,
    build_dataset,
    embedded_tiling,
    scaled_image_sizes,
    select_tiling,
)

SMALL = dict(max_crops=(2, 12), top_k=(4, 12), num_active_blocks=(12, 16))


def test_the_embedded_geometry_is_the_runtimes() -> None:
    from runtime.embedded_model import EmbeddedSpec

    spec = EmbeddedSpec()
    assert (spec.window_px, spec.total_margin_px) == (EMBEDDED_WINDOW_PX, EMBEDDED_TOTAL_MARGIN_PX) == (84, 28)
    assert TILING_IMAGE_SCALE == 84 / 224 == 0.375


def test_a_hand_computed_case() -> None:
    # Molmo on 1024x768 at max_crops 10: 656 x 912 px after the 112-px margin; rows need 656/224 = 2.93 -> 3,
    # cols 912/224 = 4.07 -> 5 windows, 15 > 10 crops, so every tiling downscales and the largest scale wins:
    # (3, 3) min(672/656, 672/912) = 0.737 beats (2, 5) 0.683 and (2, 4) 0.683 -> 9 crops
    rows, cols = select_tiling(np.array([768]), np.array([1024]), 10)
    assert (int(rows[0]), int(cols[0])) == (3, 3)
    # written at 0.375: 28 + 0.375 * (1024 - 112) = 370, 28 + 0.375 * (768 - 112) = 274; the embedded rule
    # on 246 x 342 px with 84-px windows compares the same scales, 252/246 and 252/342
    assert scaled_image_sizes(np.array([[1024, 768]]), TILING_IMAGE_SCALE).tolist() == [[370, 274]]
    rows, cols = embedded_tiling(np.array([274]), np.array([370]), 10)
    assert (int(rows[0]), int(cols[0])) == (3, 3)


def test_scaled_sizes_tile_as_the_originals_over_many_sizes() -> None:
    rng = np.random.default_rng(0)
    size = np.stack([rng.integers(150, 2400, 20_000), rng.integers(150, 2400, 20_000)], axis=1)
    written = scaled_image_sizes(size, TILING_IMAGE_SCALE)
    plain = np.round(EMBEDDED_TOTAL_MARGIN_PX + TILING_IMAGE_SCALE * (size - 112)).astype(np.int64)
    assert np.abs(written - plain).max() <= 4 and (written != plain).any(axis=1).mean() < 0.02
    for max_crops in TILING_CHECK_MAX_CROPS:
        want = select_tiling(size[:, 1], size[:, 0], max_crops)
        got = embedded_tiling(written[:, 1], written[:, 0], max_crops)
        assert (want[0] == got[0]).all() and (want[1] == got[1]).all(), max_crops


def test_written_images_tile_as_the_truth(tmp_path: Path) -> None:
    spec = SyntheticSpec(datasets=("coco_2014_vqa", "text_vqa", "doc_qa", "science_qa_img"), num_samples=10,
                         world_size=1, image_scale=TILING_IMAGE_SCALE, image_sizes="vqa", **SMALL)
    tree = generate_tree(spec, tmp_path)
    checked = 0
    for s in tree.samples:
        with Image.open(tree.images_dir / s.image_file) as img:
            width, height = img.size
        truth = tree.truth[s.dataset]
        for max_crops in TILING_CHECK_MAX_CROPS:
            rows, cols = embedded_tiling(np.array([height]), np.array([width]), max_crops)
            assert int(rows[0] * cols[0]) == int(truth.num_crops(max_crops)[s.index]), (s.image_file, max_crops)
            checked += 1
    assert checked == len(tree.samples) * len(TILING_CHECK_MAX_CROPS) > 0
    # the crop counts differ per image: the tiling tells requests apart
    assert len({int(tree.truth["text_vqa"].num_crops(12)[i]) for i in range(10)}) > 1


def test_the_stamps_of_specs_without_the_new_fields_are_unchanged() -> None:
    # computed on the generator before image_scale, image_sizes and prompt_context existed
    assert spec_fingerprint(SyntheticSpec()) == "e85188241ff6a3ecd0c50e27185baaba55b370565eb8da60a2e4fd2c79e76566"
    assert (spec_fingerprint(SyntheticSpec(num_samples=400))
            == "b674b88da823b45b539548e5a67c0d0680c4203f1432cf1b261f5e9c318dc81b")
    base = spec_fingerprint(SyntheticSpec())
    for options in ({"image_scale": 0.375}, {"image_sizes": "vqa"}, {"prompt_context": True}):
        assert spec_fingerprint(SyntheticSpec(**options)) != base


def test_image_sizes_change_only_the_sizes() -> None:
    for ds in ("coco_2014_vqa", "doc_qa", "text_vqa"):
        default, vqa = build_dataset(ds, 200, seed=3), build_dataset(ds, 200, seed=3, image_sizes="vqa")
        assert vqa.metadata == default.metadata and np.array_equal(vqa.detail, default.detail)
        assert np.array_equal(vqa.image_index, default.image_index)
        if ds == "text_vqa":  # already the mixed spread of the real set
            assert np.array_equal(vqa.image_size, default.image_size)
    coco = build_dataset("coco_2014_vqa", 300, seed=3, image_sizes="vqa").image_size
    assert coco.max(axis=1).min() >= 480 and coco.max(axis=1).max() <= 640
    assert np.mean(np.isclose(coco[:, 0] / coco[:, 1], 4 / 3, atol=0.01)) > 0.35
    doc = build_dataset("doc_qa", 300, seed=3, image_sizes="vqa").image_size
    assert (doc[:, 1] > doc[:, 0]).all() and doc[:, 1].min() >= 1000 and doc[:, 1].max() <= 2200
    with pytest.raises(ValueError, match="image_sizes"):
        build_dataset("doc_qa", 5, seed=3, image_sizes="tiny")


def test_prompt_context_lengthens_questions_by_family() -> None:
    default = build_dataset("coco_2014_vqa", 300, seed=4)
    ctx = build_dataset("coco_2014_vqa", 300, seed=4, prompt_context=True)
    assert np.array_equal(ctx.detail, default.detail) and np.array_equal(ctx.out_tokens, default.out_tokens)
    for a, b in zip(default.metadata, ctx.metadata):
        assert b["question"].endswith(a["question"]) and b["family"] == a["family"]
    family = np.array([m["family"] for m in ctx.metadata])
    means = {f: ctx.text_tokens[family == f].mean() for f in set(family)}
    assert means["place"] > 2 * means["color"]  # 3 sentences on average vs 0.3
    assert ctx.text_tokens.max() > 3 * default.text_tokens.max()


def test_the_new_fields_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="image_scale"):
        generate_tree(SyntheticSpec(num_samples=2, image_scale=0.0), tmp_path)
    with pytest.raises(ValueError, match="image_sizes"):
        generate_tree(SyntheticSpec(num_samples=2, image_sizes="huge"), tmp_path)
