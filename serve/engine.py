"""Requests through the model behind a bounded queue: one at a time, or many decoding together.

One worker thread owns the model. With ``max_batch`` 1 it runs one request at a time; with more it
batches continuously (:meth:`Engine._run_batched`): a request's stage 1, preprocessing, prefix and
stage 2 run alone, then it joins the running batch between decode steps (``runtime.batched_decoder``,
each row with its own knobs) and leaves at its end; a request that finds the batch empty and no one
waiting runs on the single-request path. Requests wait in a queue of at most ``max_queue``; one
more is refused at once (:class:`Overloaded`, HTTP 503 with Retry-After) instead of waiting longer
than any budget. A request with a budget of its own that the requests ahead leave no room for,
even at the cheapest configuration, is refused on arrival (:class:`BudgetUnreachable`, 503), and
the waiting are served earliest deadline first (:mod:`serve.queueing`). The time a request waits
counts against its budget: stage 1 reads the budget less the time since the request arrived.
Admitted requests are preprocessed off the worker meanwhile (:mod:`serve.preprocessing`).

A request's timeline: its arrival (the HTTP handler starts), parse (body, JSON, image decode) and
queue, then its way through the model (``runtime.request.RequestExecutor``: stage 1, preprocess,
prefix, stage 2, suffix, decode steps, each timed).

Stage 1 and stage 2 read the budget :class:`serve.budget.BudgetPlanner` plans for the request
(every term in its record): the budget less the time spent so far and the reserves, capped by
the requests waiting and the arrival rate, times its budget class's margin, over the latency
scale. Where that is below every configuration's reference latency, the request takes the
fastest configuration without asking the controller (:class:`serve.deciders.CheapestConfig`).

``latency_total_ms`` runs from the arrival to the answer's text, as the client sees it but for
the response's serialisation and transfer; for a streamed request, to its last token (its text
goes to the handler part by part as it is decoded: :meth:`Job.emit`, :mod:`serve.streaming`).
Each token is the argmax, or a sample of the request's own seeded generator
(:class:`serve.decoding.TokenPicker`); a stop sequence ends the answer
(:class:`serve.decoding.TextStream`). A cancelled request (its client disconnected, or the
server was told to stop at once: :meth:`Engine.abort`) stops before the next decoder block,
stage or token: the prefill of a long prompt is cut within one block's time. A request that has
spent ``queue_deadline`` times its budget when the worker takes it from the queue is dropped
(:class:`DeadlineExceeded`) rather than run, and so is one that would be refused on arrival now
(:class:`BudgetLeftBehind`: the rest of its budget is less than the cheapest configuration takes).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import torch
from PIL import Image

from controller.cost import LatencyScale, quantile_of
from pipeline.knobs import MAX_CROPS_LIMIT, Config
from runtime import ModelRuntime
from runtime.base import ModelInputs, PrefixState, RowKnobs
from runtime.batched_decoder import BatchedDecoder, BatchRow
from runtime.request import Answer, RequestExecutor, RequestOutcome, StartedRequest
from runtime.timing import RequestTiming, Segment, StageTimer, cpu_threads
from serve.batch_cost import BatchCost
from serve.budget import BudgetPlan, BudgetPlanner
from serve.deciders import FixedKnobs, RequestDecider, Stage1Choice, Stage2Inputs
from serve.decoding import TextStream, TokenPicker, draw_seed
from serve.metrics import ServeMetrics
from serve.preprocessing import PreparedInputs, Preprocessor
from serve.protocol import ChatRequest, RequestError
from serve.request_log import RequestLog, RequestLogGone
from serve.scheduling import BudgetUnreachable, Overloaded, Scheduler

#: the budget plan's terms recorded with a request (serve.budget.BudgetPlan; the requests view's columns)
PLAN_COLUMNS = ("reserve_ms", "reply_reserve_ms", "budget_left_ms", "queue_cap_ms", "arrival_rate_rps",
                "arrival_cap_ms", "arrival_scv", "latency_scale", "budget_class", "budget_margin", "met_target",
                "feasible_rate", "floor", "controller_budget_ms", "batch_factor", "batch_rows_expected", "occupancy")
#: the measured parts of a request (request-log columns ``latency_<part>_ms``, the reply's ``ctrl.latency_ms``)
LATENCY_PARTS = ("parse", "queue", "stage1", "preprocess", "vision", "prefill", "stage2", "decode", "model", "total")


class Cancelled(Exception):
    """The client went away, or the server stops at once: the request stops where it is (the message says where)."""


@dataclass
class Job:
    """One request in flight: its input, when it arrived, and how it ends."""

    request: ChatRequest
    budget_ms: float
    budget_source: str
    arrival: float  # perf_counter at the handler's start
    arrival_time: datetime
    parse_ms: float
    queue_length: int
    request_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    cancelled: threading.Event = field(default_factory=threading.Event)
    future: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None
    enqueued: float = 0.0
    #: a streamed request's settled text, part by part, as the worker decodes it (read on ``loop``)
    deltas: asyncio.Queue[str] | None = None
    #: the sampling seed: the request's, or one drawn for it (recorded); None for greedy decoding
    seed: int | None = None
    #: the answer's tokens so far (what a cancelled request's record says it got to)
    tokens_out: int = 0
    #: admitted although the queue ahead left its budget no room (``when_unreachable: run``): it runs at the
    #: cheapest configuration
    unreachable: bool = False
    #: the model's CUDA graph captures when the request reached it (None before): its record says
    #: whether it paid one
    captures_at_start: int | None = None
    #: its inputs being prepared off the worker thread (None: the worker preprocesses it)
    prepared: PreparedInputs | None = None

    @property
    def fixed(self) -> bool:
        """Its knobs are its own (the controller does not decide it)."""
        return self.request.knobs is not None

    @property
    def when_unreachable(self) -> str:
        return self.request.when_unreachable

    def emit(self, text: str) -> None:
        """Queue a part of a streamed answer for the handler (thread-safe; never waits for the client)."""
        if self.deltas is None or self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.deltas.put_nowait, text)
        except RuntimeError:  # the event loop has closed: nobody reads any more
            pass

    def finish(self, outcome: Result | BaseException) -> None:
        """Hand the outcome to the waiting handler (thread-safe)."""
        if self.future is None or self.loop is None:
            return

        def deliver() -> None:
            if self.future is not None and not self.future.done():
                if self.cancelled.is_set():  # its handler has answered 499 and left: no one would read an exception
                    self.future.cancel()
                elif isinstance(outcome, BaseException):
                    self.future.set_exception(outcome)
                else:
                    self.future.set_result(outcome)

        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the event loop has closed: nobody waits any more
            pass


@dataclass
class Result:
    """A served request: the answer and everything measured about it."""

    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    record: dict[str, Any]

    def usage(self) -> dict[str, int]:
        """The OpenAI ``usage`` object of the answer."""
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_output_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_output_tokens}


class LogUnavailable(RequestError):
    """The request log can no longer record requests (its workspace is gone): the server takes none."""

    def __init__(self, reason: str) -> None:
        super().__init__(503, f"{reason}; this server takes no more requests: restart it on a workspace", None,
                         "request_log_unavailable")


class Slot:
    """A place in the queue, taken before a request's body is read (:meth:`Engine.reserve`): freed
    by :meth:`release` on every path that does not queue the request, by the worker once it has run."""

    def __init__(self, engine: Engine) -> None:
        self._engine: Engine | None = engine

    def hand_over(self) -> None:
        """The queued job holds the place now: the worker frees it."""
        self._engine = None

    def release(self) -> None:
        """Free the place (a no-op once freed or handed over)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine._release()


