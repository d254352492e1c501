"""The workspace directory: generations of Parquet tables, the parse cache, the lock, the catalog.

Layout::

    workspace/
      CURRENT                 name of the live generation, replaced atomically
      tables/gen-000007/      samples, measurements, configs, files (.parquet) + state.json
      fragments/p2/ab/<sha>.* parse cache: what one file content contributes (Arrow IPC + meta)
      ctrl.duckdb             DuckDB catalog of views over the live generation (rebuildable)
      .lock                   held by the process that writes

A writer builds a complete new generation next to the live one and then swaps ``CURRENT``,
so a crash or Ctrl-C at any point leaves the previous generation intact.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import SchemaError, WorkspaceError, WorkspaceLockedError
from pipeline.schema import SCHEMA_VERSION, SCHEMA_VERSION_KEY, TABLES, TableSchema

if TYPE_CHECKING:
    import polars as pl

ENV_VAR = "CTRL_WORKSPACE"
DEFAULT_WORKSPACE = "workspace"
CATALOG_NAME = "ctrl.duckdb"


def resolve_workspace(path: str | os.PathLike | None = None) -> Path:
    """``path`` if given, else ``$CTRL_WORKSPACE``, else ``./workspace``; made absolute."""
    chosen = path if path is not None else os.environ.get(ENV_VAR) or DEFAULT_WORKSPACE
    return Path(chosen).expanduser().resolve()


@contextmanager
def atomic_path(path: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; it replaces ``path`` when the block
    succeeds and is removed when it fails, so readers see the old file or the whole new one.

    ``suffix`` keeps a file type for writers that infer the format from the name (images).
    """
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        raise os_error_naming(e, path) from None
    finally:
        tmp.unlink(missing_ok=True)


def os_error_naming(error: OSError, path: Path) -> OSError:
    """``error`` naming ``path`` when it names no file (Arrow's writers do not), with the reason
    Arrow buries in its text (``... Detail: [errno 28] No space left on device``) as its own."""
    if error.filename is not None:
        return error
    found = re.search(r"\[errno (\d+)\]", str(error))
    if found:
        code = int(found[1])
        return OSError(code, os.strerror(code), str(path))
    return OSError(error.errno, error.strerror or str(error), str(path))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


#: beside the files of a feature chunk or a run: their SHA-256 as written ({file name: hex})
CHECKSUM_FILE = "sha256.json"


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's content, read in blocks (about 1 GB/s with the CPU's SHA instructions)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(4 << 20):
            digest.update(block)
    return digest.hexdigest()


