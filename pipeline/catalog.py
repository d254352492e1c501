"""DuckDB views over the workspace: generated DDL (pure) and the code that executes it.

Views hold no data, so ``ctrl.duckdb`` can always be deleted and rebuilt. ``ctrl query`` runs in
an in-memory database whose views read Arrow datasets that pyarrow opens, while DuckDB itself
may open no file and load no extension (:func:`connect_read_only`): read-only by construction,
whatever the statement.

Workspace paths are data: any character a file system allows is escaped before DuckDB's glob
sees it (``[``, ``*`` and ``?`` are glob syntax there).
"""

from __future__ import annotations

import glob
import json
import os
import uuid
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import QueryError
from pipeline.schema import FEATURE_TABLES, REQUESTS, TABLES, duckdb_type, quote_ident, quote_literal
from pipeline.workspace import CHECKSUM_FILE, Workspace, file_sha256

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
             "evaluation_groups": "evaluation_groups.parquet", "online_steps": "online_steps.parquet",
             "rollouts": "rollouts/step-*.parquet", "simulations": "simulations/*.parquet"}


def duckdb_glob(root: Path, pattern: str = "") -> str:
    """``root`` taken literally (its glob characters escaped), then ``pattern`` as a glob."""
    return glob.escape(str(root)) + ("/" + pattern if pattern else "")


def _paths_sql(paths: str | list[str]) -> str:
    if isinstance(paths, list):
        return "[" + ", ".join(quote_literal(p) for p in paths) + "]"
    return quote_literal(paths)


def view_ddl(table_paths: dict[str, str | list[str]]) -> list[str]:
    """CREATE VIEW statements for the given tables (a DuckDB glob or a list of them each, as
    :func:`duckdb_glob` writes them) plus derived views, in a stable order."""
    statements = [
        f"CREATE OR REPLACE VIEW {quote_ident(name)} AS SELECT * FROM read_parquet({_paths_sql(path)}, "
        "union_by_name = true)"
        for name, path in sorted(table_paths.items())
    ]
    if {"measurements", "configs"} <= table_paths.keys():
        statements.append(f"CREATE OR REPLACE VIEW groups AS {GROUPS_SQL.strip()}")
    return statements


def requests_view_ddl(log_glob: str) -> str:
    """The ``requests`` view over the server's JSON-lines logs: typed columns from the schema; a
    line that does not parse (a torn tail after a crash of the file system) is left out."""
    columns = ", ".join(f"{quote_literal(c.name)}: {quote_literal(duckdb_type(c.dtype))}" for c in REQUESTS.columns)
    return (f"CREATE OR REPLACE VIEW requests AS SELECT * FROM read_json({quote_literal(log_glob)}, "
            f"format = 'newline_delimited', columns = {{{columns}}}, ignore_errors = true) "
            "WHERE request_id IS NOT NULL")


def _requests_glob(workspace: Workspace) -> str | None:
    directory = workspace.requests_dir
    return duckdb_glob(directory, "*.jsonl") if any(p.is_file() for p in directory.glob("*.jsonl")) else None


def _globbed_tables(workspace: Workspace) -> dict[str, tuple[Path, str]]:
    """table -> (workspace directory, glob inside it), for the tables outside the generation."""
    tables = {name: (workspace.features_dir, f"*/chunk-*/{name}.parquet") for name in FEATURE_TABLES}
    tables.update({name: (workspace.runs_dir, f"*/{filename}") for name, filename in RUN_VIEWS.items()})
    return tables


def workspace_table_files(workspace: Workspace) -> dict[str, list[Path]]:
    """Every table's files, listed: the live generation's tables, the feature tables of every
    model's cache and the run tables; ``measurements`` also reads the online rollouts."""
    gen = workspace.require_generation()
    files = {name: [gen / f"{name}.parquet"] for name in TABLES if (gen / f"{name}.parquet").exists()}
    for name, (root, pattern) in _globbed_tables(workspace).items():
        found = sorted(root.glob(pattern))  # Path.glob takes the root literally
        if found:
            files[name] = found
    if "rollouts" in files and "measurements" in files:
        files["measurements"] = files["measurements"] + files["rollouts"]
    return files


def workspace_table_paths(workspace: Workspace) -> dict[str, str | list[str]]:
    """The tables of :func:`workspace_table_files` as DuckDB globs (``ctrl.duckdb``'s views then
    also see the files written after it was built)."""
    files = workspace_table_files(workspace)
    gen = workspace.require_generation()
    paths: dict[str, str | list[str]] = {name: duckdb_glob(gen / f"{name}.parquet") for name in TABLES
                                         if name in files}
    for name, (root, pattern) in _globbed_tables(workspace).items():
        if name in files:
            paths[name] = duckdb_glob(root, pattern)
    if "rollouts" in paths and "measurements" in paths:
        paths["measurements"] = [paths["measurements"], paths["rollouts"]]  # type: ignore[list-item]
    return paths


