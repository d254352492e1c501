"""The costs of a served request outside the profiled model time, the machine's latency scales and its
service noise: read from a ``ctrl serve`` request log (a workspace's ``requests/*.jsonl`` or one such
file), else none.

A served request's time is its parse, its queue, stage 1 (the controller's first decision and the
budget plan), the preprocessing at the chosen crops that the worker waits for, the model (vision,
prefill, decode: what the profile records), stage 2, the rest until the answer's text
(detokenising, the record) and the reply's write. From the log's :data:`RECENT_REQUESTS` most recent
answered requests, the simulation takes each fixed part as their median (preprocessing per crops
choice), and each simulated request draws one of those requests' parse, stage 1, stage 2 and rest,
so that they spread as served; the latency scale as their median model time over the simulated
samples' median latency at the configuration they ran (per configuration where enough ran it); and
the service noise as the spread of those ratios beyond the samples' own. A request whose
``metadata`` names a simulated sample (``example_id``) is paired with that sample's own profiled
latency instead: its ratio counts in the scale, and where enough requests are paired the noise is
their ratios' own spread (per configuration, around its mean), not an estimate net of the samples'
spread. The log records the reply's write only as the server's reserve for it (the 90th percentile
of recent replies): its median is read, so the reply term leans long; the client's own costs are not
in the log at all.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.errors import CtrlError
from pipeline.knobs import Config

#: the fewest requests at one configuration that give it a latency scale of its own
SCALE_MIN_REQUESTS = 8
#: the answered requests the calibration reads: the most recent (a workspace's logs span every session
#: served on it, on whatever machine and load it ran then)
RECENT_REQUESTS = 2000
#: the ``metadata`` key that names a request's profiled sample (its ``example_id``)
SAMPLE_KEY = "example_id"
#: the request-log columns the calibration reads (and ``metadata``, where the log has it)
LOG_COLUMNS = ("time", "status", "model_fingerprint", "max_crops", "top_k", "num_active_blocks", "reply_reserve_ms",
               "latency_parse_ms", "latency_queue_ms", "latency_stage1_ms", "latency_preprocess_ms",
               "latency_stage2_ms", "latency_model_ms", "latency_total_ms")


@dataclass(frozen=True)
class Overheads:
    """Per-request costs outside the profiled model time (ms), and the machine's latency scale."""

    parse_ms: float = 0.0
    stage1_ms: float = 0.0
    stage2_ms: float = 0.0
    rest_ms: float = 0.0  # after the model and stage 2 until the answer's text
    reply_ms: float = 0.0
    client_ms: float = 0.0  # outside the server's clock: the client's connection, upload and read
    preprocess_ms: dict[int, float] = field(default_factory=dict)  # per max_crops; others: the overall median
    preprocess_other_ms: float = 0.0
    latency_scale: float = 1.0
    #: per configuration with at least SCALE_MIN_REQUESTS requests in the log, its own median ratio (a machine
    #: does not slow every configuration alike); the others take ``latency_scale``
    scale_by_config: dict[Config, float] = field(default_factory=dict)
    #: the log-normal spread (sd of the log) of a request's model time around its sample's recorded one: what
    #: the log's spread holds beyond the samples' own (0: every request takes its sample's time exactly)
    noise_sigma: float = 0.0
    source: str = "profile"  # or the log it was read from
    requests: int = 0  # answered requests it was read from
    paired: int = 0  # of those, the requests paired with their profiled sample (``metadata.example_id``)
    #: (R, 4): per answered request of the log, its parse, stage 1, stage 2 and rest (ms). A simulated request
    #: draws one row, so that these costs spread as the served ones did (the planner's reserves read their 90th
    #: percentile, and a budget is missed on a slow one); None: every request takes the medians above
    fixed_rows: np.ndarray | None = field(default=None, compare=False, repr=False)

    def fixed(self, row: int | None = None) -> tuple[float, float, float, float]:
        """(parse, stage 1, stage 2, rest) ms of the log's request ``row`` (None, or no rows: the medians)."""
        if row is None or self.fixed_rows is None or len(self.fixed_rows) == 0:
            return self.parse_ms, self.stage1_ms, self.stage2_ms, self.rest_ms
        parse, stage1, stage2, rest = self.fixed_rows[row]
        return float(parse), float(stage1), float(stage2), float(rest)

    def scale(self, config: Config) -> float:
        """The machine's model time over the profile's at ``config``."""
        return self.scale_by_config.get(tuple(config), self.latency_scale)

    def preprocess(self, max_crops: int) -> float:
        return self.preprocess_ms.get(int(max_crops), self.preprocess_other_ms)

    def worker_ms(self, max_crops: int, model_ms: float, row: int | None = None) -> float:
        """The worker's time on a request at ``max_crops`` whose model time is ``model_ms``, its fixed costs
        those of the log's request ``row`` (:meth:`fixed`)."""
        _, stage1, stage2, rest = self.fixed(row)
        return stage1 + self.preprocess(max_crops) + model_ms + stage2 + rest


