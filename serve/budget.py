"""The budget arithmetic of a served request, in one place: what the controller may spend.

The engine asks :meth:`BudgetPlanner.plan` once per request, at stage 1, and gets every term of
the answer (:class:`BudgetPlan`, one request-log column each):

1. **Time spent and reserved.** ``budget_left = budget - spent - reserve``: ``spent`` runs from
   the request's arrival to stage 1 (parsing, image decoding, the queue); ``reserve`` holds back
   what the request will still cost outside the model's profiled path: after stage 1
   (preprocessing at the chosen crops, stage 2, detokenisation) and after the answer's text (the
   reply's serialisation and write, outside the server's clock), each the 90th percentile of the
   last 64 requests.
2. **The queue cap** (:func:`queue_cap_ms`): the most this request may take so that each request
   already waiting can still meet its budget at the cheapest configuration.
3. **The arrival cap** (:func:`arrival_cap_ms`): the most a request may take so that the requests
   still to come, arriving at the rate observed (:class:`ArrivalRate`), would on average wait
   little enough to meet a budget like this one, were every request to take that long: an M/G/1
   queue's mean waiting time (Pollaczek-Khinchine). It moves the controller to cheaper
   configurations when arrivals come faster than its choices are served, before a queue forms,
   and back when they slow; the tail beyond the mean is the margin's to keep.
4. **The latency scale** (:class:`controller.cost.LatencyScale`): the budget is divided by it to
   read in the profile's milliseconds; under continuous batching also by the request's **batch
   factor** (:class:`serve.batch_cost.BatchCost`: how much longer than alone it is expected to take
   beside the rows it joins), while the queue and arrival caps count each request's hold on the
   worker at its **occupancy** (the share of its time it holds the worker alone), so that they reckon
   with the batched service rate, not one request's time.
5. **The margin of the request's budget class** (:func:`budget_class`): each class of budgets, by
   their ratio to the cheapest configuration's expected time, keeps its own
   :class:`BudgetMargin`, so that a stream of budgets nothing can meet moves no
   other class. A class aims at the smaller of ``met_target`` and what the cheapest configuration
   would meet in it (:func:`cheapest_met_share`: the latencies just served, at the cheapest
   configuration's reference, queued at the arrival rate observed), and its margin stops where
   its budgets already read as the cheapest configuration's (:data:`CLASS_MARGIN_FLOORS`): beyond
   that it would only slow its recovery.
6. **The cheapest rule**: a budget that reads below every configuration's reference latency takes
   the cheapest configuration, the controller not asked (it would extrapolate).
7. **The per-configuration guard** (the decider's :class:`controller.machine.MachineCost`, after
   stage 2; its rule :func:`controller.cost.guard_config`): a configuration whose own
   measured scale says its median takes more than the whole budget the controller read is replaced
   by the largest one at the same crops that fits.

Every function here takes plain numbers; tests call them with values written out by hand.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from controller.cost import LatencyScale, QuantileTracker, RecentWindow, quantile_of
from pipeline.knobs import Config

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


#: the lower edges of the budget classes, in multiples of the cheapest configuration's expected time
#: (the first class holds the budgets below it: nothing is expected to meet them)
BUDGET_CLASS_EDGES = (1.0, 1.5, 2.0, 3.0, 5.0)
#: per class, the lowest margin: the one at which the class's budgets read as the cheapest configuration
#: (1 / the class's upper edge), never below the margin's own bound
CLASS_MARGIN_FLOORS = tuple(max(MARGIN_BOUNDS[0], 1.0 / upper) for upper in (*BUDGET_CLASS_EDGES[1:], math.inf))
#: arrivals the rate is estimated over, the fewest that give an estimate, and the oldest one counted
#: (s): there is no estimate (and no cap) a horizon after the last arrival
ARRIVAL_WINDOW, ARRIVAL_MIN, ARRIVAL_HORIZON_S = 32, 5, 30.0
#: requests the reserves and the feasibility estimate look back over
OVERHEAD_WINDOW, SERVICE_WINDOW, FEASIBLE_WINDOW = 64, 64, 64
#: the burst rate: over the last ``BURST_ARRIVALS`` arrivals, read instead of the windowed rate once it is
#: ``BURST_RATIO`` times that (a Poisson stream reads so high about 3 % of the time)
BURST_ARRIVALS, BURST_RATIO = 8, 2.0
#: arrivals the dispersion of arrival counts is measured over (within ARRIVAL_HORIZON_S), the fewest
#: windows it needs, and the range its reading is kept in (1: Poisson, never read as smoother)
DISPERSION_ARRIVALS, DISPERSION_MIN_BINS, ARRIVAL_SCV_BOUNDS = 256, 8, (1.0, 16.0)
#: the quantile of the cheapest configuration's served times that refusing and dropping reckon with: the
#: least it typically takes, so that neither gives up a request it would often have answered in time
LEAST_QUANTILE = 0.1
#: the floor: arrivals replayed at the cheapest configuration, a class's recent controller requests
#: compared with that replay, the fewest that decide, and how far below the replay they may fall
FLOOR_ARRIVALS, FLOOR_WINDOW, FLOOR_MIN, FLOOR_TOLERANCE = 256, 64, 20, 0.02


def budget_class(budget_ms: float, cheapest_ms: float | None) -> int:
    """The class of a budget: 0 below ``cheapest_ms`` (the cheapest configuration's expected served
    time), then one per interval of :data:`BUDGET_CLASS_EDGES`; 1 when the cheapest time is unknown."""
    if cheapest_ms is None or not cheapest_ms > 0:
        return 1
    ratio = budget_ms / cheapest_ms
    return sum(ratio >= edge for edge in BUDGET_CLASS_EDGES)


def class_name(index: int) -> str:
    """``<1x``, ``1-1.5x``, ..., ``>=5x``: the budget over the cheapest configuration's expected time."""
    edges = BUDGET_CLASS_EDGES
    if index == 0:
        return f"<{edges[0]:g}x"
    if index >= len(edges):
        return f">={edges[-1]:g}x"
    return f"{edges[index - 1]:g}-{edges[index]:g}x"


