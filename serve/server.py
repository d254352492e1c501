"""``ctrl serve``: load the model and the controller, warm up, then serve HTTP until SIGTERM or Ctrl-C.

uvicorn runs the app: on SIGTERM (or SIGINT) it stops accepting connections, lets the requests
in flight finish, then the app's lifespan stops the engine (the queue drains) and the process
exits 0.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterator

from pipeline.catalog import build_catalog
from pipeline.workspace import Workspace
from runtime import load_runtime
from serve.app import create_app
from serve.calibration import BudgetMargin, LatencyScale
from serve.config import ServeConfig
from serve.deciders import load_decider
from serve.engine import Engine, warm_up
from serve.protocol import Limits, warm_image_decoding
from serve.request_log import RequestLog


def build_engine(config: ServeConfig, log: Callable[[str], None] = lambda _: None) -> Engine:
    """The model, the controller and the request log of ``config`` (no thread started yet)."""
    workspace = Workspace(config.workspace)
    log(f"loading model {config.model!r} ({config.device}, dtype {config.dtype})")
    runtime = load_runtime(config.model, config.device, None, config.dtype)
    decider = load_decider(workspace, config.controller, runtime.fingerprint)
    scale = LatencyScale(decider.reference_latency_ms, fixed=config.latency_scale,
                         quantile=config.latency_scale_quantile)
    engine = Engine(runtime, decider, model_name=config.model_name, max_queue=config.max_queue,
                    default_budget_ms=config.default_budget_ms, threads=config.threads,
                    request_log=RequestLog(workspace), latency_scale=scale, queue_aware=config.queue_aware,
                    budget_margin=BudgetMargin(config.met_target or None))
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
        runs = warm_up(engine)
        measured = f"; latency scale {scale.value:.2f}" if scale.calibrates else ""
        log(f"warm-up: {runs} requests{measured}")
    return engine


def limits_of(config: ServeConfig, engine: Engine) -> Limits:
    return Limits(default_max_tokens=config.default_max_tokens, max_tokens_limit=config.max_tokens_limit,
                  max_image_pixels=config.max_image_pixels, local_images=config.local_images,
                  image_required=not engine.runtime.answers_without_image,
                  max_prompt_chars=config.max_prompt_chars, max_image_file_bytes=config.max_body_bytes)


def check_port_free(host: str, port: int) -> None:
    """Refuse (``ValueError``, one line) a port something already listens on."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            msg = (f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}); another server may hold it: "
                   "stop it or choose another port (--port 0 picks a free one)")
            raise ValueError(msg) from None


def serve(config: ServeConfig, log: Callable[[str], None] = lambda _: None) -> None:
    """Run the server in this process until it is told to stop."""
    import uvicorn  # deferred: only this command needs it

    check_port_free(config.host, config.port)  # before the model loads: a taken port is found in a second
    engine = build_engine(config, log)
    app = create_app(engine, limits_of(config, engine), max_body_bytes=config.max_body_bytes, api_key=config.api_key)
    server = _draining_server_class()(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                            access_log=False, lifespan="on"))
    server.run()


def _draining_server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, but a SIGTERM / SIGINT that drained the requests ends the process with
        exit code 0 (uvicorn re-raises the signal once shut down, which makes the exit code -15)."""

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