def log_files(source: Path) -> list[Path]:
    """The request logs ``source`` names: one ``.jsonl`` file, or a workspace's ``requests/*.jsonl``."""
    source = Path(source)
    if source.is_file():
        return [source]
    files = sorted((source / "requests").glob("*.jsonl"))
    if not files:
        msg = (f"{source}: no request log (requests/*.jsonl) to calibrate from\n"
               f"Hint: serve requests with `ctrl serve -w {source}` first, or leave out --calibrate-from.")
        raise CtrlError(msg)
    return files


def read_log(source: Path, model_fingerprint: str | None = None, recent: int = RECENT_REQUESTS) -> pl.DataFrame:
    """The ``recent`` most recent answered requests of ``source``'s logs (of the model ``model_fingerprint``
    where given), oldest first."""
    frames = []
    for path in log_files(source):
        if path.stat().st_size == 0:  # a server that answered nothing
            continue
        try:
            frame = pl.read_ndjson(path, infer_schema_length=None, ignore_errors=True)
        except (pl.exceptions.PolarsError, OSError, ValueError) as exc:
            msg = f"{path}: not a request log ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            raise CtrlError(msg) from None
        if frame.height == 0:
            continue
        missing = [c for c in LOG_COLUMNS if c not in frame.columns]
        if missing:
            msg = f"{path}: not a request log of `ctrl serve` (no column {missing[0]!r})"
            raise CtrlError(msg)
        # a log written before requests carried metadata has none
        metadata = pl.col("metadata").cast(pl.Utf8) if "metadata" in frame.columns else pl.lit(None, pl.Utf8)
        frames.append(frame.select([pl.col(c).cast(pl.Float64) if c.startswith(("latency_", "reply_", "max_", "top_",
                                                                                 "num_")) else pl.col(c).cast(pl.Utf8)
                                    for c in LOG_COLUMNS] + [metadata.alias("metadata")]))
    log = pl.concat(frames) if frames else pl.DataFrame(schema={**{c: pl.Float64 for c in LOG_COLUMNS},
                                                                "metadata": pl.Utf8})
    if log.height:
        log = log.filter(pl.col("status") == "ok")
    if model_fingerprint is not None and log.height:
        log = log.filter(pl.col("model_fingerprint").cast(pl.Utf8).str.starts_with(model_fingerprint[:16]))
    if log.height == 0:
        which = f" of model {model_fingerprint[:16]}" if model_fingerprint else ""
        msg = f"{source}: the request log has no answered request{which} to calibrate from"
        raise CtrlError(msg)
    # ISO 8601 times in UTC, as the server writes them, sort as text
    return log.sort("time", maintain_order=True).tail(recent)


def _median(values: pl.Series | list[float]) -> float:
    array = np.asarray([v for v in list(values) if v is not None and math.isfinite(v)], dtype=float)
    return float(np.median(array)) if array.size else 0.0


def sample_of(metadata: str | None) -> str | None:
    """The profiled sample a request's ``metadata`` (the log's JSON text) names, or None."""
    if not metadata:
        return None
    try:
        labels = json.loads(metadata)
    except ValueError:
        return None
    value = labels.get(SAMPLE_KEY) if isinstance(labels, dict) else None
    return value if isinstance(value, str) and value else None


