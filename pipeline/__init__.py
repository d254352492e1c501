"""pipeline: raw exp5/exp6/core_exp results -> Parquet workspace tables and DuckDB views.

The lowest layer of ctrl: it imports no torch. Other stages use only the names below.
"""

from importlib import import_module
from typing import Any

#: public name -> its module; imported on first use, so that a module needing one name (an
#: error class, the workspace) does not load DuckDB and pyarrow with the rest
_EXPORTS = {
    "build_catalog": "pipeline.catalog",
    "connect": "pipeline.catalog",
    "run_query": "pipeline.catalog",
    "view_ddl": "pipeline.catalog",
    "view_names": "pipeline.catalog",
    "CacheMismatchError": "pipeline.errors",
    "CtrlError": "pipeline.errors",
    "IngestError": "pipeline.errors",
    "KnobError": "pipeline.errors",
    "QueryError": "pipeline.errors",
    "SchemaError": "pipeline.errors",
    "WorkspaceError": "pipeline.errors",
    "WorkspaceLockedError": "pipeline.errors",
    "IngestConfig": "pipeline.ingest_config",
    "IngestReport": "pipeline.ingestion",
    "ingest": "pipeline.ingestion",
    "build_sample_key": "pipeline.keys",
    "CONFIGS": "pipeline.schema",
    "FILES": "pipeline.schema",
    "MEASUREMENTS": "pipeline.schema",
    "SAMPLES": "pipeline.schema",
    "TABLES": "pipeline.schema",
    "TableSchema": "pipeline.schema",
    "workspace_status": "pipeline.status",
    "Workspace": "pipeline.workspace",
    "resolve_workspace": "pipeline.workspace",
}

__all__ = [
    # configs and runners
    "IngestConfig",
    "IngestReport",
    "ingest",
    "workspace_status",
    # workspace and readers
    "Workspace",
    "resolve_workspace",
    "connect",
    "run_query",
    "build_catalog",
    "view_ddl",
    "view_names",
    # schemas
    "TABLES",
    "TableSchema",
    "SAMPLES",
    "MEASUREMENTS",
    "CONFIGS",
    "FILES",
    "build_sample_key",
    # errors
    "CtrlError",
    "IngestError",
    "SchemaError",
    "KnobError",
    "CacheMismatchError",
    "WorkspaceLockedError",
    "WorkspaceError",
    "QueryError",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        msg = f"module 'pipeline' has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(import_module(_EXPORTS[name]), name)
