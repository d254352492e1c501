"""A discrete-event simulation of ``ctrl serve`` replicas on a virtual clock, running the server's own code.

Each replica is a :class:`serve.scheduling.Scheduler` (the engine's admission, earliest-deadline queue,
drops, budget planner and decisions) with its own planner, latency scale and controller, on the
simulation's clock. What the model would do is the only part not run: a request's model time is the
profile's recorded latency of its sample at the configuration chosen, times the machine's latency scale,
and its answer's score is the profile's score there. The fixed costs around the model
(:class:`simulate.calibration.Overheads`) come from a served request log, or are none.

A request's way, as the server takes it: it reaches a replica (the balancer's choice; a full queue
answers 503 at once), is parsed, then admitted (a budget the queue ahead leaves no room for is
refused, 503) and queued. When the worker is free it takes the next by deadline, drops one whose
budget is gone (504), else plans its budget and lets the decider choose; the request holds the worker
for its stage 1, preprocessing, model time, stage 2 and the rest, and its reply reaches the client
``reply_ms`` later. Its parse, stage 1, stage 2 and rest are one served request's of the log, drawn
per request (the same for every decider). The replica then learns what the server learns: the
latency scale, the reserves, the margins, the floor.

Only one request runs per replica at a time, as ``ctrl serve --max-batch auto`` serves.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from controller.cost import LatencyScale
from pipeline.knobs import Config
from serve.budget import BudgetPlan, BudgetPlanner
from serve.deciders import CheapestConfig, FixedKnobs, OfflineDecider, RequestDecider, Stage1Choice
from serve.scheduling import BudgetUnreachable, Scheduler
from serve.warmup import fastest_and_slowest
from simulate.calibration import Overheads
from simulate.config import SERVE_DEFAULT_MAX_QUEUE, SERVE_DEFAULT_MET_TARGET, SERVE_DEFAULT_QUEUE_DEADLINE
from simulate.profile import SimProfile


@dataclass
class SimRequest:
    """One simulated request: what the scheduler reads (:class:`serve.scheduling.Scheduled`) and how it ended."""

    index: int
    sample: int
    arrival: float  # virtual seconds: when it reached the server
    budget_ms: float
    knobs: Config | None = None  # a static decider's configuration (the request's own knobs)
    budget_source: str = "request"
    when_unreachable: str = "refuse"
    queue_length: int = 0
    unreachable: bool = False
    replica: int = -1
    #: ok | full (503, queue full) | refused (503, budget unreachable) | dropped (504)
    status: str = ""
    config: Config | None = None
    decided_by: str | None = None
    latency_ms: float = math.nan  # the client's: arrival to the reply's last byte
    model_ms: float = math.nan  # its model time (the profile's times the latency scale)
    score: float = 0.0
    plan: BudgetPlan | None = field(default=None, repr=False)
    #: from the decision to the answer: (decider, stage-1 choice, model ms, ms spent before it, worker ms)
    served: tuple | None = field(default=None, repr=False)

    @property
    def fixed(self) -> bool:
        return self.knobs is not None

    @property
    def met(self) -> bool:
        return self.status == "ok" and self.latency_ms <= self.budget_ms


@dataclass(frozen=True)
class ServerOptions:
    """The ``ctrl serve`` options a replica runs with (their defaults are the server's)."""

    max_queue: int = SERVE_DEFAULT_MAX_QUEUE
    queue_deadline: float = SERVE_DEFAULT_QUEUE_DEADLINE
    met_target: float | None = SERVE_DEFAULT_MET_TARGET


@dataclass(frozen=True)
class Workload:
    """One cell's requests: arrival times (s), samples, budgets (ms); the same for every decider."""

    arrivals: np.ndarray
    samples: np.ndarray
    budgets_ms: np.ndarray

    def __len__(self) -> int:
        return int(self.arrivals.shape[0])

    @property
    def duration_s(self) -> float:
        return float(self.arrivals[-1] - self.arrivals[0]) if len(self) > 1 else 0.0


class _Replica:
    def __init__(self, index: int, base: OfflineDecider, options: ServerOptions, clock: _Clock) -> None:
        decider = OfflineDecider(base.deployed, base.controller_run)  # its own cost model: it learns its machine
        scale = LatencyScale(decider.reference_latency_ms)
        decider.cost = decider.cost.with_scale(scale)
        planner = BudgetPlanner(decider.reference_latency_ms, scale, met_target=options.met_target)
        self.index = index
        self.scheduler = Scheduler(decider, planner, clock=clock, max_queue=options.max_queue,
                                   queue_deadline=options.queue_deadline)
        self.taken = 0  # places: bodies being read, requests waiting, the one running
        self.pending = 0  # waiting + running
        self.busy = False
        self.fixed: dict[Config, FixedKnobs] = {}  # the deciders of requests at their own knobs


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


_ARRIVE, _SUBMIT, _DONE = 0, 1, 2


class Simulation:
    """Replicas of one server configuration serving a :class:`Workload`.

    ``decider``: the run's controller (every replica gets its own copy, its cost model and planner
    fresh); ``static``: a configuration every request fixes as its own knobs instead (the server still
    runs the controller's planner, as for a request with ``knobs``)."""

    def __init__(self, profile: SimProfile, decider: OfflineDecider, overheads: Overheads, *, replicas: int = 1,
                 balancer: str = "least-loaded", options: ServerOptions | None = None, seed: int = 0,
                 warm: bool = True) -> None:
        self.profile, self.decider, self.overheads = profile, decider, overheads
        self.replicas, self.balancer = int(replicas), balancer
        self.options = options or ServerOptions()
        self.seed, self.warm = seed, warm
        configs = profile.configs
        self._fixed_limits = (max(c[1] for c in configs), max(c[2] for c in configs))
        memoize_per_question(decider.deployed)
        self._median_ms = profile.median_latency_ms()

    def run(self, workload: Workload, static: Config | None = None) -> list[SimRequest]:
        """Every request of ``workload`` simulated, in arrival order."""
        if static is not None:
            self.profile.column(static)  # a one-line error for a configuration the profile lacks
        with torch.no_grad():  # a simulation never trains: the controller's calls skip autograd
            return self._run(workload, static)

    def _run(self, workload: Workload, static: Config | None) -> list[SimRequest]:
        clock = _Clock()
        replicas = [_Replica(i, self.decider, self.options, clock) for i in range(self.replicas)]
        if self.warm:
            for replica in replicas:
                self._warm_up(replica)
        rng = np.random.default_rng(self.seed)
        # each request's own draw of the machine's noise, the same whoever decides it
        noise = np.random.default_rng([self.seed, 1]).standard_normal(len(workload))
        self._noise = np.exp(self.overheads.noise_sigma * noise)
        # and its draw of the served requests' fixed costs (a row of the log), the same whoever decides it
        rows = self.overheads.fixed_rows
        self._row = (np.random.default_rng([self.seed, 2]).integers(len(rows), size=len(workload))
                     if rows is not None and len(rows) else [None] * len(workload))
        requests = [SimRequest(i, int(s), float(t), float(b), knobs=static)
                    for i, (t, s, b) in enumerate(zip(workload.arrivals, workload.samples, workload.budgets_ms,
                                                      strict=True))]
        events: list[tuple[float, int, int, SimRequest | None, _Replica | None]] = [
            (r.arrival, _ARRIVE, r.index, r, None) for r in requests]
        heapq.heapify(events)
        sequence = len(requests)
        round_robin = 0
        lat, score = self.profile.latency_ms, self.profile.score
        over = self.overheads

        def schedule(at: float, kind: int, request: SimRequest | None, replica: _Replica) -> None:
            nonlocal sequence
            sequence += 1
            heapq.heappush(events, (at, kind, sequence, request, replica))

        def start_next(replica: _Replica) -> None:
            sched = replica.scheduler
            while True:
                job = sched.queue.get(wait=False)
                if job is None:
                    replica.busy = False
                    return
                sched.running_since = clock.now
                dropped = sched.expired(job)
                if dropped is not None:
                    job.status = "dropped"
                    sched.observe_end("dropped", job.budget_ms, controller=not job.fixed)
                    sched.running_since = None
                    replica.taken -= 1
                    replica.pending -= 1
                    continue
                replica.busy = True
                service_s = self._decide(replica, job, lat, score) / 1000.0
                schedule(clock.now + service_s, _DONE, job, replica)
                return

        while events:
            at, kind, _, request, replica = heapq.heappop(events)
            clock.now = at
            if kind == _ARRIVE:
                replica = self._balance(replicas, round_robin, rng)
                round_robin += 1
                request.replica = replica.index
                if replica.scheduler.full(replica.taken):
                    request.status = "full"
                    continue
                replica.taken += 1
                parse_ms = over.fixed(self._row[request.index])[0]
                schedule(at + parse_ms / 1000.0, _SUBMIT, request, replica)
            elif kind == _SUBMIT:
                sched = replica.scheduler
                request.queue_length = replica.pending
                replica.pending += 1
                sched.arrived(request)
                try:
                    sched.admit(request)
                except BudgetUnreachable:
                    request.status = "refused"
                    replica.pending -= 1
                    replica.taken -= 1
                    sched.observe_end("refused", request.budget_ms, controller=not request.fixed)
                    continue
                sched.queue.put(request)
                if not replica.busy:
                    start_next(replica)
            else:
                self._finish(replica, request)
                replica.taken -= 1
                replica.pending -= 1
                replica.scheduler.running_since = None
                start_next(replica)
        return requests

    # -- one request on the worker
    def _decide(self, replica: _Replica, job: SimRequest, lat: np.ndarray, score: np.ndarray) -> float:
        """Plan and decide ``job`` now (the worker has taken it); returns the worker's time on it (ms) and
        keeps what :meth:`_finish` reports."""
        sched, profile, over, now = replica.scheduler, self.profile, self.overheads, replica.scheduler.clock()
        i = job.sample
        spent_ms = (now - job.arrival) * 1000.0
        plan = sched.plan(job, spent_ms, now)
        decider: RequestDecider = sched.decider if not job.fixed else self._fixed(replica, job.knobs)
        decider = sched.decider_for(job, plan, decider)
        lang, tiling = profile.lang[i], profile.tiling[i]
        prompt = float(profile.prompt_tokens[i])
        choice = sched.stage1(decider, lang, tiling, plan.controller_budget_ms, prompt)
        image = profile.image[i] if profile.image_present[i] else None
        inputs = sched.stage2_inputs(plan, lang, tiling, plan.controller_budget_ms, image, None, prompt)
        top_k, blocks = decider.stage2(choice, inputs)
        config = (int(choice.max_crops), int(top_k), int(blocks))
        column = profile.column(config)
        model_ms = float(lat[i, column]) * over.scale(config) * self._noise[job.index]
        worker_ms = over.worker_ms(config[0], model_ms, self._row[job.index])
        job.config, job.decided_by, job.plan, job.model_ms = config, choice.decided_by, plan, model_ms
        job.score = float(score[i, column])
        job.served = (decider, choice, model_ms, spent_ms, worker_ms)
        return worker_ms

    def _finish(self, replica: _Replica, job: SimRequest) -> None:
        """The request's answer is out: what the server learns from it, and its client latency."""
        sched, over = replica.scheduler, self.overheads
        decider, choice, model_ms, spent_ms, worker_ms = job.served
        job.served = None
        total_ms = spent_ms + worker_ms
        _, stage1_ms, stage2_ms, _ = over.fixed(self._row[job.index])
        sched.observe_served(decider, choice, job.config, fixed=job.fixed, plan=job.plan, model_ms=model_ms,
                             measured_ms=stage1_ms + stage2_ms + model_ms,
                             after_ms=worker_ms - model_ms, service_ms=worker_ms)
        sched.observe_end("ok", job.budget_ms, controller=not job.fixed, total_ms=total_ms, plan=job.plan)
        sched.planner.observe_reply(over.reply_ms)
        job.status = "ok"
        job.latency_ms = total_ms + over.reply_ms + over.client_ms

    def _warm_up(self, replica: _Replica) -> None:
        """The server's warm-up (:func:`serve.warmup.warm_up`): per crops choice its fastest and slowest
        configuration by reference latency, twice, each a request at its own knobs that takes the samples'
        median latency there times the machine's scale, and teaches the latency scale and the planner's
        reserves what a served request does; then the margins are seeded from the scale."""
        sched, over = replica.scheduler, self.overheads
        decider = sched.decider
        configs = [c for m in decider.max_crops_values for c in fastest_and_slowest(decider.reference_latency_ms, m)]
        for _ in range(2):
            for config in configs:
                base = self._median_ms.get(config, decider.reference_latency_ms[config])
                model_ms = base * over.scale(config)
                worker_ms = over.worker_ms(config[0], model_ms)
                fixed = self._fixed(replica, config)
                measured_ms = over.stage1_ms + over.stage2_ms + model_ms
                sched.observe_served(fixed, Stage1Choice(config[0], 0, None, "request"), config, fixed=True,
                                     plan=None, model_ms=model_ms, measured_ms=measured_ms,
                                     after_ms=worker_ms - model_ms, service_ms=worker_ms)
        sched.planner.seed_margin(decider.cost.scale.ratios())

    def _fixed(self, replica: _Replica, config: Config) -> FixedKnobs:
        """The decider of a request at its own knobs ``config`` on ``replica`` (its cost model the server's),
        made once per configuration and replica."""
        fixed = replica.fixed.get(config)
        if fixed is None:
            knobs = {"max_crops": config[0], "top_k": config[1], "num_active_blocks": config[2]}
            fixed = replica.fixed[config] = FixedKnobs(knobs, self._fixed_limits[0], self._fixed_limits[1],
                                                       max(config[0], 1), replica.scheduler.decider.cost)
        return fixed

    def _balance(self, replicas: Sequence[_Replica], turn: int, rng: np.random.Generator) -> _Replica:
        if len(replicas) == 1:
            return replicas[0]
        if self.balancer == "round-robin":
            return replicas[turn % len(replicas)]
        if self.balancer == "power-of-two":
            a, b = rng.choice(len(replicas), size=2, replace=False)
            return replicas[a] if replicas[a].taken <= replicas[b].taken else replicas[b]
        return min(replicas, key=lambda r: (r.taken, r.index))


def memoize_per_question(deployed: torch.nn.Module) -> None:
    """Remember, per question, what the deployed controller computes from the question alone: its
    question group and its cost model's prediction at every configuration (they do not depend on the
    budget, which is all that changes between two requests of one sample). Keyed by the storage of the
    feature rows; each entry holds its rows, so that their memory is never reused for another question's
    while the entry lives. The controller's own methods compute every first call."""
    if getattr(deployed, "_ctrl_memoized", False):
        return
    group, expected = deployed.question_group, getattr(deployed, "expected_latency", None)
    groups: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    latencies: dict[tuple, tuple[tuple, tuple[torch.Tensor, ...]]] = {}

    def key(*tensors: torch.Tensor | None) -> tuple:
        return tuple((t.data_ptr(), tuple(t.shape), t.dtype) if t is not None else None for t in tensors)

    def question_group(lang: torch.Tensor) -> torch.Tensor:
        k = key(lang)
        if k not in groups:
            groups[k] = (lang, group(lang))
        return groups[k][1]

    def expected_latency(lang: torch.Tensor, tiling_crops: torch.Tensor | None = None,
                         prompt_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        # the prompt's length is a fresh one-element tensor per call: its bytes are the key (NaN included)
        k = (*key(lang, tiling_crops), None if prompt_tokens is None else prompt_tokens.numpy().tobytes())
        if k not in latencies:
            latencies[k] = ((lang, tiling_crops), expected(lang, tiling_crops, prompt_tokens))
        return latencies[k][1]

    object.__setattr__(deployed, "question_group", question_group)
    if expected is not None:
        object.__setattr__(deployed, "expected_latency", expected_latency)
    object.__setattr__(deployed, "_ctrl_memoized", True)


_MEMO_ATTRIBUTES = ("question_group", "expected_latency", "_ctrl_memoized")


def without_memo(deployed: torch.nn.Module) -> torch.nn.Module:
    """``deployed`` as it was before :func:`memoize_per_question` (the module itself where it was not memoized;
    else a shallow copy without the memo, whose functions cannot be pickled), for another process."""
    if not getattr(deployed, "_ctrl_memoized", False):
        return deployed
    clone = copy.copy(deployed)
    for name in _MEMO_ATTRIBUTES:
        clone.__dict__.pop(name, None)
    return clone


def cheapest_config(decider: OfflineDecider) -> Config:
    """The configuration the server's cheapest rule runs (the smallest reference latency)."""
    return CheapestConfig(decider).config


def full_config(profile: SimProfile) -> Config:
    """The model's full configuration among the profiled ones: the most crops, experts and blocks."""
    return max(profile.configs)


def capacity_rps(profile: SimProfile, overheads: Overheads) -> float:
    """One replica's capacity: 1 / the mean worker time of the unseen samples at :func:`full_config`."""
    config = full_config(profile)
    column = profile.column(config)
    worker = [overheads.worker_ms(config[0], float(ms) * overheads.scale(config))
              for ms in profile.latency_ms[:, column]]
    return 1000.0 / float(np.mean(worker))