def calibrate(source: Path, reference_ms: Mapping[Config, float], model_fingerprint: str | None = None,
              sample_spread: Mapping[Config, float] | None = None, recent: int = RECENT_REQUESTS,
              sample_latency_ms: Callable[[str, Config], float | None] | None = None) -> Overheads:
    """The :class:`Overheads` of a served request log; the latency scale is the median of the requests' model
    time over ``reference_ms`` of their configuration (the simulated samples' median latency there; 1 where no
    request ran a configuration with one). ``sample_latency_ms(example_id, config)``: a simulated sample's own
    profiled latency (None: not simulated), which a request naming it in its metadata is read against."""
    log = read_log(source, model_fingerprint, recent)
    parts = {c: log[c].to_list() for c in LOG_COLUMNS if c.startswith("latency_")}
    rows = [(p or 0.0, s1 or 0.0, s2 or 0.0, max(0.0, t - (q or 0) - (p or 0) - (s1 or 0) - (pp or 0) - (m or 0)
                                                 - (s2 or 0)))
            for t, q, p, s1, pp, m, s2 in zip(parts["latency_total_ms"], parts["latency_queue_ms"],
                                                parts["latency_parse_ms"], parts["latency_stage1_ms"],
                                                parts["latency_preprocess_ms"], parts["latency_model_ms"],
                                                parts["latency_stage2_ms"], strict=True) if t is not None]
    rest = [row[3] for row in rows]
    preprocess: dict[int, list[float]] = {}
    for crops, ms in zip(log["max_crops"].to_list(), parts["latency_preprocess_ms"], strict=True):
        if crops is not None and ms is not None:
            preprocess.setdefault(int(crops), []).append(ms)
    ratios: dict[Config, list[float]] = {}
    paired: dict[Config, list[float]] = {}  # the ratios of requests read against their own sample
    for c, k, b, ms, labels in zip(log["max_crops"].to_list(), log["top_k"].to_list(),
                                   log["num_active_blocks"].to_list(), parts["latency_model_ms"],
                                   log["metadata"].to_list(), strict=True):
        if None in (c, k, b, ms):
            continue
        config = (int(c), int(k), int(b))
        sample = sample_of(labels) if sample_latency_ms is not None else None
        own_ms = sample_latency_ms(sample, config) if sample is not None else None
        if own_ms is not None and own_ms > 0:
            paired.setdefault(config, []).append(ms / own_ms)
            ratios.setdefault(config, []).append(ms / own_ms)
            continue
        reference = reference_ms.get(config)
        if reference and reference > 0:
            ratios.setdefault(config, []).append(ms / reference)
    every = [r for values in ratios.values() for r in values]
    noise = 0.0
    # paired: each request's spread around its configuration's mean (in logs), its sample's own taken out
    spread = [math.log(r) - float(np.mean(np.log(v))) for v in paired.values() if len(v) >= SCALE_MIN_REQUESTS
              for r in v]
    if len(spread) >= SCALE_MIN_REQUESTS:
        noise = float(np.std(spread))
    elif sample_spread:  # the served spread around each configuration's median, less the samples' own
        served = [math.log(r) - float(np.mean(np.log(v))) for c, v in ratios.items()
                  if len(v) >= SCALE_MIN_REQUESTS for r in v]
        own = [sample_spread[c] ** 2 for c, v in ratios.items() if len(v) >= SCALE_MIN_REQUESTS and c in sample_spread]
        if len(served) >= SCALE_MIN_REQUESTS and own:
            noise = math.sqrt(max(0.0, float(np.var(served)) - float(np.mean(own))))
    return Overheads(parse_ms=_median(parts["latency_parse_ms"]), stage1_ms=_median(parts["latency_stage1_ms"]),
                     stage2_ms=_median(parts["latency_stage2_ms"]), rest_ms=max(0.0, _median(rest)),
                     reply_ms=_median(log["reply_reserve_ms"]),
                     preprocess_ms={c: _median(v) for c, v in sorted(preprocess.items())},
                     preprocess_other_ms=_median(parts["latency_preprocess_ms"]),
                     latency_scale=_median(every) if every else 1.0,
                     scale_by_config={c: _median(v) for c, v in sorted(ratios.items()) if len(v) >= SCALE_MIN_REQUESTS},
                     noise_sigma=noise, source=str(source), requests=log.height,
                     paired=sum(len(v) for v in paired.values()),
                     fixed_rows=np.asarray(rows, dtype=float).reshape(-1, 4) if rows else None)
