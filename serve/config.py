"""Options of ``ctrl serve``: each option's default and help live on its field, once.

The CLI builds its options from the fields (``cli/options.py``); docs/serving.md lists the
same text (tests/test_serve.py checks they agree). This module imports nothing of
ctrl, so that ``ctrl --help`` reads it without loading pyarrow or torch; a bad value is a
``ValueError`` with one line.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from controller.cost import LATENCY_SCALE_QUANTILE, LATENCY_SCALE_WINDOW
from pipeline.execution import DTYPE_CHOICES, ExecutionOptions, execution_field
from pipeline.options import WORKSPACE_CLI, auto_or_count, option, option_flags

#: the prompt-token limit of a model whose runtime does not say its context length
FALLBACK_MAX_PROMPT_TOKENS = 4096
#: host names that always mean loopback
LOOPBACK_NAMES = {"localhost"}


@dataclass
class ServeConfig:
    """How ``ctrl serve`` runs: the model, the controller, the HTTP endpoint and its limits."""

    model: str = option("testbed", help=
        "The model answering requests: 'embedded', 'testbed', a local MolmoE directory or a Hugging Face id "
        "org/name[@revision] in the local cache; must be the model the controller's features came from.")
    controller: str = option("latest", help=
        "The controller on the request path: a run id or directory (offline or online), 'latest' (the most "
        "recently started run with a checkpoint, either phase), a checkpoint .pt or a file written by "
        "`ctrl export`.")
    workspace: Path | None = option(None, help=
        "Workspace: where runs are looked up and every request is recorded (requests/*.jsonl, view `requests`).",
        **WORKSPACE_CLI)
    host: str = option("127.0.0.1", help=
        "Address or host name to bind (an IPv6 address with or without brackets: ::1 or [::1]); anything but "
        "loopback also needs --allow-remote.")
    port: int = option(8000, help="TCP port to listen on (0 = any free port, printed at start).")
    allow_remote: bool = option(False, help=
        "Allow binding to a non-loopback address (then also set --api-key).", flags=("--allow-remote",))
    auth_by_proxy: bool = option(False, help=
        "Allow a non-loopback address without --api-key because an authenticating proxy in front of the server "
        "checks every request.", flags=("--auth-by-proxy",))
    api_key: str | None = option(None, help=
        "Require 'Authorization: Bearer KEY' on every endpoint but /health (env CTRL_API_KEY); surrounding "
        "whitespace, such as a key file's newline, is dropped from the key and from the token a client sends, "
        "and what remains must be visible ASCII.", envvar="CTRL_API_KEY")
    device: str = execution_field("device")
    # a plain string checked here: a bad value is one line naming the choices, as for --device
    dtype: str = execution_field("dtype", choices=None, metavar="<auto|bfloat16|float16|float32>")
    threads: int = execution_field("threads", min=None)
    max_queue: int = option(8, help=
        "Requests waiting for the model beyond those running; one more is answered 503 with Retry-After.")
    max_batch: str = option("auto", help=
        "Requests decoding together (continuous batching: a request joins the running batch between decode "
        "steps, its own knobs in the shared passes, and leaves at its end); 1 serves one request at a time; "
        "auto: 1, the setting measured to keep the most budgets: on a CPU four rows served the testbed no "
        "more requests per second and fewer right answers within budget than one at a time, and no card has "
        "measured it yet (docs/serving.md#continuous-batching).")
    preprocess_workers: int | None = option(None, help=
        "Threads that preprocess admitted requests (resize, normalise, tile at each crops choice) off the "
        "model's thread, while they wait and while stage 1 decides; 0: the model's thread does it "
        "(default: half the CPUs this process may use, 1 to 4).")
    default_budget_ms: float | None = option(None, help=
        "Latency budget of a request without latency_budget_ms (default: the top of the controller's "
        "training budget range).")
    latency_scale: float | None = option(None, help=
        "This machine's model time per millisecond of the latencies the controller was trained on; budgets are "
        "divided by it before the controller reads them. 1 reads budgets as the profile's milliseconds (default: "
        "measured on the requests served, warm-up included; docs/serving.md#latency-calibration).")
    latency_scale_quantile: float = option(LATENCY_SCALE_QUANTILE, help=
        f"The measured latency scale is this quantile of the last {LATENCY_SCALE_WINDOW} requests' ratios of served "
        "model time to the configuration's median training latency (higher: more careful decisions).")
    queue_aware: bool = option(True, help=
        "Cap the budget the controller reads by what the requests waiting behind a request still need to meet "
        "theirs at the cheapest configuration (docs/serving.md#queue-aware-budgets).")
    load_aware: bool = option(True, help=
        "Cap the budget the controller reads by what the requests still to come, at the arrival rate observed, "
        "need to meet budgets like it on average: an M/G/1 queue's mean waiting time "
        "(docs/serving.md#load-aware-budgets).")
    burst_aware: bool = option(True, help=
        "Read arrivals as bursty as they are: the arrival rate of the last 8 requests where it is at least twice "
        "the windowed one (a burst seen within a few arrivals), and a G/G/1 wait (Kingman) with the arrival "
        "counts' dispersion over windows of the budget (docs/serving.md#bursty-arrivals).")
    refuse_unreachable: bool = option(True, help=
        "Refuse at once (503 budget_unreachable, with Retry-After) a request with a latency_budget_ms of its own "
        "when the requests ahead of it, at the cheapest configuration, leave too little of its "
        "budget for the cheapest configuration, instead of queueing it to fail; drop such a request (504) when "
        "the rest of its budget is less than the cheapest configuration takes by the time the model could start "
        "it; serve the waiting earliest deadline first either way (docs/serving.md#overload).")
    cheapest_floor: bool = option(False, help=
        "Per budget class, decide requests at the cheapest configuration while the class's controller requests "
        "have recently met their budgets less often than a replay of the same arrivals at the cheapest "
        "configuration would have. Off by default: under Poisson arrivals it cost accuracy without meeting more "
        "budgets (docs/serving.md#the-cheapest-floor).")
    config_guard: bool = option(True, help=
        "After stage 2, replace a configuration whose median on this machine (its reference latency times its "
        "own measured scale) exceeds the budget the controller read by the largest one at the same crops that "
        "fits (docs/serving.md#budget-terms).")
    met_target: float = option(0.95, help=
        "The share of controller-decided requests to answer within their budget: the budget the controller reads "
        "is multiplied by a margin that falls after each request that missed and rises after each that met, so "
        "that this share is met under the server's own load; each budget class keeps its own margin and aims no "
        "higher than the cheapest configuration can meet (0 turns the margin off; docs/serving.md#met-target).")
    default_max_tokens: int = option(16, help="Tokens generated when a request sets no max_tokens.")
    max_tokens_limit: int = option(256, help="The largest max_tokens a request may ask for.")
    max_body_bytes: int = option(16 * 1024 * 1024, help=
        "The largest request body accepted, in bytes (413 above); also the largest image file read from "
        "--local-images.")
    max_prompt_chars: int = option(8000, help=
        "The most characters of question text a request may send (400 above): the prefill's time grows "
        "with the prompt, quadratically, and holds the one model thread.")
    max_prompt_tokens: int | None = option(None, help=
        "The most tokens the question's formatted prompt may have, as the model's tokenizer counts them before "
        "the request is queued (400 above; the image's tokens come on top, bounded by the crops). Default: the "
        "model's context length (2048 for the embedded model and the testbed, 4096 for MolmoE-1B), "
        f"{FALLBACK_MAX_PROMPT_TOKENS} where the runtime does not know it.")
    queue_deadline: float = option(4.0, help=
        "A request that has spent this many times its latency budget since it arrived when the model could "
        "start it is dropped instead of run (504, deadline_exceeded): its answer would come far too late, and "
        "running it would delay every request behind it (0: never drop).")
    max_image_pixels: int = option(25_000_000, help=
        "The most pixels (width x height, read from the header before decoding) an image may have (400 above).")
    max_image_aspect: float = option(25.0, help=
        "The most an image's longer side may be of its shorter side (400 above): resizing a sliver of millions of "
        "pixels costs the model thread several times what a square image of as many pixels does.")
    max_connections: int = option(128, help=
        "The most open HTTP connections; one more is answered 503 and closed before its request is read.")
    header_timeout_s: float = option(10.0, help=
        "Seconds a connection has to send a request's headers (from its opening or the previous reply); "
        "then it is answered 408 and closed.")
    body_timeout_s: float = option(30.0, help=
        "Seconds a request's body has to arrive once its headers are in; then it is answered 408 and the "
        "connection closed (a body of --max-body-bytes needs about 0.6 MB/s by default).")
    write_timeout_s: float = option(10.0, help=
        "Seconds a connection's replies may wait unread in its send buffer (a client that sends requests and "
        "never reads the answers); then the connection is closed at once.")
    max_pipelined: int = option(8, help=
        "Requests answered in a row on one connection that its client sent before the previous reply was "
        "complete (HTTP pipelining); after them the server ends the connection, the replies written still "
        "readable.")
    max_uploads: int | None = option(None, help=
        "Request bodies received at once: a body's first byte takes a place, a body with none is read, "
        "dropped and answered 503 uploads_full with Retry-After; one client address (not loopback, and not "
        "with --auth-by-proxy, where every client has the proxy's) may hold half of them (default: 2 x "
        "(--max-queue + 1)).")
    allowed_hosts: str | None = option(None, help=
        "Comma-separated host names the Host header may name, '*' for any (default: on a loopback bind "
        "localhost, 127.0.0.1, ::1 and the --host value, so that a web page cannot reach the server through a "
        "name of its own (DNS rebinding); elsewhere any).")
    allowed_origins: str | None = option(None, help=
        "Comma-separated origins (scheme://host[:port]) whose browser pages may call the server, with CORS "
        "headers (default: none; a request with any other Origin header is refused with 403).")
    local_images: Path | None = option(None, help=
        "Also accept image_url file paths (file:///... or /...) inside this directory (default: data: URIs only).",
        is_dir=True)
    served_model_name: str | None = option(None, help=
        "The model name requests must use and /v1/models lists (default: the --model value).")
    fast_path: bool = execution_field("fast_path", more_help=(
        "The warm-up captures the steps of the configurations the controller can choose."))
    float32_attention: bool = execution_field("float32_attention")
    warmup: bool = option(True, help=
        "Before accepting requests, run the fastest and the slowest configuration of every crops choice (twice "
        "when the latency scale is measured), so first requests do not pay one-time costs.")
    warmup_capture_s: float = option(300.0, help=
        "With CUDA graphs, the most seconds the warm-up spends capturing the graphs served requests can reach "
        "(the ViT per array count, each configuration's decode step per attention window); the rest are captured "
        "by the first request that needs them (docs/serving.md#warm-up).")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            msg = f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}"
            raise ValueError(msg)
        for name in ("max_queue", "default_max_tokens", "max_tokens_limit", "max_body_bytes", "max_prompt_chars",
                     "max_prompt_tokens", "max_image_pixels"):
            value = getattr(self, name)
            if value is None and name == "max_prompt_tokens":
                continue
            low = 0 if name == "max_queue" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "an integer >= 0" if low == 0 else "a positive integer"
                msg = f"--{name.replace('_', '-')} must be {kind}, got {value!r}"
                raise ValueError(msg)
        if not (math.isfinite(self.max_image_aspect) and self.max_image_aspect >= 1):
            msg = f"--max-image-aspect must be a number >= 1, got {self.max_image_aspect!r}"
            raise ValueError(msg)
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            msg = f"--max-connections must be a positive integer, got {self.max_connections!r}"
            raise ValueError(msg)
        for name in ("max_pipelined", "max_uploads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                msg = f"--{name.replace('_', '-')} must be a positive integer, got {value!r}"
                raise ValueError(msg)
        self.max_batch = auto_or_count("--max-batch", self.max_batch)
        workers = self.preprocess_workers
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
            msg = f"--preprocess-workers must be an integer >= 0, got {workers!r}"
            raise ValueError(msg)
        for name in ("header_timeout_s", "body_timeout_s", "write_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                msg = f"--{name.replace('_', '-')} must be a positive number of seconds, got {value!r}"
                raise ValueError(msg)
        for name in ("allowed_hosts", "allowed_origins"):
            value = getattr(self, name)
            if value is not None and not [item for item in value.split(",") if item.strip()]:
                msg = f"--{name.replace('_', '-')} must name at least one value, got {value!r}"
                raise ValueError(msg)
        for origin in self.origins:
            if not re.fullmatch(r"https?://[^/\s]+", origin):
                msg = f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port], no path)"
                raise ValueError(msg)
        if not 0 <= int(self.port) <= 65535:
            msg = f"--port must be in 0..65535, got {self.port!r}"
            raise ValueError(msg)
        if self.threads < 0:
            msg = f"--threads must be >= 0, got {self.threads!r}"
            raise ValueError(msg)
        if self.threads > available_cpus():
            # each thread is a torch worker spinning on a core: more than the cores only contend, and
            # thousands exhaust the process's threads (the server then crashes)
            msg = (f"--threads {self.threads}: more than the {available_cpus()} CPU(s) this process may use "
                   "(0 = torch's default, one per core)")
            raise ValueError(msg)
        if self.default_max_tokens > self.max_tokens_limit:
            msg = (f"--default-max-tokens ({self.default_max_tokens}) must not exceed --max-tokens-limit "
                   f"({self.max_tokens_limit})")
            raise ValueError(msg)
        if self.default_budget_ms is not None and not (math.isfinite(self.default_budget_ms)
                                                       and self.default_budget_ms > 0):
            msg = f"--default-budget-ms must be a positive number of milliseconds, got {self.default_budget_ms!r}"
            raise ValueError(msg)
        if self.latency_scale is not None and not (math.isfinite(self.latency_scale) and self.latency_scale > 0):
            msg = f"--latency-scale must be a positive number, got {self.latency_scale!r}"
            raise ValueError(msg)
        if not (math.isfinite(self.latency_scale_quantile) and 0 <= self.latency_scale_quantile <= 1):
            msg = f"--latency-scale-quantile must be in [0, 1], got {self.latency_scale_quantile!r}"
            raise ValueError(msg)
        if isinstance(self.queue_deadline, bool) or not (math.isfinite(self.queue_deadline)
                                                          and self.queue_deadline >= 0):
            msg = f"--queue-deadline must be a number >= 0 (times the budget; 0: never), got {self.queue_deadline!r}"
            raise ValueError(msg)
        if not (math.isfinite(self.warmup_capture_s) and self.warmup_capture_s >= 0):
            msg = (f"--warmup-capture-s must be a number of seconds >= 0 (0: capture nothing ahead), "
                   f"got {self.warmup_capture_s!r}")
            raise ValueError(msg)
        if not (math.isfinite(self.met_target) and 0 <= self.met_target < 1):
            msg = f"--met-target must be in [0, 1) (0: no margin), got {self.met_target!r}"
            raise ValueError(msg)
        self.host = unbracketed(self.host)
        if not self.allow_remote and not is_loopback(self.host):
            msg = (f"--host {self.host!r} is not a loopback address: the server would answer other machines\n"
                   "Hint: add --allow-remote (and --api-key) to serve on the network, or bind to 127.0.0.1.")
            raise ValueError(msg)
        if not is_loopback(self.host) and self.api_key is None and not self.auth_by_proxy:
            msg = (f"--host {self.host!r} without --api-key would let anyone who reaches this machine use the model: "
                   "set --api-key (or CTRL_API_KEY), or --auth-by-proxy behind a proxy that checks every request")
            raise ValueError(msg)
        if self.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", self.device):
            msg = f"--device must be cpu, cuda or cuda:N, got {self.device!r}"
            raise ValueError(msg)
        if self.local_images is not None and not Path(self.local_images).is_dir():
            msg = f"--local-images {str(self.local_images)!r} is not a directory"
            raise ValueError(msg)
        if self.api_key is not None:
            self.api_key = normalize_api_key(self.api_key)
            if not self.api_key:
                msg = "--api-key must not be empty"
                raise ValueError(msg)
            # a client sends the key in an HTTP header: a space or a control character inside cannot
            # arrive as written, and httpx (the openai client) refuses non-ASCII header values
            position, char = next(((i, c) for i, c in enumerate(self.api_key, 1) if not "!" <= c <= "~"), (0, ""))
            if position:
                msg = (f"--api-key must be visible ASCII characters (a Bearer token), but has {char!r} at position "
                       f"{position}")
                raise ValueError(msg)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def execution(self) -> ExecutionOptions:
        return ExecutionOptions.of(self)

    @property
    def hosts(self) -> frozenset[str] | None:
        """The host names a request's Host header may name (lower case, no port); None: any."""
        if self.allowed_hosts is not None:
            names = {h.strip().lower().strip("[]") for h in self.allowed_hosts.split(",") if h.strip()}
            return None if "*" in names else frozenset(names)
        if not is_loopback(self.host):
            return None
        return frozenset({"localhost", "127.0.0.1", "::1", self.host.lower().strip("[]")})

    def batch_rows(self, batches: bool) -> int:
        """``max_batch`` resolved for a model that runs batches (``batches``) or not:
        "auto" is :data:`AUTO_MAX_BATCH` where the model batches, 1 where it does not."""
        if self.max_batch != "auto":
            return int(self.max_batch)
        return AUTO_MAX_BATCH if batches else 1

    @property
    def preprocess_threads(self) -> int:
        """``preprocess_workers``, its default resolved: half the CPUs this process may use, 1 to 4."""
        if self.preprocess_workers is not None:
            return self.preprocess_workers
        return max(1, min(4, available_cpus() // 2))

    @property
    def origins(self) -> tuple[str, ...]:
        """The origins whose browser pages may call the server (lower case, no trailing slash)."""
        if self.allowed_origins is None:
            return ()
        return tuple(o.strip().lower().rstrip("/") for o in self.allowed_origins.split(",") if o.strip())


#: --max-batch auto: one request at a time. On a 2-vCPU CPU four rows served the embedded model's long
#: answers 56-59 % more requests per second, but the served testbed's short ones no more, and its
#: controller fewer right answers within budget at loads 0.5-1.0 (docs/results.md, "Continuous batching
#: past one request's capacity"); no GPU has measured it
AUTO_MAX_BATCH = 1


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; all of the machine's where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def unbracketed(host: str) -> str:
    """``host`` without the brackets of an IPv6 literal (``[::1]`` as a URL writes it): the socket
    layer takes the bare address. Brackets around anything else are refused."""
    if not (host.startswith("[") and host.endswith("]")):
        return host
    try:
        ipaddress.IPv6Address(host[1:-1])
    except ValueError:
        msg = f"--host {host!r}: brackets hold an IPv6 address only (e.g. [::1]); write a host name or IPv4 bare"
        raise ValueError(msg) from None
    return host[1:-1]


def normalize_api_key(key: str) -> str:
    """The API key as it is compared, configured or sent: without surrounding whitespace (a key read
    from a file keeps its newline; an HTTP header value loses its surrounding spaces anyway)."""
    return key.strip()


def is_loopback(host: str) -> bool:
    """True for localhost and addresses in 127.0.0.0/8 or ::1."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def options_markdown() -> str:
    """The options table of docs/serving.md, from the fields (a test checks the doc holds it)."""
    lines = ["| option | default | |", "|---|---|---|"]
    for f in fields(ServeConfig):
        flags = ", ".join(option_flags(ServeConfig, f.name))
        default = "" if f.default in (None, MISSING) else f"`{f.default}`"
        lines.append(f"| `{flags}` | {default} | {f.metadata['help']} |")
    return "\n".join(lines)
