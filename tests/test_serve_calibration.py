"""The latency scale a server measures: served model time per ms of the controller's training latencies."""

from __future__ import annotations

import math

import pytest
import torch

from controller.cost import LatencyScale

REFERENCE = {(2, 4, 12): 20.0, (10, 8, 16): 80.0, (6, 4, 12): float("nan")}


def test_the_scale_is_a_quantile_of_the_recent_ratios():
    scale = LatencyScale(REFERENCE, quantile=0.5, window=3)
    assert (scale.value, scale.source, scale.calibrates) == (1.0, "none", True)
    assert scale.observe((2, 4, 12), 40.0) == 2.0
    assert scale.observe((10, 8, 16), 120.0) == 1.5
    assert scale.observe((10, 8, 16), 200.0) == 2.5
    assert (scale.value, scale.source) == (2.0, "measured")  # the middle of 1.5, 2.0, 2.5
    assert scale.observe((2, 4, 12), 60.0) == 3.0  # the window drops the oldest ratio (2.0)
    assert scale.value == 2.5  # 1.5, 2.5, 3.0
    assert LatencyScale(REFERENCE, quantile=0.0).value == 1.0


def test_upper_quantile_rank_without_interpolation():
    scale = LatencyScale(REFERENCE, quantile=0.75, window=32)
    for ms in (20.0, 22.0, 24.0, 26.0):  # ratios 1.0, 1.1, 1.2, 1.3
        scale.observe((2, 4, 12), ms)
    assert scale.value == pytest.approx(1.3)  # rank floor(0.75 * 4) = 3 of 0..3


def test_requests_that_cannot_be_compared_do_not_count():
    scale = LatencyScale(REFERENCE)
    assert scale.observe((6, 4, 12), 50.0) is None  # NaN reference: not recorded in training
    assert scale.observe((2, 8, 12), 50.0) is None  # not in the reference at all
    assert scale.observe((2, 4, 12), 0.0) is None
    assert scale.observe((2, 4, 12), math.nan) is None
    assert scale.source == "none" and scale.value == 1.0
    assert scale.reference_ms.get((6, 4, 12)) is None and scale.reference_ms.get((10, 8, 16)) == 80.0
    assert not LatencyScale({}).calibrates


def test_a_fixed_scale_is_never_measured():
    scale = LatencyScale(REFERENCE, fixed=1.7)
    assert scale.observe((2, 4, 12), 40.0) is None
    assert (scale.value, scale.source, scale.calibrates) == (1.7, "fixed", False)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"fixed": 0.0}, "latency scale must be a positive number, got 0.0"),
    ({"fixed": math.inf}, "latency scale must be a positive number, got inf"),
    ({"quantile": 1.5}, r"quantile must be in \[0, 1\], got 1.5"),
    ({"window": 0}, "window must be at least 1, got 0"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LatencyScale(REFERENCE, **kwargs)


def test_reference_latencies_of_a_deployed_controller():
    from serve.deciders import reference_latencies

    class Deployed:
        actions = torch.tensor([[2, 4, 12], [6, 4, 12], [10, 8, 16]])
        reference_latency_ms = torch.tensor([20.0, float("nan"), 80.0], dtype=torch.float64)

    assert reference_latencies(Deployed()) == {(2, 4, 12): 20.0, (10, 8, 16): 80.0}
    Deployed.reference_latency_ms = torch.zeros(0, dtype=torch.float64)  # no table fallback
    assert reference_latencies(Deployed()) == {}
    del Deployed.reference_latency_ms  # a controller file without the buffer
    assert reference_latencies(Deployed()) == {}
