"""The two statistics every estimate of "what does a request cost on this machine now" is made of.

* :class:`RecentWindow`: the last ``n`` values of something measured per request (a ratio of
  measured to expected latency, a reply's time) and a quantile of them: the machine's current
  state, forgetting what it was minutes ago (a shared machine's speed drifts by tens of percent).
* :class:`QuantileTracker`: a multiplicative factor moved after each request by whether the
  request met its mark, so that a ``target`` share of requests does (a stochastic-approximation
  quantile tracker: ``log(factor)`` moves by ``step * (hit - target)``, its fixed point is the
  factor at which a ``target`` share hits).

The server's latency scale and budget margins (``serve.calibration``), its planner's reserves
(``serve.budget``) and the latency guard's drift and tail factors (``controller.latency_guard``)
are built from these two.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Sequence


def quantile_of(values: Sequence[float] | Iterable[float], q: float, empty: float = 0.0) -> float:
    """The sorted value at rank ``floor(q * n)`` (no interpolation: a value that was measured);
    ``empty`` for no values."""
    ordered = sorted(values)
    if not ordered:
        return empty
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class RecentWindow:
    """The last ``size`` values appended, thread-safe, and quantiles of them."""

    def __init__(self, size: int) -> None:
        if size < 1:
            msg = f"a window holds at least one value, got {size!r}"
            raise ValueError(msg)
        self._values: deque[float] = deque(maxlen=int(size))
        self._lock = threading.Lock()

    def append(self, value: float) -> None:
        with self._lock:
            self._values.append(float(value))

    def values(self) -> list[float]:
        """The values held, oldest first."""
        with self._lock:
            return list(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def quantile(self, q: float, empty: float = 0.0) -> float:
        """:func:`quantile_of` the values held (``empty`` when there are none)."""
        return quantile_of(self.values(), q, empty)

    def median(self, empty: float = 0.0) -> float:
        return self.quantile(0.5, empty)


class QuantileTracker:
    """A factor in ``bounds`` that a ``target`` share of the requests it is told about should meet.

    After each request ``observe(hit)`` moves ``log(factor)`` by ``step * (hit - target)``: up by
    ``step * (1 - target)`` after a hit, down by ``step * target`` after a miss (``target``: this
    request's own, where it differs). ``hit`` is whatever the caller counts: a request within its
    budget (the budget margin), a request over its expectation (the guard's tail factor)."""

    def __init__(self, target: float, *, step: float, bounds: tuple[float, float], initial: float = 1.0) -> None:
        if not (math.isfinite(step) and step >= 0):
            msg = f"the tracker's step must be a number >= 0 (0: the factor stays), got {step!r}"
            raise ValueError(msg)
        low, high = bounds
        if not 0 < low <= high:
            msg = f"the tracker's bounds must be positive and ordered, got {bounds!r}"
            raise ValueError(msg)
        if not low <= initial <= high:
            msg = f"the initial factor must be within the bounds {bounds!r}, got {initial!r}"
            raise ValueError(msg)
        self.target, self.step, self.bounds = float(target), float(step), (float(low), float(high))
        self._log = math.log(initial)
        self._lock = threading.Lock()

    @property
    def value(self) -> float:
        return math.exp(self._log)

    def observe(self, hit: bool, target: float | None = None) -> float:
        """Record one request; the new factor."""
        aim = self.target if target is None else float(target)
        low, high = self.bounds
        with self._lock:
            moved = self._log + self.step * (float(hit) - aim)
            self._log = min(math.log(high), max(math.log(low), moved))
            return math.exp(self._log)