def queue_cap_ms(time_left_ms: Sequence[float], cheapest_ms: float, occupancy: float = 1.0) -> float | None:
    """The most the request starting now may take (served ms, end to end) so that each request
    waiting behind it can still meet its budget at the cheapest configuration.

    ``time_left_ms``: the waiting requests' budget not yet spent, in queue order; the i-th (from 1)
    also waits for the i - 1 before it, each taken at ``cheapest_ms`` (the least a request takes),
    and then runs itself. A request holds the worker alone for ``occupancy`` of its time (1: one
    request at a time; less in a batch, :class:`serve.batch_cost.BatchCost`), so the i-th needs
    ``occupancy * (t + (i - 1) * cheapest_ms) + cheapest_ms <= time_left_ms[i - 1]``. A waiting
    request that cannot make it even when this one takes the cheapest configuration does not cap
    it (it is lost either way). None when nothing caps."""
    occupancy = min(1.0, max(1e-3, float(occupancy)))
    caps = [(left - cheapest_ms) / occupancy - (i - 1) * cheapest_ms
            for i, left in enumerate(time_left_ms, start=1)]
    feasible = [cap for cap in caps if cap >= cheapest_ms]
    return min(feasible) if feasible else None


@dataclass(frozen=True)
class Load:
    """What arrives and what it costs (rates per second, times in ms).

    ``rate_adjustable``: requests whose cost the controller chooses; ``rate_other``: requests whose
    cost is not its choice (fixed knobs, budgets below the cheapest configuration), which took
    ``other_mean_ms`` on average with second moment ``other_m2_ms2``. ``service_scv``: the squared
    coefficient of variation of the adjustable requests' service times (0: all alike); ``arrival_scv``:
    the arrivals' variability (1: Poisson; the index of dispersion of their counts,
    :meth:`ArrivalRate.dispersion`); ``occupancy``: the share of a request's time that it holds the
    server alone (1: one request at a time; less under batching, :class:`serve.batch_cost.BatchCost`),
    what turns a request's latency into the server's busy time."""

    rate_adjustable: float
    rate_other: float = 0.0
    other_mean_ms: float = 0.0
    other_m2_ms2: float = 0.0
    service_scv: float = 0.0
    arrival_scv: float = 1.0
    occupancy: float = 1.0


def utilisation(service_ms: float, load: Load) -> float:
    """The share of the time the server is busy when every adjustable request takes ``service_ms``
    (each holding it for ``occupancy`` of that)."""
    return load.occupancy * (load.rate_adjustable / 1000.0 * service_ms + load.rate_other / 1000.0 * load.other_mean_ms)


