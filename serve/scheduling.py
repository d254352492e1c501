"""The server's decisions around the model, on any clock: admission, the queue, the drops, the budget
plan, the two decisions and what each finished request teaches the planner and the cost model.

:class:`Scheduler` holds the decider, the :class:`serve.budget.BudgetPlanner` and the
:class:`serve.queueing.DeadlineQueue`, and reads time only through the clock it is given. The
engine (:mod:`serve.engine`) runs it on ``time.perf_counter`` beside the model; a simulation runs
the same object on a virtual clock, with each request's time on the model drawn from a profile,
so that what it predicts is what this code does, not a model of it.

A job is anything with the fields of :class:`Scheduled` (the engine's ``Job``, a simulated request).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from pipeline.knobs import Config
from serve.budget import BudgetPlan, BudgetPlanner
from serve.deciders import CheapestConfig, RequestDecider, Stage1Choice, Stage2Inputs
from serve.protocol import RequestError
from serve.queueing import DeadlineQueue, projected_start_ms


def milliseconds(value: float) -> str:
    """``value`` ms for a message: whole milliseconds, or three significant digits below ten."""
    return f"{value:,.0f} ms" if value >= 10 else f"{value:.3g} ms"


class Scheduled(Protocol):
    """What the scheduler reads of a request."""

    arrival: float  # clock seconds
    budget_ms: float
    budget_source: str  # request | default
    queue_length: int  # requests pending when it arrived
    unreachable: bool  # admitted although unreachable (``when_unreachable: run``)

    @property
    def fixed(self) -> bool: ...  # its knobs are its own

    @property
    def when_unreachable(self) -> str: ...  # refuse | run


class DeadlineExceeded(RequestError):
    """A request dropped from the queue: its budget had long passed before the model could start it."""

    def __init__(self, spent_ms: float, budget_ms: float, factor: float) -> None:
        super().__init__(504, f"the request waited {milliseconds(spent_ms)} for the model, more than {factor:g} x "
                              f"its latency budget of {milliseconds(budget_ms)}: dropped instead of answered that late",
                         "latency_budget_ms", "deadline_exceeded")


class BudgetLeftBehind(RequestError):
    """Dropped from the queue: what is left of its budget is less than the cheapest configuration takes."""

    def __init__(self, spent_ms: float, budget_ms: float, cheapest_ms: float) -> None:
        super().__init__(504, f"the request waited {milliseconds(spent_ms)} for the model; what is left of its latency "
                              f"budget of {milliseconds(budget_ms)} is less than the cheapest configuration's "
                              f"{milliseconds(cheapest_ms)}: dropped instead of answered late", "latency_budget_ms",
                         "budget_unreachable")


class Overloaded(RequestError):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(503, f"the server is at capacity (queue full); retry in {retry_after_s} s", None,
                         "queue_full")
        self.retry_after_s = retry_after_s


class BudgetUnreachable(Overloaded):
    """Refused on arrival: the requests ahead of it, each at the cheapest configuration, leave too little of
    its budget for even the cheapest configuration (HTTP 503, Retry-After: when the queue will have drained)."""

    def __init__(self, wait_ms: float, budget_ms: float, retry_after_s: int) -> None:
        RequestError.__init__(self, 503, f"the requests ahead of this one need {milliseconds(wait_ms)} of the model "
                                         f"at the least, which leaves too little of its latency budget of "
                                         f"{milliseconds(budget_ms)} for any configuration; retry in "
                                         f"{retry_after_s} s", "latency_budget_ms", "budget_unreachable")
        self.retry_after_s = retry_after_s


class Scheduler:
    """Admission, the queue and the decisions of one server (one worker), on ``clock`` (seconds).

    ``occupancy``: the share of a request's time on the worker that it holds the worker alone (1 one
    request at a time; the batched server's measured share). The other options are ``ctrl serve``'s
    (:class:`serve.config.ServeConfig`)."""

    def __init__(self, decider: RequestDecider, planner: BudgetPlanner, *, clock: Callable[[], float],
                 max_queue: int, max_batch: int = 1, queue_deadline: float = 0.0, refuse_unreachable: bool = True,
                 guard: bool = True, occupancy: Callable[[], float] = lambda: 1.0) -> None:
        self.decider, self.planner, self.clock = decider, planner, clock
        # below every configuration's reference latency the controller would extrapolate
        self.cheapest = CheapestConfig(decider) if decider.reference_latency_ms else None
        self.max_queue, self.max_batch = int(max_queue), int(max_batch)
        self.queue_deadline = float(queue_deadline)
        self.refuse_unreachable, self.guard = bool(refuse_unreachable), bool(guard)
        self.occupancy = occupancy
        # the worker's share of the cheapest configuration's time (the reply's write is the handler's)
        self.queue: DeadlineQueue = DeadlineQueue(self.cheapest_worker_ms, clock)
        #: clock seconds when the worker took the request it runs (None: idle)
        self.running_since: float | None = None

    # -- the queue's state
    def cheapest_worker_ms(self) -> float | None:
        """The least the cheapest configuration typically takes on the worker (less the reply's write:
        :meth:`serve.budget.BudgetPlanner.cheapest_least_ms`)."""
        typical = self.planner.cheapest_least_ms()
        return None if typical is None else typical[0] - typical[1]

    def running_left_ms(self, now: float, worker_ms: float) -> float:
        """The least the running request may still take: the least the cheapest configuration takes on the
        worker, ``worker_ms``, less the time it has run (0 when none runs)."""
        since = self.running_since
        return 0.0 if since is None else max(0.0, worker_ms - (now - since) * 1000.0)

    def waiting_left_ms(self, now: float) -> list[float]:
        """The budget not yet spent of each request waiting now, in the order they will be served."""
        return [j.budget_ms - (now - j.arrival) * 1000.0 for j in self.queue.snapshot()]

    def full(self, taken: int) -> bool:
        """Whether a request finding ``taken`` places taken (those running, the rest waiting or having their
        bodies read) is refused: ``max_queue + max_batch`` is the bound."""
        return taken >= self.max_queue + self.max_batch

    # -- admission and drops
    def arrived(self, job: Scheduled) -> None:
        """A request reached the server (at ``job.arrival``, not when parsed): the planner's arrivals."""
        adjustable = not job.fixed and self.planner.class_of(job.budget_ms) > 0
        self.planner.observe_arrival(job.arrival, adjustable, job.budget_ms)

    def droppable(self, job: Scheduled, cheapest_ms: float) -> bool:
        """Whether the queue drops ``job`` once what is left of its budget is less than ``cheapest_ms``."""
        return (self.refuse_unreachable and job.budget_source == "request" and job.when_unreachable == "refuse"
                and not job.unreachable and cheapest_ms <= job.budget_ms)

    def admit(self, job: Scheduled) -> None:
        """Raise :class:`BudgetUnreachable` for a request with a budget of its own (its knobs the
        controller's or its own) when the server is busy and the requests to be served before it (the one
        running, less what it has run; those waiting with earlier deadlines, at the cheapest
        configuration) would leave less of its budget than the cheapest configuration takes. Every time
        is the least the cheapest configuration typically takes, so that a request is refused only where
        even that leaves it no room. A request that asked to run anyway is marked ``unreachable``."""
        if not self.refuse_unreachable or job.budget_source != "request":
            return
        typical = self.planner.cheapest_least_ms()
        if typical is None:
            return
        cheapest, worker = typical[0], typical[0] - typical[1]
        worker *= self.occupancy()  # what each one ahead holds the worker for
        now = self.clock()
        ahead = self.queue.ahead_of(job.arrival + job.budget_ms / 1000.0)
        # those ahead that will be dropped when their turn comes take no time
        wait_ms = projected_start_ms([(j.arrival - now) * 1000.0 + j.budget_ms for j in ahead],
                                     [self.droppable(j, cheapest) for j in ahead],
                                     self.running_left_ms(now, worker), worker, cheapest)
        if wait_ms <= 0:  # an idle server runs it, whatever its budget
            return
        spent_ms = (now - job.arrival) * 1000.0
        if spent_ms + wait_ms + cheapest <= job.budget_ms:
            return
        if job.when_unreachable == "run":
            job.unreachable = True
            return
        backlog_ms = self.running_left_ms(now, worker) + len(self.queue) * worker
        raise BudgetUnreachable(wait_ms, job.budget_ms, max(1, math.ceil(backlog_ms / 1000.0)))

    def expired(self, job: Scheduled) -> RequestError | None:
        """The job's :class:`DeadlineExceeded` when it has spent more than ``queue_deadline`` times its
        budget, or its :class:`BudgetLeftBehind` when it would be refused on arrival now (:meth:`admit`'s
        requests: what is left of its budget is less than the cheapest configuration's expected time);
        None when it is still worth running."""
        spent_ms = (self.clock() - job.arrival) * 1000.0
        typical = self.planner.cheapest_least_ms()
        cheapest = None if typical is None else typical[0]
        # a request that found the server idle runs, as on arrival: what it spent is its own parsing
        if (cheapest is not None and job.queue_length > 0 and self.droppable(job, cheapest)
                and job.budget_ms < spent_ms + cheapest):
            return BudgetLeftBehind(spent_ms, job.budget_ms, cheapest)
        if not self.queue_deadline or spent_ms <= self.queue_deadline * job.budget_ms:
            return None
        return DeadlineExceeded(spent_ms, job.budget_ms, self.queue_deadline)

    # -- the decisions
    def plan(self, job: Scheduled, spent_ms: float, now: float, *, batch_factor: float = 1.0,
             batch_rows_expected: int | None = None) -> BudgetPlan:
        """The budget plan of a request at stage 1 (:meth:`serve.budget.BudgetPlanner.plan`), the requests
        waiting behind it read off the queue."""
        fixed = job.fixed
        return self.planner.plan(job.budget_ms, spent_ms, now_s=now, fixed=fixed,
                                 waiting_left_ms=() if fixed else self.waiting_left_ms(now),
                                 batch_factor=batch_factor, batch_rows_expected=batch_rows_expected,
                                 occupancy=self.occupancy())

    def decider_for(self, job: Scheduled, plan: BudgetPlan, decider: RequestDecider) -> RequestDecider:
        """Who decides the request: the cheapest configuration where its plan says so (or it was admitted
        unreachable), else ``decider`` (the server's, or the request's own knobs)."""
        if (plan.cheapest or (job.unreachable and not job.fixed)) and self.cheapest:
            return self.cheapest
        return decider

    def stage1(self, decider: RequestDecider, lang: torch.Tensor, tiling: torch.Tensor, budget_ms: float,
               prompt_tokens: float = math.nan) -> Stage1Choice:
        """Stage 1 of ``decider`` at ``budget_ms`` (the controller's units); the prompt's tokens where the
        server's own decider reads them."""
        if decider.reads_prompt_tokens and decider is self.decider:
            return decider.stage1(lang, tiling, budget_ms, prompt_tokens=prompt_tokens)
        return decider.stage1(lang, tiling, budget_ms)

    def stage2_inputs(self, plan: BudgetPlan, lang: torch.Tensor, tiling: torch.Tensor, budget_ms: float,
                      image_feature: torch.Tensor | None, latency_token: torch.Tensor | None = None,
                      prompt_tokens: float = math.nan,
                      batch_factor_of: Callable[[Config], float] | None = None) -> Stage2Inputs:
        """What stage 2 reads at ``budget_ms`` (controller ms). The guard holds the choice to the budget read
        before the batch's factor (served ms): the factor applies per configuration there (``batch_factor_of``)."""
        unbatched = budget_ms * plan.batch_factor if batch_factor_of is not None else budget_ms
        served = unbatched * plan.latency_scale if self.guard else None
        return Stage2Inputs(lang, tiling, budget_ms, image_feature, latency_token, served_budget_ms=served,
                            prompt_tokens=prompt_tokens, batch_factor_of=batch_factor_of)

    # -- what a request teaches
    def observe_served(self, decider: RequestDecider, choice: Stage1Choice, config: Config, *, fixed: bool,
                       plan: BudgetPlan | None, model_ms: float, measured_ms: float, after_ms: float,
                       service_ms: float) -> float | None:
        """A finished request's costs, told to ``decider``'s cost model (``model_ms`` as it would have run
        alone; ``measured_ms`` the controller's and the model's time) and to the planner (``after_ms``: the
        time after stage 1 outside the model's path; ``service_ms``: the worker's time on it). ``plan`` may
        be None for a request at its own knobs (``fixed``). Returns the model time over the configuration's
        reference (None: no reference)."""
        ratio = decider.cost.observe(choice.cost_grid, config, model_ms=model_ms, measured_ms=measured_ms,
                                     insertion_position=choice.insertion_position)
        adjustable = not fixed and plan.budget_class != "<1x"
        self.planner.observe_served(after_ms=after_ms, adjustable=adjustable, service_ms=service_ms,
                                    model_over_reference=ratio)
        return ratio

    def observe_end(self, status: str, budget_ms: float, *, controller: bool, total_ms: float | None = None,
                    plan: BudgetPlan | None = None) -> None:
        """How a request ended (``ok``, ``refused``, ``dropped``, ...), for the budget margins and the floor;
        ``controller``: the server's decider was to decide it (not the request's own knobs)."""
        if not controller:
            return
        if status == "ok" and total_ms is not None and plan is not None:
            # judged on the client's clock: the reply's time comes after the server's total
            kept = total_ms + plan.reply_reserve_ms <= budget_ms
            self.planner.observe_outcome(plan, kept)
            self.planner.observe_kept(budget_ms, kept)  # the floor's own decisions too: it stops once they keep up
        elif status in ("refused", "dropped"):
            self.planner.observe_refused(budget_ms)
