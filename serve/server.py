"""``ctrl serve``: load the model and the controller, warm up, then serve HTTP until SIGTERM or Ctrl-C.

uvicorn runs the app: on SIGTERM (or SIGINT) it stops accepting connections, lets the requests
in flight finish, then the app's lifespan stops the engine (the queue drains) and the process
exits 0. A second SIGTERM (or SIGINT) stops at once: the request running stops before its next
decoder block, the queued ones are not run (each recorded as cancelled) and the process exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import signal
import threading
from collections.abc import Callable, Iterator

from controller.cost import LatencyScale
from pipeline.catalog import build_catalog
from pipeline.workspace import Workspace
from runtime import load_runtime
from serve.app import create_app
from serve.config import FALLBACK_MAX_PROMPT_TOKENS, ServeConfig
from serve.connections import DROP_REASONS, ConnectionLimits, UploadPlaces, protocol_class
from serve.deciders import find_controller, load_decider
from serve.engine import Engine
from serve.protocol import Limits, warm_image_decoding
from serve.request_log import RequestLog
from serve.warmup import capture_graphs, warm_batches, warm_decisions, warm_up


def build_engine(config: ServeConfig, log: Callable[[str], None] = lambda _: None) -> Engine:
    """The model, the controller and the request log of ``config`` (no thread started yet)."""
    workspace = Workspace(config.workspace)
    controller = find_controller(workspace, config.controller)  # before the model: a bad controller fails at once
    log(f"loading model {config.model!r} ({config.device}, dtype {config.dtype}, "
        f"{'fast path' if config.fast_path else 'eager path'})")
    runtime = load_runtime(config.model, config.execution)
    decider = load_decider(controller, runtime.fingerprint)
    scale = LatencyScale(decider.reference_latency_ms, fixed=config.latency_scale,
                         quantile=config.latency_scale_quantile)
    engine = Engine(runtime, decider, model_name=config.model_name, max_queue=config.max_queue,
                    default_budget_ms=config.default_budget_ms, threads=config.threads,
                    request_log=RequestLog(workspace), latency_scale=scale, queue_aware=config.queue_aware,
                    load_aware=config.load_aware, guard=config.config_guard, met_target=config.met_target or None,
                    queue_deadline=config.queue_deadline, burst_aware=config.burst_aware,
                    refuse_unreachable=config.refuse_unreachable, cheapest_floor=config.cheapest_floor,
                    preprocess_workers=config.preprocess_threads,
                    max_batch=config.batch_rows(runtime.batches))
    if workspace.current_generation() is not None:
        build_catalog(workspace)  # ctrl.duckdb gains the `requests` view (plain duckdb reads the catalog)
    log(f"controller {decider.controller_run} ({decider.phase}); default budget {engine.default_budget_ms:.1f} ms; "
        f"requests recorded in {engine.log.path if engine.log else '-'}")
    if scale.fixed is not None:
        log(f"latency scale fixed at {scale.fixed:g}")
    elif not scale.reference_ms:
        log("latency scale 1: the controller records no latencies per configuration (an online run, an offline "
            "run trained without a table fallback, or an exported file without them), so budgets are read as the "
            "controller's milliseconds")
    if config.warmup:
        warm_image_decoding()
        results = warm_up(engine, config.default_max_tokens)
        measured = (f"; latency scale {scale.value:.2f}, margins start at {engine.planner.initial_margin:.2f}"
                    if scale.calibrates else "")
        log(f"warm-up: {len(results)} requests of {config.default_max_tokens} tokens{measured}")
        decided = warm_decisions(engine, config.default_max_tokens)
        guard = engine.decider.cost.guard
        drift = f"; the latency guard's drift x{guard.drift():.2f}" if guard is not None else ""
        log(f"warm-up: {len(decided)} requests decided by the controller{drift}")
        if engine.max_batch > 1:
            log(f"warm-up: {warm_batches(engine)} batched decode steps at 1-{engine.max_batch} rows timed")
        captured = capture_graphs(engine, config.default_max_tokens, config.max_tokens_limit,
                                  config.warmup_capture_s)
        if engine.runtime.execution["cuda_graphs"]:
            memory = engine.runtime.fast.memory_bytes()
            left = (f"; {captured.left} left to their first request (--warmup-capture-s {config.warmup_capture_s:g} "
                    "ran out)" if captured.left else "")
            log(f"warm-up: {captured.decode_graphs} decode steps, {captured.prefill_graphs} prefill blocks and "
                f"{captured.vision_graphs} ViT array counts captured as CUDA graphs in {captured.seconds:.1f}s "
                f"(graph pool {memory['graph_pool'] / 2**20:.0f} MiB, KV cache "
                f"{memory['kv_cache'] / 2**20:.0f} MiB){left}")
        engine.metrics.graph_captures.labels(during="warmup").inc(engine.runtime.graph_captures)
    return engine


def max_prompt_tokens(config: ServeConfig, engine: Engine) -> int:
    """``--max-prompt-tokens``, else the model's context length, else a fixed default."""
    return int(config.max_prompt_tokens or engine.runtime.context_length or FALLBACK_MAX_PROMPT_TOKENS)