def mean_wait_ms(service_ms: float, load: Load) -> float:
    """A G/G/1 queue's mean waiting time when every adjustable request takes ``service_ms``: the
    Pollaczek-Khinchine formula ``W = (lambda_a E[S_a^2] + lambda_o E[S_o^2]) / (2 (1 - rho))``, with
    ``E[S_a^2] = (1 + scv) service_ms^2``, exact for Poisson arrivals, plus Kingman's term for arrivals
    of another variability, ``(arrival_scv - 1) / 2 * rho / (1 - rho) * E[S]`` (so that the whole is
    Kingman's ``rho / (1 - rho) (c_a^2 + c_s^2) / 2 E[S]``); infinite when ``rho >= 1``. The service
    times the queue reads are the server's busy time, ``occupancy`` x the requests' times."""
    rho = utilisation(service_ms, load)
    if rho >= 1.0:
        return math.inf
    second_moment = load.occupancy ** 2 * (load.rate_adjustable / 1000.0 * (1.0 + load.service_scv) * service_ms ** 2
                                           + load.rate_other / 1000.0 * load.other_m2_ms2)
    wait = second_moment / (2.0 * (1.0 - rho))
    total_rate = (load.rate_adjustable + load.rate_other) / 1000.0
    if load.arrival_scv != 1.0 and total_rate > 0:
        wait += (load.arrival_scv - 1.0) / 2.0 * rho / (1.0 - rho) * (rho / total_rate)
    return max(0.0, wait)


def wait_exceeds(t_ms: np.ndarray, rho: float, mean_wait: float) -> np.ndarray:
    """``P(wait > t)`` for each of ``t_ms`` in a queue of utilisation ``rho`` and mean wait ``mean_wait`` with
    an exponential tail, ``rho exp(-t rho / W)`` (exact for M/M/1); 0 for an idle server, 1 for ``t < 0``."""
    t = np.asarray(t_ms, dtype=np.float64)
    if rho <= 0.0 or mean_wait <= 0.0:
        return np.where(t < 0, 1.0, 0.0)
    return np.where(t < 0, 1.0, rho * np.exp(-np.maximum(t, 0.0) * rho / mean_wait))


def arrival_cap_ms(budget_ms: float, load: Load) -> float | None:
    """The longest service time ``s`` (at most ``budget_ms``) with ``s + mean_wait_ms(s) <= budget_ms``;
    None without adjustable arrivals, 0 when not even an instant request would meet the budget at this
    load. The left side grows with ``s``; times ``1 - rho(s)`` the inequality is a quadratic in ``s``,
    whose root is the cap (bisection where the quadratic does not hold: arrivals smoother than Poisson)."""
    if load.rate_adjustable <= 0 or not budget_ms > 0:
        return None
    if mean_wait_ms(0.0, load) > budget_ms:
        return 0.0
    if load.arrival_scv >= 1.0:
        cap = _arrival_cap_root(budget_ms, load)
        if cap is not None:
            return cap
    low, high = 0.0, budget_ms
    for _ in range(60):
        mid = (low + high) / 2
        if mid + mean_wait_ms(mid, load) <= budget_ms:
            low = mid
        else:
            high = mid
    return low


def _arrival_cap_root(budget_ms: float, load: Load) -> float | None:
    """:func:`arrival_cap_ms` in closed form. With ``rho(s) = r s + b`` and the second moment ``A s^2 + C``,
    ``s + W(s) <= B`` times ``1 - rho(s)`` reads ``a2 s^2 + a1 s + a0 <= 0`` (Kingman's term ``K rho^2``
    included); its crossing below the saturation point is the cap, stepped down to the last float that
    keeps the inequality as :func:`mean_wait_ms` computes it. None where that fails (the caller bisects)."""
    occupancy = load.occupancy
    r = occupancy * load.rate_adjustable / 1000.0
    b = occupancy * load.rate_other / 1000.0 * load.other_mean_ms
    big_a = occupancy ** 2 * load.rate_adjustable / 1000.0 * (1.0 + load.service_scv)
    big_c = occupancy ** 2 * load.rate_other / 1000.0 * load.other_m2_ms2
    total_rate = (load.rate_adjustable + load.rate_other) / 1000.0
    k = (load.arrival_scv - 1.0) / 2.0 / total_rate if load.arrival_scv != 1.0 and total_rate > 0 else 0.0
    a2 = big_a / 2.0 - r + k * r * r
    a1 = 1.0 - b + 2.0 * k * r * b + budget_ms * r
    a0 = big_c / 2.0 + k * b * b - budget_ms * (1.0 - b)
    if r <= 0.0:  # a load holding the server no time: the bisection answers
        return None
    saturation = (1.0 - b) / r
    if a2 == 0.0:
        root = -a0 / a1 if a1 > 0 else math.inf
    else:
        disc = a1 * a1 - 4.0 * a2 * a0
        if disc < 0:
            return None
        q = -0.5 * (a1 + math.copysign(math.sqrt(disc), a1))
        roots = [x for x in (q / a2, a0 / q if q != 0 else math.nan) if 0.0 <= x <= saturation]
        if not roots:
            return None
        root = min(roots)
    cap = min(budget_ms, max(0.0, root))

    def meets(s: float) -> bool:
        return s + mean_wait_ms(s, load) <= budget_ms

    for _ in range(64):  # the root's rounding: the last float on the side the inequality holds
        if meets(cap):
            return cap
        cap = math.nextafter(cap, 0.0)
    return None


