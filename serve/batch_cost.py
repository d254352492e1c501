"""What running inside a batch does to a request's latency and to the server's capacity, measured.

The profile's latencies are of one request alone on the single-request path. Under continuous
batching (``--max-batch`` > 1) a request's decode steps are shared with the rows beside it, and its
starts and those of the requests joining after it run on the worker while the batch waits. Two
figures follow, both kept current from what the server measures (the warm-up seeds them):

* **A request's batch factor** at a configuration: how much longer than alone it is expected to
  take when it joins the rows running now, ``1 + d (f / (1 - s) - 1)`` (never below 1): ``d`` the
  decode steps' share of a request's model time (the median of the last requests), ``f`` the
  predicted step time of the batch with it over its own step time alone, ``s`` the share of the
  batch's time spent on other requests' starts (their arrival rate x the median start). The step
  time is a least-squares fit over the last decode steps,
  ``a + b * (blocks any row runs) + c * (expert products: the rows' top-K summed over their blocks)``:
  a block's weights are read once per step whatever the rows running it, so a row whose blocks the
  batch already runs costs less than one that adds blocks. Its own step alone is the same fit over
  the single-request path's steps, ``a' + c' * (its expert products)``.
* **The occupancy**: the share of a request's time on the worker that it holds the worker alone
  (its start, its share of the prefill pass it joined and of each decode step: the pass's time over
  its rows), the mean of the last requests; 1 on the single-request path. The budget planner's
  queue and arrival caps count the server's busy time per request at its latency times this share:
  a batched server serves requests faster than one request's latency.

Before a fit has enough distinct steps the factor is 1 (nothing is known of the batch).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

from controller.cost import quantile_of
from runtime.base import RowKnobs

#: decode steps (batched and alone) the fits look back over; the fewest that give one
STEP_WINDOW, STEP_MIN = 256, 8
#: requests the decode share, the start time and the occupancy look back over
REQUEST_WINDOW = 64
#: the most of the batch's time other requests' starts are read to take (a stall share near 1 would
#: read every request as infinitely slow; the caps see such a load)
STALL_SHARE_MAX = 0.5


def step_features(rows: Sequence[RowKnobs]) -> tuple[float, float, float]:
    """(1, the blocks any row runs, the rows' expert products per token: top-K summed over their blocks)."""
    union: set[int] = set()
    products = 0
    for row in rows:
        union.update(row.blocks)
        products += sum(row.top_k[b] for b in row.blocks)
    return 1.0, float(len(union)), float(products)


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """Least squares of ``y`` on the columns of ``x`` with every coefficient >= 0 (a column whose
    coefficient comes out negative is dropped and the rest refitted); None where nothing fits."""
    active = [j for j in range(x.shape[1]) if np.ptp(x[:, j]) > 0 or j == 0]
    while active:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all():
            full = np.zeros(x.shape[1])
            full[active] = coef
            return full
        active.pop(int(np.argmin(coef)))
    return None


class StepFit:
    """A least-squares fit of step time on :func:`step_features`, over the last steps observed."""

    def __init__(self, columns: Sequence[int], window: int = STEP_WINDOW) -> None:
        self.columns = tuple(columns)
        self._steps: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._coef: np.ndarray | None = None
        self._stale = True

    def observe(self, features: tuple[float, float, float], wall_ms: float) -> None:
        if math.isfinite(wall_ms) and wall_ms > 0:
            self._steps.append((tuple(features[j] for j in self.columns), float(wall_ms)))
            self._stale = True

    def __len__(self) -> int:
        return len(self._steps)

    def predict(self, features: tuple[float, float, float]) -> float | None:
        """The predicted step (ms); None with fewer than :data:`STEP_MIN` steps or no fit."""
        if len(self._steps) < STEP_MIN:
            return None
        if self._stale:
            x = np.array([f for f, _ in self._steps])
            y = np.array([w for _, w in self._steps])
            self._coef, self._stale = _nonnegative_fit(x, y), False
        if self._coef is None:
            return None
        value = float(np.dot(self._coef, [features[j] for j in self.columns]))
        return value if value > 0 else None


class BatchCost:
    """The batch factor and the occupancy of a batched server (module docstring). Thread-safe: the
    worker observes and asks; the metrics read."""

    def __init__(self) -> None:
        self._batched = StepFit((0, 1, 2))
        self._alone = StepFit((0, 2))
        self._decode_share: deque[float] = deque(maxlen=REQUEST_WINDOW)
        self._start_ms: deque[float] = deque(maxlen=REQUEST_WINDOW)
        self._occupancy: deque[float] = deque(maxlen=REQUEST_WINDOW)
        self._lock = threading.Lock()

    # -- what the server measures
    def observe_step(self, rows: Sequence[RowKnobs], wall_ms: float) -> None:
        """One batched decode step over ``rows``."""
        if rows:
            with self._lock:
                self._batched.observe(step_features(rows), wall_ms)

    def observe_alone(self, knobs: RowKnobs, step_ms: float) -> None:
        """A decode step of a request on the single-request path."""
        with self._lock:
            self._alone.observe(step_features([knobs]), step_ms)

    def observe_request(self, *, model_ms: float, decode_ms: float, start_ms: float | None = None,
                        exclusive_ms: float | None = None, worker_ms: float | None = None) -> None:
        """One request served: its model and decode time; for a batched one, its start on the worker
        (stage 1 to stage 2, the batch waiting) and its time holding the worker alone out of its time on it."""
        with self._lock:
            if model_ms > 0 and decode_ms >= 0:
                self._decode_share.append(min(1.0, decode_ms / model_ms))
            if start_ms is not None and start_ms >= 0:
                self._start_ms.append(start_ms)
            if exclusive_ms is not None and worker_ms is not None and worker_ms > 0:
                self._occupancy.append(min(1.0, max(0.0, exclusive_ms / worker_ms)))
            elif worker_ms is not None:
                self._occupancy.append(1.0)

    # -- the state, read
    @property
    def decode_share(self) -> float:
        """The median share of a request's model time its decode steps take (0 before any request)."""
        with self._lock:
            return quantile_of(list(self._decode_share), 0.5)

    @property
    def start_ms(self) -> float:
        with self._lock:
            return quantile_of(list(self._start_ms), 0.5)

    @property
    def occupancy(self) -> float:
        """The mean share of its time on the worker a request holds it alone (1 before any request)."""
        with self._lock:
            values = list(self._occupancy)
        return sum(values) / len(values) if values else 1.0

    def step_ms(self, rows: Sequence[RowKnobs]) -> float | None:
        """The predicted batched decode step over ``rows`` (None: not measured yet)."""
        with self._lock:
            return self._batched.predict(step_features(rows))

    def alone_ms(self, knobs: RowKnobs) -> float | None:
        """The predicted decode step of ``knobs`` alone on the single-request path (None: not measured yet)."""
        with self._lock:
            return self._alone.predict(step_features([knobs]))

    def factor(self, knobs: RowKnobs, beside: Sequence[RowKnobs], starts_per_s: float = 0.0) -> float:
        """How much longer than alone a request at ``knobs`` is expected to take beside the rows ``beside``
        while others start at ``starts_per_s``: 1 with nothing beside it (it runs alone) or before the fits."""
        if not beside:
            return 1.0
        together, alone = self.step_ms([*beside, knobs]), self.alone_ms(knobs)
        if together is None or alone is None:
            return 1.0
        stall = min(STALL_SHARE_MAX, max(0.0, starts_per_s * self.start_ms / 1000.0))
        slowdown = together / alone / (1.0 - stall)
        return max(1.0, 1.0 + self.decode_share * (slowdown - 1.0))