class Engine:
    """The model, the controller, the queue and the worker thread that runs requests."""

    def __init__(self, runtime: ModelRuntime, decider: RequestDecider, *, model_name: str, max_queue: int,
                 default_budget_ms: float | None, threads: int, request_log: RequestLog | None,
                 metrics: ServeMetrics | None = None, latency_scale: LatencyScale | None = None,
                 queue_aware: bool = True, met_target: float | None = None, load_aware: bool = True,
                 guard: bool = True, queue_deadline: float = 0.0, burst_aware: bool = True,
                 refuse_unreachable: bool = True, cheapest_floor: bool = False, preprocess_workers: int = 0,
                 max_batch: int = 1) -> None:
        if isinstance(max_batch, bool) or int(max_batch) < 1:
            msg = f"max_batch must be a positive integer, got {max_batch!r}"
            raise ValueError(msg)
        if int(max_batch) > 1 and not runtime.batches:
            msg = f"--max-batch {max_batch}: the {runtime.kind} runtime does not run batched generation"
            raise ValueError(msg)
        self.max_batch = int(max_batch)
        self.runtime, self.decider = runtime, decider
        self.preprocessor = Preprocessor(runtime, preprocess_workers)
        self.model_name = model_name
        self.max_queue = int(max_queue)
        self.default_budget_ms = float(default_budget_ms if default_budget_ms is not None
                                       else decider.budget_range_ms[1])
        self.threads = int(threads)
        self.log = request_log
        self.metrics = metrics if metrics is not None else ServeMetrics()
        if latency_scale is not None:  # the server's pinned or configured scale, read by the decider's cost model
            decider.cost = decider.cost.with_scale(latency_scale)
        self.latency_scale = decider.cost.scale
        planner = BudgetPlanner(decider.reference_latency_ms, self.latency_scale, met_target=met_target,
                                queue_aware=queue_aware, load_aware=load_aware, burst_aware=burst_aware,
                                cheapest_floor=cheapest_floor)
        self.scheduler = Scheduler(decider, planner, clock=time.perf_counter, max_queue=self.max_queue,
                                   max_batch=self.max_batch, queue_deadline=queue_deadline,
                                   refuse_unreachable=refuse_unreachable, guard=guard,
                                   occupancy=lambda: self.occupancy)
        self.planner, self.cheapest = planner, self.scheduler.cheapest
        self.batch_cost = BatchCost()
        # the batched worker's rows (running and joining) as the request it starts now finds them, and the
        # knobs of the request it started last (the typical choice stage 1 reckons a batch factor at)
        self._beside: list[RowKnobs] = []
        self._last_knobs: RowKnobs | None = None
        self.timer = StageTimer(runtime.vision_module, list(runtime.decoder_layers), runtime.device)
        self.executor = RequestExecutor(runtime, self.timer)
        self._jobs = self.scheduler.queue
        self._reserved = 0  # places taken: bodies being read, requests waiting, the one running
        self._pending = 0  # waiting + running
        self._lock = threading.Lock()
        self._service_s: deque[float] = deque(maxlen=50)
        self._worker: threading.Thread | None = None
        self._aborting = threading.Event()
        self.served = 0

    # -- lifecycle
    def start(self) -> None:
        self._worker = threading.Thread(target=self._run, name="ctrl-serve-worker", daemon=True)
        self._worker.start()

    def abort(self) -> None:
        """Stop at once: the running request stops before its next decoder block, the queued ones are
        not run (each recorded as cancelled); :meth:`stop` then returns within one block's time."""
        self._aborting.set()

    def stop(self) -> None:
        """Finish the queued requests (or, after :meth:`abort`, cancel them), then stop the worker and close the log."""
        if self._worker is not None:
            self._jobs.close()
            self._worker.join()
            self._worker = None
        self.timer.close()
        self.preprocessor.close()
        if self.log is not None:
            self.log.close()

    def overhead_reserve_ms(self) -> float:
        """What the rest of a request costs outside the model's profiled path (the vision pass,
        prefill and decoding): preprocessing at the chosen crops, stage 2, detokenisation, and the
        reply's serialisation and write. The controller's latencies were measured without it, so
        stage 1 reads the budget less this reserve (:meth:`serve.budget.BudgetPlanner.reserve_ms`)."""
        return sum(self.planner.reserve_ms())

    def waiting_left_ms(self, now: float) -> list[float]:
        """The budget not yet spent of each request waiting now, in the order they will be served."""
        return self.scheduler.waiting_left_ms(now)

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def occupancy(self) -> float:
        """The share of a request's time on the worker that it holds the worker alone: 1 one request at a
        time, the batched server's measured share under continuous batching (:class:`serve.batch_cost.BatchCost`)."""
        return self.batch_cost.occupancy if self.max_batch > 1 else 1.0

    # -- admission
    def budget_for(self, request: ChatRequest) -> tuple[float, str]:
        if request.budget_ms is not None:
            return request.budget_ms, "request"
        return self.default_budget_ms, "default"

    def check_room(self) -> None:
        """Raise :class:`Overloaded` when the queue is full now (before a request's image is decoded)."""
        with self._lock:
            self._refuse_if_full()

    def check_log(self, *, count: bool = True) -> None:
        """Raise :class:`LogUnavailable` when requests can no longer be recorded (the request log
        reopens a file removed while serving; a workspace removed is the end); ``count``: as a
        request refused (``rejected``)."""
        if self.log is None:
            return
        try:
            self.log.check()
        except RequestLogGone as gone:
            if count:
                self.metrics.requests.labels(status="rejected").inc()
            raise LogUnavailable(str(gone)) from None

    def reserve(self) -> Slot:
        """Take a place in the queue before a request's body is read, or raise :class:`Overloaded`:
        the bodies held at once are bounded by the queue, not by the clients."""
        with self._lock:
            self._refuse_if_full()
            self._reserved += 1
        return Slot(self)

    def _release(self, ran: bool = False) -> None:
        with self._lock:
            self._reserved -= 1
            if ran:
                self._pending -= 1
                self.metrics.queue_length.set(self._pending)

    def submit(self, job: Job, slot: Slot | None = None) -> None:
        """Queue a job in its reserved ``slot`` (the worker frees it), or in one taken now: then
        :class:`Overloaded` when ``max_queue`` requests already wait."""
        if slot is None:
            slot = self.reserve()
        slot.hand_over()
        with self._lock:
            self._pending += 1
            self.metrics.queue_length.set(self._pending)
        job.enqueued = time.perf_counter()
        self.scheduler.arrived(job)
        try:
            self.scheduler.admit(job)
        except BudgetUnreachable as refused:
            self._release(ran=True)
            self._record(job, "refused", queue_ms=0.0, error=refused.message)
            raise
        job.prepared = self.preprocessor.prepare(job.request.image, job.request.question, self._crops_choices(job))
        self._jobs.put(job)

    def _crops_choices(self, job: Job) -> tuple[int, ...]:
        """The max_crops values stage 1 may choose for the job (its own where it fixed its knobs)."""
        if job.request.knobs is not None:
            return (job.request.knobs["max_crops"],)
        return tuple(int(m) for m in self.decider.max_crops_values)

    def _refuse_if_full(self) -> None:
        """(under ``_lock``) :class:`Overloaded` when ``max_queue + max_batch`` places are taken (those
        running, the rest waiting or having their bodies read)."""
        if self.scheduler.full(self._reserved):
            self.metrics.requests.labels(status="rejected").inc()
            raise Overloaded(self._retry_after(self._reserved))

    def _retry_after(self, pending: int) -> int:
        typical = quantile_of(self._service_s, 0.5, empty=1.0)
        return max(1, math.ceil(pending * typical))

    # -- the worker
    def _run(self) -> None:
        with cpu_threads(self.threads, self.runtime.device):
            if self.max_batch > 1:
                self._run_batched()
                return
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                started = self.scheduler.running_since = time.perf_counter()
                outcome: Result | BaseException
                expired = self._expired(job)
                try:
                    outcome = expired or self.execute(job)
                except BaseException as exc:  # every failure goes back to its request, the worker lives on
                    outcome = exc
                finally:  # the slot is free before the answer leaves: a client's next request finds room
                    if expired is None:  # a drop takes no model time: the typical service is of requests run
                        self._service_s.append(time.perf_counter() - started)
                    self.scheduler.running_since = None
                    self._done(job)
                job.finish(outcome)

    def _done(self, job: Job) -> None:
        """A request has left the worker: its place and its prepared inputs are free."""
        self._release(ran=True)
        if job.prepared is not None:
            job.prepared.release()

    # -- the batched worker
    def _run_batched(self) -> None:
        """Continuous batching: requests join the running batch between decode steps (each one's stage 1,
        preprocessing, prefix and stage 2 alone, then its prefill with the others joining at that step),
        every live row advances one token per step, a row leaves at its end."""
        batch = self._new_batch()
        rows: dict[int, _BatchedRequest] = {}
        while True:
            joining: list[_BatchedRequest] = []
            while len(rows) + len(joining) < self.max_batch:
                job = self._jobs.get(wait=not rows and not joining)
                if job is None:
                    break
                alone = not rows and not joining and not len(self._jobs)
                self._beside = [] if alone else [
                    *(r.row.knobs for r in rows.values() if not r.row.done), *(r.knobs for r in joining)]
                started = self._start_row(job)
                if started is not None:
                    joining.append(started)
            if not rows and not joining:  # the queue waited, and was closed empty
                return
            self.scheduler.running_since = time.perf_counter()
            if not rows and len(joining) == 1 and not len(self._jobs):
                # alone with nobody waiting: the single-request path (the fast path's decode step is
                # faster than a batch of one row); those arriving meanwhile wait and join the next batch
                self._answer_alone(joining[0])
                self.scheduler.running_since = None
                continue
            try:
                if joining:
                    self._join(batch, joining, rows)
                stepping = []
                for r in rows.values():
                    if r.row.done:
                        continue
                    if r.job.cancelled.is_set() or self._aborting.is_set():
                        r.row.cancel()  # out before the step's first block: not one of its rows
                    else:
                        stepping.append(r)
                if batch.live:
                    knobs = [r.row.knobs for r in stepping]
                    predicted = self.batch_cost.step_ms(knobs)  # before this step joins the fit
                    tick = time.perf_counter()
                    with self.runtime.batch_context():
                        batch.step()
                    wall_ms = (time.perf_counter() - tick) * 1000.0
                    self.batch_cost.observe_step(knobs, wall_ms)
                    for r in stepping:
                        alone = self.batch_cost.alone_ms(r.knobs)
                        r.stepped(wall_ms, len(stepping),
                                  None if predicted is None or alone is None else min(1.0, alone / predicted))
            except BaseException as exc:  # a pass failed: every row in it ends with the error, the worker lives on
                for r in {id(r): r for r in [*rows.values(), *joining]}.values():
                    self._end_row(r, None if r.row is not None and r.row.done else exc)
                rows.clear()
                batch = self._new_batch()
                continue
            for key in [k for k, r in rows.items() if r.row.done]:
                self._end_row(rows.pop(key))
            if not rows:
                self.scheduler.running_since = None

    def _new_batch(self) -> BatchedDecoder:
        batch = self.runtime.batch_decoder()
        batch.count_products = False  # a count for tests, not for serving
        return batch

    def _start_row(self, job: Job) -> _BatchedRequest | None:
        """A request taken from the queue, up to its row: dropped, failed (finished here: None) or started."""
        expired = self._expired(job)
        if expired is not None:
            self._done(job)
            job.finish(expired)
            return None
        queue_ms = (time.perf_counter() - job.enqueued) * 1000.0 if job.enqueued else 0.0
        served = _Decisions(self, job)
        job.captures_at_start = self.runtime.graph_captures
        tick = time.perf_counter()
        try:
            waited_ms = self._begin(job, True)
            started = self.executor.start(served.stage1, served.inputs, served.stage2,
                                          check=lambda block: self._check(job, block))
        except BaseException as exc:
            self._failed(job, exc, queue_ms, True)
            self._service_s.append(time.perf_counter() - tick)
            self._done(job)
            job.finish(exc)
            return None
        knobs = self.runtime.knobs_after_prefix(started.prefix.insertion_position, started.top_k,
                                                started.num_active_blocks)
        if not served.fixed:
            self._last_knobs = knobs
        return _BatchedRequest(job, served, started, queue_ms, waited_ms, _text_stream(self.runtime, job), tick,
                               knobs, (time.perf_counter() - tick) * 1000.0)

    def _answer_alone(self, r: _BatchedRequest) -> None:
        """A started request answered on the single-request path, as the one-at-a-time worker answers it."""
        job = r.job
        outcome: Result | BaseException
        try:
            run = self._complete(job, r.started, r.streamed)
            outcome = self._answered(job, r.served, run, r.streamed, queue_ms=r.queue_ms, waited_ms=r.waited_ms,
                                     record=True, batch_rows=(1, 1.0 if len(run.tokens) > 1 else None))
        except BaseException as exc:
            self._failed(job, exc, r.queue_ms, True)
            outcome = exc
        self._service_s.append(time.perf_counter() - r.started_at)
        self._done(job)
        job.finish(outcome)

    def _join(self, batch: BatchedDecoder, joining: list[_BatchedRequest], rows: dict[int, _BatchedRequest]) -> None:
        """Prefill the joining requests together (the live rows wait for that pass) and pick their first tokens."""
        runtime = self.runtime
        embeds, prefixes, knobs, limits, picks, untils = [], [], [], [], [], []
        for r in joining:
            req, started = r.job.request, r.started
            hidden, prefix = runtime.row_prefix(started.prefix)
            embeds.append(hidden)
            prefixes.append(prefix)
            knobs.append(r.knobs)
            limits.append(req.max_tokens)
            picks.append(TokenPicker(req.temperature, req.top_p, r.job.seed, runtime.device))
            untils.append(r.streamed.push if r.streamed is not None else None)
        tick = time.perf_counter()
        with runtime.batch_context():
            joined = batch.join(embeds, knobs, limits, pick=picks, until=untils, prefixes=prefixes)
        wall_ms = (time.perf_counter() - tick) * 1000.0
        for r, row in zip(joining, joined, strict=True):
            r.joined(row, wall_ms, len(joining))
            rows[row.index] = r

    def _end_row(self, r: _BatchedRequest, failure: BaseException | None = None) -> None:
        """A row that left the batch: its answer (or why it has none) to its request."""
        job, outcome = r.job, failure
        if outcome is None and r.row.finish_reason == "cancelled":
            why = "the server was stopped at once" if self._aborting.is_set() else "the client disconnected"
            outcome = Cancelled(f"{why} while decoding, after {len(r.row.tokens)} token"
                                f"{'s' if len(r.row.tokens) != 1 else ''} of the answer")
        if outcome is not None:
            self._failed(job, outcome, r.queue_ms, True)
        else:
            try:
                outcome = self._answered_row(r)
            except BaseException as exc:
                outcome = exc
        self._service_s.append(time.perf_counter() - r.started_at)
        self._done(job)
        job.finish(outcome)

    def _answered_row(self, r: _BatchedRequest) -> Result:
        started, row = r.started, r.row
        tokens = list(row.tokens)
        timing = self.timer.resolve(started.timing)
        # the shared passes' walls, as the request's own suffix and decode segments
        timing.segments.append(Segment("suffix", blocks_calls=len(row.knobs.blocks), wall_ms=r.prefill_ms,
                                       blocks_ms=r.prefill_ms))
        timing.segments.extend(Segment("decode", blocks_calls=len(row.knobs.blocks), wall_ms=ms)
                               for ms in r.step_ms[:max(len(tokens) - 1, 0)])
        outcome = RequestOutcome(started.decision, started.inputs, started.top_k, started.num_active_blocks,
                                 Answer(tokens, row.knobs.blocks), timing)
        rows = (r.prefill_rows, sum(r.step_rows) / len(r.step_rows) if r.step_rows else None)
        return self._answered(r.job, r.served, outcome, r.streamed, queue_ms=r.queue_ms, waited_ms=r.waited_ms,
                              record=True, batch_rows=rows, batched=r)

    def _expired(self, job: Job) -> RequestError | None:
        """The job's drop (:meth:`serve.scheduling.Scheduler.expired`), recorded as ``dropped``; None when it
        is still worth running."""
        dropped = self.scheduler.expired(job)
        if dropped is None:
            return None
        spent_ms = (time.perf_counter() - job.arrival) * 1000.0
        queue_ms = (time.perf_counter() - job.enqueued) * 1000.0 if job.enqueued else 0.0
        self._record(job, "dropped", queue_ms=queue_ms, waited_ms=spent_ms, error=dropped.message)
        return dropped

    def execute(self, job: Job, *, record: bool = True) -> Result:
        """Run one request on the model (the worker thread's work; tests and the warm-up call it directly)."""
        runtime = self.runtime
        queue_ms = (time.perf_counter() - job.enqueued) * 1000.0 if job.enqueued else 0.0
        served = _Decisions(self, job)
        job.captures_at_start = runtime.graph_captures
        try:
            waited_ms = self._begin(job, record)
            streamed = _text_stream(runtime, job)
            started = self.executor.start(served.stage1, served.inputs, served.stage2,
                                          check=lambda block: self._check(job, block))
            outcome = self._complete(job, started, streamed)
        except BaseException as exc:
            self._failed(job, exc, queue_ms, record)
            raise
        return self._answered(job, served, outcome, streamed, queue_ms=queue_ms, waited_ms=waited_ms, record=record)

    def _complete(self, job: Job, started: StartedRequest, streamed: TextStream | None) -> RequestOutcome:
        """A started request's answer on the single-request path."""
        req = job.request
        pick = TokenPicker(req.temperature, req.top_p, job.seed, self.runtime.device)
        return self.executor.complete(
            started, max_tokens=req.max_tokens, pick=pick,
            until=streamed.push if streamed is not None else None, check=lambda block: self._check(job, block),
            on_token=lambda tokens: setattr(job, "tokens_out", tokens))

    def _begin(self, job: Job, record: bool) -> float:
        """The checks before a request reaches the model; what it waited (ms since it arrived)."""
        if record:  # a request queued when the workspace went: refused before the model runs it
            self.check_log()
        self._check(job)
        return (time.perf_counter() - job.arrival) * 1000.0

    def _failed(self, job: Job, exc: BaseException, queue_ms: float, record: bool) -> None:
        """Record a request that did not finish (a cancellation, an error; a refusal is recorded where it is made)."""
        if not record or isinstance(exc, RequestError):
            return
        if isinstance(exc, Cancelled):
            self._record(job, "cancelled", queue_ms=queue_ms, error=str(exc))
        elif isinstance(exc, Exception):
            self._record(job, "error", queue_ms=queue_ms, error=f"{type(exc).__name__}: {exc}")

    def _answered(self, job: Job, served: _Decisions, outcome: RequestOutcome, streamed: TextStream | None, *,
                  queue_ms: float, waited_ms: float, record: bool,
                  batch_rows: tuple[int, float | None] | None = None, batched: _BatchedRequest | None = None) -> Result:
        """A finished request: its text (``streamed``'s where it was decoded token by token), what it
        cost told to the cost model, the batch cost and the planner, its record, its result.
        ``batch_rows``: the rows of its batch at its prefill and their mean over its decode steps;
        ``batched``: its row's account where it ran in a batch."""
        runtime, tokens, plan, decider = self.runtime, outcome.tokens, served.plan, served.decider
        text = streamed.finish() if streamed is not None else runtime.decode_text(tokens)
        stop_hit = streamed.stop_hit if streamed is not None else None
        total_ms = (time.perf_counter() - job.arrival) * 1000.0
        choice, top_k, blocks, parts = outcome.stage1, outcome.top_k, outcome.num_active_blocks, outcome.parts
        p, guarded_from = choice.insertion_position, choice.guarded_from
        service_ms = (time.perf_counter() - served.started) * 1000.0
        # the scale reads a batched request's model time as it would have run alone: the batch factor is
        # applied on top of the scale, not learnt into it
        alone_model_ms = parts.model_ms
        if batched is not None:
            alone_model_ms += batched.alone_decode_ms() - parts.decode_ms
            # the decode share as alone: the batch factor multiplies its decode steps from there
            self.batch_cost.observe_request(model_ms=alone_model_ms, decode_ms=batched.alone_decode_ms(),
                                            start_ms=batched.start_ms, exclusive_ms=batched.exclusive_ms(),
                                            worker_ms=service_ms)
        else:
            if parts.decode_step_ms and self.max_batch > 1:
                knobs = runtime.knobs_after_prefix(p, top_k, blocks)
                for step_ms in parts.decode_step_ms:
                    self.batch_cost.observe_alone(knobs, step_ms)
            self.batch_cost.observe_request(model_ms=parts.model_ms, decode_ms=parts.decode_ms, worker_ms=service_ms)
        # the scale counts the layout the reference latencies were recorded for (insertion position 0)
        self.scheduler.observe_served(decider, choice, (choice.max_crops, top_k, blocks), fixed=served.fixed,
                                      plan=plan, model_ms=alone_model_ms,
                                      measured_ms=parts.controller_ms + parts.model_ms,
                                      after_ms=total_ms - served.spent_ms - parts.model_ms, service_ms=service_ms)
        knobs = {"max_crops": choice.max_crops, "insertion_position": p, "top_k": top_k,
                 "num_active_blocks": blocks}
        latency = {
            "parse": job.parse_ms, "queue": queue_ms, "stage1": parts.stage1_ms, "preprocess": parts.preprocess_ms,
            "vision": parts.vision_ms, "prefill": parts.prefill_ms, "stage2": parts.stage2_ms,
            "decode": parts.decode_ms, "model": parts.model_ms, "total": total_ms,
        }
        finish = "stop" if stop_hit is not None or (tokens and tokens[-1] == runtime.eos_id) else "length"
        prompt_tokens = int(outcome.inputs.input_ids.shape[1])
        result = Result(text, finish, prompt_tokens, len(tokens), {})
        result.record = self._record(job, "ok", queue_ms=queue_ms, waited_ms=waited_ms, knobs=knobs, plan=plan,
                                     decided_by=choice.decided_by, question_group=choice.question_group,
                                     guarded_from=guarded_from, cost=choice,
                                     latency=latency, num_crops=outcome.inputs.num_crops,
                                     num_prompt_tokens=prompt_tokens, num_output_tokens=len(tokens), answer=text,
                                     finish_reason=finish, stop_hit=stop_hit, stages=outcome.timing,
                                     batch_rows=batch_rows, alone=served.alone) if record else {}
        return result

    def _check(self, job: Job, block: int | None = None) -> None:
        """Raise :class:`Cancelled` (saying why and where) when the job's client has gone or the server aborts."""
        if not (job.cancelled.is_set() or self._aborting.is_set()):
            return
        why = "the server was stopped at once" if self._aborting.is_set() else "the client disconnected"
        stage = self.timer.current_segment
        where = f" during {_STAGE_NAMES.get(stage, stage)}" if stage else ""
        if job.tokens_out:  # between two decode steps or inside one
            where = f" while decoding, after {job.tokens_out} token{'s' if job.tokens_out != 1 else ''} of the answer"
        before = f", before decoder block {block}" if block is not None else ""
        msg = f"{why}{where}{before}"
        raise Cancelled(msg)

    def _record(self, job: Job, status: str, *, queue_ms: float, waited_ms: float | None = None,
                plan: BudgetPlan | None = None, knobs: dict[str, int] | None = None, decided_by: str | None = None,
                question_group: str | None = None, guarded_from: str | None = None,
                cost: Stage1Choice | None = None, latency: dict[str, float | None] | None = None,
                num_crops: int | None = None,
                num_prompt_tokens: int | None = None, num_output_tokens: int | None = None,
                answer: str | None = None, finish_reason: str | None = None, stop_hit: str | None = None,
                error: str | None = None, stages: RequestTiming | None = None,
                batch_rows: tuple[int, float] | None = None,
                alone: tuple[int, int | None, int | None] | None = None) -> dict[str, Any]:
        """The request's row of the ``requests`` view; appended to the log and counted in the metrics."""
        latency = latency or {}
        total = latency.get("total")
        met = None if total is None else bool(total <= job.budget_ms)
        decider = self.decider if job.request.knobs is None else None
        captures = None if job.captures_at_start is None else self.runtime.graph_captures - job.captures_at_start
        row: dict[str, Any] = {
            "request_id": job.request_id, "time": job.arrival_time, "status": status,
            "model": self.model_name, "model_fingerprint": self.runtime.fingerprint,
            "controller_run": decider.controller_run if decider else "request",
            "controller_phase": decider.phase if decider else "request",
            "budget_ms": job.budget_ms, "budget_source": job.budget_source, "queue_length": job.queue_length,
            "unreachable": job.unreachable,
            "waited_ms": waited_ms,
            **{name: getattr(plan, name, None) for name in PLAN_COLUMNS},
            "decided_by": decided_by, "question_group": question_group, "guarded_from": guarded_from,
            **{name: getattr(cost, name, None) for name in COST_COLUMNS},
            **{k: (knobs or {}).get(k) for k in ("max_crops", "insertion_position", "top_k", "num_active_blocks")},
            "num_crops": num_crops, "num_prompt_tokens": num_prompt_tokens, "num_output_tokens": num_output_tokens,
            "stream": job.request.stream, "temperature": job.request.temperature, "top_p": job.request.top_p,
            "seed": job.seed,
            "metadata": None if job.request.metadata is None else json.dumps(job.request.metadata, ensure_ascii=False),
            "finish_reason": finish_reason, "stop_hit": stop_hit,
            **{f"latency_{k}_ms": latency.get(k) for k in LATENCY_PARTS},
            "met": met, "captured": None if captures is None else captures > 0, "answer": answer, "error": error,
            "batch_rows_prefill": None if batch_rows is None else batch_rows[0],
            "batch_rows_decode": None if batch_rows is None else batch_rows[1],
            **dict(zip(ALONE_COLUMNS, alone or (None, None, None), strict=True)),
        }
        if job.request_id.startswith("warmup-"):
            return row
        if captures:
            self.metrics.graph_captures.labels(during="request").inc(captures)
        self.scheduler.observe_end(status, job.budget_ms, controller=decider is not None, total_ms=total, plan=plan)
        if self.log is not None:
            try:
                recorded = self.log.append(row)
            except RequestLogGone as gone:
                self.metrics.log_failures.inc()
                self.metrics.requests.labels(status="rejected").inc()
                if status == "ok":  # nothing is answered without its record
                    raise LogUnavailable(str(gone)) from None
                return row
            if not recorded:
                self.metrics.log_failures.inc()
        self.metrics.observe(row)
        self.served += 1
        return row