def cheapest_met_share(costs_ms: Sequence[float], budget_ms: float, rate_per_s: float) -> float:
    """The share of requests the cheapest configuration would answer within ``budget_ms`` were every
    request served with it: each of ``costs_ms`` (what it would take, on the machine as the recently
    served requests found it) waits in an M/G/1 queue of those costs at ``rate_per_s``,
    ``P(wait <= t) = 1 - rho exp(-t rho / W)`` (the Pollaczek-Khinchine mean ``W``, an exponential tail);
    the mean of ``P(wait <= budget - cost)`` over the costs. 0 where that queue is unstable."""
    costs = np.asarray(costs_ms, dtype=np.float64)
    if costs.shape[0] == 0:
        return math.nan
    # every request at the cheapest configuration: a queue of "other" requests only
    queue = Load(0.0, max(0.0, rate_per_s), float(costs.mean()), float((costs * costs).mean()))
    rho = utilisation(0.0, queue)
    if rho >= 1.0:
        return 0.0
    return float((1.0 - wait_exceeds(budget_ms - costs, rho, mean_wait_ms(0.0, queue))).mean())


class ArrivalRate:
    """Arrivals of one stream, as rates: :meth:`rate` over the last ``window`` arrivals no older than
    ``horizon_s``; :meth:`burst_rate` that, or the rate of the last few arrivals where those come far
    faster (a burst seen within a few arrivals); :meth:`dispersion` the variability of the counts."""

    def __init__(self, window: int = ARRIVAL_WINDOW, horizon_s: float = ARRIVAL_HORIZON_S,
                 minimum: int = ARRIVAL_MIN) -> None:
        self.window, self.horizon_s, self.minimum = int(window), float(horizon_s), max(2, int(minimum))
        self._times: deque[float] = deque(maxlen=max(int(window), DISPERSION_ARRIVALS))
        self._lock = threading.Lock()

    def observe(self, at_s: float) -> None:
        with self._lock:
            self._times.append(float(at_s))

    def _recent(self, now_s: float, count: int | None = None) -> list[float]:
        with self._lock:
            held = len(self._times)
            start = 0 if count is None else max(0, held - count)
            times = list(itertools.islice(self._times, start, held))
        return [t for t in times if now_s - t <= self.horizon_s]

    def rate(self, now_s: float) -> float | None:
        """``(n - 1) / (now - oldest)`` over the last ``window`` arrivals in the horizon; None with fewer
        than ``minimum``."""
        recent = self._recent(now_s, self.window)
        if len(recent) < self.minimum or now_s <= recent[0]:
            return None
        return (len(recent) - 1) / (now_s - recent[0])

    def burst_rate(self, now_s: float) -> float | None:
        """:meth:`rate`, or the rate of the last :data:`BURST_ARRIVALS` arrivals where that is at least
        :data:`BURST_RATIO` times it."""
        rate = self.rate(now_s)
        last = self._recent(now_s, BURST_ARRIVALS)
        if rate is None or len(last) < BURST_ARRIVALS or now_s <= last[0]:
            return rate
        short = (len(last) - 1) / (now_s - last[0])
        return short if short >= BURST_RATIO * rate else rate

    def dispersion(self, now_s: float, bin_s: float) -> float | None:
        """The index of dispersion (variance over mean) of the arrival counts in consecutive windows of
        ``bin_s`` ending now, over the arrivals kept in the horizon: 1 for a Poisson stream, more for a
        bursty one; None with fewer than :data:`DISPERSION_MIN_BINS` windows or arrivals."""
        with self._lock:
            times = np.fromiter(self._times, dtype=np.float64, count=len(self._times))
        age = now_s - times
        recent = age[age <= self.horizon_s]
        if not bin_s > 0 or recent.shape[0] < DISPERSION_MIN_BINS:
            return None
        bins = int(recent[0] // bin_s)
        if bins < DISPERSION_MIN_BINS:
            return None
        index = np.floor_divide(recent, bin_s).astype(np.int64)
        counts = np.bincount(index[index < bins])
        # the counts' sum and sum of squares in integers (exact); the empty windows count as zeros
        total, squares = int(counts.sum()), int((counts * counts).sum())
        if total <= 0:
            return None
        mean = total / bins
        return (squares * bins - total * total) / bins / (bins - 1) / mean


def replay_cheapest(arrivals: Sequence[tuple[float, float]], costs_ms: Sequence[float]) -> list[bool]:
    """Whether each of ``arrivals`` ((arrival s, budget ms), in arrival order) would have met its budget
    had every one of them been served first come first served at the cheapest configuration: request
    n takes ``costs_ms[n % len(costs_ms)]`` and waits ``W_n = max(0, W_{n-1} + S_{n-1} - gap)``
    (Lindley's recursion); the real arrival times, bursts included. All False without costs."""
    if not costs_ms:
        return [False] * len(arrivals)
    met, wait, previous, cost = [], 0.0, None, 0.0
    for n, (at_s, budget_ms) in enumerate(arrivals):
        if previous is not None:
            wait = max(0.0, wait + cost - (at_s - previous) * 1000.0)
        cost = costs_ms[n % len(costs_ms)]
        met.append(wait + cost <= budget_ms)
        previous = at_s
    return met


def _p90(values: Sequence[float]) -> float:
    return quantile_of(values, 0.9)


@dataclass(frozen=True)
class BudgetPlan:
    """One request's budget, every term (ms unless said; None: the term did not apply)."""

    budget_ms: float
    spent_ms: float  # arrival to stage 1
    reserve_ms: float  # after stage 1 outside the model's path, and the reply
    reply_reserve_ms: float  # the reply's part of reserve_ms
    budget_left_ms: float  # budget - spent - reserve
    queue_cap_ms: float | None  # service ms, end to end
    arrival_rate_rps: float | None
    arrival_cap_ms: float | None  # service ms, end to end
    latency_scale: float
    budget_class: str
    budget_margin: float
    met_target: float | None  # the class's target: min(--met-target, feasible rate)
    feasible_rate: float | None  # the class's recent share the cheapest configuration would meet (cheapest_met_share)
    controller_budget_ms: float  # what the controller reads, in the profile's ms
    cheapest: bool  # the cheapest configuration, the controller not asked: below every reference, or the floor
    arrival_scv: float | None = None  # the arrivals' variability the wait model read (1: Poisson)
    floor: bool = False  # the class's controller requests fell below the cheapest configuration's replay
    batch_factor: float = 1.0  # how much longer than alone it is expected to take in the batch it joins
    batch_rows_expected: int | None = None  # --max-batch > 1: the rows of the batch it joins, itself included
    occupancy: float | None = None  # the share of a request's time it holds the worker alone (the caps read)

    def record(self) -> dict[str, float | str | bool | None]:
        return asdict(self)


class BudgetPlanner:
    """The server's state for budgets: reserves, arrivals, service times, the latency scale and
    the margins of the budget classes. Thread-safe: handlers record arrivals while the worker plans."""

    def __init__(self, reference_ms: Mapping[Config, float], latency_scale: LatencyScale, *,
                 met_target: float | None, queue_aware: bool = True, load_aware: bool = True,
                 burst_aware: bool = True, cheapest_floor: bool = False) -> None:
        self.latency_scale = latency_scale
        reference = {k: v for k, v in reference_ms.items() if math.isfinite(v) and v > 0}
        self.cheapest_reference_ms = min(reference.values()) if reference else None
        self.cheapest_config = min(reference, key=lambda c: (reference[c], c)) if reference else None
        self.met_target = met_target
        self.queue_aware, self.load_aware = bool(queue_aware), bool(load_aware)
        self.burst_aware, self.cheapest_floor = bool(burst_aware), bool(cheapest_floor)
        self._history: deque[tuple[float, float]] = deque(maxlen=FLOOR_ARRIVALS)  # (arrival s, budget ms)
        self._kept: dict[int, deque[bool]] = {}  # per class, whether its controller requests met their budgets
        self._floor_on: dict[int, bool] = {}
        self._targets: dict[int, float] = {}  # per class, the met target the last plan aimed at
        self.initial_margin = 1.0
        self._margins: dict[int, BudgetMargin] = {}
        self._feasible: dict[int, deque[float]] = {}
        self._after = RecentWindow(OVERHEAD_WINDOW)  # after stage 1, outside the model's path
        self._reply = RecentWindow(OVERHEAD_WINDOW)  # serialising and writing the reply
        self._served: deque[tuple[float, float]] = deque(maxlen=FEASIBLE_WINDOW)  # (model / reference, after)
        self._service: dict[bool, deque[float]] = {True: deque(maxlen=SERVICE_WINDOW),
                                                   False: deque(maxlen=SERVICE_WINDOW)}
        self._arrivals = {True: ArrivalRate(), False: ArrivalRate()}
        # what every plan reads of the served requests, kept until the next one is served
        self._service_moments: tuple[float, float, float] | None = None
        self._cheapest_costs: list[float] | None = None
        # cheapest_least_ms and the versions of the windows and the scale it was read from
        self._cheapest_least: tuple[tuple[int, int, int], tuple[float, float]] | None = None
        self._lock = threading.Lock()

    # -- what the server measures
    def observe_arrival(self, at_s: float, adjustable: bool, budget_ms: float | None = None) -> None:
        """A request reached the server (``adjustable``: the controller will choose its cost); with its
        ``budget_ms``, it is one of the arrivals the floor replays."""
        self._arrivals[bool(adjustable)].observe(at_s)
        if budget_ms is not None:
            with self._lock:
                self._history.append((float(at_s), float(budget_ms)))

    def observe_kept(self, budget_ms: float, met: bool) -> None:
        """How a request the controller was to decide ended: within its budget, or not (late, refused,
        dropped). The floor compares these, per class, with the cheapest configuration's replay."""
        index = self.class_of(budget_ms)
        if index == 0:
            return
        with self._lock:
            self._kept.setdefault(index, deque(maxlen=FLOOR_WINDOW)).append(bool(met))

    def observe_refused(self, budget_ms: float) -> None:
        """A request the controller was to decide, refused or dropped before it ran: a miss for its class's
        margin (at the target the class last aimed at) and for the floor. Without it, a server that sheds
        the requests it would have been late on reads its budgets as met and its margin climbs, choosing
        dearer configurations that make it shed more."""
        self.observe_kept(budget_ms, False)
        index = self.class_of(budget_ms)
        if index == 0 or self.met_target is None:
            return
        with self._lock:
            target = self._targets.get(index, self.met_target)
        self._margin(index).observe(False, target=target)

    def observe_served(self, *, after_ms: float, service_ms: float, adjustable: bool,
                       model_over_reference: float | None) -> None:
        """One request's costs: the time after stage 1 outside the model's path, the worker's time on
        it, and its model time over its configuration's reference latency (None: no reference)."""
        with self._lock:
            self._after.append(max(0.0, after_ms))
            self._service[bool(adjustable)].append(max(0.0, service_ms))
            self._service_moments = None
            if model_over_reference is not None and math.isfinite(model_over_reference):
                self._served.append((model_over_reference, max(0.0, after_ms)))
                self._cheapest_costs = None

    def observe_reply(self, reply_ms: float) -> None:
        """The time from the answer's text to the reply's last byte handed to the socket."""
        with self._lock:
            self._reply.append(max(0.0, reply_ms))

    def observe_outcome(self, plan: BudgetPlan, met: bool) -> None:
        """Move the margin of the plan's class (not the class below the cheapest configuration)."""
        index = self._class_index(plan.budget_class)
        if index == 0 or self.met_target is None:
            return
        self._margin(index).observe(met, target=plan.met_target)

    def seed_margin(self, ratios: Sequence[float]) -> float:
        """Start every class's margin from the warm-up: the median ratio of model time to reference
        over their 90th percentile, so that a machine whose configurations are ranked as in the
        profile starts near 1 and one where they are not starts as careful as that spread."""
        if self.met_target is None or not ratios:
            return self.initial_margin
        median, high = quantile_of(ratios, 0.5), _p90(ratios)
        self.initial_margin = min(1.0, max(MARGIN_BOUNDS[0], median / high)) if high > 0 else 1.0
        with self._lock:
            self._margins.clear()
        return self.initial_margin

    # -- the state, read
    def reserve_ms(self) -> tuple[float, float]:
        """(after stage 1, reply): each the 90th percentile of the last requests, 0 before the first."""
        with self._lock:
            return self._after.quantile(0.9), self._reply.quantile(0.9)

    def cheapest_least_ms(self) -> tuple[float, float] | None:
        """(the least the cheapest configuration typically takes to serve a request, its reply's part): its
        reference x the :data:`LEAST_QUANTILE` of its own latency scale's ratios (:meth:`LatencyScale.of`:
        a machine does not slow every configuration alike) plus that quantile of the time after stage 1
        and of the reply, where :meth:`cheapest_ms` holds back their 90th percentiles. What refusing a
        request on arrival and dropping it from the queue reckon with, so that neither gives up a request
        that the cheapest configuration would often have answered in time."""
        if self.cheapest_reference_ms is None or self.cheapest_config is None:
            return None
        # read several times per request (admission, the queue's order, drops): kept until a window or the
        # scale changes
        with self._lock:
            versions = (self._after.version, self._reply.version, self.latency_scale.version)
            cached = self._cheapest_least
            if cached is not None and cached[0] == versions:
                return cached[1]
            after = self._after.quantile(LEAST_QUANTILE)
            reply = self._reply.quantile(LEAST_QUANTILE)
        scale = self.latency_scale.of(self.cheapest_config, LEAST_QUANTILE)
        least = (self.cheapest_reference_ms * scale + after + reply, reply)
        with self._lock:
            self._cheapest_least = (versions, least)
        return least

    def cheapest_ms(self, scale: float | None = None) -> float | None:
        """The cheapest configuration's expected served time: its reference x the scale + the reserves."""
        if self.cheapest_reference_ms is None:
            return None
        after, reply = self.reserve_ms()
        return self.cheapest_reference_ms * (self.latency_scale.value if scale is None else scale) + after + reply

    def load(self, now_s: float, budget_ms: float | None = None, occupancy: float = 1.0
             ) -> tuple[float | None, Load | None]:
        """(the adjustable arrival rate, the :class:`Load` now); (None, None) before enough arrivals.
        Burst-aware (the default), the rates are :meth:`ArrivalRate.burst_rate` and, given the budget,
        the arrivals' variability is their counts' dispersion over windows of that budget;
        ``occupancy``: :attr:`Load.occupancy`."""
        streams = self._arrivals
        rate_of = (lambda s: s.burst_rate(now_s)) if self.burst_aware else (lambda s: s.rate(now_s))
        rate_a = rate_of(streams[True])
        if rate_a is None:
            return None, None
        rate_o = rate_of(streams[False]) or 0.0
        arrival_scv = 1.0
        if self.burst_aware and budget_ms is not None and budget_ms > 0:
            dispersion = streams[True].dispersion(now_s, budget_ms / 1000.0)
            if dispersion is not None:
                arrival_scv = min(ARRIVAL_SCV_BOUNDS[1], max(ARRIVAL_SCV_BOUNDS[0], dispersion))
        scv, mean_o, m2_o = self._service_statistics()
        return rate_a, Load(rate_a, rate_o, mean_o, m2_o, scv, arrival_scv, min(1.0, max(1e-3, occupancy)))

    def _service_statistics(self) -> tuple[float, float, float]:
        """(the adjustable requests' service-time scv, the other requests' mean and second moment) over
        the last requests served."""
        with self._lock:
            moments = self._service_moments
            if moments is not None:
                return moments
            adjustable, other = list(self._service[True]), list(self._service[False])
            scv = 0.0
            if len(adjustable) >= 5:
                mean = sum(adjustable) / len(adjustable)
                var = sum((s - mean) ** 2 for s in adjustable) / len(adjustable)
                scv = min(3.0, var / mean ** 2) if mean > 0 else 0.0
            mean_o = sum(other) / len(other) if other else 0.0
            m2_o = sum(s * s for s in other) / len(other) if other else 0.0
            self._service_moments = (scv, mean_o, m2_o)
            return self._service_moments

    def arrival_rate_rps(self, now_s: float) -> float | None:
        """Every request's arrival rate now (both streams, as :meth:`load` reads them); None before enough arrivals."""
        rates = [s.burst_rate(now_s) if self.burst_aware else s.rate(now_s) for s in self._arrivals.values()]
        known = [r for r in rates if r is not None]
        return sum(known) if known else None

    def class_of(self, budget_ms: float) -> int:
        return budget_class(budget_ms, self.cheapest_ms())

    def margin_of(self, index: int) -> float:
        return 1.0 if self.met_target is None or index == 0 else self._margin(index).value

    def margins(self) -> dict[str, float]:
        """The margin of every class that has one."""
        with self._lock:
            items = sorted(self._margins.items())
        return {class_name(i): m.value for i, m in items}

    def feasible_rates(self) -> dict[str, float]:
        with self._lock:
            items = sorted((i, list(v)) for i, v in self._feasible.items() if v)
        return {class_name(i): sum(v) / len(v) for i, v in items}

    # -- the plan
    def plan(self, budget_ms: float, spent_ms: float, *, now_s: float, waiting_left_ms: Sequence[float] = (),
             fixed: bool = False, batch_factor: float = 1.0, batch_rows_expected: int | None = None,
             occupancy: float = 1.0) -> BudgetPlan:
        """The budget the controller reads for a request at stage 1. ``waiting_left_ms``: the budget
        not yet spent of each request waiting behind it, in queue order; ``fixed``: its knobs are the
        request's own (every term recorded, none applied). Under batching: ``batch_factor``, how much
        longer than alone the request is expected to take in the batch it joins (the controller's budget
        is divided by it), ``batch_rows_expected`` the rows it joins, itself included, and ``occupancy`` the share
        of a request's time it holds the worker alone (the caps' service rate);
        :class:`serve.batch_cost.BatchCost`."""
        after, reply = self.reserve_ms()
        reserve = after + reply
        scale = self.latency_scale.value
        budget_left = budget_ms - spent_ms - reserve
        cheapest_ms = None if self.cheapest_reference_ms is None else self.cheapest_reference_ms * scale + reserve
        index = budget_class(budget_ms, cheapest_ms)
        queue_cap = None
        if self.queue_aware and cheapest_ms is not None and waiting_left_ms and not fixed:
            queue_cap = queue_cap_ms(waiting_left_ms, cheapest_ms - reply, occupancy)
        rate, load = self.load(now_s, budget_ms - reply, occupancy)
        arrival_cap = None
        if self.load_aware and load is not None and not fixed and index > 0:
            arrival_cap = arrival_cap_ms(budget_ms - reply, load)
        total_rate = 0.0 if load is None else load.rate_adjustable + load.rate_other
        feasible = self._feasible_rate(index, budget_ms - reply, total_rate) if not fixed else None
        target = None if self.met_target is None or index == 0 else (
            self.met_target if feasible is None else min(self.met_target, feasible))
        if target is not None:
            with self._lock:
                self._targets[index] = target
        margin = 1.0 if fixed else self.margin_of(index)
        decided = budget_left
        for cap in (queue_cap, arrival_cap):
            if cap is not None:
                decided = min(decided, cap - after)
        factor = 1.0 if fixed else max(1.0, float(batch_factor))
        controller_budget = decided * margin / scale / factor
        floor = not fixed and index > 0 and self.cheapest_floor and self._floor_active(index, cheapest_ms)
        cheapest = (not fixed and self.cheapest_reference_ms is not None
                    and (floor or controller_budget < self.cheapest_reference_ms))
        return BudgetPlan(budget_ms, spent_ms, reserve, reply, budget_left, queue_cap, rate, arrival_cap, scale,
                          class_name(index), margin, target, feasible, controller_budget, cheapest,
                          None if load is None else load.arrival_scv, floor, factor, batch_rows_expected,
                          None if fixed else float(occupancy))

    def floor_states(self) -> dict[str, bool]:
        """Per class with controller requests, whether the floor decides its requests now."""
        with self._lock:
            return {class_name(i): on for i, on in sorted(self._floor_on.items())}

    # -- internals
    def _floor_active(self, index: int, cheapest_ms: float | None) -> bool:
        """Whether the class's recent controller requests met their budgets less often than the cheapest
        configuration would have (:func:`replay_cheapest` of the recent arrivals at the recently served
        costs) by more than :data:`FLOOR_TOLERANCE`; once on, until they meet them as often."""
        if self.cheapest_reference_ms is None or cheapest_ms is None:
            return False
        with self._lock:
            kept = list(self._kept.get(index, ()))
            history = list(self._history)
            served = list(self._served)
            reply = self._reply.quantile(0.5)
            was_on = self._floor_on.get(index, False)
        if len(kept) < FLOOR_MIN or not served:
            return False
        # each served request's ratio, recentred on the cheapest configuration's own scale
        own = self.latency_scale.of(self.cheapest_config) / self.latency_scale.value if self.cheapest_config else 1.0
        costs = [ratio * own * self.cheapest_reference_ms + after + reply for ratio, after in served]
        replayed = [met for (_, budget), met in zip(history, replay_cheapest(history, costs))
                    if budget_class(budget, cheapest_ms) == index][-FLOOR_WINDOW:]
        if len(replayed) < FLOOR_MIN:
            return False
        cheapest_share, kept_share = sum(replayed) / len(replayed), sum(kept) / len(kept)
        on = kept_share < cheapest_share - (0.0 if was_on else FLOOR_TOLERANCE)
        with self._lock:
            self._floor_on[index] = on
        return on

    def _margin(self, index: int) -> BudgetMargin:
        with self._lock:
            margin = self._margins.get(index)
            if margin is None:
                floor = CLASS_MARGIN_FLOORS[index - 1]
                initial = min(MARGIN_BOUNDS[1], max(floor, self.initial_margin))
                margin = BudgetMargin(self.met_target, bounds=(floor, MARGIN_BOUNDS[1]), initial=initial)
                self._margins[index] = margin
            return margin

    def _feasible_rate(self, index: int, budget_ms: float, rate_per_s: float) -> float | None:
        """:func:`cheapest_met_share` of ``budget_ms`` at the recently served requests' model-time ratios
        and after-stage-1 costs, averaged over the class's recent requests (None before any request was
        served with a reference latency)."""
        if self.cheapest_reference_ms is None:
            return None
        with self._lock:
            costs = self._cheapest_costs
            if costs is None:
                costs = self._cheapest_costs = [ratio * self.cheapest_reference_ms + after
                                                for ratio, after in self._served]
            if not costs:
                return None
            share = cheapest_met_share(costs, budget_ms, rate_per_s)
            history = self._feasible.setdefault(index, deque(maxlen=FEASIBLE_WINDOW))
            history.append(share)
            return sum(history) / len(history)

    @staticmethod
    def _class_index(name: str) -> int:
        return next(i for i in range(len(BUDGET_CLASS_EDGES) + 1) if class_name(i) == name)
