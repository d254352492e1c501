"""DuckDB views: generated DDL, the catalog file for plain duckdb, the groups view, schema docs."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import CONFIGS, NUM_SAMPLES, run_ingest
from pipeline import QueryError, SchemaError, run_query, view_ddl
from pipeline.schema import FEATURE_TABLES, RUN_TABLES, TABLES, duckdb_type, schema_markdown, schemas_markdown

SCHEMA_DOC = Path(__file__).resolve().parents[1] / "docs" / "schema.md"


def test_view_ddl_is_sorted_and_quotes_paths():
    ddl = view_ddl({"samples": Path("/w/it's/samples.parquet"), "configs": Path("/c.parquet"),
                    "measurements": Path("/m.parquet")})
    assert [s.split()[4] for s in ddl] == ['"configs"', '"measurements"', '"samples"', "groups"]
    assert "read_parquet('/w/it''s/samples.parquet', union_by_name = true)" in ddl[2]
    # no groups without its inputs
    assert view_ddl({"samples": Path("/s.parquet")})[-1].startswith('CREATE OR REPLACE VIEW "samples"')


def test_catalog_file_works_from_plain_duckdb(small_tree, workspace):
    run_ingest([small_tree], workspace)
    with duckdb.connect(str(workspace.catalog_path), read_only=True) as con:
        n = con.execute("SELECT count(*) FROM measurements WHERE experiment = $e", {"e": "exp6"}).fetchone()[0]
        views = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
        generation = con.execute("SELECT generation FROM ctrl_generation").fetchall()
    assert n == len(CONFIGS) * NUM_SAMPLES
    assert views == {"samples", "measurements", "configs", "files", "groups", "ctrl_generation"}
    assert generation == [((workspace.root / "CURRENT").read_text().strip(),)]


def test_groups_view_joins_exp5_scores_with_exp6_latency(small_tree, workspace):
    run_ingest([small_tree], workspace)
    groups = run_query(workspace, "SELECT * FROM groups ORDER BY sample_key, max_crops").to_pylist()
    assert len(groups) == NUM_SAMPLES * len(CONFIGS)
    assert all(g["num_configs"] == len(CONFIGS) and g["latency_source"] == "sample" for g in groups)
    first = groups[0]
    assert ((first["sample_key"], first["score_exp5"], first["score_exp6"], first["latency_total_ms"])
            == ("ex:500000", 0.0, 0.0, 200.0))


def test_groups_view_falls_back_to_config_median_latency(tmp_path, workspace):
    from origin_files import exp5_config_doc, exp5_name, exp6_config_doc, exp6_name, write

    write(tmp_path / "r" / exp5_name(2, 4, 12), exp5_config_doc(2, 4, 12, [0, 1, 2, 3], merged=True))
    write(tmp_path / "r" / exp6_name(2, 4, 12), exp6_config_doc(2, 4, 12, [0, 1], merged=True))
    run_ingest([tmp_path / "r"], workspace)
    rows = run_query(workspace, "SELECT sample_key, latency_total_ms, latency_source, score_source "
                                "FROM groups ORDER BY sample_key").to_pylist()
    assert [r["latency_source"] for r in rows] == ["sample", "sample", "config_p50", "config_p50"]
    assert rows[2]["latency_total_ms"] == pytest.approx(200.5) and rows[2]["score_source"] == "exp5"


def test_bad_sql_is_one_clear_error(small_tree, workspace):
    run_ingest([small_tree], workspace)
    with pytest.raises(QueryError, match=r"query failed: .*no_such_table"):
        run_query(workspace, "SELECT * FROM no_such_table")


@pytest.mark.parametrize(("sql", "message"), [
    ("COPY (SELECT * FROM measurements LIMIT 10) TO '{table}'", "refused"),
    ("COPY (SELECT * FROM measurements LIMIT 10) TO '{table}' (FORMAT parquet, USE_TMP_FILE false)", "refused"),
    ("EXPLAIN ANALYZE COPY (SELECT * FROM measurements) TO '{table}' (FORMAT parquet, USE_TMP_FILE false)",
     "refused"),
    ("ATTACH '{catalog}' AS c; CREATE OR REPLACE VIEW c.measurements AS SELECT 1 AS x", "refused"),
    ("EXPORT DATABASE '{root}/export'", "refused"),
    ("INSTALL httpfs", "refused"),
    ("EXPLAIN ANALYZE INSTALL httpfs", "refused"),
    ("SELECT * FROM 'https://example.com/x.parquet'", "refused"),
    ("SELECT * FROM read_csv('/etc/hostname')", "refused"),
    ("SELECT * FROM read_parquet('{table}')", "refused"),  # even the workspace's files, but through the views
    ("SET lock_configuration = false", "failed"),
    ("SET enable_external_access = true", "failed"),
    ("PRAGMA enable_profiling", "failed"),
])
def test_queries_cannot_write_to_the_workspace_or_reach_out(small_tree, workspace, sql, message):
    run_ingest([small_tree], workspace)
    table = workspace.require_generation() / "measurements.parquet"
    before = {p: p.read_bytes() for p in (table, workspace.catalog_path)}
    files = sorted(p.relative_to(workspace.root) for p in workspace.root.rglob("*"))
    rows = run_query(workspace, "SELECT count(*) AS n FROM measurements").to_pylist()
    statement = sql.format(table=table, catalog=workspace.catalog_path, root=workspace.root)
    expected = (r"^query refused: `ctrl query` only reads the workspace's views" if message == "refused"
                else r"^query failed: .*(Cannot change configuration|configuration has been locked)")
    with pytest.raises(QueryError, match=expected):
        run_query(workspace, statement)
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.relative_to(workspace.root) for p in workspace.root.rglob("*")) == files
    assert run_query(workspace, "SELECT count(*) AS n FROM measurements").to_pylist() == rows


@pytest.mark.parametrize("sql", [
    "COPY (SELECT 1 AS x) TO '.tmp/out.csv'",
    "SELECT * FROM read_csv('.tmp/inside.csv')",
    "SELECT * FROM glob('.tmp/*')",
    "ATTACH '.tmp/new.duckdb' AS n",
])
def test_queries_cannot_reach_a_tmp_folder_of_the_current_directory(small_tree, workspace, tmp_path, monkeypatch,
                                                                    sql):
    # DuckDB's default temp directory is ./.tmp, and it stays openable with external access off
    run_ingest([small_tree], workspace)
    cwd = tmp_path / "cwd"
    (cwd / ".tmp").mkdir(parents=True)
    (cwd / ".tmp" / "inside.csv").write_text("secret\n1\n")
    monkeypatch.chdir(cwd)
    with pytest.raises(QueryError, match=r"^query refused: `ctrl query` only reads the workspace's views"):
        run_query(workspace, sql)
    assert sorted(p.name for p in (cwd / ".tmp").iterdir()) == ["inside.csv"]


def test_read_only_statements_still_run(small_tree, workspace):
    run_ingest([small_tree], workspace)
    assert "score" in run_query(workspace, "DESCRIBE measurements").column("column_name").to_pylist()
    assert run_query(workspace, "EXPLAIN SELECT * FROM measurements").num_rows >= 1
    assert run_query(workspace, "EXPLAIN ANALYZE SELECT count(*) FROM measurements").num_rows >= 1
    pivot = run_query(workspace, "PIVOT (SELECT experiment, max_crops FROM measurements) ON experiment "
                                 "USING count(*) ORDER BY max_crops")
    assert pivot.column_names[0] == "max_crops" and pivot.num_rows >= 1
    # statements that change only the query's own in-memory database run, and leave the workspace alone
    assert run_query(workspace, "CREATE TABLE t AS SELECT 1 AS x; SELECT x FROM t").to_pylist() == [{"x": 1}]


def test_a_workspace_path_with_glob_characters_reads_only_its_own_tables(small_tree, tmp_path):
    from pipeline import Workspace

    mine, other = Workspace(tmp_path / "ws-d[u]pkey"), Workspace(tmp_path / "ws-dupkey")
    run_ingest([small_tree], mine)
    run_ingest([small_tree], other)
    extra = run_query(other, "SELECT count(*) AS n FROM measurements").to_pylist()[0]["n"]
    n = run_query(mine, "SELECT count(*) AS n FROM measurements").to_pylist()[0]["n"]
    assert n == extra  # the same tree: equal counts, and not the two workspaces' tables together
    starry = Workspace(tmp_path / "ws-nan*")
    run_ingest([small_tree], starry)
    assert run_query(starry, "SELECT count(*) AS n FROM measurements").to_pylist()[0]["n"] == n
    con = duckdb.connect(str(mine.catalog_path), read_only=True)  # plain duckdb over ctrl.duckdb
    assert con.sql("SELECT count(*) FROM measurements").fetchall() == [(n,)]
    con.close()


def test_reader_rejects_a_table_of_another_schema(small_tree, workspace):
    run_ingest([small_tree], workspace)
    path = workspace.table_path("samples")
    pq.write_table(pa.table({"dataset": ["x"]}), path)
    with pytest.raises(SchemaError, match=r"columns do not match table 'samples'"):
        workspace.read_table("samples")


@pytest.mark.parametrize("name", sorted(TABLES) + sorted(FEATURE_TABLES) + sorted(RUN_TABLES))
def test_schema_doc_documents_every_table_exactly(name):
    table = TABLES.get(name) or FEATURE_TABLES.get(name) or RUN_TABLES[name]
    assert schema_markdown(table) in SCHEMA_DOC.read_text(), (f"docs/schema.md of {name!r} is stale: "
                                                              "paste the output of `ctrl schema`")


def test_schema_doc_holds_the_output_of_ctrl_schema_in_order():
    assert schemas_markdown() in SCHEMA_DOC.read_text(), "docs/schema.md is stale: paste the output of `ctrl schema`"


def test_a_workspace_under_a_quoted_directory_name_works(small_tree, tmp_path):
    from pipeline import Workspace

    ws = Workspace(tmp_path / "it's a 'quoted' ws")
    report = run_ingest([small_tree], ws)
    assert report.changed and not report.errors
    assert run_query(ws, "SELECT count(*) AS n FROM samples").to_pylist() == [{"n": NUM_SAMPLES}]
    # the catalog file too, from plain DuckDB
    con = duckdb.connect(str(ws.catalog_path), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM samples").fetchone() == (NUM_SAMPLES,)
    finally:
        con.close()


def test_arrow_types_map_to_duckdb_types():
    cases = {pa.string(): "VARCHAR", pa.large_string(): "VARCHAR", pa.bool_(): "BOOLEAN", pa.int32(): "INTEGER",
             pa.int64(): "BIGINT", pa.float64(): "DOUBLE", pa.float32(): "FLOAT",
             pa.timestamp("us", tz="UTC"): "TIMESTAMPTZ", pa.timestamp("us"): "TIMESTAMP",
             pa.list_(pa.int32()): "INTEGER[]", pa.large_list(pa.float32()): "FLOAT[]"}
    assert {t: duckdb_type(t) for t in cases} == cases
    with pytest.raises(TypeError, match=r"^no DuckDB type for arrow type DataType\(int8\)$"):
        duckdb_type(pa.int8())


def test_key_columns_are_not_nullable_in_the_written_schema():
    fields = {f.name: f.nullable for f in TABLES["samples"].arrow_schema()}
    key = (fields["dataset"], fields["sample_key"], fields["key_source"])
    assert key == (False, False, False) and fields["split"] is True


def test_a_backslash_in_the_workspace_path_works_without_a_catalog(small_tree, tmp_path):
    from pipeline import Workspace
    from pipeline.health import check_workspace

    ws = Workspace(tmp_path / "ws\\back")
    for _ in range(2):  # the second ingest too: nothing is left half-built
        run_ingest([small_tree], ws)
    assert run_query(ws, "SELECT count(*) AS n FROM measurements").to_pylist()[0]["n"] > 0
    assert not ws.catalog_path.exists() and check_workspace(ws) == []
    assert not (tmp_path / "ws").exists()  # nothing written where DuckDB would have read the path


def test_the_requests_view_reads_clean_logs_and_skips_a_torn_or_foreign_line(small_tree, tmp_path):
    from pipeline import Workspace

    ws = Workspace(tmp_path / "ws")
    assert not run_ingest([small_tree], ws).errors
    ws.requests_dir.mkdir()
    (ws.requests_dir / "a.jsonl").write_text(
        '{"request_id": "a1", "time": "2026-01-02T03:04:05.5Z", "status": "ok", "budget_ms": 50.0, "unknown": 1}\n'
        '{"request_id": "a2", "status": "error"}\n')
    (ws.requests_dir / "b.jsonl").write_text(
        '{"request_id": "b1", "status": "ok", "budget_ms": 70.0}\n'
        '{"request_id": "b2", "status": "ok", "budget_ms": "fast"}\n'  # a line of other types
        '[1, 2]\n'
        '{"request_id": "b3", "sta')  # a torn tail
    (ws.requests_dir / "c.jsonl").mkdir()  # a directory with a log's name is no log (and breaks no query)
    rows = run_query(ws, "SELECT request_id, status, budget_ms, strftime(time, '%Y-%m-%d %H:%M:%S.%f') AS t "
                         "FROM requests ORDER BY request_id").to_pylist()
    assert rows == [
        {"request_id": "a1", "status": "ok", "budget_ms": 50.0, "t": "2026-01-02 03:04:05.500000"},
        {"request_id": "a2", "status": "error", "budget_ms": None, "t": None},
        {"request_id": "b1", "status": "ok", "budget_ms": 70.0, "t": None},
    ]