class _Decisions:
    """One request's two decisions as the worker makes them, and what stage 1 fixed for stage 2 and
    the record (the decider, the budget plan, the request's features, the batch it joins)."""

    def __init__(self, engine: Engine, job: Job) -> None:
        req, runtime = job.request, engine.runtime
        self.engine, self.job = engine, job
        self.fixed = req.knobs is not None
        self.decider: RequestDecider = engine.decider if not self.fixed else FixedKnobs(
            req.knobs, runtime.num_experts, runtime.num_layers, MAX_CROPS_LIMIT, engine.decider.cost)
        self.plan: BudgetPlan | None = None
        self.lang: torch.Tensor | None = None
        self.tiling: torch.Tensor | None = None
        self.prompt_tokens = math.nan
        self.started = self.spent_ms = 0.0
        # the rows of the batch it joins (none: it runs alone) and the rate requests start at beside it
        self.beside: list[RowKnobs] = list(engine._beside) if engine.max_batch > 1 and not self.fixed else []
        self.starts_per_s = 0.0
        self._factors: dict[tuple[int, int, int], float] = {}
        #: (max_crops, top_k, blocks) the controller would have chosen alone where the batch changed its choice
        #: (top-K and blocks None where its crops differ: stage 2 alone would read another vision pass)
        self.alone: tuple[int, int | None, int | None] | None = None

    def batch_factor(self, insertion_position: int, top_k: int, blocks: int) -> float:
        """How much longer than alone the request would take at these knobs beside the batch it joins."""
        key = (insertion_position, top_k, blocks)
        if key not in self._factors:
            knobs = self.engine.runtime.knobs_after_prefix(insertion_position, top_k, blocks)
            self._factors[key] = self.engine.batch_cost.factor(knobs, self.beside, self.starts_per_s)
        return self._factors[key]

    def _decide_stage1(self, budget_ms: float) -> Stage1Choice:  # in the controller's units
        return self.engine.scheduler.stage1(self.decider, self.lang, self.tiling, budget_ms, self.prompt_tokens)

    def stage1(self) -> Stage1Choice:
        engine, job, runtime = self.engine, self.job, self.engine.runtime
        req = job.request
        self.started = time.perf_counter()
        self.lang = runtime.lang_features([req.question])[0]
        self.tiling = _tiling(runtime, req.image, self.decider.max_crops_values)
        if self.decider.reads_prompt_tokens:  # the per-request table's prompt length, as the features counted it
            self.prompt_tokens = float(job.prepared.text_tokens() if job.prepared is not None
                                       else runtime.preprocess(None, req.question, 1).num_text_tokens)
        now = time.perf_counter()
        self.spent_ms = (now - job.arrival) * 1000.0
        factor, rows = 1.0, None
        if engine.max_batch > 1 and not self.fixed:
            rows = len(self.beside) + 1
            self.starts_per_s = engine.planner.arrival_rate_rps(now) or 0.0
            if self.beside:  # at the knobs of the request started last: the typical choice
                typical = engine._last_knobs or runtime.knobs_after_prefix(0, runtime.default_top_k,
                                                                           runtime.num_layers)
                factor = engine.batch_cost.factor(typical, self.beside, self.starts_per_s)
        self.plan = plan = engine.scheduler.plan(job, self.spent_ms, now, batch_factor=factor,
                                                 batch_rows_expected=rows)
        self.decider = engine.scheduler.decider_for(job, plan, self.decider)
        choice = self._decide_stage1(plan.controller_budget_ms)
        if self.beside and self.decider is engine.decider:
            alone = self._decide_stage1(plan.controller_budget_ms * plan.batch_factor)
            if alone.max_crops != choice.max_crops:
                self.alone = (alone.max_crops, None, None)
        return choice

    def inputs(self, max_crops: int) -> ModelInputs:
        job = self.job
        if job.prepared is not None:
            return job.prepared.inputs(max_crops)
        return self.engine.runtime.preprocess(job.request.image, job.request.question, max_crops)

    def _stage2_inputs(self, choice: Stage1Choice, prefix: PrefixState, budget_ms: float,
                       batch_factor_of: Callable[[Config], float] | None = None) -> Stage2Inputs:
        latency_token = prefix.latency_token if choice.insertion_position > 0 else None
        return self.engine.scheduler.stage2_inputs(self.plan, self.lang, self.tiling, budget_ms, prefix.image_feature,
                                                   latency_token, self.prompt_tokens, batch_factor_of)

    def stage2(self, choice: Stage1Choice, prefix: PrefixState) -> tuple[int, int]:
        p, plan = choice.insertion_position, self.plan
        if not self.beside or self.decider is not self.engine.decider:
            return self.decider.stage2(choice, self._stage2_inputs(choice, prefix, plan.controller_budget_ms))
        alone_budget = plan.controller_budget_ms * plan.batch_factor
        in_batch = self.decider.stage2(choice, self._stage2_inputs(
            choice, prefix, plan.controller_budget_ms, lambda c: self.batch_factor(p, c[1], c[2])))
        if self.alone is None:  # the same crops: what stage 2 would have chosen alone
            alone = self.decider.stage2(replace(choice), self._stage2_inputs(choice, prefix, alone_budget))
            if tuple(alone) != tuple(in_batch):
                self.alone = (choice.max_crops, int(alone[0]), int(alone[1]))
        return in_batch


