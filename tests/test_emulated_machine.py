"""The benchmarks' emulated machine: each stage takes its factor times as long, as the product's
own hooks measure it, on a fake clock (so that nothing here depends on how busy the CPU is)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "emulated_machine.py"


@pytest.fixture(scope="module")
def em():
    spec = importlib.util.spec_from_file_location("emulated_machine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["emulated_machine"] = module
    spec.loader.exec_module(module)
    return module


class FakeClock:
    """perf_counter and sleep of a clock that only the model's work and the sleeps move."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Block(torch.nn.Module):
    """A block whose work takes 10 ms a token of its input on the fake clock."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.clock.now += 0.010 * hidden.shape[-2]
        return hidden


class Runtime:
    def __init__(self, clock: FakeClock) -> None:
        self.vision_module = Block(clock)
        self.decoder_layers = [Block(clock), Block(clock)]
        self.fast = None


def timed(module: torch.nn.Module, clock: FakeClock) -> list[float]:
    """Hooks like the product's timers (registered before the stretch): each call's measured seconds."""
    spans: list[float] = []
    starts: list[float] = []
    module.register_forward_pre_hook(lambda m, a: starts.append(clock.now))
    module.register_forward_hook(lambda m, a, o: spans.append(clock.now - starts.pop()))
    return spans


def test_each_stage_is_measured_its_factor_times_as_long(em, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(em, "time", clock)
    runtime = Runtime(clock)
    vision = timed(runtime.vision_module, clock)
    block = timed(runtime.decoder_layers[0], clock)
    with em.stretched(runtime, em.StageFactors(vision=2.0, prefill=3.0, decode=1.5)):
        runtime.vision_module(torch.zeros(1, 4, 8))  # 40 ms of work
        for layer in runtime.decoder_layers:
            layer(torch.zeros(1, 5, 8))  # a prefill: 50 ms a block
        for layer in runtime.decoder_layers:
            layer(torch.zeros(1, 1, 8))  # a decode step: 10 ms a block
    assert vision == pytest.approx([0.080])
    assert block == pytest.approx([0.150, 0.015])
    assert clock.now == pytest.approx(0.080 + 2 * 0.150 + 2 * 0.015)
    runtime.vision_module(torch.zeros(1, 4, 8))  # outside the block: as fast as here
    assert vision[-1] == pytest.approx(0.040)


def test_hooks_called_around_a_whole_step_are_stretched_once(em, monkeypatch):
    """The fast path calls every block's pre-hook, runs the step, then every post-hook: the step is
    stretched once, not once per block."""
    clock = FakeClock()
    monkeypatch.setattr(em, "time", clock)
    runtime = Runtime(clock)
    spans = timed(runtime.decoder_layers[-1], clock)

    class Fast:  # the two entry points of runtime.fast_decoder.FastDecoder the stretch wraps
        def prefill(self) -> None:
            pass

        def step(self) -> None:
            layers = runtime.decoder_layers
            for layer in layers:
                for hook in list(layer._forward_pre_hooks.values()):
                    hook(layer, ())
            clock.now += 0.020  # the fused step of both blocks
            for layer in layers:
                for hook in list(layer._forward_hooks.values()):
                    hook(layer, (), None)

    runtime.fast = Fast()
    with em.stretched(runtime, decode=2.0):
        runtime.fast.step()
    assert spans == pytest.approx([0.040])
    assert not hasattr(runtime.fast, "__dict__") or "step" not in runtime.fast.__dict__  # unpatched on the way out


def test_stage_factors_are_parsed_and_checked(em):
    assert em.StageFactors.parse("prefill=3,decode=1.5") == em.StageFactors(vision=1.0, prefill=3.0, decode=1.5)
    for bad in ("prefill", "attention=2", "decode=0.5"):
        with pytest.raises(ValueError, match="--stretch"):
            em.StageFactors.parse(bad)