def connect(workspace: Workspace) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the workspace's views (:func:`connect_read_only` without
    the guard): the views read Arrow datasets, so any path works, whatever DuckDB makes of it."""
    return connect_read_only(workspace, guard=False)


def _workspace_ddl(workspace: Workspace) -> list[str]:
    statements = view_ddl(workspace_table_paths(workspace))
    log_glob = _requests_glob(workspace)
    if log_glob is not None:
        statements.append(requests_view_ddl(log_glob))
    return statements


def view_names(con: duckdb.DuckDBPyConnection) -> set[str]:
    """The views of a connection from :func:`connect` (which ones exist depends on what the workspace holds)."""
    return {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}


def catalog_supported(workspace: Workspace) -> bool:
    """DuckDB reads a backslash in a path as a separator, so a workspace whose path holds one gets no
    ``ctrl.duckdb`` (``ctrl query`` and every command work all the same)."""
    return "\\" not in str(workspace.root.resolve())


def build_catalog(workspace: Workspace) -> Path | None:
    """(Re)write ``ctrl.duckdb`` with views over the live generation; atomic replace. None (and no
    catalog) where :func:`catalog_supported` says DuckDB cannot open the workspace's paths."""
    import duckdb  # deferred, as in connect()

    if not catalog_supported(workspace):
        workspace.catalog_path.unlink(missing_ok=True)
        return None

    tmp = workspace.root / f".{workspace.catalog_path.name}.{uuid.uuid4().hex}.tmp"
    try:
        con = duckdb.connect(str(tmp))
        try:
            for stmt in _workspace_ddl(workspace):
                con.execute(stmt)
            # which generation these views read: a catalog left behind by a crash is detected and rebuilt
            con.execute(f"CREATE VIEW ctrl_generation AS SELECT "
                        f"{quote_literal(workspace.require_generation().name)} AS generation")
            con.execute("CHECKPOINT")
        finally:
            con.close()
        _move_aside_a_directory(workspace.catalog_path)
        os.replace(tmp, workspace.catalog_path)
    finally:
        for left in (tmp, tmp.with_name(tmp.name + ".wal")):
            left.unlink(missing_ok=True)
    return workspace.catalog_path


#: where :func:`build_catalog` moves a directory found in the catalog's place (it deletes nothing it did not write)
NOT_A_CATALOG_SUFFIX = ".not-a-catalog"


def _move_aside_a_directory(path: Path) -> None:
    if not path.is_dir() or path.is_symlink():
        return
    aside = path.with_name(path.name + NOT_A_CATALOG_SUFFIX)
    n = 1
    while aside.exists() or aside.is_symlink():
        n += 1
        aside = path.with_name(f"{path.name}{NOT_A_CATALOG_SUFFIX}-{n}")
    os.rename(path, aside)


#: set before a query's SQL runs, then locked: DuckDB opens no file (the views read Arrow datasets
#: that pyarrow opened), downloads nothing, installs and loads no extension. The connection also has
#: no temp directory (:data:`QUERY_CONFIG`): DuckDB keeps the one it has among the directories it
#: may open even with external access off, and its default is ``./.tmp`` of the current directory.
QUERY_GUARD = ("SET enable_external_access = false", "SET autoinstall_known_extensions = false",
               "SET autoload_known_extensions = false", "SET lock_configuration = true")
#: the guarded connection's settings at creation: no temp directory (nothing spills, nothing else is opened)
QUERY_CONFIG = {"temp_directory": ""}


def connect_read_only(workspace: Workspace, guard: bool = True) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the workspace's views, which no statement can make
    write a file, read one outside the workspace's tables, or reach the network (:data:`QUERY_GUARD`;
    ``guard=False``: the same views, for the project's own queries)."""
    import duckdb  # deferred, as in connect()
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    con = duckdb.connect(config=QUERY_CONFIG if guard else {})
    try:
        tables = workspace_table_files(workspace)
        # a damaged run file leaves its run out of every view that reads it (`measurements` reads the
        # rollouts too), never the other runs; each is checked once
        run_files = {f for name in RUN_VIEWS for f in tables.get(name, ())}
        damaged = {f for f in run_files if not _intact_run_file(f)}
        for name, files in sorted(tables.items()):
            files = [f for f in files if f not in damaged]
            if not files:
                continue
            if name in TABLES:
                _check_generation_table(workspace, name)
            schemas = []
            for f in files:
                try:
                    schemas.append(pq.read_schema(f))
                except (OSError, pa.ArrowException) as err:
                    msg = (f"{f}: not a readable Parquet file ({str(err).splitlines()[0]})\n"
                           "Hint: `ctrl doctor` checks every file of the workspace and says how to rebuild it.")
                    raise QueryError(msg) from None
            schema = pa.unify_schemas(schemas, promote_options="permissive")  # as union_by_name
            source = f"_arrow_{name}"
            con.register(source, ds.dataset([str(f) for f in files], format="parquet", schema=schema))
            con.execute(f"CREATE VIEW {quote_ident(name)} AS SELECT * FROM {quote_ident(source)}")
        if {"measurements", "configs"} <= set(tables):
            con.execute(f"CREATE VIEW groups AS {GROUPS_SQL.strip()}")
        log = request_log_table(workspace)
        if log is not None:
            con.register("_arrow_requests", log)
            con.execute("CREATE VIEW requests AS SELECT * FROM _arrow_requests")
        for statement in QUERY_GUARD if guard else ():
            con.execute(statement)
    except BaseException:
        con.close()
        raise
    return con