@dataclass
class _BatchedRequest:
    """A request in the batched worker: started alone (through stage 2), then a row of the batch."""

    job: Job
    served: _Decisions
    started: StartedRequest
    queue_ms: float
    waited_ms: float
    streamed: TextStream | None
    started_at: float
    knobs: RowKnobs  # as its row runs them
    start_ms: float  # stage 1 to stage 2 on the worker, the batch waiting
    row: BatchRow | None = None
    prefill_ms: float = 0.0
    prefill_rows: int = 0
    step_ms: list[float] = field(default_factory=list)
    step_rows: list[int] = field(default_factory=list)
    #: per decode step, its predicted time alone over the batch's (None: not measured yet)
    step_alone: list[float | None] = field(default_factory=list)

    def joined(self, row: BatchRow, wall_ms: float, rows: int) -> None:
        self.row, self.prefill_ms, self.prefill_rows = row, wall_ms, rows
        self.job.tokens_out = len(row.tokens)

    def stepped(self, wall_ms: float, rows: int, alone_share: float | None = None) -> None:
        if self.row is not None and len(self.row.tokens) > self.job.tokens_out:  # it took a token in the step
            self.step_ms.append(wall_ms)
            self.step_rows.append(rows)
            self.step_alone.append(alone_share)
            self.job.tokens_out = len(self.row.tokens)

    def exclusive_ms(self) -> float:
        """Its time holding the worker alone: its start, its share of its prefill pass and of each step."""
        steps = sum(ms / max(1, rows) for ms, rows in zip(self.step_ms, self.step_rows, strict=True))
        return self.start_ms + self.prefill_ms / max(1, self.prefill_rows) + steps

    def alone_decode_ms(self) -> float:
        """Its decode steps as long as they are predicted to take alone (where measured; as run elsewhere)."""
        return sum(ms * (1.0 if share is None else share) for ms, share in zip(self.step_ms, self.step_alone,
                                                                               strict=True))


