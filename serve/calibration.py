"""The server's clock against the controller's: how much longer a served request takes than the
latencies the controller was trained on.

An offline controller reads budgets in the units of its profile: latencies recorded on another
machine, or on the same machine at another time (a shared machine's speed drifts by tens of
percent within minutes: docs/serving.md#latency-calibration). A server that handed it budgets
in its own milliseconds would let it pick configurations that are too slow whenever the
serving machine is slower than the profiling one. :class:`LatencyScale` measures the ratio on
the requests served: per request, its model time (vision pass, prefill and decoding, as the
profile timed them) over the median latency of the same configuration in the controller's
training split. The scale is a quantile of the last ``window`` ratios, so it follows the
machine as it drifts; the server divides the budget left by it before the controller reads it.

The ratio assumes answers of the lengths the profile recorded (its ``max_new_tokens``): a request
that generates many more tokens raises its own ratio, which makes later decisions more careful,
not less.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping

from controller.cost import QuantileTracker, RecentWindow
from pipeline.knobs import Config
from pipeline.options import option_default
from serve.config import LATENCY_SCALE_WINDOW, ServeConfig


class LatencyScale:
    """Served model time / the controller's reference latency, over the last ``window`` requests.

    ``reference_ms`` maps a configuration to its median training latency (configurations without
    one are not measured). ``fixed`` pins the scale (no measurement); otherwise it is the
    ``quantile`` of the recorded ratios, and 1.0 before the first.
    """

    def __init__(self, reference_ms: Mapping[Config, float], *, fixed: float | None = None,
                 quantile: float = option_default(ServeConfig, "latency_scale_quantile"),
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


#: the ratios kept per configuration, and the fewest that give it a scale of its own
CONFIG_SCALE_WINDOW, CONFIG_SCALE_MIN = 16, 5
#: how far one request moves the budget margin (log scale, per unit of met - target)
MARGIN_STEP = 0.1
#: the budget margin's range: at most this much tighter / looser than the budget left
MARGIN_BOUNDS = (0.2, 1.5)


class BudgetMargin:
    """The share of the budget left that the controller reads, adjusted on the requests served so
    that a ``target`` share of them is answered within budget.

    The controller's latencies and the latency scale describe one request on a free model; what
    a request takes on a loaded server also depends on the queue and on everything the latency
    scale's median does not see. Instead of modelling that, the margin tracks the outcome the
    budget is about (a :class:`controller.cost.QuantileTracker` of the requests within budget):
    after each request the controller decided, ``log(margin)`` moves down by ``step * target``
    after a miss, up by ``step * (1 - target)`` after a request within budget. Under load it falls,
    the controller picks cheaper configurations and the queue shortens; where the controller is
    more careful than it needs to be it rises above 1. ``target`` None pins the margin at 1.
    """

    def __init__(self, target: float | None, *, step: float = MARGIN_STEP,
                 bounds: tuple[float, float] = MARGIN_BOUNDS, initial: float = 1.0) -> None:
        if target is not None and not (math.isfinite(target) and 0.0 < target < 1.0):
            msg = f"the met target must be in (0, 1), got {target!r}"
            raise ValueError(msg)
        if not (math.isfinite(step) and step > 0):
            msg = f"the margin step must be a positive number, got {step!r}"
            raise ValueError(msg)
        low, high = bounds
        if not 0 < low <= 1.0 <= high:
            msg = f"the margin bounds must hold 1 and be positive, got {bounds!r}"
            raise ValueError(msg)
        if not low <= initial <= high:
            msg = f"the initial margin must be within the bounds {bounds!r}, got {initial!r}"
            raise ValueError(msg)
        self.target = target
        self._within = QuantileTracker(target if target is not None else 0.5, step=step, bounds=bounds,
                                       initial=initial)
        self.step, self.bounds = self._within.step, self._within.bounds

    @property
    def value(self) -> float:
        return self._within.value

    def observe(self, met: bool, target: float | None = None) -> float:
        """Record whether one controller-decided request was answered within its budget; the new margin.
        ``target``: this request's own target (a lower one where the budget could not be met more often),
        else the margin's."""
        if self.target is None:
            return 1.0
        aim = self.target if target is None else min(self.target, max(0.0, float(target)))
        return self._within.observe(met, aim)
