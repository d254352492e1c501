"""Prometheus metrics of a server (``GET /metrics``), in a registry of its own.

ctrl_requests_total{status}            ok, cancelled, error (500), rejected (queue full, request log gone),
                                       refused (budget unreachable on arrival), dropped (the queue deadline),
                                       invalid (4xx)
ctrl_budget_total{outcome}             met / missed, of the requests answered
ctrl_request_latency_seconds           histogram of the end-to-end latency (arrival to answer)
ctrl_stage_latency_seconds{stage}      histogram per stage: parse, queue, stage1, preprocess, vision,
                                       prefill, stage2, decode
ctrl_queue_length                      requests waiting or running
ctrl_latency_scale                     model time per ms of the controller's training latencies, as the
                                       last request read it
ctrl_budget_margin{budget_class}       the share of the budget left the controller read
                                       (docs/serving.md#met-target), per budget class, as the last
                                       request of the class read it
ctrl_budget_target{budget_class}       the met target the class's margin aims at: --met-target, or
                                       what the cheapest configuration meets where that is less
ctrl_budget_unreachable_total{budget_class}  controller requests whose budget the cheapest configuration
                                       meets less often than --met-target (class <1x: never)
ctrl_arrival_rate                      requests per second the controller chooses the cost of, as the
                                       last request read it (docs/serving.md#load-aware-budgets)
ctrl_overhead_reserve_seconds          the reserve for work outside the profiled path, as the last
                                       request read it
ctrl_decisions_total{knob, value}      the knob values chosen (max_crops, top_k, num_active_blocks,
                                       insertion_position)
ctrl_request_log_failures_total        requests the request log could not record (a full disk; a workspace
                                       removed, after which requests are refused)
ctrl_connections_dropped_total{reason} connections closed before their request was complete:
                                       too_many_connections, header_timeout, body_timeout, client_left
ctrl_graph_captures_total{during}      CUDA graphs captured (decode steps, the ViT): during the warm-up, or
                                       during a served request, which paid for it (its log row: captured)
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: seconds; from a sub-millisecond controller stage to a full-size request on a CPU
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STAGES = ("parse", "queue", "stage1", "preprocess", "vision", "prefill", "stage2", "decode")
KNOBS = ("max_crops", "top_k", "num_active_blocks", "insertion_position")


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("ctrl_requests", "Requests by how they ended", ["status"], registry=self.registry)
        self.budget = Counter("ctrl_budget", "Answered requests by whether they met their budget", ["outcome"],
                              registry=self.registry)
        self.latency = Histogram("ctrl_request_latency_seconds", "End-to-end latency (arrival to answer)",
                                 buckets=BUCKETS, registry=self.registry)
        self.stage_latency = Histogram("ctrl_stage_latency_seconds", "Latency per stage of a request", ["stage"],
                                       buckets=BUCKETS, registry=self.registry)
        self.queue_length = Gauge("ctrl_queue_length", "Requests waiting or running", registry=self.registry)
        self.latency_scale = Gauge("ctrl_latency_scale", "Model time per ms of the controller's training "
                                   "latencies (budgets are divided by it)", registry=self.registry)
        self.budget_margin = Gauge("ctrl_budget_margin", "Share of the budget left the controller reads "
                                   "(the met target's margin), per budget class", ["budget_class"],
                                   registry=self.registry)
        self.budget_target = Gauge("ctrl_budget_target", "The met target a budget class's margin aims at",
                                   ["budget_class"], registry=self.registry)
        self.unreachable = Counter("ctrl_budget_unreachable", "Controller requests whose budget the cheapest "
                                   "configuration meets less often than the met target", ["budget_class"],
                                   registry=self.registry)
        self.arrival_rate = Gauge("ctrl_arrival_rate", "Requests per second whose cost the controller chooses",
                                  registry=self.registry)
        self.reserve = Gauge("ctrl_overhead_reserve_seconds", "Reserve for the work outside the profiled path",
                             registry=self.registry)
        self.decisions = Counter("ctrl_decisions", "Knob values chosen", ["knob", "value"], registry=self.registry)
        self.log_failures = Counter("ctrl_request_log_failures", "Requests the request log could not record",
                                    registry=self.registry)
        self.connections_dropped = Counter("ctrl_connections_dropped", "Connections closed before their request "
                                           "was complete", ["reason"], registry=self.registry)
        self.graph_captures = Counter("ctrl_graph_captures", "CUDA graphs captured, during the warm-up or "
                                      "during a served request", ["during"], registry=self.registry)

    def observe(self, row: dict[str, Any]) -> None:
        """Count one finished request from its ``requests`` row."""
        self.requests.labels(status=row["status"]).inc()
        if row["status"] != "ok":
            return
        self.budget.labels(outcome="met" if row["met"] else "missed").inc()
        self.latency.observe(row["latency_total_ms"] / 1000.0)
        if row.get("latency_scale") is not None:
            self.latency_scale.set(row["latency_scale"])
        budget_class = row.get("budget_class")
        if row.get("controller_phase") != "request" and budget_class is not None:
            if row.get("budget_margin") is not None:
                self.budget_margin.labels(budget_class=budget_class).set(row["budget_margin"])
            target, feasible = row.get("met_target"), row.get("feasible_rate")
            if target is not None:
                self.budget_target.labels(budget_class=budget_class).set(target)
            if budget_class.startswith("<") or (feasible is not None and target is not None and feasible <= target):
                self.unreachable.labels(budget_class=budget_class).inc()
        if row.get("arrival_rate_rps") is not None:
            self.arrival_rate.set(row["arrival_rate_rps"])
        if row.get("reserve_ms") is not None:
            self.reserve.set(row["reserve_ms"] / 1000.0)
        for stage in STAGES:
            value = row.get(f"latency_{stage}_ms")
            if value is not None:
                self.stage_latency.labels(stage=stage).observe(value / 1000.0)
        for knob in KNOBS:
            if row.get(knob) is not None:
                self.decisions.labels(knob=knob, value=str(row[knob])).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