def _text_stream(runtime: ModelRuntime, job: Job) -> TextStream | None:
    """The request's text decoded token by token, where it is needed before the end (stop sequences, streaming)."""
    req = job.request
    return TextStream(runtime.decode_text, req.stop, job.emit) if (req.stop or job.deltas is not None) else None


#: the configuration the controller would have chosen alone, where the batch it joined changed its choice
ALONE_COLUMNS = ("alone_max_crops", "alone_top_k", "alone_num_active_blocks")
#: the deployed cost model's prediction for the request at the configuration it ran (``Stage1Choice``)
COST_COLUMNS = ("expected_latency_ms", "latency_quantile_ms", "cost_basis")

#: what a cancelled request's record calls the segment it stopped in
_STAGE_NAMES = {"prefix": "the vision pass and the prefill", "suffix": "the prefill", "decode": "decoding"}


def _tiling(runtime: ModelRuntime, image: Image.Image | None, max_crops_values: tuple[int, ...]) -> torch.Tensor:
    """(C,) crops of this image's tiling at each max_crops choice; NaN without an image."""
    if image is None:
        return torch.full((len(max_crops_values),), float("nan"))
    return torch.tensor([float(r * c) for r, c in (runtime.tiling(image.width, image.height, int(m))
                                                    for m in max_crops_values)])


def new_job(request: ChatRequest, engine: Engine, arrival: float, arrival_time: datetime, parse_ms: float,
            request_id: str | None = None) -> Job:
    budget, source = engine.budget_for(request)
    job = Job(request, budget, source, arrival, arrival_time, parse_ms, engine.pending)
    if request.stream:
        job.deltas = asyncio.Queue()
    if request.temperature > 0:
        job.seed = draw_seed() if request.seed is None else request.seed
    if request_id is not None:
        job.request_id = request_id
    return job
