"""Damage detection: every file of a workspace checked against what its writer recorded.

A workspace is rebuilt from its inputs and caches, so damage is repaired by the command that
wrote the damaged part: ``ctrl ingest`` for the live generation, the parse cache and the
catalog; ``ctrl extract-features`` for feature chunks. :func:`check_workspace` finds the
damage (``ctrl doctor`` prints it); the commands call the narrower checks below to decide what
to rebuild instead of trusting what is on disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.catalog import NOT_A_CATALOG_SUFFIX, catalog_supported
from pipeline.errors import CtrlError, describe
from pipeline.parse import PARSER_VERSION
from pipeline.schema import FEATURE_TABLES, TABLES
from pipeline.workspace import CHECKSUM_FILE, Workspace, check_table_schema, file_sha256

#: the view of ``ctrl.duckdb`` naming the generation its views read
CATALOG_GENERATION_VIEW = "ctrl_generation"


@dataclass(frozen=True)
class Problem:
    """One damaged or inconsistent file: what is wrong and which command repairs it."""

    path: Path
    problem: str
    repair: str

    def line(self) -> str:
        return f"{self.path}: {self.problem} (repair: {self.repair})"


def generation_problems(workspace: Workspace) -> list[Problem]:
    """``CURRENT``, ``state.json`` and every table of the live generation: present, readable,
    of its schema and with the row count the ingest that wrote it recorded."""
    current = workspace.root / "CURRENT"
    if not current.exists():
        if workspace.tables_dir.exists() and any(workspace.tables_dir.glob("gen-*")):
            return [Problem(current, "missing, while generations exist", "ctrl ingest")]
        return []
    try:
        gen = workspace.current_generation()
    except CtrlError as err:
        return [Problem(current, str(err).splitlines()[0].removeprefix(f"{current} "), "ctrl ingest")]
    assert gen is not None
    problems: list[Problem] = []
    rows: dict = {}
    hashes: dict = {}
    try:
        state = json.loads((gen / "state.json").read_text())
        rows = state.get("rows", {}) if isinstance(state, dict) else {}
        hashes = state.get("sha256", {}) if isinstance(state, dict) else {}
        if not isinstance(state, dict) or not isinstance(rows, dict):
            problems.append(Problem(gen / "state.json", "not a JSON object with 'rows'", "ctrl ingest"))
            rows = {}
    except (OSError, ValueError) as err:
        problems.append(Problem(gen / "state.json", f"unreadable ({describe(err)})", "ctrl ingest"))
    for name, schema in TABLES.items():
        path = gen / f"{name}.parquet"
        if not path.exists():
            problems.append(Problem(path, "missing", "ctrl ingest"))
            continue
        try:
            meta = pq.read_metadata(path)
            check_table_schema(meta.schema.to_arrow_schema(), schema, path)
        except (OSError, pa.ArrowException, CtrlError) as err:
            problems.append(Problem(path, f"unreadable ({describe(err)})", "ctrl ingest"))
            continue
        expected = rows.get(name)
        if isinstance(expected, int) and meta.num_rows != expected:
            problems.append(Problem(path, f"has {meta.num_rows} rows, its ingest wrote {expected}", "ctrl ingest"))
            continue
        recorded = hashes.get(path.name) if isinstance(hashes, dict) else None
        if isinstance(recorded, str) and file_sha256(path) != recorded:
            problems.append(Problem(path, "content differs from what its ingest wrote (SHA-256)", "ctrl ingest"))
    return problems


def fragment_meta_path(workspace: Workspace, sha: str) -> Path:
    """A cached parse is ``<sha>.json`` (written last: its presence marks a complete fragment)
    plus ``<sha>.<table>.arrow`` files beside it."""
    return workspace.fragments_dir / f"p{PARSER_VERSION}" / sha[:2] / f"{sha}.json"


def fragment_problems(meta_file: Path) -> str | None:
    """Why a cached parse (``<sha>.json`` and its Arrow files) cannot be used, or None."""
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:
        return f"unreadable ({describe(err)})"
    if not isinstance(meta, dict):
        return "not a JSON object"
    sizes = meta.get("sizes", {})
    hashes = meta.get("sha256", {})
    for name, filename in (meta.get("tables") or {}).items():
        path = meta_file.parent / filename
        if not path.exists():
            return f"its {name} file {filename} is missing"
        if name in sizes and path.stat().st_size != sizes[name]:
            return f"its {name} file {filename} has {path.stat().st_size} bytes, {sizes[name]} were written"
        if isinstance(hashes, dict) and name in hashes and file_sha256(path) != hashes[name]:
            return f"its {name} file {filename} differs from what was written (SHA-256)"
        try:
            with pa.memory_map(str(path)) as source:
                pa.ipc.open_file(source).schema  # reading the footer is the check
        except (OSError, pa.ArrowException) as err:
            return f"its {name} file {filename} is unreadable ({describe(err)})"
    return None


def catalog_problem(workspace: Workspace) -> str | None:
    """Why ``ctrl.duckdb`` does not describe the live generation, or None."""
    import duckdb  # deferred: parser workers import pipeline and never query

    gen = workspace.current_generation()
    path = workspace.catalog_path
    if gen is None or not catalog_supported(workspace):
        return None
    if not path.exists():
        return "missing"
    if path.is_dir():
        return (f"a directory, not the catalog file (ctrl ingest moves it aside to {path.name}"
                f"{NOT_A_CATALOG_SUFFIX}, deleting nothing, and writes the catalog)")
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error as err:
        return f"unreadable ({describe(err)})"
    try:
        recorded = con.execute(f"SELECT generation FROM {CATALOG_GENERATION_VIEW}").fetchone()
    except duckdb.Error:
        recorded = None
    finally:
        con.close()
    if recorded is None or recorded[0] != gen.name:
        return f"describes {recorded[0] if recorded else 'an unknown generation'}, CURRENT is {gen.name}"
    return None


def feature_chunk_problem(chunk: Path) -> str | None:
    """Why a feature chunk cannot be used (a table missing, unreadable or written before one of
    its columns existed, tables of different samples), or None."""
    counts = {}
    for name, schema in FEATURE_TABLES.items():
        path = chunk / f"{name}.parquet"
        if not path.exists():
            return f"{name}.parquet is missing"
        try:
            meta = pq.read_metadata(path)
            names = meta.schema.to_arrow_schema().names
            missing = [c for c in schema.column_names if c not in names]
            if missing and set(names) < set(schema.column_names):
                return f"{name}.parquet was written by an older ctrl (no column {', '.join(missing)})"
            check_table_schema(meta.schema.to_arrow_schema(), schema, path)
        except (OSError, pa.ArrowException, CtrlError) as err:
            return f"{name}.parquet is unreadable ({describe(err)})"
        counts[name] = meta.num_rows
    if counts["lang_features"] != counts["image_features"]:
        return f"lang_features has {counts['lang_features']} rows, image_features {counts['image_features']}"
    return checksum_problem(chunk)


def checksum_problem(directory: Path) -> str | None:
    """Which file of ``directory`` differs from the SHA-256 its writer recorded in ``sha256.json``
    (None: all equal, or no hash recorded)."""
    try:
        recorded = json.loads((directory / CHECKSUM_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        return f"{CHECKSUM_FILE} is unreadable ({describe(err)})"
    if not isinstance(recorded, dict):
        return f"{CHECKSUM_FILE} is not a JSON object"
    for name, digest in sorted(recorded.items()):
        path = directory / name
        if not path.exists():
            return f"{name} is missing"
        if file_sha256(path) != digest:
            return f"{name} differs from what was written (SHA-256)"
    return None


def check_workspace(workspace: Workspace) -> list[Problem]:
    """Every problem of the workspace: generation tables, parse cache, catalog, feature chunks, runs."""
    problems = generation_problems(workspace)
    gen_ok = not problems
    manifest_rows: list[dict] = []
    if gen_ok and workspace.current_generation() is not None:
        manifest_rows = pq.read_table(workspace.table_path("files"), columns=["path", "fragment_sha256"]).to_pylist()
    for row in manifest_rows:
        sha = row["fragment_sha256"]
        if sha:
            meta_file = fragment_meta_path(workspace, sha)
            why = fragment_problems(meta_file)
            if why:
                problems.append(Problem(meta_file, f"parse cache of {row['path']}: {why}",
                                        "ctrl ingest (parses the file again; a file gone from disk loses its rows)"))
    if gen_ok:
        why = catalog_problem(workspace)
        if why:
            problems.append(Problem(workspace.catalog_path, why, "ctrl ingest"))
    for chunk in sorted(workspace.features_dir.glob("*/chunk-*")):
        why = feature_chunk_problem(chunk)
        if why:
            problems.append(Problem(chunk, why, "ctrl extract-features (computes its samples again)"))
    for book in sorted(workspace.runs_dir.glob(f"*/**/{CHECKSUM_FILE}")):  # run files and rollouts
        why = checksum_problem(book.parent)
        if why:
            run = book.relative_to(workspace.runs_dir).parts[0]
            problems.append(Problem(book.parent, why, f"ctrl train --resume {run} rewrites its metrics; "
                                                      f"ctrl evaluate {run} its evaluation; else delete the run"))
    for config in sorted(workspace.runs_dir.glob("*/config.json")):
        try:
            if not isinstance(json.loads(config.read_text()), dict):
                problems.append(Problem(config, "not a JSON object", "delete the run directory and train again"))
        except (OSError, ValueError) as err:
            problems.append(Problem(config, f"unreadable ({describe(err)})", "delete the run directory"))
    return problems


__all__ = ["CATALOG_GENERATION_VIEW", "Problem", "catalog_problem", "check_workspace", "feature_chunk_problem",
           "fragment_meta_path", "fragment_problems", "generation_problems"]
