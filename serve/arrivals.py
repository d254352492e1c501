"""Arrival processes: when the requests of a workload reach the server.

Production inference traffic is not Poisson: inter-arrival coefficients of variation from about 1
to over 10 have been published for LLM services, with bursts of several times the mean rate for
tens of seconds. The benchmarks replay these shapes, open loop, at a chosen mean rate:

* ``poisson``: exponential gaps (CV 1);
* ``gamma:CV``: independent Gamma gaps with that coefficient of variation (``gamma:1`` is Poisson);
* ``onoff:FACTOR:ON_S:OFF_S``: Poisson within phases whose rate alternates between a base rate
  (for ``OFF_S`` seconds, first) and ``FACTOR`` times it (for ``ON_S`` seconds), the base chosen so
  that the mean over a cycle is the rate asked for;
* ``file:PATH``: arrival times in seconds from a file, one per line (``#`` comments and blank lines
  skipped), shifted to start at 0 and rescaled to the rate asked for (its bursts kept); a workload
  longer than the file repeats it.

:func:`arrival_times` draws the times; :func:`bursts` says where an on/off process's bursts lie, for
the figures that ask how fast a server recovers after one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KINDS = ("poisson", "gamma", "onoff", "file")


class ArrivalSpecError(ValueError):
    """An arrival process spec or file that cannot be used (the message says which part and why)."""


@dataclass(frozen=True)
class ArrivalProcess:
    """A parsed ``--arrivals`` value (see the module's description)."""

    kind: str
    cv: float = 1.0  # gamma
    factor: float = 1.0  # onoff
    on_s: float = 0.0
    off_s: float = 0.0
    path: Path | None = None  # file

    @property
    def name(self) -> str:
        if self.kind == "gamma":
            return f"gamma:{self.cv:g}"
        if self.kind == "onoff":
            return f"onoff:{self.factor:g}:{self.on_s:g}:{self.off_s:g}"
        if self.kind == "file":
            return f"file:{self.path}"
        return "poisson"


def parse_arrivals(spec: str) -> ArrivalProcess:
    """The process a spec names; :class:`ArrivalSpecError` naming the bad part otherwise."""
    kind, _, rest = spec.strip().partition(":")
    kind = kind.lower()
    if kind == "poisson" and not rest:
        return ArrivalProcess("poisson")
    if kind == "file" and rest:
        return ArrivalProcess("file", path=Path(rest))
    parts = rest.split(":") if rest else []
    try:
        values = [float(p) for p in parts]
    except ValueError:
        msg = f"arrivals {spec!r}: {rest!r} is not a list of numbers"
        raise ArrivalSpecError(msg) from None
    if kind == "gamma" and len(values) == 1:
        if not (math.isfinite(values[0]) and values[0] > 0):
            msg = f"arrivals {spec!r}: the coefficient of variation must be > 0"
            raise ArrivalSpecError(msg)
        return ArrivalProcess("gamma", cv=values[0])
    if kind == "onoff" and len(values) == 3:
        factor, on_s, off_s = values
        if not (math.isfinite(factor) and factor >= 1):
            msg = f"arrivals {spec!r}: the burst factor must be >= 1"
            raise ArrivalSpecError(msg)
        if not (math.isfinite(on_s) and on_s > 0 and math.isfinite(off_s) and off_s > 0):
            msg = f"arrivals {spec!r}: the on and off durations must be > 0 seconds"
            raise ArrivalSpecError(msg)
        return ArrivalProcess("onoff", factor=factor, on_s=on_s, off_s=off_s)
    msg = f"arrivals {spec!r}: expected poisson, gamma:CV, onoff:FACTOR:ON_S:OFF_S or file:PATH"
    raise ArrivalSpecError(msg)


def read_trace(path: Path) -> np.ndarray:
    """A trace file's arrival times (s), sorted as written, shifted to start at 0."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        msg = f"{path}: cannot read the arrival trace ({exc.strerror or exc})"
        raise ArrivalSpecError(msg) from None
    times: list[float] = []
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            msg = f"{path}:{number}: {text!r} is not a time in seconds"
            raise ArrivalSpecError(msg) from None
        if not math.isfinite(value):
            msg = f"{path}:{number}: {text!r} is not a finite time"
            raise ArrivalSpecError(msg)
        if times and value < times[-1]:
            msg = (
                f"{path}:{number}: {value:g} s comes before the line above ({times[-1]:g} s); "
                                   "arrival times must not decrease"
            )
            raise ArrivalSpecError(msg)
        times.append(value)
    if len(times) < 2 or times[-1] <= times[0]:
        msg = f"{path}: an arrival trace needs at least two distinct times, got {len(times)}"
        raise ArrivalSpecError(msg)
    return np.asarray(times) - times[0]


def arrival_times(process: ArrivalProcess | str, count: int, rate_per_s: float, seed: int | np.random.Generator
                  ) -> np.ndarray:
    """``count`` increasing arrival times (s) of ``process`` at a mean rate of ``rate_per_s``; seeded.
    A generated process's first arrival comes one gap after 0, a file's at 0."""
    if isinstance(process, str):
        process = parse_arrivals(process)
    if not (math.isfinite(rate_per_s) and rate_per_s > 0):
        msg = f"the arrival rate must be > 0 per second, got {rate_per_s!r}"
        raise ArrivalSpecError(msg)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    if count <= 0:
        return np.zeros(0)
    if process.kind == "poisson":
        return np.cumsum(rng.exponential(1.0 / rate_per_s, count))
    if process.kind == "gamma":
        shape = 1.0 / process.cv ** 2
        return np.cumsum(rng.gamma(shape, 1.0 / (shape * rate_per_s), count))
    if process.kind == "onoff":
        # unit-rate Poisson times mapped through the inverse of the cumulative intensity
        cycle = process.on_s + process.off_s
        base = rate_per_s * cycle / (process.factor * process.on_s + process.off_s)
        per_cycle = base * (process.off_s + process.factor * process.on_s)
        mass = np.cumsum(rng.exponential(1.0, count))
        cycles, within = np.divmod(mass, per_cycle)
        off_mass = base * process.off_s
        in_off = within < off_mass
        offset = np.where(in_off, within / base, process.off_s + (within - off_mass) / (base * process.factor))
        return cycles * cycle + offset
    trace = read_trace(process.path)  # type: ignore[arg-type]
    span = trace[-1] + trace[-1] / (len(trace) - 1)  # a repetition starts one mean gap after the last arrival
    repeats = math.ceil(count / len(trace))
    times = np.concatenate([trace + i * span for i in range(repeats)])[:count]
    return times * ((len(trace) - 1) / trace[-1] / rate_per_s)  # the trace's mean rate over the one asked for


def bursts(process: ArrivalProcess | str, until_s: float) -> list[tuple[float, float]]:
    """The (start, end) seconds of an on/off process's bursts before ``until_s``; [] for the others."""
    if isinstance(process, str):
        process = parse_arrivals(process)
    if process.kind != "onoff":
        return []
    cycle = process.on_s + process.off_s
    out = []
    start = process.off_s
    while start < until_s:
        out.append((start, start + process.on_s))
        start += cycle
    return out