def _intact_run_file(path: Path) -> bool:
    """A run file whose content is what its writer recorded (or has no recorded hash) and whose footer reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        recorded = json.loads((path.parent / CHECKSUM_FILE).read_text()).get(path.name)
    except (OSError, ValueError, AttributeError):
        recorded = None
    try:
        if recorded is not None and file_sha256(path) != recorded:
            return False
        pq.read_schema(path)
    except (OSError, ValueError, pa.ArrowException):
        return False
    return True


def _check_generation_table(workspace: Workspace, name: str) -> None:
    """QueryError when a table of the live generation differs from what its ingest wrote."""
    gen = workspace.require_generation()
    try:
        recorded = json.loads((gen / "state.json").read_text()).get("sha256", {}).get(f"{name}.parquet")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded is not None and file_sha256(gen / f"{name}.parquet") != recorded:
        msg = (f"{gen / f'{name}.parquet'}: content differs from what its ingest wrote (SHA-256)\n"
               "Hint: `ctrl doctor` lists what is damaged; `ctrl ingest` rebuilds it from the parse cache and the "
               "inputs.")
        raise QueryError(msg)


def request_log_table(workspace: Workspace) -> pa.Table | None:
    """The server's request logs as a table of the ``requests`` schema; lines that do not parse (a
    torn tail after a crash) or hold no request are left out. None without any log."""
    import pyarrow as pa

    files = sorted(p for p in workspace.requests_dir.glob("*.jsonl") if p.is_file())  # not a directory so named
    if not files:
        return None
    schema = REQUESTS.arrow_schema()
    return pa.concat_tables([_log_file_table(path, schema) for path in files])


def _log_file_table(path: Path, schema: pa.Schema) -> pa.Table:
    """One request log: Arrow's JSON reader for a clean file (C++, every command's connection reads
    the logs), line by line in Python for a file with a line it cannot take."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    try:
        read = pj.read_json(path, parse_options=pj.ParseOptions(explicit_schema=schema,
                                                                unexpected_field_behavior="ignore"))
    except (OSError, pa.ArrowInvalid, pa.ArrowTypeError):
        return _log_file_table_by_line(path, schema)
    columns = [read.column(name) if name in read.column_names else pa.nulls(read.num_rows, schema.field(name).type)
               for name in schema.names]
    table = pa.Table.from_arrays(columns, schema=schema)
    return table.filter(pc.is_valid(table["request_id"]))


def _log_file_table_by_line(path: Path, schema: pa.Schema) -> pa.Table:
    import pyarrow as pa

    rows = []
    for line in path.read_bytes().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or row.get("request_id") is None:
            continue
        if isinstance(row.get("time"), str):
            try:
                row["time"] = datetime.fromisoformat(row["time"])
            except ValueError:
                row["time"] = None
        rows.append({c: row.get(c) for c in schema.names})
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # a line of other types: keep every line that converts
        kept = []
        for row in rows:
            try:
                pa.Table.from_pylist([row], schema=schema)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                continue
            kept.append(row)
        return pa.Table.from_pylist(kept, schema=schema)


def csv_ready(table: pa.Table) -> pa.Table:
    """``table`` with its nested columns (lists, structs, maps), which CSV cannot hold, as JSON text."""
    import pyarrow as pa

    columns = []
    for column, field in zip(table.columns, table.schema):
        if pa.types.is_nested(field.type):
            column = pa.array([None if v is None else json.dumps(v, default=str) for v in column.to_pylist()],
                              pa.string())
        columns.append(column)
    return pa.Table.from_arrays(columns, names=table.column_names)


def run_query(workspace: Workspace, sql: str) -> pa.Table:
    """Run SQL over the workspace views in a :func:`connect_read_only` connection; returns a pyarrow
    Table. DuckDB errors become QueryError; so does any attempt to open a file."""
    import duckdb  # deferred, as in connect()

    con = connect_read_only(workspace)
    try:
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
    except duckdb.PermissionException as err:
        first = str(err).strip().splitlines()[0]
        msg = (f"query refused: `ctrl query` only reads the workspace's views; it opens no file, downloads "
               f"nothing and loads no extension ({first})\n"
               "Hint: export with `ctrl query --format csv \"SELECT ...\" > FILE`, or open ctrl.duckdb in your own "
               "duckdb session.")
        raise QueryError(msg) from None
    except duckdb.Error as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        views = ", ".join(sorted(workspace_table_paths(workspace)) + ["groups"]
                          + (["requests"] if _requests_glob(workspace) else []))
        msg = f"query failed: {first}\nHint: views are {views}; `ctrl query \"DESCRIBE measurements\"` lists columns."
        raise QueryError(msg) from None
    finally:
        con.close()
