"""``ctrl status``: what a workspace holds, as plain data the CLI renders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.catalog import connect, view_names
from pipeline.workspace import Workspace

_FLAG_COLUMNS = ("flag_prefill_invalid", "flag_prefill_partial", "flag_text_tokens_derived", "flag_decode_missing",
                 "flag_partial_config", "flag_copies_disagree")


def workspace_status(workspace: Workspace) -> dict[str, Any]:
    """Datasets, samples, configurations per experiment, flag counts and bad files."""
    con = connect(workspace)
    views = view_names(con)
    try:
        def rows(sql: str) -> list[dict[str, Any]]:
            cur = con.execute(sql)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, r)) for r in cur.fetchall()]

        return {
            "workspace": str(workspace.root),
            "generation": workspace.require_generation().name,
            "catalog": str(workspace.catalog_path),
            "datasets": rows("""
                SELECT s.dataset, s.samples, coalesce(m.measurements, 0) AS measurements
                FROM (SELECT dataset, count(*) AS samples FROM samples GROUP BY dataset) s
                LEFT JOIN (SELECT dataset, count(*) AS measurements FROM measurements GROUP BY dataset) m
                  USING (dataset)
                ORDER BY dataset"""),
            "experiments": rows("""
                SELECT experiment, dataset, count(*) AS configs, sum(num_samples) AS measurements,
                       count(*) FILTER (WHERE flag_summary_nan) AS nan_summaries,
                       count(*) FILTER (WHERE flag_partial_config) AS partial_configs
                FROM configs GROUP BY experiment, dataset ORDER BY experiment, dataset"""),
            "flags": rows("SELECT " + ", ".join(f"count(*) FILTER (WHERE {f}) AS {f}" for f in _FLAG_COLUMNS)
                          + " FROM measurements")[0],
            "files": rows("SELECT status, count(*) AS files, sum(rows) AS rows FROM files "
                          "GROUP BY status ORDER BY status"),
            "bad_files": rows("SELECT path, status, error FROM files WHERE status = 'error' ORDER BY path"),
            "features": rows("""
                SELECT left(model_fingerprint, 16) AS model, count(*) AS samples,
                       count(*) FILTER (WHERE image_status = 'ok') AS images_ok,
                       count(*) FILTER (WHERE image_status <> 'ok') AS images_missing
                FROM image_features GROUP BY 1 ORDER BY 1""") if "image_features" in views else [],
            # ingest keeps the rows of files that have since disappeared: say so
            "missing_files": [r["path"] for r in rows("SELECT path FROM files ORDER BY path")
                              if not Path(r["path"]).exists()],
        }
    finally:
        con.close()
