"""What gpu_check.py makes of its measurements, and the wrapper that takes them inside ``ctrl profile``.

* :data:`EVENTS_PRELUDE`: run first in the ``ctrl profile`` process; it wraps the request timer so
  that every timed request also gets CUDA events (on a GPU) and the host clock around it, written
  with the hooks' own figures of that request to ``$GPU_CHECK_EVENTS``, one JSON line each;
* :func:`agreement`: those clocks against the hook-timed totals;
* :func:`config_medians`, :func:`budget_summary`: the profile per configuration, the served
  requests per budget.
"""

from __future__ import annotations

import statistics
from collections import Counter

#: hook and CUDA-event totals of one request may differ by this share before it is flagged
AGREEMENT = 0.10


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def agreement(requests: list[dict], tolerance: float = AGREEMENT) -> dict:
    """How each request's hook-timed total agrees with the clocks around it: ratios hook / CUDA
    events and hook / host clock, the largest deviation from 1 of each, and ``flagged``: the
    requests whose event ratio (or, without events, host ratio) is off by more than ``tolerance``."""
    def ratios(key: str) -> list[float]:
        return [r["hook_total_ms"] / r[key] for r in requests if r.get(key)]

    events, wall = ratios("event_ms"), ratios("wall_ms")
    judged = events or wall
    flagged = [i for i, ratio in enumerate(judged) if abs(ratio - 1.0) > tolerance]
    return {"requests": len(requests), "compared_with": "cuda_events" if events else "host_clock",
            "hook_over_event_median": median(events), "hook_over_event_max_deviation":
                max((abs(x - 1) for x in events), default=None),
            "hook_over_wall_median": median(wall), "hook_over_wall_max_deviation":
                max((abs(x - 1) for x in wall), default=None),
            "tolerance": tolerance, "flagged": flagged, "agree": not flagged and bool(judged)}


def budget_summary(rows: list[dict]) -> dict:
    """Per budget: requests, share within budget, server latencies, the knobs chosen and by whom."""
    out = {}
    for budget in sorted({r["budget_ms"] for r in rows}):
        mine = [r for r in rows if r["budget_ms"] == budget]
        totals = sorted(r["latency_ms"]["total"] for r in mine)
        out[f"{budget:g}"] = {
            "requests": len(mine), "met_share": sum(bool(r["met"]) for r in mine) / len(mine),
            "latency_total_ms_median": median(totals),
            "latency_total_ms_p90": totals[min(len(totals) - 1, int(0.9 * len(totals)))],
            "latency_model_ms_median": median([r["latency_ms"].get("model") for r in mine]),
            "knobs": dict(Counter("{max_crops}/{top_k}/{num_active_blocks}".format(**r["knobs"]) for r in mine)),
            "decided_by": dict(Counter(r["decided_by"] for r in mine))}
    return out


#: wraps ``ctrl profile``'s request timer: CUDA events (and the host clock) around each timed
#: request, written with the hooks' own figures of the same request to $GPU_CHECK_EVENTS
EVENTS_PRELUDE = r'''
import json, os, time
from contextlib import contextmanager
import torch
from runtime.timing import GenerateTimer

_request, _resolve = GenerateTimer.request, GenerateTimer.resolve
_events = open(os.environ["GPU_CHECK_EVENTS"], "a")

@contextmanager
def _request_with_events(self):
    cuda = self.clock.cuda
    with _request(self) as marks:
        start = end = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        wall = time.perf_counter()
        try:
            yield marks
        finally:
            if cuda:
                end.record()
    if cuda:
        torch.cuda.synchronize()
    marks.gpu_check = {"wall_ms": (time.perf_counter() - wall) * 1000.0,
                       "event_ms": start.elapsed_time(end) if cuda else None}

def _resolve_and_record(self, marks):
    t = _resolve(self, marks)
    extra = getattr(marks, "gpu_check", None)
    if extra is not None:
        _events.write(json.dumps({"hook_total_ms": t.total_ms, "vision_ms": t.vision_ms, "prefill_ms": t.prefill_ms,
                                  "decode_ms": t.decode_ms, "passes": t.num_passes, **extra}) + "\n")
        _events.flush()
    return t

GenerateTimer.request, GenerateTimer.resolve = _request_with_events, _resolve_and_record
'''


def config_medians(records: list[dict]) -> dict[str, dict]:
    """Per configuration ("C/K/B") of the profile's exp6 records: counts and median stage times."""
    per_config: dict[str, list[dict]] = {}
    for r in records:
        per_config.setdefault(f"{r['max_crops']}/{r['top_k']}/{r['num_active_blocks']}", []).append(r)
    return {k: {"requests": len(v), "total_ms_median": median([r["T_total_ms"] for r in v]),
                "vision_ms_median": median([r["T_vision_ms"] for r in v]),
                "prefill_ms_median": median([r["T_prefill_ms"] for r in v]),
                "decode_ms_median": median([r["T_decode_ms"] for r in v]),
                "num_crops_median": median([r["num_crops"] for r in v]),
                "output_tokens_median": median([r["num_output_tokens"] for r in v])}
            for k, v in sorted(per_config.items())}
