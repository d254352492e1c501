"""The warm-up's graph captures (``serve.warmup``): the shapes and windows a served request can
reach, and that a request after the warm-up captures nothing (its row's ``captured``, the
``ctrl_graph_captures_total`` counter). On a CPU the fast path's graphs use the rerun backend,
which keeps a graph's contract without a device."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from PIL import Image
from test_serve import RecordingDecider

from runtime.cuda_graphs import GraphCache, RerunBackend
from runtime.fast_decoder import CpuFormulation, CudaFormulation
from serve.warmup import QUESTION_ALLOWANCE_TOKENS, capture_graphs, decode_windows, served_shapes


@pytest.fixture
def graphed(embedded_runtime) -> Iterator:
    """The embedded runtime's fast path in a GPU's formulation, capturing its decode steps and prefill blocks."""
    decoder = embedded_runtime.fast
    decoder.use(CudaFormulation(decoder, grouped=True), GraphCache(RerunBackend(), label="decode step"),
                GraphCache(RerunBackend(), label="prefill block"))
    try:
        yield embedded_runtime
    finally:
        decoder.use(CpuFormulation(decoder))


def test_the_windows_of_a_request_span_its_first_step_to_its_last_with_a_longer_question():
    assert QUESTION_ALLOWANCE_TOKENS == 64
    assert decode_windows(600, 16) == [1024]
    assert decode_windows(1000, 16) == [1024, 2048]  # 1000 + 64 + 16 positions reach past 1,024
    assert decode_windows(10, 8) == [64, 128]
    assert decode_windows(63, 1) == [64, 128]


def test_served_shapes_are_every_tiling_at_the_crops_choice_and_the_text_prompt(embedded_runtime):
    shapes = served_shapes(embedded_runtime, 4)
    # tilings of up to 4 crops: 1, 2 (1x2, 2x1), 3, 4 (1x4, 2x2, 4x1) crops, each with the global image
    assert {s.arrays for s in shapes} == {0, 2, 3, 4, 5}
    text = [s.prompt_tokens for s in shapes if s.arrays == 0]
    one = [s.prompt_tokens for s in shapes if s.arrays == 2]
    assert len(text) == 1 and min(one) > text[0]
    assert {s.arrays for s in served_shapes(embedded_runtime, 1)} == {0, 2}


def test_after_the_warm_up_a_served_request_captures_nothing(graphed, tmp_path):
    from pipeline.workspace import Workspace
    from serve.engine import Engine, new_job
    from serve.protocol import ChatRequest
    from serve.request_log import RequestLog

    decider = RecordingDecider({(1, 1, 2): 5.0, (2, 2, 3): 10.0})  # it chooses max_crops 2, top-K 2, 3 blocks
    engine = Engine(graphed, decider, model_name="embedded", max_queue=1, default_budget_ms=None,
                    threads=1, request_log=RequestLog(Workspace(tmp_path / "ws")))
    captured = capture_graphs(engine, max_tokens=4)
    decoder = graphed.fast
    windows = {w for m in (1, 2) for s in served_shapes(graphed, m) for w in decode_windows(s.prompt_tokens, 4)}
    assert captured.left == 0 and captured.vision_graphs == 0  # the embedded runtime has no ViT graphs
    assert captured.decode_graphs == len(decoder.graphs) >= len(windows)
    assert captured.prefill_graphs == len(decoder.prefill_graphs) > 0
    request = ChatRequest("embedded", "What color?", Image.new("RGB", (640, 320), (200, 20, 20)), 4, 900.0)
    row = engine.execute(new_job(request, engine, time.perf_counter(), datetime.now(UTC), 0.0)).record
    assert row["status"] == "ok" and row["captured"] is False
    samples = engine.metrics.registry.get_sample_value
    assert samples("ctrl_graph_captures_total", {"during": "request"}) is None
    decoder.graphs.clear()  # as if the warm-up had not reached this window
    decoder.prefill_graphs.clear()
    row = engine.execute(new_job(request, engine, time.perf_counter(), datetime.now(UTC), 0.0)).record
    assert row["captured"] is True
    assert samples("ctrl_graph_captures_total", {"during": "request"}) >= 1
    engine.stop()


def test_a_warm_up_out_of_time_leaves_the_rest_to_first_use(graphed):
    from serve.engine import Engine

    engine = Engine(graphed, RecordingDecider({(1, 1, 2): 5.0, (2, 2, 3): 10.0}), model_name="embedded",
                    max_queue=1, default_budget_ms=None, threads=1, request_log=None)
    captured = capture_graphs(engine, max_tokens=4, time_limit_s=0.0)
    assert captured.decode_graphs == captured.prefill_graphs == 0 and captured.left > 0
    assert len(graphed.fast.graphs) == len(graphed.fast.prefill_graphs) == 0
    engine.stop()


def test_the_warm_up_times_the_batched_pass_so_the_batch_factor_is_known_from_the_first_request(embedded_runtime):
    from serve.engine import Engine
    from serve.warmup import WARM_BATCH_STEPS, warm_batches, warm_up

    one = Engine(embedded_runtime, RecordingDecider(), model_name="embedded", max_queue=4, default_budget_ms=None,
                 threads=1, request_log=None)
    assert warm_batches(one) == 0  # one request at a time: nothing batched to time
    engine = Engine(embedded_runtime, RecordingDecider(), model_name="embedded", max_queue=4, default_budget_ms=None,
                    threads=1, request_log=None, max_batch=3)
    full = embedded_runtime.knobs_after_prefix(0, embedded_runtime.default_top_k, embedded_runtime.num_layers)
    assert engine.batch_cost.factor(full, [full]) == 1.0  # nothing measured yet
    steps = warm_batches(engine)
    # 3 batch sizes x 3 mixes, each up to WARM_BATCH_STEPS steps (a row may end early at EOS)
    assert 9 <= steps <= 9 * WARM_BATCH_STEPS
    assert engine.batch_cost.step_ms([full, full]) is not None
    warm_up(engine, 8)  # the single-request steps: the factor's other half
    assert engine.batch_cost.alone_ms(full) is not None
    assert engine.batch_cost.factor(full, [full, full]) >= 1.0
    one.stop()
    engine.stop()


class _CountingGuard:
    """A latency guard that prices every configuration at 10 ms and counts what the server tells it."""

    fit_median = 1.0

    def __init__(self) -> None:
        self.observed: list[tuple[float, float]] = []

    def drift(self) -> float:
        return 1.0

    def grid(self, lang, tiling_crops, budget_ms, prompt_tokens=float("nan")):
        import torch

        from controller.machine import CostGrid

        return CostGrid(((2, 2, 3),), torch.tensor([10.0], dtype=torch.float64), lambda _config: 1.0, budget_ms,
                        "guard")

    def observe(self, base_ms, measured_ms, expected_ms=None) -> None:
        self.observed.append((base_ms, measured_ms))


class _GuardedDecider(RecordingDecider):
    """Decides (2, 2, 3) by its guard's grid, as an online run's controller holding a latency guard does."""

    phase = "online"

    def __init__(self, guard: _CountingGuard) -> None:
        from controller.cost import LatencyScale
        from controller.machine import MachineCost

        super().__init__()
        self.cost = MachineCost(LatencyScale({}), guard)

    def stage1(self, lang, tiling_crops, budget_ms):
        choice = super().stage1(lang, tiling_crops, budget_ms)
        choice.cost_grid = self.cost.grid(lang, tiling_crops, budget_ms)
        return choice

    def stage2(self, choice, inputs):
        return 2, 3


def test_the_warm_up_asks_the_controller_inside_its_budget_range_and_records_nothing(embedded_runtime, tmp_path):
    from test_serve import in_process_engine

    from serve.warmup import warm_decisions

    decider = RecordingDecider()  # budgets 10-1000 ms, no latency guard: one request
    engine = in_process_engine(embedded_runtime, decider, tmp_path)
    try:
        results = warm_decisions(engine, max_tokens=2)
        assert len(results) == 1 and results[0].num_output_tokens == 2
        assert len(decider.budgets) == 1 and 10.0 < decider.budgets[0] < 1000.0  # the controller was asked
        assert engine.served == 0 and engine.log.path.stat().st_size == 0  # unrecorded
    finally:
        engine.stop()


def test_the_warm_up_gives_a_latency_guard_enough_requests_for_its_drift(embedded_runtime, tmp_path):
    from test_serve import in_process_engine

    from controller.latency_guard import DRIFT_MIN
    from serve.warmup import warm_decisions

    guard = _CountingGuard()
    decider = _GuardedDecider(guard)
    engine = in_process_engine(embedded_runtime, decider, tmp_path)
    try:
        results = warm_decisions(engine, max_tokens=2)
        assert len(results) == DRIFT_MIN == 8
        # budgets spread over the range, inside it, each request told to the guard with its measured time
        assert decider.budgets == sorted(decider.budgets) and 10.0 < decider.budgets[0] < decider.budgets[-1] < 1000.0
        assert len(guard.observed) == DRIFT_MIN and all(base == 10.0 and ms > 0 for base, ms in guard.observed)
        guard.fit_median = None  # a guard without a drift factor: nothing to seed beyond one request
        assert len(warm_decisions(engine, max_tokens=2)) == 1
    finally:
        engine.stop()


def test_the_apps_start_parses_a_request_on_the_handlers_pool_and_counts_nothing(embedded_runtime, tmp_path,
                                                                                monkeypatch):
    import threading

    from fastapi.testclient import TestClient
    from test_serve import in_process_engine

    from serve.app import Served, create_app
    from serve.protocol import Limits, RequestError

    parsed: list[tuple[str, object]] = []
    real = Served.parse_bounded

    def spy(self, body):
        try:
            chat = real(self, body)
        except RequestError as exc:
            parsed.append((threading.current_thread().name, exc))
            raise
        parsed.append((threading.current_thread().name, chat))
        return chat

    monkeypatch.setattr(Served, "parse_bounded", spy)
    # limits that refuse the warm-up's image (more pixels than 10): the server starts all the same
    for pixels, refused in ((10**6, False), (10, True)):
        parsed.clear()
        app = create_app(in_process_engine(embedded_runtime, RecordingDecider(), tmp_path / str(pixels)),
                         Limits(default_max_tokens=2, max_tokens_limit=8, max_image_pixels=pixels),
                         max_body_bytes=10**6)
        with TestClient(app) as client:  # its lifespan starts (and at the end stops) the engine
            assert len(parsed) == 1 and parsed[0][0] != threading.current_thread().name
            assert isinstance(parsed[0][1], RequestError) is refused
            if not refused:
                assert parsed[0][1].image is not None and parsed[0][1].model == "embedded"
            assert 'ctrl_requests_total{status="invalid"}' not in client.get("/metrics").text
