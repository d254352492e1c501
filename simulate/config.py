"""``ctrl simulate``'s options (:class:`SimulateConfig`), checked once, and the parsers of its values."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pipeline.options import WORKSPACE_CLI, option, option_default
from serve.config import ServeConfig

#: --jobs 0 starts worker processes only for at least this many requests decided by the controller in all
#: cells, a static configuration's request counting :data:`STATIC_REQUEST_WEIGHT` of one (it takes about that
#: share of the time): below it, starting the workers (seconds: torch's import) costs more than they save
PARALLEL_MIN_REQUESTS, STATIC_REQUEST_WEIGHT = 20_000, 1 / 8

#: how requests are spread over the replicas
BALANCERS = ("round-robin", "least-loaded", "power-of-two")
#: the server's options a simulated replica runs with: ``ctrl serve``'s defaults, written once there
SERVE_DEFAULT_MAX_QUEUE, SERVE_DEFAULT_QUEUE_DEADLINE, SERVE_DEFAULT_MET_TARGET = (
    option_default(ServeConfig, name) for name in ("max_queue", "queue_deadline", "met_target"))


class SimulateOptionError(ValueError):
    """An option value ``ctrl simulate`` cannot use (the message names the option and the reason)."""


def parse_numbers(option_name: str, text: str, *, positive: bool = True) -> tuple[float, ...]:
    """``"5,10,20"`` -> (5.0, 10.0, 20.0); a one-line error naming the option otherwise."""
    values = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            value = float(part)
        except ValueError:
            msg = f"{option_name}: {part!r} is not a number"
            raise SimulateOptionError(msg) from None
        if not math.isfinite(value) or (positive and value <= 0):
            msg = f"{option_name}: {part!r} must be a number > 0"
            raise SimulateOptionError(msg)
        values.append(value)
    return tuple(values)


def parse_budget_mix(text: str) -> tuple[tuple[float, float], ...]:
    """``"150"`` -> ((150, 1),); ``"150:0.6,300:0.4"`` -> ((150, 0.6), (300, 0.4)): budgets (ms) and the
    share of requests with each. The shares must sum to 1."""
    mix: list[tuple[float, float]] = []
    parts = [p.strip() for p in str(text).split(",")]
    for part in parts:
        budget, sep, share = part.partition(":")
        if not sep and len(parts) > 1:
            msg = f"--budget-ms {text!r}: {part!r} has no share (write BUDGET:SHARE, e.g. 150:0.6,300:0.4)"
            raise SimulateOptionError(msg)
        (value,) = parse_numbers("--budget-ms", budget)
        weight = 1.0 if not sep else parse_numbers("--budget-ms", share)[0]
        mix.append((value, weight))
    total = sum(w for _, w in mix)
    if abs(total - 1.0) > 1e-6:
        msg = f"--budget-ms {text!r}: the shares sum to {total:g}, not 1"
        raise SimulateOptionError(msg)
    return tuple(mix)


def mix_name(mix: tuple[tuple[float, float], ...]) -> str:
    """The budget mix as ``--budget-ms`` spells it."""
    if len(mix) == 1:
        return f"{mix[0][0]:g}"
    return ",".join(f"{b:g}:{w:g}" for b, w in mix)


@dataclass
class SimulateConfig:
    """What ``ctrl simulate`` simulates: the run, the workload, the replicas and the deciders."""

    run: str = option("latest", help=
        "The offline run whose controller is simulated: a run id, a run directory or 'latest' (the most recently "
        "started offline run with a checkpoint). Requests draw samples from its unseen split: its held-out "
        "dataset; else, cross-fitted, its validation split (the deployed network trains on the test split too); "
        "else its test split.")
    workspace: Path | None = option(None, help="Workspace: the run, the profile and where the results go.",
                                    **WORKSPACE_CLI)
    samples: str | None = option(None, help=
        "Draw the requests from this dataset of the workspace's profile instead of the run's unseen split: a "
        "request set profiled after the run was trained, which it never learned from (you vouch for that; "
        "benchmarks/bench_simulate.py profiles its own).")
    rate: str | None = option(None, help=
        "Arrival rate in requests per second, Poisson; a list (5,10,20) simulates each. One of --rate, --load.",
        metavar="R[,R...]")
    load: str | None = option(None, help=
        "Arrival rate as a multiple of one replica's capacity (1 / the mean service time of the unseen samples at "
        "the model's full configuration, overheads included); a list simulates each. With --trace, its mean rate "
        "is rescaled to this, its bursts kept.", metavar="L[,L...]")
    trace: Path | None = option(None, help=
        "Arrival times from a file, in seconds, one per line ('#' comments and blank lines skipped), replayed "
        "from its first time (needs --load or --rate: its mean rate is rescaled to it).", is_dir=False,
        exists=True)
    budget_ms: str = option("", help=
        "The requests' latency budget in ms, or a mix of budgets with the share of requests at each "
        "(150:0.6,300:0.4). Required.", metavar="B|B:SHARE,...")
    requests: int | None = option(None, help=
        "Requests per simulated cell (default 2,000 unless --duration is given).", min=1)
    duration: float | None = option(None, help="Simulated seconds of arrivals per cell (instead of --requests).",
                                    min=0)
    replicas: int = option(1, help="Servers behind the balancer, each with its own queue, planner and controller.",
                           min=1)
    balancer: str = option("least-loaded", help=
        "How requests are spread over the replicas: round-robin, least-loaded (fewest requests pending, then "
        "the lowest index) or power-of-two (the less loaded of two drawn at random).", choices=BALANCERS)
    deciders: str = option("controller,front", help=
        "Who chooses each request's configuration, comma-separated: controller (the run's, on the server's "
        "code), cheapest (the configuration with the smallest reference latency), static:C/K/B (fixed knobs), "
        "front (every configuration on the profile's accuracy-latency front, each as a static).")
    target: float | None = option(None, help=
        "A within-budget share (0.95): per decider and cell, find the fewest replicas (up to --max-replicas) "
        "that meet it, instead of simulating --replicas.", min=0, max=1)
    max_replicas: int = option(64, help="The most replicas --target tries.", min=1)
    latency_scale: float | None = option(None, help=
        "This machine's model time over the profile's (default: measured from --calibrate-from, else 1).", min=0)
    service_noise: float | None = option(None, help=
        "The spread of a request's model time around its sample's recorded one: the standard deviation of its "
        "log (0.2: about a fifth); each request's time is drawn log-normal about its sample's, the same draw for "
        "every decider. Default: what --calibrate-from's log holds beyond the samples' own spread, else 0.",
        min=0)
    client_ms: float = option(0.0, help=
        "Time per request outside the server's clock, added to every client latency: the client's connection, "
        "upload and read of the reply (ms; the request log does not see it).", min=0)
    calibrate_from: Path | None = option(None, help=
        "A workspace or a request log (requests/*.jsonl) of `ctrl serve` on the machine to simulate: the fixed "
        "per-request costs (parse, stage 1, preprocessing per crops, stage 2, reply) are its medians, and the "
        "latency scale its median model time over the profile's. Default: the profile alone (no fixed costs).",
        exists=True)
    max_queue: int = option(SERVE_DEFAULT_MAX_QUEUE, help="As `ctrl serve --max-queue`: the 503 queue bound.",
                            min=0)
    queue_deadline: float = option(SERVE_DEFAULT_QUEUE_DEADLINE, help=
        "As `ctrl serve --queue-deadline`: a request that has spent this many times its budget when its turn "
        "comes is dropped (504); 0: never.", min=0)
    met_target: float = option(SERVE_DEFAULT_MET_TARGET, help=
        "As `ctrl serve --met-target`: the within-budget share the budget margins aim at (0: margins pinned at "
        "1).", min=0, max=1)
    seed: int = option(0, help="Seeds the arrivals, the samples drawn and the budgets of a mix.")
    jobs: int = option(0, help=
        "Worker processes that simulate cells side by side, one thread each; the results are the same whatever "
        "the number. 0: one per CPU this process may use, up to the number of cells, where the cells hold at "
        f"least {PARALLEL_MIN_REQUESTS:,} requests for the controller to decide (a static's count "
        f"{STATIC_REQUEST_WEIGHT:.3g}); else none, as starting them takes seconds.", min=0)
    plot: Path | None = option(None, help=
        "Write the within-budget share against the arrival rate, one line per decider, to this PNG.")

    def __post_init__(self) -> None:
        if self.workspace is not None:
            self.workspace = Path(self.workspace)
        if not str(self.budget_ms).strip():
            msg = "--budget-ms is required: a budget in ms (150) or a mix (150:0.6,300:0.4)"
            raise SimulateOptionError(msg)
        self.budgets = parse_budget_mix(self.budget_ms)
        if self.rate is None and self.load is None:
            msg = "give --rate (requests per second) or --load (a multiple of one replica's capacity)"
            raise SimulateOptionError(msg)
        if self.rate is not None and self.load is not None:
            msg = "give --rate or --load, not both"
            raise SimulateOptionError(msg)
        self.rates = parse_numbers("--rate", self.rate) if self.rate is not None else ()
        self.loads = parse_numbers("--load", self.load) if self.load is not None else ()
        if self.requests is not None and self.duration is not None:
            msg = "give --requests or --duration, not both"
            raise SimulateOptionError(msg)
        if self.requests is not None and (isinstance(self.requests, bool) or self.requests < 1):
            msg = f"--requests must be a positive integer, got {self.requests!r}"
            raise SimulateOptionError(msg)
        if self.duration is not None and not (math.isfinite(self.duration) and self.duration > 0):
            msg = f"--duration must be a number of seconds > 0, got {self.duration!r}"
            raise SimulateOptionError(msg)
        if self.requests is None and self.duration is None:
            self.requests = 2000
        if isinstance(self.replicas, bool) or self.replicas < 1:
            msg = f"--replicas must be a positive integer, got {self.replicas!r}"
            raise SimulateOptionError(msg)
        if self.requests is not None and self.target is None and self.replicas > self.requests:
            msg = f"--replicas {self.replicas} is more than the {self.requests} requests simulated"
            raise SimulateOptionError(msg)
        if self.balancer not in BALANCERS:
            msg = f"--balancer must be one of {', '.join(BALANCERS)}, got {self.balancer!r}"
            raise SimulateOptionError(msg)
        if self.target is not None and not 0 < self.target <= 1:
            msg = f"--target must be a share in (0, 1], got {self.target!r}"
            raise SimulateOptionError(msg)
        if not 0 <= self.met_target < 1:
            msg = f"--met-target must be in [0, 1), got {self.met_target!r}"
            raise SimulateOptionError(msg)
        if self.latency_scale is not None and not (math.isfinite(self.latency_scale) and self.latency_scale > 0):
            msg = f"--latency-scale must be a number > 0, got {self.latency_scale!r}"
            raise SimulateOptionError(msg)
        if not (math.isfinite(self.client_ms) and self.client_ms >= 0):
            msg = f"--client-ms must be a number of ms >= 0, got {self.client_ms!r}"
            raise SimulateOptionError(msg)
        if self.service_noise is not None and not (math.isfinite(self.service_noise) and 0 <= self.service_noise <= 2):
            msg = f"--service-noise must be a log standard deviation in [0, 2], got {self.service_noise!r}"
            raise SimulateOptionError(msg)
        if isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 0:
            msg = f"--jobs must be an integer >= 0 (0: as many as the CPUs and cells allow), got {self.jobs!r}"
            raise SimulateOptionError(msg)
        self.decider_specs = parse_deciders(self.deciders)


def parse_deciders(text: str) -> tuple[str, ...]:
    """The ``--deciders`` list, each checked: controller, cheapest, front, static:C/K/B."""
    specs = [s.strip() for s in str(text).split(",") if s.strip()]
    if not specs:
        msg = "--deciders: name at least one of controller, cheapest, front, static:C/K/B"
        raise SimulateOptionError(msg)
    for spec in specs:
        if spec in ("controller", "cheapest", "front"):
            continue
        kind, _, knobs = spec.partition(":")
        parts = knobs.split("/")
        if kind != "static" or len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            msg = (f"--deciders: {spec!r} is not controller, cheapest, front or static:C/K/B "
                   "(crops/top-K/blocks, e.g. static:4/8/16)")
            raise SimulateOptionError(msg)
    return tuple(dict.fromkeys(specs))
