"""runtime.request: one request's way through the model, as the server and the rollouts run it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from PIL import Image

from runtime.request import LatencyParts, RequestExecutor
from runtime.timing import RequestTiming, Segment, StageTimer


def _segment(name: str, wall: float, vision: float | None = None, blocks: float | None = None) -> Segment:
    return Segment(name, wall_ms=wall, vision_ms=vision, blocks_ms=blocks)


def test_latency_parts_read_each_segment_once():
    timing = RequestTiming([
        _segment("stage1", 1.0), _segment("preprocess", 2.0), _segment("prefix", 10.0, vision=6.0, blocks=3.0),
        _segment("stage2", 0.5), _segment("suffix", 20.0, blocks=18.0), _segment("decode", 4.0),
        _segment("decode", 5.0)])
    parts = LatencyParts.of(timing)
    assert parts.stage1_ms == 1.0 and parts.stage2_ms == 0.5 and parts.controller_ms == 1.5
    assert parts.preprocess_ms == 2.0 and parts.vision_ms == 6.0
    assert parts.prefill_ms == 21.0  # blocks of both prefill parts
    assert parts.decode_step_ms == (4.0, 5.0) and parts.decode_ms == 9.0
    assert parts.model_ms == 39.0  # prefix + suffix + decode walls
    assert parts.measured_ms == 42.5  # every segment
    untimed = LatencyParts.of(RequestTiming([s for s in timing.segments if s.name != "preprocess"]))
    assert untimed.preprocess_ms is None and untimed.measured_ms == 40.5


@dataclass
class _Choice:
    max_crops: int
    insertion_position: int
    budget_token: torch.Tensor | None = None


@pytest.fixture
def executor(embedded_runtime):
    rt = embedded_runtime
    timer = StageTimer(rt.vision_module, list(rt.decoder_layers), rt.device)
    yield RequestExecutor(rt, timer)
    timer.close()


def _image() -> Image.Image:
    return Image.new("RGB", (336, 200), (40, 120, 200))


@pytest.mark.parametrize(("p", "top_k", "blocks"), [(0, 4, 12), (2, 6, 14)])
def test_a_run_answers_what_generate_answers_at_its_knobs(embedded_runtime, executor, p, top_k, blocks):
    rt = embedded_runtime
    question = "What color is the square?"
    seen: list[tuple[str, object]] = []

    def stage1() -> _Choice:
        seen.append(("stage1", None))
        return _Choice(4, p)

    def inputs(max_crops: int):
        seen.append(("inputs", max_crops))
        return rt.preprocess(_image(), question, max_crops)

    def stage2(choice: _Choice, prefix) -> tuple[int, int]:
        seen.append(("stage2", prefix.insertion_position))
        return top_k, blocks

    outcome = executor.run(stage1, inputs, stage2, max_tokens=5)
    assert seen == [("stage1", None), ("inputs", 4), ("stage2", p)]
    names = [s.name for s in outcome.timing.segments]
    assert names[:5] == ["stage1", "preprocess", "prefix", "stage2", "suffix"]
    assert set(names[5:]) <= {"decode"} and len(names) - 5 == len(outcome.tokens) - 1
    assert all(s.wall_ms is not None for s in outcome.timing.segments)  # resolved on return

    active = rt.blocks_for(blocks, first_kept=max(p, 1))
    assert outcome.answer.active_blocks == active and len(active) == blocks
    with rt.knobs(top_k={i: top_k for i in range(p, rt.num_layers)}, active_blocks=active):
        reference = rt.generate(rt.preprocess(_image(), question, 4), max_new_tokens=5).token_ids
    assert outcome.tokens == reference
    assert rt.current_top_k() == [rt.default_top_k] * rt.num_layers  # the knobs are restored


def test_check_stops_the_request_between_blocks_and_steps(embedded_runtime, executor):
    rt = embedded_runtime
    calls: list[int | None] = []

    class Stop(Exception):
        pass

    def check(block: int | None) -> None:
        calls.append(block)
        if block == 3:
            raise Stop

    with pytest.raises(Stop):
        executor.run(lambda: _Choice(2, 0), lambda m: rt.preprocess(_image(), "Which shape?", m),
                     lambda c, prefix: (8, 16), max_tokens=4, check=check)
    # between stage 1 and preprocessing, after the prefix, after stage 2, then blocks 0..3 of the prefill
    assert calls == [None, None, None, 0, 1, 2, 3]
    assert rt.current_top_k() == [rt.default_top_k] * rt.num_layers


def test_on_token_counts_every_token_and_until_ends_the_answer(embedded_runtime, executor):
    rt = embedded_runtime
    counts: list[int] = []
    prefix_timing = RequestTiming()
    prefix = executor.prefix(rt.preprocess(_image(), "How many?", 2), 0, None, prefix_timing)
    answer = executor.answer(prefix, 8, 16, prefix_timing, max_tokens=6, on_token=counts.append,
                             until=lambda token: len(counts) >= 3)
    assert counts == list(range(1, len(answer.tokens) + 1))
    assert len(answer.tokens) == 3 or (len(answer.tokens) < 3 and answer.tokens[-1] == rt.eos_id)
