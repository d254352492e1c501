"""The warm-up before ``ctrl serve`` takes requests: each crops choice's fastest and slowest
configuration run once or twice, unrecorded (first requests do not pay one-time costs, and the
measured latency scale starts from them), then on a GPU every CUDA graph a served request can
reach captured: the ViT at each array count and the decode steps the controller can choose at
each attention window the served prompts reach."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from PIL import Image

from controller.latency_guard import DRIFT_MIN
from pipeline.knobs import Config
from runtime.fast_decoder import bucket_for, prefill_bucket_for
from runtime.timing import cpu_threads
from serve.engine import Engine, Result, new_job
from serve.protocol import ChatRequest


def fastest_and_slowest(reference_ms: Mapping[Config, float], max_crops: int) -> list[Config]:
    """At one crops choice, its fastest and its slowest configuration by reference latency (one where
    they are the same; none without a reference latency there)."""
    ranked = sorted((ms, knobs) for knobs, ms in reference_ms.items() if knobs[0] == int(max_crops))
    return list(dict.fromkeys([ranked[0][1], ranked[-1][1]])) if ranked else []


def warmup_configs(engine: Engine) -> list[Config]:
    """What the warm-up runs: per crops choice of the controller, its fastest and its slowest
    configuration by reference latency (the range the latency scale is seeded over), or the model's
    defaults at that crops choice where the controller has no reference latencies."""
    configs: list[Config] = []
    for max_crops in engine.decider.max_crops_values:
        configs.extend(fastest_and_slowest(engine.latency_scale.reference_ms, max_crops) or [
            (int(max_crops), engine.runtime.default_top_k, engine.runtime.num_layers)])
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


#: the image size and question of every warm-up request
_WARM_IMAGE_SIZE, _WARM_QUESTION = (640, 480), "What is in the image?"
#: prompt tokens a question may add beyond the warm-up's own before its decode steps reach a window
#: the warm-up did not capture (a served prompt is the image's tokens plus its question's)
QUESTION_ALLOWANCE_TOKENS = 64
#: image sides (px) the tilings reachable at a max_crops are read from: every aspect ratio and scale
#: from a thumbnail to past the largest tiling (MolmoE-1B: 12 crops of 336 px windows)
_SIDES = np.unique(np.geomspace(32, 8192, 48).astype(int))


@dataclass(frozen=True)
class ServedShape:
    """One shape a served request can take at a max_crops choice: its image arrays (crops and the
    global image; 0 for a text-only request) and its prompt's tokens with the warm-up's question."""

    arrays: int
    prompt_tokens: int


@dataclass
class WarmupCaptures:
    """What :func:`capture_graphs` captured: decode-step, prefill-block and ViT graphs, the seconds
    it took, and the captures it left to their first use (the time limit ran out)."""

    decode_graphs: int = 0
    prefill_graphs: int = 0
    vision_graphs: int = 0
    seconds: float = 0.0
    left: int = 0


def served_shapes(runtime, max_crops: int, question: str = _WARM_QUESTION) -> list[ServedShape]:
    """Every shape a request at ``max_crops`` can take: each tiling some image size reaches (by the
    runtime's tiling rule) and the text-only prompt."""
    tilings: dict[tuple[int, int], tuple[int, int]] = {}
    for height in _SIDES:
        for width in _SIDES:
            tiling = tuple(runtime.tiling(int(width), int(height), int(max_crops)))
            tilings.setdefault(tiling, (int(width), int(height)))
    shapes = {ServedShape(0, int(runtime.preprocess(None, question, max_crops).input_ids.shape[1]))}
    for width, height in tilings.values():
        inputs = runtime.preprocess(Image.new("RGB", (width, height), (120, 110, 100)), question, max_crops)
        images = getattr(inputs, "images", None)
        arrays = 0 if images is None else int(images.shape[0])
        shapes.add(ServedShape(arrays, int(inputs.input_ids.shape[1])))
    return sorted(shapes, key=lambda s: (s.arrays, s.prompt_tokens))


def decode_windows(prompt_tokens: int, max_tokens: int) -> list[int]:
    """The attention windows a request's decode steps use: from its first step's to the last one's
    at ``max_tokens`` tokens after a prompt up to :data:`QUESTION_ALLOWANCE_TOKENS` longer."""
    first = bucket_for(prompt_tokens + 1)
    last = bucket_for(prompt_tokens + QUESTION_ALLOWANCE_TOKENS + max_tokens)
    windows = [first]
    while windows[-1] < last:
        windows.append(windows[-1] * 2)
    return windows


def capture_graphs(engine: Engine, max_tokens: int, longest_tokens: int | None = None,
                   time_limit_s: float = 300.0) -> WarmupCaptures:
    """Capture, before serving, every CUDA graph a served request can need: the ViT at each number
    of image arrays the controller's crops choices reach, each :func:`decode_configs` configuration's
    prefill blocks at the token buckets of every :func:`served_shapes` prompt (and one a longer
    question reaches), and its decode step at every window of :func:`decode_windows`, so that no
    served request pays a capture (0.1-0.3 s each). The windows of answers of ``max_tokens`` come
    first, those only answers up to ``longest_tokens`` reach after them. Stops after
    ``time_limit_s`` (the rest are captured at first use, and ``left`` counts them). Nothing
    without CUDA graphs."""
    runtime = engine.runtime
    result = WarmupCaptures()
    if not runtime.execution["cuda_graphs"]:
        return result
    started = time.perf_counter()
    configs = decode_configs(engine)
    shapes = {m: served_shapes(runtime, m) for m in dict.fromkeys(c[0] for c in configs)}
    capture_vision = getattr(runtime, "capture_vision", None)
    pending_vision = sorted({s.arrays for found in shapes.values() for s in found if s.arrays})

    def windows(max_crops: int, tokens: int) -> set[int]:
        return {w for shape in shapes[max_crops] for w in decode_windows(shape.prompt_tokens, tokens)}

    pending_decode = [(p, top_k, blocks, window) for max_crops, p, top_k, blocks in configs
                      for window in sorted(windows(max_crops, max_tokens))]
    if longest_tokens is not None and longest_tokens > max_tokens:
        pending_decode += [(p, top_k, blocks, window) for max_crops, p, top_k, blocks in configs
                           for window in sorted(windows(max_crops, longest_tokens) - windows(max_crops, max_tokens))]
    if capture_vision is None:
        pending_vision = []
    capture_prefill = getattr(runtime, "capture_prefill", None)
    pending_prefill = [] if capture_prefill is None else [
        (p, top_k, blocks, bucket) for max_crops, p, top_k, blocks in configs
        for bucket in sorted({prefill_bucket_for(s.prompt_tokens + extra) for s in shapes[max_crops]
                              for extra in (0, QUESTION_ALLOWANCE_TOKENS)})]
    done = 0
    for arrays in pending_vision:
        if time.perf_counter() - started > time_limit_s:
            break
        result.vision_graphs += bool(capture_vision(arrays))
        done += 1
    for p, top_k, blocks, bucket in pending_prefill:
        if time.perf_counter() - started > time_limit_s:
            break
        with engine.executor.configured(p, top_k, blocks) as active:
            result.prefill_graphs += capture_prefill(active, bucket)
        done += 1
    for p, top_k, blocks, window in pending_decode:
        if time.perf_counter() - started > time_limit_s:
            break
        with engine.executor.configured(p, top_k, blocks) as active:
            result.decode_graphs += bool(runtime.capture_decode(active, window))
        done += 1
    result.left = len(pending_vision) + len(pending_prefill) + len(pending_decode) - done
    result.seconds = time.perf_counter() - started
    return result


#: decode steps the batched warm-up times per batch
WARM_BATCH_STEPS = 6


def warm_batches(engine: Engine, max_tokens: int = WARM_BATCH_STEPS + 1) -> int:
    """Under continuous batching (``--max-batch`` > 1), run the batched pass before the first request
    does: for every batch size from 1 to ``max_batch`` rows, at the warm-up's fastest and slowest
    configurations (each batch of one configuration, then of both alternating), a text prompt's
    rows join and take up to ``max_tokens - 1`` decode steps, each step timed into the engine's
    :class:`serve.batch_cost.BatchCost` (its step fit is measured from the start). Returns the steps
    timed; 0 with one row per batch."""
    if engine.max_batch <= 1:
        return 0
    runtime, cost = engine.runtime, engine.batch_cost
    embeds = runtime.decoder_inputs(runtime.preprocess(None, _WARM_QUESTION, 1))
    configs = warmup_configs(engine)
    kinds = [runtime.knobs_after_prefix(0, top_k, blocks) for _, top_k, blocks in (configs[0], configs[-1])]
    steps = 0
    with cpu_threads(engine.threads, runtime.device), runtime.batch_context():
        for rows in range(1, engine.max_batch + 1):
            for mix in ([kinds[0]], [kinds[1]], kinds):
                knobs = [mix[i % len(mix)] for i in range(rows)]
                batch = runtime.batch_decoder()
                batch.count_products = False
                batch.join([embeds] * rows, knobs, [max_tokens] * rows)
                while batch.live:
                    stepping = [r.knobs for r in batch.live]
                    tick = time.perf_counter()
                    batch.step()
                    cost.observe_step(stepping, (time.perf_counter() - tick) * 1000.0)
                    steps += 1
    return steps


def _warm_request(engine: Engine, max_tokens: int, budget_ms: float | None, knobs: dict[str, int] | None,
                  request_id: str) -> Result:
    """One unrecorded warm-up request (``knobs`` None: the controller decides at ``budget_ms``)."""
    image = Image.new("RGB", _WARM_IMAGE_SIZE, (120, 110, 100))
    request = ChatRequest(engine.model_name, _WARM_QUESTION, image, max_tokens, budget_ms, knobs)
    job = new_job(request, engine, time.perf_counter(), datetime.now(UTC), 0.0, request_id)
    with cpu_threads(engine.threads, engine.runtime.device):
        return engine.execute(job, record=False)


def warm_up(engine: Engine, max_tokens: int) -> list[Result]:
    """Run the :func:`warmup_configs` (an image request each, ``max_tokens`` long), unrecorded; twice
    where they seed the latency scale. Returns the requests' results.

    The seeded ratios are only as right as ``max_tokens`` is typical: the server passes what a
    request without ``max_tokens`` generates, since a shorter warm-up reads the machine as faster
    than it serves."""
    rounds = 2 if engine.latency_scale.calibrates else 1
    results: list[Result] = []
    for _ in range(rounds):
        for max_crops, top_k, blocks in warmup_configs(engine):
            knobs = {"max_crops": max_crops, "top_k": top_k, "num_active_blocks": blocks}
            results.append(_warm_request(engine, max_tokens, None, knobs, f"warmup-{len(results)}"))
    if engine.latency_scale.calibrates:
        engine.planner.seed_margin(engine.latency_scale.ratios())
    return results


def warm_decisions(engine: Engine, max_tokens: int) -> list[Result]:
    """Requests the controller decides (an image request each, ``max_tokens`` long, unrecorded), at
    budgets spread over its training range: its stages have run before the first request's (a first
    call pays one-time costs of its own), and where it holds an online run's latency
    guard with a drift factor, the guard has seen ``DRIFT_MIN`` requests of this machine as it runs
    now, so the first requests are not decided at the speed of the spell the guard was fitted in.
    One request where there is no drift to seed. Returns the requests' results."""
    guard = engine.decider.cost.guard
    count = DRIFT_MIN if guard is not None and guard.fit_median is not None else 1
    low, high = engine.decider.budget_range_ms
    low = max(float(low), 1.0)
    budgets = np.geomspace(low, max(float(high), low), count + 2)[1:-1]  # inside the range: the controller decides
    return [_warm_request(engine, max_tokens, float(budget_ms), None, f"warmup-decided-{i}")
            for i, budget_ms in enumerate(budgets)]
