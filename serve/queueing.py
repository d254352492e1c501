"""The order the waiting requests are served in: earliest deadline first among those that can still
make their budgets, then the rest.

A request's deadline is its arrival plus its budget. When the worker takes the next request, those
whose deadline is at least the cheapest configuration's expected time away (they can still be
answered within their budgets) go first, earliest deadline first; the others with a budget of their
own (late whatever is chosen for them) after, oldest first, until the queue drops them. A request
without a budget of its own (the server's default) is never moved back: its deadline orders it, and
with one budget for every request this is first come, first served. With mixed budgets a tight
budget is not stuck behind a loose one, and in a burst a request that can still make it is not
stuck behind one that cannot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar


class Deadlined(Protocol):
    arrival: float  # perf_counter seconds
    budget_ms: float
    budget_source: str  # request | default


T = TypeVar("T", bound=Deadlined)


def service_order(deadlines_s: Sequence[float], now_s: float, cheapest_s: float,
                  own_budget: Sequence[bool] | None = None) -> list[int]:
    """The indices of the waiting requests (``deadlines_s`` in arrival order) in the order to serve
    them: those with ``deadline - now >= cheapest_s``, and those without a budget of their own
    (``own_budget`` False; all have one by default), by deadline (ties by arrival), then the others by
    arrival."""
    own = [True] * len(deadlines_s) if own_budget is None else list(own_budget)
    late = [i for i, d in enumerate(deadlines_s) if own[i] and d - now_s < cheapest_s]
    first = [i for i in range(len(deadlines_s)) if i not in set(late)]
    return sorted(first, key=lambda i: (deadlines_s[i], i)) + late


def projected_start_ms(deadlines_ms: Sequence[float], droppable: Sequence[bool], start_ms: float,
                       cost_ms: float, served_ms: float | None = None) -> float:
    """When a request would start (ms from now) behind the waiting requests served before it
    (``deadlines_ms``, ms from now, in service order), each taking ``cost_ms`` of the worker, the first
    from ``start_ms`` (when the running one is done): a ``droppable`` one whose turn would come less
    than ``served_ms`` (its whole served time, ``cost_ms`` by default) before its deadline takes no
    time: it will be dropped then, as :meth:`serve.engine.Engine._expired` drops it."""
    start, served = start_ms, cost_ms if served_ms is None else served_ms
    for deadline, drop in zip(deadlines_ms, droppable):
        if drop and start + served > deadline:
            continue
        start += cost_ms
    return start


class DeadlineQueue(Generic[T]):
    """Waiting requests, taken in :func:`service_order`; ``cheapest_ms`` says what the cheapest
    configuration is expected to take now (None: unknown, read as 0). :meth:`close` lets
    :meth:`get` return None once the queue is empty."""

    def __init__(self, cheapest_ms: Callable[[], float | None], clock: Callable[[], float]) -> None:
        self._cheapest_ms, self._clock = cheapest_ms, clock
        self._items: list[T] = []
        self._closed = False
        self._ready = threading.Condition()

    def put(self, item: T) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify()

    def close(self) -> None:
        """No more items: :meth:`get` returns the rest, then None."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def _order(self) -> list[int]:
        cheapest_s = (self._cheapest_ms() or 0.0) / 1000.0
        deadlines = [item.arrival + item.budget_ms / 1000.0 for item in self._items]
        own = [item.budget_source == "request" for item in self._items]
        return service_order(deadlines, self._clock(), cheapest_s, own)

    def get(self, wait: bool = True) -> T | None:
        """The next item to serve (``wait``: for one to come); None once closed and empty, or
        without ``wait`` when none waits."""
        with self._ready:
            while wait and not self._items and not self._closed:
                self._ready.wait()
            if not self._items:
                return None
            return self._items.pop(self._order()[0])

    def snapshot(self) -> list[T]:
        """The waiting items, in the order they would be served now."""
        with self._ready:
            return [self._items[i] for i in self._order()]

    def ahead_of(self, deadline_s: float) -> list[T]:
        """The waiting items that would be served before a request with ``deadline_s`` that can still
        make it: those with an earlier or equal deadline that can still make theirs or have no budget of
        their own, in the order they would be served."""
        with self._ready:
            cheapest_s = (self._cheapest_ms() or 0.0) / 1000.0
            now = self._clock()
            return [self._items[i] for i in self._order()
                    if self._items[i].arrival + self._items[i].budget_ms / 1000.0 <= deadline_s
                    and (self._items[i].budget_source != "request"
                         or self._items[i].arrival + self._items[i].budget_ms / 1000.0 - now >= cheapest_s)]

    def __len__(self) -> int:
        with self._ready:
            return len(self._items)
