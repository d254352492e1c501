"""The costs of a served request outside the profiled model time, the machine's latency scales and its
service noise: read from a ``ctrl serve`` request log (a workspace's ``requests/*.jsonl`` or one such
file), else none.

A served request's time is its parse, its queue, stage 1 (the controller's first decision and the
budget plan), the preprocessing at the chosen crops that the worker waits for, the model (vision,
prefill, decode: what the profile records), stage 2, the rest until the answer's text
(detokenising, the record) and the reply's write. From the log's :data:`RECENT_REQUESTS` most recent
answered requests, the simulation takes each fixed part as their median (preprocessing per crops
choice); the latency scale as their median model time over the simulated samples' median latency at
the configuration they ran (per configuration where enough ran it); and the service noise as the
spread of those ratios beyond the samples' own. The log records the reply's write only as the
server's reserve for it (the 90th percentile of recent replies): its median is read, so the reply
term leans long; the client's own costs are not in the log at all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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
#: the request-log columns the calibration reads
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

    def scale(self, config: Config) -> float:
        """The machine's model time over the profile's at ``config``."""
        return self.scale_by_config.get(tuple(config), self.latency_scale)

    def preprocess(self, max_crops: int) -> float:
        return self.preprocess_ms.get(int(max_crops), self.preprocess_other_ms)

    def worker_ms(self, max_crops: int, model_ms: float) -> float:
        """The worker's time on a request at ``max_crops`` whose model time is ``model_ms``."""
        return self.stage1_ms + self.preprocess(max_crops) + model_ms + self.stage2_ms + self.rest_ms


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
        frames.append(frame.select([pl.col(c).cast(pl.Float64) if c.startswith(("latency_", "reply_", "max_", "top_",
                                                                                 "num_")) else pl.col(c).cast(pl.Utf8)
                                    for c in LOG_COLUMNS]))
    log = pl.concat(frames) if frames else pl.DataFrame(schema={c: pl.Float64 for c in LOG_COLUMNS})
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


def calibrate(source: Path, reference_ms: Mapping[Config, float], model_fingerprint: str | None = None,
              sample_spread: Mapping[Config, float] | None = None, recent: int = RECENT_REQUESTS) -> Overheads:
    """The :class:`Overheads` of a served request log; the latency scale is the median of the requests' model
    time over ``reference_ms`` of their configuration (the simulated samples' median latency there; 1 where no
    request ran a configuration with one)."""
    log = read_log(source, model_fingerprint, recent)
    parts = {c: log[c].to_list() for c in LOG_COLUMNS if c.startswith("latency_")}
    rest = [t - (q or 0) - (p or 0) - (s1 or 0) - (pp or 0) - (m or 0) - (s2 or 0)
            for t, q, p, s1, pp, m, s2 in zip(parts["latency_total_ms"], parts["latency_queue_ms"],
                                                parts["latency_parse_ms"], parts["latency_stage1_ms"],
                                                parts["latency_preprocess_ms"], parts["latency_model_ms"],
                                                parts["latency_stage2_ms"], strict=True) if t is not None]
    preprocess: dict[int, list[float]] = {}
    for crops, ms in zip(log["max_crops"].to_list(), parts["latency_preprocess_ms"], strict=True):
        if crops is not None and ms is not None:
            preprocess.setdefault(int(crops), []).append(ms)
    ratios: dict[Config, list[float]] = {}
    for c, k, b, ms in zip(log["max_crops"].to_list(), log["top_k"].to_list(), log["num_active_blocks"].to_list(),
                           parts["latency_model_ms"], strict=True):
        if None in (c, k, b, ms):
            continue
        config = (int(c), int(k), int(b))
        reference = reference_ms.get(config)
        if reference and reference > 0:
            ratios.setdefault(config, []).append(ms / reference)
    every = [r for values in ratios.values() for r in values]
    noise = 0.0
    if sample_spread:  # the served spread around each configuration's median, less the samples' own
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
                     noise_sigma=noise, source=str(source), requests=log.height)
