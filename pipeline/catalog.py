"""DuckDB views over the workspace: generated DDL (pure) and the code that executes it.

Views hold no data, so ``ctrl.duckdb`` can always be deleted and rebuilt; ``ctrl query``
uses an in-memory database with the same views.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import QueryError
from pipeline.schema import FEATURE_TABLES, REQUESTS, TABLES, duckdb_type, quote_ident, quote_literal
from pipeline.workspace import Workspace

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa

#: per (dataset, sample_key): every recorded exp5/exp6 configuration, what offline training reads
GROUPS_SQL = """
WITH e5 AS (
  SELECT dataset, sample_key, max_crops, top_k, num_active_blocks, score
  FROM measurements WHERE experiment = 'exp5'
), e6 AS (
  SELECT dataset, sample_key, max_crops, top_k, num_active_blocks, score, latency_total_ms,
         latency_decode_ms, num_vision_tokens, num_output_tokens
  FROM measurements WHERE experiment = 'exp6'
), c6 AS (
  SELECT dataset, max_crops, top_k, num_active_blocks, latency_total_ms_p50
  FROM configs WHERE experiment = 'exp6'
)
SELECT
  dataset, sample_key, max_crops, top_k, num_active_blocks,
  e5.score AS score_exp5,
  e6.score AS score_exp6,
  coalesce(e6.score, e5.score) AS score,
  CASE WHEN e6.score IS NOT NULL THEN 'exp6' ELSE 'exp5' END AS score_source,
  coalesce(e6.latency_total_ms, c6.latency_total_ms_p50) AS latency_total_ms,
  CASE WHEN e6.latency_total_ms IS NOT NULL THEN 'sample'
       WHEN c6.latency_total_ms_p50 IS NOT NULL THEN 'config_p50' END AS latency_source,
  e6.latency_decode_ms, e6.num_vision_tokens, e6.num_output_tokens,
  count(*) OVER (PARTITION BY dataset, sample_key) AS num_configs
FROM e5 FULL OUTER JOIN e6 USING (dataset, sample_key, max_crops, top_k, num_active_blocks)
LEFT JOIN c6 USING (dataset, max_crops, top_k, num_active_blocks)
"""

GROUPS_COLUMNS = {
    "dataset, sample_key": "the sample",
    "max_crops, top_k, num_active_blocks": "the configuration",
    "score_exp5, score_exp6": "the score recorded by each experiment (null where not recorded)",
    "score": "score_exp6 where present (same run as the latency), else score_exp5; `score_source` says which",
    "latency_total_ms": "exp6 per-sample total latency; where exp6 lacks the sample, the configuration's exp6 median",
    "latency_source": "`sample` or `config_p50` (null: no latency recorded for that configuration)",
    "latency_decode_ms, num_vision_tokens, num_output_tokens": "from the exp6 measurement",
    "num_configs": "configurations recorded for the sample",
}


#: view name -> file (glob) inside workspace/runs/<run_id>/
RUN_VIEWS = {"runs": "run.parquet", "metrics": "metrics.parquet", "evaluations": "evaluation.parquet",
             "online_steps": "online_steps.parquet", "rollouts": "rollouts/step-*.parquet"}


def _paths_sql(paths: Path | list[Path]) -> str:
    if isinstance(paths, list):
        return "[" + ", ".join(quote_literal(str(p)) for p in paths) + "]"
    return quote_literal(str(paths))


def view_ddl(table_paths: dict[str, Path | list[Path]]) -> list[str]:
    """CREATE VIEW statements for the given tables (a path/glob or a list of them each) plus
    derived views, in a stable order."""
    statements = [
        f"CREATE OR REPLACE VIEW {quote_ident(name)} AS SELECT * FROM read_parquet({_paths_sql(path)}, "
        "union_by_name = true)"
        for name, path in sorted(table_paths.items())
    ]
    if {"measurements", "configs"} <= table_paths.keys():
        statements.append(f"CREATE OR REPLACE VIEW groups AS {GROUPS_SQL.strip()}")
    return statements


def requests_view_ddl(log_glob: Path) -> str:
    """The ``requests`` view over the server's JSON-lines logs: typed columns from the schema; a
    line that does not parse (a torn tail after a crash of the file system) is left out."""
    columns = ", ".join(f"{quote_literal(c.name)}: {quote_literal(duckdb_type(c.dtype))}" for c in REQUESTS.columns)
    return (f"CREATE OR REPLACE VIEW requests AS SELECT * FROM read_json({quote_literal(str(log_glob))}, "
            f"format = 'newline_delimited', columns = {{{columns}}}, ignore_errors = true) "
            "WHERE request_id IS NOT NULL")


def _requests_glob(workspace: Workspace) -> Path | None:
    directory = workspace.requests_dir
    return directory / "*.jsonl" if any(directory.glob("*.jsonl")) else None


def workspace_table_paths(workspace: Workspace) -> dict[str, Path | list[Path]]:
    """The live generation's tables, plus feature tables (a glob over every model's cache) and
    run tables; ``measurements`` also reads the online rollouts (experiment 'online')."""
    gen = workspace.require_generation()
    paths = {name: gen / f"{name}.parquet" for name in TABLES if (gen / f"{name}.parquet").exists()}
    for name in FEATURE_TABLES:
        if any(workspace.features_dir.glob(f"*/chunk-*/{name}.parquet")):
            paths[name] = workspace.features_dir / "*" / "chunk-*" / f"{name}.parquet"
    for name, filename in RUN_VIEWS.items():  # written by the trainer, one file per run
        if any(workspace.runs_dir.glob(f"*/{filename}")):
            paths[name] = workspace.runs_dir / "*" / filename
    if "rollouts" in paths and "measurements" in paths:
        paths["measurements"] = [paths["measurements"], paths["rollouts"]]  # type: ignore[list-item]
    return paths


def connect(workspace: Workspace) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the workspace's views."""
    import duckdb  # deferred: parser worker processes import pipeline and never query

    con = duckdb.connect()
    for stmt in _workspace_ddl(workspace):
        con.execute(stmt)
    return con


