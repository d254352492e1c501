"""The warm-up before ``ctrl serve`` takes requests: each crops choice's fastest and slowest
configuration run once or twice, unrecorded (first requests do not pay one-time costs, and the
measured latency scale starts from them), then the decode steps the controller can choose
captured as CUDA graphs on a GPU."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from PIL import Image

from pipeline.knobs import Config
from runtime.timing import cpu_threads
from serve.engine import Engine, Result, new_job
from serve.protocol import ChatRequest


def warmup_configs(engine: Engine) -> list[Config]:
    """What the warm-up runs: per crops choice of the controller, its fastest and its slowest
    configuration by reference latency (the range the latency scale is seeded over), or the model's
    defaults at that crops choice where the controller has no reference latencies."""
    configs: list[Config] = []
    reference = engine.latency_scale.reference_ms
    for max_crops in engine.decider.max_crops_values:
        ranked = sorted((ms, knobs) for knobs, ms in reference.items() if knobs[0] == int(max_crops))
        chosen = [ranked[0][1], ranked[-1][1]] if ranked else [
            (int(max_crops), engine.runtime.default_top_k, engine.runtime.num_layers)]
        configs.extend(dict.fromkeys(chosen))
    return configs


def decode_configs(engine: Engine) -> list[tuple[int, int, int, int]]:
    """The configurations (max_crops, insertion position, top-K, blocks) the controller can choose:
    those of its reference latencies, else the value grids of an online controller, else the
    warm-up's."""
    reference = engine.decider.reference_latency_ms
    if reference:
        return [(c, 0, k, b) for c, k, b in sorted(reference)]
    controller = getattr(engine.decider, "controller", None)
    if controller is not None:
        return [(c, p, k, b) for c in controller.max_crops_values for p in controller.insertion_positions
                for k in controller.top_k_values for b in controller.num_active_blocks_values]
    return [(c, 0, k, b) for c, k, b in warmup_configs(engine)]


def capture_decode_steps(engine: Engine, max_tokens: int, time_limit_s: float = 120.0) -> tuple[int, float]:
    """Capture the decode steps of :func:`decode_configs` as CUDA graphs before serving (a prompt
    of the warm-up image at each crops choice, up to ``max_tokens`` tokens): first requests do not
    pay the capture. Stops after ``time_limit_s`` (the rest are captured at first use). Returns
    (graphs held, seconds); (0, 0) without CUDA graphs."""
    runtime = engine.runtime
    if not runtime.execution["cuda_graphs"]:
        return 0, 0.0
    started = time.perf_counter()
    image = Image.new("RGB", (640, 480), (120, 110, 100))
    lengths: dict[int, int] = {}
    for max_crops, p, top_k, blocks in decode_configs(engine):
        if time.perf_counter() - started > time_limit_s:
            break
        if max_crops not in lengths:
            lengths[max_crops] = int(runtime.preprocess(image, "What is in the image?", max_crops).input_ids.shape[1])
        with engine.executor.configured(p, top_k, blocks) as active:
            for positions in (lengths[max_crops] + 1, lengths[max_crops] + max_tokens):  # first and last window
                runtime.capture_decode(active, positions)
    return runtime.captured_graphs, time.perf_counter() - started


def warm_up(engine: Engine, max_tokens: int) -> list[Result]:
    """Run the :func:`warmup_configs` (an image request each, ``max_tokens`` long), unrecorded; twice
    where they seed the latency scale. Returns the requests' results.

    The seeded ratios are only as right as ``max_tokens`` is typical: the server passes what a
    request without ``max_tokens`` generates, since a shorter warm-up reads the machine as faster
    than it serves."""
    image = Image.new("RGB", (640, 480), (120, 110, 100))
    rounds = 2 if engine.latency_scale.calibrates else 1
    results: list[Result] = []
    for _ in range(rounds):
        for max_crops, top_k, blocks in warmup_configs(engine):
            knobs = {"max_crops": max_crops, "top_k": top_k, "num_active_blocks": blocks}
            request = ChatRequest(engine.model_name, "What is in the image?", image, max_tokens, None, knobs)
            job = new_job(request, engine, time.perf_counter(), datetime.now(UTC), 0.0, f"warmup-{len(results)}")
            with cpu_threads(engine.threads, engine.runtime.device):
                results.append(engine.execute(job, record=False))
    if engine.latency_scale.calibrates:
        engine.planner.seed_margin(engine.latency_scale.ratios())
    return results
