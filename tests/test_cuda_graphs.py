"""The one graph cache (``runtime.cuda_graphs``) every captured piece uses: its bound, its failure
handling, the device a capture runs on, and the ViT's graphed function over it, on the CPU."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from runtime.cuda_graphs import CudaGraphBackend, GraphCache, RerunBackend, restored
from runtime.fast_decoder import GraphedFunction


class CountingBody:
    """A body doubling its fixed input into a fresh tensor, counting its runs."""

    def __init__(self) -> None:
        self.input = torch.ones(3)
        self.runs = 0

    def __call__(self) -> tuple[torch.Tensor]:
        self.runs += 1
        return (self.input * 2,)


def test_a_capture_runs_the_body_three_times_and_a_replay_updates_its_outputs_in_place():
    cache = GraphCache(RerunBackend())
    body = CountingBody()
    captured = cache.get("a", body)
    assert body.runs == 3 and cache.stats.captures == 1 and len(cache) == 1  # two warm-up runs, the capture
    out = captured.outputs[0]
    body.input.fill_(5.0)
    again = cache.get("a", body)
    assert again is captured and body.runs == 3  # held: no capture
    again.replay()
    assert again.outputs[0] is out and torch.equal(out, torch.full((3,), 10.0))


def test_the_least_recently_used_graph_goes_first():
    cache = GraphCache(RerunBackend(), max_graphs=2)
    body = CountingBody()
    cache.get("a", body)
    cache.get("b", body)
    cache.get("a", body)  # a is now the most recent
    cache.get("c", body)
    assert "a" in cache and "c" in cache and "b" not in cache
    assert cache.stats.graphs == 2 and cache.stats.captures == 3


class BrokenBackend(RerunBackend):
    def capture(self, body):
        body()
        msg = "CUDA error: operation not permitted when stream is capturing\nmore detail"
        raise RuntimeError(msg)


def test_a_failed_capture_turns_the_cache_off_with_one_warning():
    cache = GraphCache(BrokenBackend(), label="decode step")
    body = CountingBody()
    with pytest.warns(RuntimeWarning, match="the decode step runs uncaptured: RuntimeError: CUDA error"):
        assert cache.get("a", body) is None
    assert not cache.enabled and cache.error.endswith("capturing") and cache.stats.captures == 0
    runs = body.runs
    assert cache.get("b", body) is None and body.runs == runs  # off: no second attempt


def test_around_wraps_the_capture_and_restored_puts_values_back_on_failure():
    state = torch.tensor([7])
    entered = []

    @contextmanager
    def around():
        with restored(state):
            state.fill_(63)
            entered.append(int(state))
            yield

    cache = GraphCache(BrokenBackend())
    with pytest.warns(RuntimeWarning):
        cache.get("a", CountingBody(), around=around)
    assert entered == [63] and int(state) == 7


def test_a_cuda_capture_runs_on_the_models_device_not_the_current_one(monkeypatch):
    """A model on cuda:1 captures under cuda:1: the device entered, the side stream's and the
    current stream's device (torch.cuda recorded on a CPU)."""
    seen: list[tuple[str, object]] = []

    class Stream:
        def __init__(self, device=None) -> None:
            seen.append(("stream", device))

        def wait_stream(self, other) -> None:
            pass

    @contextmanager
    def record(name, value):
        seen.append((name, value))
        yield

    monkeypatch.setattr(torch.cuda, "device", lambda device: record("device", device))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    def current_stream(device=None):
        seen.append(("current", device))
        return type("Current", (), {"wait_stream": lambda self, other: None})()

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: record("on-stream", None))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: type("G", (), {"replay": lambda self: None})())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: record("capture", pool))
    device = torch.device("cuda:1")
    body = CountingBody()
    GraphCache(CudaGraphBackend(device)).get("a", body)
    assert seen[0] == ("device", device) and ("stream", device) in seen and ("current", device) in seen
    assert ("capture", (0, 1)) in seen and body.runs == 3


def test_a_graphed_function_replays_per_shape_and_hands_out_its_own_tensor():
    calls = []

    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return x * 2

    graphed = GraphedFunction(double, GraphCache(RerunBackend(), max_graphs=2))
    with torch.no_grad():
        first = graphed(torch.ones(2, 3))
        assert torch.equal(first, torch.full((2, 3), 2.0)) and graphed.graphs == 1
        first.fill_(0.0)  # the caller's copy: the graph's output is untouched
        second = graphed(torch.full((2, 3), 4.0))
        assert torch.equal(second, torch.full((2, 3), 8.0)) and graphed.cache.stats.captures == 1
        graphed(torch.ones(1, 3))
        graphed(torch.ones(4, 3))  # the (2, 3) graph goes, and its input buffer with it
        assert graphed.graphs == 2 and len(graphed._inputs) == 2
        assert torch.equal(graphed(torch.ones(2, 3)), torch.full((2, 3), 2.0)) and graphed.cache.stats.captures == 4
    # with gradients the function runs as it is
    before = len(calls)
    assert torch.equal(graphed(torch.ones(2, 3)), torch.full((2, 3), 2.0)) and len(calls) == before + 1