def limits_of(config: ServeConfig, engine: Engine) -> Limits:
    return Limits(default_max_tokens=config.default_max_tokens, max_tokens_limit=config.max_tokens_limit,
                  max_image_pixels=config.max_image_pixels, local_images=config.local_images,
                  image_required=not engine.runtime.answers_without_image,
                  max_prompt_chars=config.max_prompt_chars, max_prompt_tokens=max_prompt_tokens(config, engine),
                  max_image_file_bytes=config.max_body_bytes, max_image_aspect=config.max_image_aspect,
                  reserved_texts=engine.runtime.special_texts())


def connection_limits(config: ServeConfig, engine: Engine) -> ConnectionLimits:
    for reason in DROP_REASONS:  # every reason in the metrics from the start, at 0
        engine.metrics.connections_dropped.labels(reason=reason)
    return ConnectionLimits(config.max_connections, config.header_timeout_s, config.body_timeout_s,
                            write_timeout_s=config.write_timeout_s, max_pipelined=config.max_pipelined,
                            on_drop=lambda reason: engine.metrics.connections_dropped.labels(reason=reason).inc())


def upload_places(config: ServeConfig) -> UploadPlaces:
    """``--max-uploads`` places for bodies in flight, half of them for one client address (every client
    behind an authenticating proxy has the proxy's)."""
    total = config.max_uploads or 2 * (config.max_queue + 1)
    return UploadPlaces(total, max(1, total // 2), by_address=not config.auth_by_proxy)


#: glibc's mallopt parameter: the allocation size from which memory is mapped on its own
_M_MMAP_THRESHOLD = -3
#: allocations of this size and more (decoded images, their crops, long prompts' activations) are mapped
MMAP_THRESHOLD_BYTES = 1 << 20


def map_large_allocations() -> None:
    """Have glibc map every allocation of ``MMAP_THRESHOLD_BYTES`` or more on its own, so that its
    memory goes back to the system when freed. By default glibc raises that threshold to the size of
    the largest buffer freed (up to 32 MiB) and then keeps such buffers in per-thread heaps: a burst
    of large images, decoded on several threads, left the server holding gigabytes it no longer used.
    A no-op where the C library has no mallopt."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass


def serve(config: ServeConfig, log: Callable[[str], None] = lambda _: None) -> bool:
    """Run the server in this process until it is told to stop. False when a second signal stopped
    it at once (the requests it cut short are recorded as cancelled), True when it drained.

    The caller checks the host and port first (:func:`serve.startup.check_bind`): the CLI does so
    before it imports this module, whose imports take seconds."""
    import uvicorn  # deferred: only this command needs it

    map_large_allocations()
    engine = build_engine(config, log)
    connections = connection_limits(config, engine)
    app = create_app(engine, limits_of(config, engine), max_body_bytes=config.max_body_bytes, api_key=config.api_key,
                     hosts=config.hosts, origins=config.origins, body_timeout_s=config.body_timeout_s,
                     connections=connections, uploads=upload_places(config))
    server = _draining_server_class()(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                                     access_log=False, lifespan="on",
                                                     http=protocol_class(connections)), engine)
    server.run()
    if server.force_exit:  # uvicorn skips the lifespan's shutdown then: the worker ends within one block
        engine.stop()
        log("stopped at once by a second signal: the requests in flight were cancelled (recorded as such)")
    return not server.force_exit


def _not_a_cancelled_task(record: logging.LogRecord) -> bool:
    """False for the tracebacks of tasks a forced stop cancels (a request's handler, the lifespan's
    wait): that stop was asked for, the requests are recorded as cancelled, and nothing failed."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, asyncio.CancelledError):
        return False
    text = record.msg if isinstance(record.msg, str) else ""
    return not (text.startswith("Traceback") and text.rstrip().endswith("CancelledError"))


def _draining_server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, but a SIGTERM / SIGINT that drained the requests ends the process with
        exit code 0 (uvicorn re-raises the signal once shut down, which makes the exit code -15), and
        a second SIGTERM, not only a second SIGINT, stops at once: the engine aborts the request
        running between two decoder blocks rather than finishing a long prefill."""

        def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
            super().__init__(config)
            self.engine = engine

        def handle_exit(self, sig: int, frame: object) -> None:
            if self.should_exit:
                self.force_exit = True
                self.engine.abort()
                for name in ("uvicorn.error", "uvicorn"):
                    logging.getLogger(name).addFilter(_not_a_cancelled_task)
            else:
                self.should_exit = True

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return DrainingServer
