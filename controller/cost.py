"""The two statistics every estimate of "what does a request cost on this machine now" is made of.

* :class:`RecentWindow`: the last ``n`` values of something measured per request (a ratio of
  measured to expected latency, a reply's time) and a quantile of them: the machine's current
  state, forgetting what it was minutes ago (a shared machine's speed drifts by tens of percent).
* :class:`QuantileTracker`: a multiplicative factor moved after each request by whether the
  request met its mark, so that a ``target`` share of requests does (a stochastic-approximation
  quantile tracker: ``log(factor)`` moves by ``step * (hit - target)``, its fixed point is the
  factor at which a ``target`` share hits).

Built from them: :class:`LatencyScale` (the server's clock against the profile's, per configuration,
here), the guard rule :func:`guard_config`, the budget margins and planner reserves (``serve.budget``)
and the latency guard's drift and tail factors (``controller.latency_guard``); ``controller.machine``
puts the scale, the per-request latency model and the guard behind one object.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from pipeline.knobs import Config

#: how many of the latest requests the measured latency scale is a quantile over, and its default quantile
LATENCY_SCALE_WINDOW, LATENCY_SCALE_QUANTILE = 32, 0.5
#: the ratios kept per configuration, and the fewest that give it a scale of its own
CONFIG_SCALE_WINDOW, CONFIG_SCALE_MIN = 16, 5


def quantile_of(values: Sequence[float] | Iterable[float], q: float, empty: float = 0.0) -> float:
    """The sorted value at rank ``floor(q * n)`` (no interpolation: a value that was measured);
    ``empty`` for no values."""
    return _ranked(sorted(values), q, empty)


def _ranked(ordered: Sequence[float], q: float, empty: float) -> float:
    """:func:`quantile_of` of values already sorted."""
    if not ordered:
        return empty
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class RecentWindow:
    """The last ``size`` values appended, thread-safe, and quantiles of them (read far more often than
    appended to: the sorted values are kept until the next append)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            msg = f"a window holds at least one value, got {size!r}"
            raise ValueError(msg)
        self._values: deque[float] = deque(maxlen=int(size))
        self._sorted: list[float] | None = None
        self._lock = threading.Lock()
        #: counts the appends: what a reader caching a statistic of the window compares
        self.version = 0

    def append(self, value: float) -> None:
        with self._lock:
            self._values.append(float(value))
            self._sorted = None
            self.version += 1

    def values(self) -> list[float]:
        """The values held, oldest first."""
        with self._lock:
            return list(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def quantile(self, q: float, empty: float = 0.0) -> float:
        """:func:`quantile_of` the values held (``empty`` when there are none)."""
        with self._lock:
            ordered = self._sorted
            if ordered is None:
                ordered = self._sorted = sorted(self._values)
        return _ranked(ordered, q, empty)

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


class LatencyScale:
    """Served model time / the controller's reference latency, over the last ``window`` requests.

    ``reference_ms`` maps a configuration to its median training latency (configurations without
    one are not measured). ``fixed`` pins the scale (no measurement); otherwise it is the
    ``quantile`` of the recorded ratios, and 1.0 before the first.
    """

    def __init__(self, reference_ms: Mapping[Config, float], *, fixed: float | None = None,
                 quantile: float = LATENCY_SCALE_QUANTILE,
                 window: int = LATENCY_SCALE_WINDOW) -> None:
        if fixed is not None and not (math.isfinite(fixed) and fixed > 0):
            msg = f"the latency scale must be a positive number, got {fixed!r}"
            raise ValueError(msg)
        if not 0.0 <= quantile <= 1.0:
            msg = f"the latency scale quantile must be in [0, 1], got {quantile!r}"
            raise ValueError(msg)
        if window < 1:
            msg = f"the latency scale window must be at least 1, got {window!r}"
            raise ValueError(msg)
        self.reference_ms = {tuple(int(v) for v in k): float(ms) for k, ms in reference_ms.items()
                             if math.isfinite(ms) and ms > 0}
        self.fixed, self.quantile = fixed, float(quantile)
        self._ratios = RecentWindow(window)
        self._by_config: dict[Config, RecentWindow] = {}
        self._lock = threading.Lock()
        #: counts the ratios recorded: what a reader caching a statistic of the scale compares
        self.version = 0

    @property
    def source(self) -> str:
        """``fixed`` (pinned), ``measured`` (ratios recorded), ``none`` (1.0: nothing to compare with yet)."""
        if self.fixed is not None:
            return "fixed"
        return "measured" if len(self._ratios) else "none"

    @property
    def calibrates(self) -> bool:
        """Whether served requests can move the scale (not pinned, and reference latencies exist)."""
        return self.fixed is None and bool(self.reference_ms)

    def observe(self, knobs: Config, model_ms: float) -> float | None:
        """Record one served request's model time; its ratio, or None when it cannot count (no
        reference for its configuration, a pinned scale, a non-positive time)."""
        reference = self.reference_ms.get(knobs)
        if self.fixed is not None or reference is None or not (math.isfinite(model_ms) and model_ms > 0):
            return None
        ratio = model_ms / reference
        with self._lock:
            own = self._by_config.setdefault(tuple(knobs), RecentWindow(CONFIG_SCALE_WINDOW))
        self._ratios.append(ratio)
        own.append(ratio)
        with self._lock:
            self.version += 1
        return ratio

    def of(self, knobs: Config, quantile: float = 0.5) -> float:
        """The scale of one configuration: the median (or ``quantile``) of its own last ratios once it
        has ``CONFIG_SCALE_MIN`` of them, else :attr:`value`. A machine unlike the profile's does not slow
        every configuration alike (the experts' top-K and the crops move apart), which one scale
        cannot say; pinned scales are the same for all."""
        if self.fixed is not None:
            return self.fixed
        own = self._by_config.get(tuple(knobs))
        if own is None or len(own) < CONFIG_SCALE_MIN:
            return self.value
        return own.quantile(quantile)

    def ratios(self) -> list[float]:
        """The ratios recorded, oldest first."""
        return self._ratios.values()

    @property
    def value(self) -> float:
        if self.fixed is not None:
            return self.fixed
        return self._ratios.quantile(self.quantile, empty=1.0)


def guard_config(chosen: Config, reference_ms: Mapping[Config, float],
                 scale_of: Callable[[Config], float], allowed_ms: float) -> Config:
    """The configuration to run for a controller's ``chosen`` one when the budget allows the model
    ``allowed_ms`` (served ms): ``chosen`` itself when its expected time (its reference latency times its
    own scale) fits or it has no reference; else, among the configurations at its crops (the vision
    pass has run at them) with a reference no larger than its own, the one with the largest reference
    whose expected time fits (the most compute the budget affords: accuracy rises with it across the
    profiled space), or the fastest expected one where none fits."""
    if chosen not in reference_ms or reference_ms[chosen] * scale_of(chosen) <= allowed_ms:
        return chosen
    same_crops = [c for c in reference_ms if c[0] == chosen[0] and reference_ms[c] <= reference_ms[chosen]]
    fitting = [c for c in same_crops if reference_ms[c] * scale_of(c) <= allowed_ms]
    if fitting:
        return max(fitting, key=lambda c: (reference_ms[c], c))
    return min(same_crops, key=lambda c: (reference_ms[c] * scale_of(c), c))
