"""Build the workspace tables from the parse cache: dedupe, precedence, recomputed summaries.

The tables are a pure function of the manifest and the fragments it references, so an
incremental ingest (one changed file) and a full one give byte-for-byte the same rows.
DuckDB does the work out of core under a memory limit, which keeps peak memory bounded
however large the results tree is.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import SchemaError
from pipeline.kinds import KINDS, priority_sql
from pipeline.schema import (
    CONFIGS,
    FILES,
    MEASUREMENTS,
    SAMPLES,
    SCHEMA_VERSION,
    TableSchema,
    duckdb_type,
    quote_ident,
    quote_literal,
)
from pipeline.workspace import check_table_schema

#: DuckDB's own buffer; it spills to disk beyond this
DUCKDB_MEMORY_LIMIT = "512MB"

_PARTIAL_KINDS = tuple(k.name for k in KINDS.values() if k.measurement_priority == 1 and k.experiment != "core_exp")


def _kv(table: TableSchema) -> str:
    return f"KV_METADATA {{'ctrl.schema_version': '{SCHEMA_VERSION}', 'ctrl.table': '{table.name}'}}"


def _copy(con, select_sql: str, table: TableSchema, out: Path) -> None:
    con.execute(f"COPY ({select_sql}) TO {quote_literal(out)} (FORMAT parquet, COMPRESSION snappy, {_kv(table)})")


def _order_by(table: TableSchema) -> str:
    return ", ".join(quote_ident(c) for c in table.primary_key)


def _stream(pairs: list[tuple[str, str]], unique_by: tuple[str, ...] | None = None) -> pa.RecordBatchReader:
    """Every fragment's rows with its ``source_file`` appended, one file at a time.

    DuckDB pulls from this reader as it goes, so only one fragment is in memory at once.
    A fragment shared by two identical files is streamed once per path. With ``unique_by``,
    rows whose key was already streamed are dropped here: pairs arrive in path order and
    rows in file order, so the first copy streamed is the one the precedence rule keeps.
    """
    with pa.memory_map(pairs[0][0]) as first:
        schema = pa.ipc.open_file(first).schema.append(pa.field("source_file", pa.string()))
    seen: set[tuple] = set()

    def batches():
        for frag, source in pairs:
            with pa.memory_map(frag) as mapped:
                table = pa.ipc.open_file(mapped).read_all()
            if unique_by:
                keys = zip(*(table.column(c).to_pylist() for c in unique_by))
                mask = [not (k in seen or seen.add(k)) for k in keys]
                table = table.filter(pa.array(mask, pa.bool_()))
            table = table.append_column(schema.field("source_file"), pa.repeat(pa.scalar(source), table.num_rows))
            yield from table.to_batches()

    return pa.RecordBatchReader.from_batches(schema, batches())


def build_tables(out_dir: Path, manifest: pa.Table, fragment_files: dict[str, list[tuple[str, str]]],
                 temp_dir: Path) -> dict[str, int]:
    """Write samples, measurements, configs and files into ``out_dir``; return row counts.

    ``fragment_files`` maps a fragment table name (measurements | samples | summaries) to
    ``(fragment parquet path, source path)`` pairs; a fragment shared by two identical files
    appears once per source path.
    """
    import duckdb  # deferred: parser worker processes import pipeline and never query

    con = duckdb.connect(config={"memory_limit": DUCKDB_MEMORY_LIMIT, "temp_directory": str(temp_dir), "threads": 2})
    try:
        for name, pairs in fragment_files.items():
            if pairs:
                con.register(f"frag_{name}", _stream(pairs, ("dataset", "sample_key") if name == "samples" else None))
        counts: dict[str, int] = {}
        meas_pairs = fragment_files.get("measurements", [])
        meas_cols = ", ".join(quote_ident(c.name) for c in MEASUREMENTS.columns)
        if meas_pairs:
            key = ", ".join(quote_ident(c) for c in MEASUREMENTS.primary_key)
            src = f"""
              WITH m AS (
                SELECT *, {priority_sql('source_kind', 'measurement')} AS prio FROM frag_measurements
              ), ranked AS (
                SELECT *,
                  row_number() OVER (PARTITION BY {key} ORDER BY prio, source_file, row_index) AS rn,
                  count(*) OVER k AS num_copies,
                  (min(score) OVER k <> max(score) OVER k)
                    OR coalesce(min(pred) OVER k <> max(pred) OVER k, false) AS flag_copies_disagree,
                  (source_kind IN ({", ".join(f"'{k}'" for k in _PARTIAL_KINDS)})
                    AND world_size > 1) AS flag_partial_config
                FROM m WINDOW k AS (PARTITION BY {key})
              )
              SELECT {meas_cols} FROM ranked WHERE rn = 1"""
        else:
            src = f"SELECT {meas_cols} FROM (SELECT {_null_row(MEASUREMENTS)}) WHERE false"
        _copy(con, f"SELECT {MEASUREMENTS.duckdb_select_list()} FROM ({src}) ORDER BY {_order_by(MEASUREMENTS)}",
              MEASUREMENTS, out_dir / "measurements.parquet")

        samp_pairs = fragment_files.get("samples", [])
        samp_cols = ", ".join(quote_ident(c.name) for c in SAMPLES.columns)
        if samp_pairs:
            src = f"""
              SELECT {samp_cols} FROM frag_samples
              QUALIFY row_number() OVER (PARTITION BY dataset, sample_key ORDER BY source_file, row_index) = 1"""
        else:
            src = f"SELECT {samp_cols} FROM (SELECT {_null_row(SAMPLES)}) WHERE false"
        _copy(con, f"SELECT {SAMPLES.duckdb_select_list()} FROM ({src}) ORDER BY {_order_by(SAMPLES)}",
              SAMPLES, out_dir / "samples.parquet")

        src = _configs_sql(fragment_files.get("summaries", []), out_dir)
        _copy(con, f"SELECT {CONFIGS.duckdb_select_list()} FROM ({src}) ORDER BY {_order_by(CONFIGS)}",
              CONFIGS, out_dir / "configs.parquet")

        for table in (MEASUREMENTS, SAMPLES, CONFIGS):
            counts[table.name] = _validate(con, out_dir / f"{table.name}.parquet", table)
    finally:
        con.close()
    files_table = manifest.select(FILES.column_names).cast(FILES.arrow_schema())
    pq.write_table(files_table.sort_by([("path", "ascending")]), out_dir / "files.parquet", compression="zstd")
    counts["files"] = files_table.num_rows
    return counts


def _null_row(table: TableSchema) -> str:
    return ", ".join(f"CAST(NULL AS {duckdb_type(c.dtype)}) AS {quote_ident(c.name)}" for c in table.columns)


def _configs_sql(summary_pairs: list[tuple[str, str]], out_dir: Path) -> str:
    keys = ("experiment", "dataset", "max_crops", "top_k", "num_active_blocks")
    key_list = ", ".join(keys)
    recorded_cols = [c.name for c in CONFIGS.columns if c.name.startswith("recorded_")]
    if summary_pairs:
        recorded = f"""
          SELECT * EXCLUDE (source_file), source_file AS summary_source_file FROM frag_summaries
          QUALIFY row_number() OVER (PARTITION BY {key_list}
                  ORDER BY {priority_sql('source_kind', 'summary')}, source_file, row_index) = 1"""
    else:
        recorded = f"SELECT * FROM (SELECT {_null_row(CONFIGS)}) WHERE false"
    meas = str(out_dir / "measurements.parquet")
    shared = ("split", "tier", "num_total_blocks", "active_block_indices", "world_size")
    return f"""
      WITH rec AS ({recorded}),
      agg AS (
        SELECT {key_list},
          any_value(split) AS split, any_value(tier) AS tier, any_value(num_total_blocks) AS num_total_blocks,
          any_value(active_block_indices) AS active_block_indices, any_value(world_size) AS world_size,
          avg(score) AS accuracy, stddev_pop(score) AS accuracy_std, count(*) AS num_samples,
          avg(latency_total_ms) AS latency_total_ms_mean,
          quantile_cont(latency_total_ms, 0.5) AS latency_total_ms_p50,
          quantile_cont(latency_total_ms, 0.95) AS latency_total_ms_p95,
          avg(latency_prefill_ms) AS latency_prefill_ms_mean,
          avg(latency_decode_ms) AS latency_decode_ms_mean,
          avg(latency_vision_ms) AS latency_vision_ms_mean,
          bool_or(flag_partial_config) AS flag_partial_config
        FROM read_parquet({quote_literal(meas)}) GROUP BY {key_list}
      )
      SELECT {key_list},
        {", ".join(f"coalesce(rec.{c}, agg.{c}) AS {c}" for c in shared)},
        rec.summary_source_file,
        {", ".join(f"rec.{c}" for c in recorded_cols)},
        agg.accuracy, agg.accuracy_std, coalesce(agg.num_samples, 0) AS num_samples,
        agg.latency_total_ms_mean, agg.latency_total_ms_p50, agg.latency_total_ms_p95,
        agg.latency_prefill_ms_mean, agg.latency_decode_ms_mean, agg.latency_vision_ms_mean,
        coalesce(rec.flag_summary_nan, true) AS flag_summary_nan,
        coalesce(agg.flag_partial_config, false) AS flag_partial_config
      FROM rec FULL OUTER JOIN agg USING ({key_list})"""


def _validate(con, path: Path, table: TableSchema) -> int:
    """Writers are strict: schema as declared and a unique primary key."""
    check_table_schema(pq.read_schema(path), table, path)
    key = ", ".join(quote_ident(c) for c in table.primary_key)
    rows, distinct = con.execute(
        f"SELECT count(*), count(DISTINCT ({key})) FROM read_parquet({quote_literal(path)})").fetchone()
    if rows != distinct:
        msg = f"{path}: primary key ({key}) is not unique ({rows} rows, {distinct} distinct keys)"
        raise SchemaError(msg)
    return rows
