"""The knob rules of pipeline/knobs.py, with expected values written out from the rules they implement."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline import knobs


def test_balanced_sweep_is_first_middle_last_of_each_list():
    combos = knobs.balanced_combinations((2, 4, 6, 8, 10), (4, 8, 12), (12, 13, 14, 15, 16))
    assert len(combos) == 27
    assert combos[:4] == [(2, 4, 12), (2, 4, 14), (2, 4, 16), (2, 8, 12)]
    assert combos[-1] == (10, 12, 16)
    assert {c[0] for c in combos} == {2, 6, 10} and {c[2] for c in combos} == {12, 14, 16}
    # lists shorter than three are used whole; one value each is that one configuration
    assert knobs.balanced_combinations((2, 6), (8,), (16,)) == [(2, 8, 16), (6, 8, 16)]
    assert knobs.balanced_combinations((6,), (8,), (16,)) == [(6, 8, 16)]
    assert knobs.balanced_combinations((6,), (8,), (12, 16)) == [(6, 8, 12), (6, 8, 16)]
    assert knobs.balanced_combinations((2, 6, 10), (8,), (16,)) == [(2, 8, 16), (6, 8, 16), (10, 8, 16)]
    assert knobs.balanced_combinations(knobs.BALANCED_MAX_CROPS, knobs.BALANCED_TOP_K,
                                       knobs.BALANCED_NUM_ACTIVE_BLOCKS)[13] == (6, 8, 14)


def test_exp_block_subsets_are_the_origin_random_draws():
    # blocks 0-3 always, the rest drawn with RandomState(42 + 1000 n) from 4..15 (values from NumPy's legacy generator)
    assert knobs.exp_active_blocks(12) == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 14)
    assert knobs.exp_active_blocks(14) == (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 15)
    assert knobs.exp_active_blocks(16) == tuple(range(16))
    assert knobs.exp_active_blocks(5) == (0, 1, 2, 3, 4)
    assert knobs.exp_active_blocks(3) == (0, 1, 2)
    assert knobs.exp_active_blocks(1) == (0,)
    for bad in (0, 17):
        with pytest.raises(ValueError, match="num_active_blocks must be in 1..16"):
            knobs.exp_active_blocks(bad)


def test_tiling_candidates_fewest_crops_first():
    assert knobs.tiling_candidates(4).tolist() == [[1, 1], [1, 2], [2, 1], [1, 3], [3, 1], [1, 4], [2, 2], [4, 1]]
    assert knobs.tiling_candidates(1).tolist() == [[1, 1]]
    with pytest.raises(ValueError, match="max_crops must be >= 1"):
        knobs.tiling_candidates(0)


def test_molmo_tiling_rule():
    # 224-px window, 112-px total margin: a 336-px square fits one crop exactly
    assert knobs.select_tiling(336, 336, 4) == (1, 1)
    # 560 px: 448 px after the margin; 2x2 windows cover it without downscaling
    assert knobs.select_tiling(560, 560, 4) == (2, 2)
    # with 3 crops every tiling downscales to 0.5: the first (fewest crops) of the largest scale wins
    assert knobs.select_tiling(560, 560, 3) == (1, 1)
    # a wide image: 224 x 672 after the margin -> one row of three; 6 crops do not change that (least upscaling)
    assert knobs.select_tiling(336, 784, 3) == (1, 3)
    assert knobs.select_tiling(336, 784, 6) == (1, 3)
    # a tall one
    assert knobs.select_tiling(784, 336, 3) == (3, 1)
    # smaller than the margin: every scale negative, (1, 1)
    assert knobs.select_tiling(100, 100, 10) == (1, 1)
    rows, cols = knobs.select_tiling(np.array([336, 560, 336]), np.array([336, 560, 784]), 4)
    assert rows.tolist() == [1, 2, 1] and cols.tolist() == [1, 2, 3]
    # a side equal to the margin scales infinitely (no warning): the other side decides
    assert knobs.select_tiling(112, 336, 4) == (1, 1)
    assert knobs.select_tiling(112, 784, 4) == (1, 3)
    # unsigned sizes under the margin go negative instead of wrapping around
    rows, cols = knobs.select_tiling(np.array([100, 560], dtype=np.uint16), np.array([100, 560], dtype=np.uint16), 4)
    assert rows.tolist() == [1, 2] and cols.tolist() == [1, 2]
    # the embedded model's geometry (84-px window, 28-px margin): 196 px -> 2x2
    assert knobs.select_tiling(196, 196, 4, window_px=84, total_margin_px=28) == (2, 2)


def test_importance_scores_are_read_from_every_wrapper(tmp_path):
    path = tmp_path / "scores.json"
    path.write_text(json.dumps({"merged_scores": {"x": 5, "0": 1.5, "4": True, "3": 2, "5": "high", "9": 0},
                                "other": 1}))
    assert knobs.load_importance_scores(path) == {0: 1.5, 3: 2.0, 9: 0.0}
    for wrapper in ("train_scores", "importance_scores"):
        path.write_text(json.dumps({wrapper: {"7": 0.25}}))
        assert knobs.load_importance_scores(path) == {7: 0.25}
    path.write_text(json.dumps({"2": 0.5, "11": -1}))
    assert knobs.load_importance_scores(path) == {2: 0.5, 11: -1.0}
    path.write_text(json.dumps({"merged_scores": {"a": 1}}))
    with pytest.raises(ValueError, match="scores.json: no integer block keys with numeric scores"):
        knobs.load_importance_scores(path)


def test_default_block_rule_keeps_block_zero_and_the_final_block():
    assert knobs.select_active_blocks(12) == (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15)
    assert knobs.select_active_blocks(14) == (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 15)
    assert knobs.select_active_blocks(16) == tuple(range(16))
    assert knobs.select_active_blocks(1) == (0,)
    assert knobs.select_active_blocks(2) == (0, 15)
    # the insertion position's blocks always run
    assert knobs.select_active_blocks(4, first_kept=3) == (0, 1, 2, 15)
    assert knobs.select_active_blocks(3, first_kept=3) == (0, 1, 2)
    assert knobs.select_active_blocks(16, first_kept=16) == tuple(range(16))
    assert knobs.select_active_blocks(16, first_kept=15) == tuple(range(16))
    with pytest.raises(ValueError, match="num_active_blocks must be in 3..16"):
        knobs.select_active_blocks(2, first_kept=3)
    with pytest.raises(ValueError, match="first_kept must be in 1..16"):
        knobs.select_active_blocks(4, first_kept=0)
    with pytest.raises(ValueError, match="num_active_blocks must be in 1..16"):
        knobs.select_active_blocks(17)


def test_importance_rule_keeps_the_highest_scores_and_drops_unscored_blocks_first():
    scores = {1: 0.1, 2: 0.9, 3: 0.5}
    assert knobs.select_active_blocks(3, 4, scores) == (0, 2, 3)
    assert knobs.select_active_blocks(2, 4, scores) == (0, 2)
    # block 0 runs whatever its score
    assert knobs.select_active_blocks(2, 4, {0: -5.0, 1: 1.0, 2: 3.0, 3: 2.0}) == (0, 2)
    # unscored blocks rank last (ties by lower index)
    assert knobs.select_active_blocks(3, 4, {2: 0.9}) == (0, 1, 2)
    assert knobs.select_active_blocks(3, 5, {4: 0.3, 1: 0.3}) == (0, 1, 4)


def test_insertion_positions_allow_the_documented_block_counts():
    assert knobs.insertion_block_options(1) == (12, 13, 14, 15, 16)
    assert knobs.insertion_block_options(2) == (13, 14, 15, 16)
    assert knobs.insertion_block_options(3) == (14, 15, 16)
    assert knobs.insertion_block_options(4) == (15, 16)
    assert knobs.insertion_block_options(5) == (16,)
    assert knobs.insertion_block_options(6) == ()  # past the five positions no count fits the rule
    assert knobs.insertion_block_options(2, num_total_blocks=24) == (21, 22, 23, 24)
    for bad in (0, 16):
        with pytest.raises(ValueError, match="insertion position must be in 1..15"):
            knobs.insertion_block_options(bad)
