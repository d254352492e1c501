"""The one exception hierarchy of ctrl.

Every error a user can cause derives from :class:`CtrlError`; the CLI turns it into one
red line on stderr and exit code 1. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path


class CtrlError(Exception):
    """Base class of every user-facing ctrl error."""


def describe(error: BaseException, limit: int = 200) -> str:
    """``ExceptionType: first line of its message`` (cut at ``limit``): how a foreign exception
    (pyarrow, torch, DuckDB, ...) is named inside a one-line ctrl error."""
    first = (str(error).strip().splitlines() or [""])[0][:limit]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class IngestError(CtrlError):
    """A results file that cannot be ingested.

    Example: a truncated ``exp6_latency_crops6_topk8_blocks16_rank0.json`` gives
    ``exp6_latency_crops6_topk8_blocks16_rank0.json: invalid JSON: unexpected end of data (line 40)``.
    """

    def __init__(self, path: str | Path, reason: str, field: str | None = None) -> None:
        self.path = str(path)
        self.field = field
        self.reason = reason
        where = f"{Path(self.path).name}: {field}: " if field else f"{Path(self.path).name}: "
        super().__init__(where + reason)


class SchemaError(CtrlError):
    """A table that does not match its declared schema.

    Example: a ``measurements.parquet`` written by another tool without ``sample_key``.
    """


class ModelLoadError(CtrlError):
    """A model directory that cannot be loaded (missing files or modules, unusable device, a dtype
    that does not exist)."""


class KnobError(CtrlError):
    """A knob value outside the knob space, e.g. ``top_k=0`` or ``num_active_blocks=17``."""


class CacheMismatchError(CtrlError):
    """Cached data computed with a different model or parser than the one in use."""


class WorkspaceLockedError(CtrlError):
    """Another ctrl process holds the workspace lock (two concurrent ``ctrl ingest`` runs)."""


class WorkspaceError(CtrlError):
    """A workspace directory that is missing, empty or unreadable."""


class QueryError(CtrlError):
    """SQL that DuckDB rejected; wraps ``duckdb.Error`` once, at the boundary."""