def _workspace_ddl(workspace: Workspace) -> list[str]:
    statements = view_ddl(workspace_table_paths(workspace))
    log_glob = _requests_glob(workspace)
    if log_glob is not None:
        statements.append(requests_view_ddl(log_glob))
    return statements


def view_names(con: duckdb.DuckDBPyConnection) -> set[str]:
    """The views of a connection from :func:`connect` (which ones exist depends on what the workspace holds)."""
    return {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}


def build_catalog(workspace: Workspace) -> Path:
    """(Re)write ``ctrl.duckdb`` with views over the live generation; atomic replace."""
    import duckdb  # deferred, as in connect()

    tmp = workspace.root / f".{workspace.catalog_path.name}.{uuid.uuid4().hex}.tmp"
    con = duckdb.connect(str(tmp))
    try:
        for stmt in _workspace_ddl(workspace):
            con.execute(stmt)
        # which generation these views read: a catalog left behind by a crash is detected and rebuilt
        con.execute(f"CREATE VIEW ctrl_generation AS SELECT {quote_literal(workspace.require_generation().name)} "
                    "AS generation")
        con.execute("CHECKPOINT")
    finally:
        con.close()
    os.replace(tmp, workspace.catalog_path)
    return workspace.catalog_path


#: what ``ctrl query`` runs: statements that only read (DESCRIBE, SHOW and SUMMARIZE parse as SELECT)
READ_ONLY_STATEMENTS = ("SELECT", "EXPLAIN")


def _refuse_writes(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """QueryError unless every statement of ``sql`` only reads: a query must never change the
    workspace's files (``COPY ... TO`` over a table, ``ATTACH`` of the catalog, ...)."""
    for statement in con.extract_statements(sql):
        kind = statement.type.name
        if kind not in READ_ONLY_STATEMENTS:
            msg = (f"query refused: {kind} statements are not run by `ctrl query`, which only reads "
                   f"({', '.join(READ_ONLY_STATEMENTS)}, DESCRIBE, SHOW, SUMMARIZE)\n"
                   "Hint: export with `ctrl query --format csv \"SELECT ...\" > FILE`, or open the data with your own "
                   "duckdb session outside the workspace.")
            raise QueryError(msg)


def run_query(workspace: Workspace, sql: str) -> pa.Table:
    """Run read-only SQL over the workspace views; returns a pyarrow Table. DuckDB errors and
    statements that could write (anything but SELECT / EXPLAIN) become QueryError."""
    import duckdb  # deferred, as in connect()

    con = connect(workspace)
    try:
        _refuse_writes(con, sql)
        con.execute("SET lock_configuration = true")  # no SET can undo the guard's assumptions
        relation = con.sql(sql)
        if relation is None:  # a statement without a result set
            import pyarrow as pa

            return pa.table({})
        return relation.to_arrow_table()
    except (duckdb.InterruptException, RuntimeError) as err:
        # Ctrl-C inside DuckDB surfaces as "Query interrupted": hand it to the caller's interrupt handling
        if isinstance(err, duckdb.InterruptException) or "interrupted" in str(err).lower():
            raise KeyboardInterrupt from None
        raise
    except duckdb.Error as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        views = ", ".join(sorted(workspace_table_paths(workspace)) + ["groups"]
                          + (["requests"] if _requests_glob(workspace) else []))
        msg = f"query failed: {first}\nHint: views are {views}; `ctrl query \"DESCRIBE measurements\"` lists columns."
        raise QueryError(msg) from None
    finally:
        con.close()