def record_checksum(path: Path) -> None:
    """Record ``path``'s SHA-256 in the ``sha256.json`` of its directory (rewritten atomically)."""
    book = path.parent / CHECKSUM_FILE
    try:
        recorded = json.loads(book.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: start it again
        recorded = {}
    if not isinstance(recorded, dict):
        recorded = {}
    recorded[path.name] = file_sha256(path)
    write_bytes_atomic(book, (json.dumps(recorded, indent=1, sort_keys=True) + "\n").encode())


#: what CURRENT may name: a generation directory inside tables/
GENERATION_NAME = re.compile(r"gen-[0-9]{6,}")


class Workspace:
    """A workspace root. Cheap to construct; nothing is created until a writer runs."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = resolve_workspace(root)

    # -- locations
    @property
    def tables_dir(self) -> Path:
        return self.root / "tables"

    @property
    def fragments_dir(self) -> Path:
        return self.root / "fragments"

    @property
    def features_dir(self) -> Path:
        return self.root / "features"

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def requests_dir(self) -> Path:
        """The request logs of ``ctrl serve`` (view ``requests``)."""
        return self.root / "requests"

    @property
    def catalog_path(self) -> Path:
        return self.root / CATALOG_NAME

    def owns(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` is (or would be) one of the workspace's own files: anything inside its
        tables, fragments, features or runs directories, or an existing file at its root (the
        catalog, CURRENT, ...). Commands refuse to write their output there."""
        target = Path(path).expanduser().resolve()
        root = self.root.resolve()
        if not target.is_relative_to(root) or target == root:
            return False
        managed = (self.tables_dir, self.fragments_dir, self.features_dir, self.runs_dir)
        return target.exists() or any(target.is_relative_to(d.resolve()) for d in managed)

    def current_generation(self) -> Path | None:
        """Directory of the live generation, or None for a workspace never written."""
        try:
            name = (self.root / "CURRENT").read_text(errors="replace").strip()
        except FileNotFoundError:
            return None
        if not GENERATION_NAME.fullmatch(name):  # empty, damaged, or a path that would leave tables/
            msg = (f"{self.root / 'CURRENT'} does not name a generation (gen-NNNNNN), it holds {name[:60]!r}\n"
                   "Hint: re-run `ctrl ingest` to rebuild the workspace.")
            raise WorkspaceError(msg)
        gen = self.tables_dir / name
        if not gen.is_dir():
            msg = (f"{self.root / 'CURRENT'} names {name!r}, which does not exist\n"
                   "Hint: re-run `ctrl ingest` to rebuild the workspace.")
            raise WorkspaceError(msg)
        return gen

    def require_generation(self) -> Path:
        gen = self.current_generation()
        if gen is None:
            msg = (f"workspace {self.root} has no tables yet\n"
                   "Hint: run `ctrl ingest PATH...` first (or pass --workspace).")
            raise WorkspaceError(msg)
        return gen

    def table_path(self, name: str) -> Path:
        return self.require_generation() / f"{name}.parquet"

    def state(self) -> dict:
        gen = self.current_generation()
        if gen is None:
            return {}
        try:
            return json.loads((gen / "state.json").read_text())
        except FileNotFoundError:
            return {}

    # -- readers
    def read_arrow(self, name: str) -> pa.Table:
        """Read one table, checking it against its declared schema."""
        schema = TABLES[name]
        path = self.table_path(name)
        table = pq.read_table(path)
        check_table_schema(table.schema, schema, path)
        return table

    def read_table(self, name: str) -> pl.DataFrame:
        """:meth:`read_arrow` as a polars frame."""
        import polars as pl  # deferred: ingest and ctrl query never need polars

        return pl.from_arrow(self.read_arrow(name))  # type: ignore[return-value]

    # -- writers
    @contextmanager
    def lock(self, purpose: str = "ctrl ingest") -> Iterator[None]:
        """Exclusive, non-blocking writer lock; released by the OS if the process dies."""
        self.root.mkdir(parents=True, exist_ok=True)
        fh = open(self.root / ".lock", "a+")
        try:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                holder = fh.read().strip() or "another process"
                msg = (f"workspace {self.root} is locked by {holder}\n"
                       "Hint: wait for that run to finish; two writers on one workspace would corrupt it.")
                raise WorkspaceLockedError(msg) from None
            fh.seek(0)
            fh.truncate()
            fh.write(f"{purpose} (pid {os.getpid()})")
            fh.flush()
            yield
        finally:
            fh.close()

    def commit(self, build: Callable[[Path], dict]) -> Path:
        """Build a new generation with ``build(tmp_dir) -> state`` and make it live atomically.

        Must be called with the lock held. Returns the new generation directory.
        """
        self.tables_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.tables_dir / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            state = build(tmp)
            # each table's content hash, which readers and `ctrl doctor` check (bit rot, a same-size edit)
            state["sha256"] = {f.name: file_sha256(f) for f in sorted(tmp.glob("*.parquet"))}
            (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            existing = [int(p.name.split("-")[1]) for p in self.tables_dir.glob("gen-*")
                        if p.name.split("-")[1].isdigit()]
            gen = self.tables_dir / f"gen-{max(existing, default=0) + 1:06d}"
            os.rename(tmp, gen)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            previous = self.current_generation()
        except WorkspaceError:  # CURRENT named a generation that is gone: the new one replaces it
            previous = None
        write_bytes_atomic(self.root / "CURRENT", (gen.name + "\n").encode())
        self._collect_garbage(keep={gen.name} | ({previous.name} if previous else set()))
        return gen

    def _collect_garbage(self, keep: set[str]) -> None:
        for p in self.tables_dir.iterdir():
            if p.name not in keep and (p.name.startswith("gen-") or p.name.startswith(".tmp-")):
                shutil.rmtree(p, ignore_errors=True)


def check_table_schema(actual: pa.Schema, expected: TableSchema, path: Path) -> None:
    """Strict read: same columns, order and types, and our schema version."""
    meta = actual.metadata or {}
    version = meta.get(SCHEMA_VERSION_KEY)
    if version is not None and version.decode().strip("'") != SCHEMA_VERSION:
        msg = (f"{path}: schema version {version.decode()!r}, this ctrl reads version {SCHEMA_VERSION!r}\n"
               "Hint: re-run `ctrl ingest` on the original files to rebuild the workspace.")
        raise SchemaError(msg)
    names = actual.names
    if names != expected.column_names:
        missing = [c for c in expected.column_names if c not in names]
        extra = [c for c in names if c not in expected.column_names]
        msg = f"{path}: columns do not match table {expected.name!r} (missing {missing}, extra {extra})"
        raise SchemaError(msg)
    for col in expected.columns:
        got = actual.field(col.name).type
        if not _same_type(got, col.dtype):
            msg = f"{path}: column {col.name!r} has type {got}, expected {col.dtype}"
            raise SchemaError(msg)


def _same_type(got: pa.DataType, expected: pa.DataType) -> bool:
    """Type equality up to physical variants writers pick (large_string from polars, fixed-size lists)."""
    if pa.types.is_large_string(got):
        got = pa.string()
    if pa.types.is_large_list(got) or pa.types.is_fixed_size_list(got):
        got = pa.list_(got.value_type)
    if pa.types.is_list(got) and pa.types.is_list(expected):
        return _same_type(got.value_type, expected.value_type)
    return got.equals(expected)
