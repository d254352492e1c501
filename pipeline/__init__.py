"""pipeline: raw exp5/exp6/core_exp results -> Parquet workspace tables and DuckDB views.

The lowest layer of ctrl: it imports no torch. Other stages use only the names below.
"""

from pipeline.catalog import build_catalog, connect, run_query, view_ddl, view_names
from pipeline.errors import (
    CacheMismatchError,
    CtrlError,
    IngestError,
    KnobError,
    QueryError,
    SchemaError,
    WorkspaceError,
    WorkspaceLockedError,
)
from pipeline.ingestion import IngestConfig, IngestReport, ingest
from pipeline.keys import build_sample_key
from pipeline.schema import CONFIGS, FILES, MEASUREMENTS, SAMPLES, TABLES, TableSchema
from pipeline.status import workspace_status
from pipeline.workspace import Workspace, resolve_workspace

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
