"""The per-stage latency model of batched rollouts (``online.latency_model``), on hand-made observations."""

from __future__ import annotations

import pytest

from online.latency_model import MemberShape, SuffixLatencyModel, fit_line


def test_a_line_is_recovered_exactly_from_points_on_it():
    assert fit_line([1.0, 2.0, 4.0], [5.0, 7.0, 11.0]) == pytest.approx((3.0, 2.0))


def test_one_distinct_x_fits_a_ratio_through_the_origin_and_zero_x_the_mean():
    assert fit_line([4.0, 4.0], [6.0, 10.0]) == pytest.approx((0.0, 2.0))
    assert fit_line([0.0, 0.0], [1.0, 3.0]) == pytest.approx((2.0, 0.0))
    with pytest.raises(ValueError, match="as many x as y"):
        fit_line([], [])


def _shape(top_k=4, suffix_blocks=10, active_blocks=14, prompt_tokens=100):
    return MemberShape(top_k, suffix_blocks, active_blocks, prompt_tokens)


def test_predictions_follow_the_observed_lines_per_top_k():
    model = SuffixLatencyModel(min_observations=3)
    # suffix = 2 + 0.01 * blocks x tokens, a quarter of it outside the blocks; step = 1 + 0.5 * active blocks
    for blocks, active, tokens in ((10, 14, 100), (12, 16, 50), (5, 12, 200)):
        suffix = 2 + 0.01 * blocks * tokens
        model.observe(_shape(4, blocks, active, tokens), suffix, 0.75 * suffix, [1 + 0.5 * active] * 3)
    assert model.ready(4) and not model.ready(8)
    modeled = model.predict(_shape(4, 8, 13, 300))
    assert modeled.suffix_ms == pytest.approx(2 + 0.01 * 8 * 300)
    assert modeled.suffix_blocks_ms == pytest.approx(0.75 * (2 + 24))
    assert modeled.step_ms == pytest.approx(1 + 0.5 * 13)
    assert modeled.total_ms(4) == pytest.approx(26 + 4 * 7.5)
    with pytest.raises(ValueError, match="top-K 8"):
        model.predict(_shape(top_k=8))


def test_a_top_k_is_ready_only_with_enough_suffixes_and_decode_steps():
    model = SuffixLatencyModel(min_observations=2)
    model.observe(_shape(), 10.0, 8.0, [])  # answered in one token: no decode step to learn from
    model.observe(_shape(), 12.0, 9.0, [3.0])
    assert not model.ready(4)
    model.observe(_shape(), 11.0, 9.0, [2.0, 4.0, 3.0])
    assert model.ready(4)
    # a suffix without blocks has no block interval
    assert model.predict(_shape(suffix_blocks=0)).suffix_blocks_ms is None


def test_the_relative_error_compares_the_modeled_part_with_its_measurement():
    model = SuffixLatencyModel(min_observations=1)
    assert model.relative_error(_shape(), 10.0, [2.0]) is None  # not ready: nothing to compare
    model.observe(_shape(), 10.0, 8.0, [2.0, 2.0])
    # modeled 10 + 2 x 2 = 14 against measured 12 + 1 + 3 = 16
    assert model.relative_error(_shape(), 12.0, [1.0, 3.0]) == pytest.approx(2 / 16)
    with pytest.raises(ValueError, match="at least 1"):
        SuffixLatencyModel(min_observations=0)
