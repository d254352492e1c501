"""``ctrl ingest``: results files -> parse cache -> a new workspace generation.

Steps, each restartable:

1. discover ``*.json`` under the given paths (sorted, so runs are reproducible);
2. skip files whose (size, mtime) match the manifest; hash the rest; content already in the
   parse cache is not parsed again (this is what makes an interrupted ingest resume);
3. parse new content file by file, in worker processes, into fragments (memory per worker
   is one file);
4. if the manifest changed, rebuild the tables from the fragments into a new generation and
   swap it in atomically; otherwise change nothing.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from stat import S_ISBLK, S_ISCHR, S_ISDIR, S_ISFIFO, S_ISREG, S_ISSOCK

import pyarrow as pa

from pipeline.catalog import build_catalog
from pipeline.compact import build_tables
from pipeline.errors import CtrlError, IngestError, describe
from pipeline.health import catalog_problem, fragment_meta_path, fragment_problems, generation_problems
from pipeline.ingest_config import IngestConfig
from pipeline.parse import PARSER_VERSION, NotResultsFile, parse_file
from pipeline.process_pool import forkserver_context, kill_workers
from pipeline.schema import FILES
from pipeline.workspace import Workspace, atomic_path, file_sha256

_FRAGMENT_TABLES = ("measurements", "samples", "summaries")


#: the largest input file read: a result file of the origin's scripts is at most a few hundred MB, and
#: parsing holds several times a file's size in memory
MAX_INPUT_BYTES = 1 << 30

@dataclass
class FileResult:
    path: str
    status: str  # ok | unchanged | skipped | error
    kind: str | None = None
    rows: int = 0
    error: str | None = None


@dataclass
class IngestReport:
    workspace: Path
    files: list[FileResult] = field(default_factory=list)
    changed: bool = False
    generation: str | None = None
    table_rows: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    #: damage found and repaired (one line each: the file, what was wrong, what was done)
    repaired: list[str] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(1 for f in self.files if f.status == status)

    @property
    def errors(self) -> list[FileResult]:
        return [f for f in self.files if f.status == "error"]

    @property
    def exit_code(self) -> int:
        return 1 if self.errors else 0


def discover(paths: Iterable[Path], exclude: Path | None = None) -> list[Path]:
    """Absolute paths of every ``*.json`` entry under ``paths`` (directory symlinks followed, each
    real directory once), sorted and de-duplicated; nothing inside ``exclude`` (the workspace,
    whose own files are never input). Entries that are not regular files (a FIFO, a link to a
    device, a dangling link) and directories that cannot be listed are kept too, as is a path
    given explicitly whatever it is: ingest records each of them as a bad file, never reads one."""
    found: set[Path] = set()
    excluded = exclude.resolve() if exclude is not None else None
    for p in paths:
        p = p.resolve()
        if not p.is_dir():
            found.add(p)
            continue
        seen: set[tuple[int, int]] = set()
        for top, dirs, names in os.walk(p, followlinks=True, onerror=lambda err: found.add(Path(err.filename))):
            st = os.stat(top)
            if (st.st_dev, st.st_ino) in seen:  # a symlink loop or a second link to a directory
                dirs[:] = []
                continue
            seen.add((st.st_dev, st.st_ino))
            dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                             and (excluded is None or (Path(top) / d).resolve() != excluded))
            found.update(Path(top) / n for n in names if n.endswith(".json") and not n.startswith("."))
    return sorted(found)


#: control characters (a newline in a file name would split a one-line message) -> their \\xNN escape
_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(32), 127)}


def path_key(path: Path) -> str:
    """The ``files.path`` of a file, as every message shows it: its path as text; bytes that are
    not UTF-8 (a name written in another encoding) and control characters are shown as ``\\xNN``
    escapes instead of failing the whole ingest or breaking a line."""
    text = str(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return text.translate(_CONTROL_ESCAPES)


def _write_arrow(table: pa.Table, path: Path) -> None:
    # uncompressed Arrow IPC: 5x faster to write than Parquet, memory-mapped on read
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def _parse_to_fragment(path_str: str, fragments_root: str) -> dict:
    """Worker: read, hash, parse (unless cached) one file. Returns its fragment meta."""
    path = Path(path_str)
    name = path_key(Path(path.name))
    try:
        stat = path.stat()
        if S_ISDIR(stat.st_mode):  # a directory that could not be listed
            try:
                os.listdir(path)
                why = "a directory"
            except OSError as err:
                why = f"a directory that cannot be listed: {err.strerror or err}"
            return {"status": "error", "error": f"{name}: not a regular file ({why})", "sha256": None,
                    "size_bytes": 0, "mtime_ns": stat.st_mtime_ns}
        if S_ISREG(stat.st_mode) and stat.st_size > MAX_INPUT_BYTES:  # parsing costs several times the size
            return {"status": "error", "error": f"{name}: {stat.st_size:,} bytes, more than an input file may have "
                                                f"({MAX_INPUT_BYTES:,}); not read",
                    "sha256": None, "size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        if not S_ISREG(stat.st_mode):  # a FIFO would block forever, /dev/zero never ends
            return {"status": "error", "error": f"{name}: not a regular file ({_file_type(stat.st_mode)})",
                    "sha256": None, "size_bytes": 0, "mtime_ns": stat.st_mtime_ns}
        data = path.read_bytes()
    except OSError as err:
        return {"status": "error", "error": f"{name}: cannot read: {err.strerror or err}", "sha256": None,
                "size_bytes": 0, "mtime_ns": 0}
    sha = hashlib.sha256(data).hexdigest()
    base = {"sha256": sha, "size_bytes": len(data), "mtime_ns": stat.st_mtime_ns}
    bucket = Path(fragments_root) / sha[:2]
    meta_file = bucket / f"{sha}.json"
    if meta_file.exists() and fragment_problems(meta_file) is None:
        return {**json.loads(meta_file.read_text()), **base, "cached": True}
    try:
        parsed = parse_file(path, data)
        meta = {"status": "ok", "kind": parsed.kind, "experiment": parsed.experiment, "dataset": parsed.dataset,
                "rows": parsed.rows, "duplicate_rows": parsed.duplicate_rows, "note": parsed.note, "error": None,
                "tables": {}}
        tables = {"measurements": parsed.measurements, "samples": parsed.samples, "summaries": parsed.summaries}
    except IngestError as err:
        where = f"{name}: {err.field}: " if err.field else f"{name}: "  # the escaped name, as everywhere
        meta = {"status": "error", "error": where + err.reason.translate(_CONTROL_ESCAPES), "rows": 0,
                "duplicate_rows": 0, "tables": {}}
        tables = {}
    except NotResultsFile as err:
        meta = {"status": "skipped", "error": f"{name}: {err}", "rows": 0, "duplicate_rows": 0, "tables": {}}
        tables = {}
    except (Exception, RecursionError) as err:  # any failure of one file is that file's error
        meta = {"status": "error", "error": f"{name}: cannot parse ({describe(err, 300)})", "rows": 0,
                "duplicate_rows": 0, "tables": {}}
        tables = {}
    # every file lands by rename and the meta last: a killed worker leaves no half fragment
    bucket.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        if table.num_rows:
            filename = f"{sha}.{name}.arrow"
            with atomic_path(bucket / filename) as tmp:
                _write_arrow(table, tmp)
            meta["tables"][name] = filename
            meta.setdefault("sizes", {})[name] = (bucket / filename).stat().st_size
            meta.setdefault("sha256", {})[name] = file_sha256(bucket / filename)
    with atomic_path(meta_file) as tmp:
        tmp.write_text(json.dumps(meta))
    return {**meta, **base, "cached": False}


def _file_type(mode: int) -> str:
    for test, label in ((S_ISFIFO, "a FIFO"), (S_ISCHR, "a character device"), (S_ISBLK, "a block device"),
                        (S_ISSOCK, "a socket"), (S_ISDIR, "a directory")):
        if test(mode):
            return label
    return "not a file"


def _read_manifest(workspace: Workspace) -> dict[str, dict]:
    gen = workspace.current_generation()
    if gen is None or not (gen / "files.parquet").exists():
        return {}
    return {row["path"]: row for row in workspace.read_arrow("files").to_pylist()}


def _manifest_of_damaged(workspace: Workspace, report: IngestReport) -> dict[str, dict]:
    """The manifest of a damaged generation where ``files.parquet`` still reads (every file it
    lists keeps its rows), else empty (the given paths rebuild it)."""
    try:
        return _read_manifest(workspace)
    except (CtrlError, OSError, pa.ArrowException) as err:
        report.repaired.append(f"files manifest unreadable ({type(err).__name__}): rebuilt from the given paths; "
                               "files only an earlier ingest saw are not in the new tables")
        return {}


def ingest(config: IngestConfig, progress: Callable[[str], None] | None = None,
           on_total: Callable[[int], None] | None = None) -> IngestReport:
    """Ingest ``config.paths`` into the workspace. ``progress(name)`` is called once per file."""
    started = time.perf_counter()
    workspace = Workspace(config.workspace)
    report = IngestReport(workspace=workspace.root)
    with workspace.lock():
        try:
            files = discover(config.paths, exclude=workspace.root)
            if on_total:
                on_total(len(files))
            # a damaged generation (a table missing or corrupt, CURRENT or state.json bad) is never
            # trusted: the tables are built again from the parse cache and the inputs
            damage = generation_problems(workspace)
            report.repaired.extend(f"{p.path}: {p.problem}: tables rebuilt" for p in damage)
            manifest = _manifest_of_damaged(workspace, report) if damage else _read_manifest(workspace)
            parser_changed = not damage and workspace.state().get("parser_version") not in (None, PARSER_VERSION)
            now = datetime.now(timezone.utc)
            new_manifest = dict(manifest)
            todo: list[Path] = []
            sizes: dict[Path, int] = {}
            checked: set[str] = set()  # cached parses already checked (or written) in this run
            for path in files:
                old = manifest.get(path_key(path))
                try:
                    st = path.stat()
                except OSError:  # vanished or a dangling link: the parser records why
                    todo.append(path)
                    sizes[path] = 0
                    continue
                same_file = (old and not parser_changed and old["size_bytes"] == st.st_size
                             and old["mtime_ns"] == st.st_mtime_ns)
                cache_damage = None
                if same_file and old["status"] == "ok":
                    cache_damage = fragment_problems(fragment_meta_path(workspace, old["fragment_sha256"]))
                    checked.add(old["fragment_sha256"])
                if cache_damage:
                    report.repaired.append(f"{path_key(path)}: parse cache {cache_damage}: parsed again")
                if same_file and not cache_damage:
                    status = "unchanged" if old["status"] == "ok" else old["status"]
                    report.files.append(FileResult(path_key(path), status, old["kind"], old["rows"], old["error"]))
                    if progress:
                        progress(path.name)
                    continue
                todo.append(path)
                sizes[path] = st.st_size

            fragments_root = str(workspace.fragments_dir / f"p{PARSER_VERSION}")
            todo.sort(key=lambda p: -sizes[p])  # largest first: workers finish together
            for path, meta in _run_parsers(todo, fragments_root, config.resolved_workers):
                key = path_key(path)
                old = manifest.get(key)
                status = meta["status"]
                checked.add(meta["sha256"])
                if status == "error" and config.strict:
                    raise IngestError(path, meta["error"].removeprefix(f"{path.name}: "))
                unchanged = old is not None and old["sha256"] == meta["sha256"] and not parser_changed
                keep_fragment = old["fragment_sha256"] if (old and status == "error") else None
                new_manifest[key] = {
                    "path": key, "sha256": meta["sha256"] or "", "size_bytes": meta["size_bytes"],
                    "mtime_ns": meta["mtime_ns"], "kind": meta.get("kind"), "experiment": meta.get("experiment"),
                    "dataset": meta.get("dataset"), "status": status, "error": meta.get("error"),
                    "note": meta.get("note"),
                    "rows": meta.get("rows", 0), "duplicate_rows": meta.get("duplicate_rows", 0),
                    "fragment_sha256": meta["sha256"] if status == "ok" else keep_fragment,
                    "ingested_at": old["ingested_at"] if unchanged else now,
                }
                result_status = "unchanged" if unchanged and status == "ok" else status
                report.files.append(FileResult(key, result_status, meta.get("kind"), meta.get("rows", 0),
                                               meta.get("error")))
                if progress:
                    progress(path.name)

            report.files.sort(key=lambda f: f.path)
            # a file not among the given paths whose cached parse is damaged cannot be parsed again
            for key, row in list(new_manifest.items()):
                if row["fragment_sha256"] and row["fragment_sha256"] not in checked:
                    why = fragment_problems(fragment_meta_path(workspace, row["fragment_sha256"]))
                    if why:
                        report.repaired.append(f"{key}: parse cache {why}, and the file is not among the given paths: "
                                               "its rows are dropped")
                        lost = f"{Path(key).name}: parse cache damaged and the file was not given"
                        new_manifest[key] = {**row, "status": "error", "fragment_sha256": None, "error": lost}
            if damage or parser_changed or _content_changed(manifest, new_manifest):
                gen = workspace.commit(lambda out: _build(workspace, out, new_manifest, report))
                build_catalog(workspace)
                _collect_fragments(workspace, new_manifest)
                report.changed, report.generation = True, gen.name
            else:
                current = workspace.current_generation()
                report.generation = current.name if current else None
            # the catalog is rewritten after the swap: a crash in between (or a deleted or damaged
            # catalog) is repaired by the next ingest
            why = catalog_problem(workspace) if report.generation else None
            if why:
                build_catalog(workspace)
                report.repaired.append(f"{workspace.catalog_path}: {why}: rebuilt")
        except OSError as err:
            if err.errno == errno.ENOSPC:  # a full disk: the fragments parsed in this run go, not the tables
                _free_unreferenced_fragments(workspace)
            raise

    report.elapsed_s = time.perf_counter() - started
    return report


def _content_changed(old: dict[str, dict], new: dict[str, dict]) -> bool:
    fields = ("sha256", "status", "fragment_sha256", "error", "kind")
    return old.keys() != new.keys() or any(tuple(old[p][f] for f in fields) != tuple(new[p][f] for f in fields)
                                           for p in new)


def _run_parsers(todo: list[Path], fragments_root: str, workers: int):
    """Yield (path, meta) as files finish; a process pool when it pays off. A parser process that
    dies (killed, out of memory) fails the file it was parsing, not the ingest: the files in
    flight then are parsed again one at a time, and the one that kills its process again is
    recorded as a bad file."""
    if workers <= 1 or len(todo) <= 1:
        for path in todo:
            yield path, _parse_to_fragment(str(path), fragments_root)
        return
    remaining = list(todo)
    while remaining:
        unfinished, in_flight = yield from _pool_pass(remaining, fragments_root, workers)
        for path in in_flight:  # one of them killed its process: each alone now
            alone, _ = yield from _pool_pass([path], fragments_root, 1)
            if alone:
                yield path, {"status": "error", "sha256": None, "size_bytes": 0, "mtime_ns": 0,
                             "error": f"{path_key(Path(path.name))}: the parser process died while parsing it "
                                      "(killed, or out of memory)"}
        remaining = [p for p in unfinished if p not in set(in_flight)]


def _pool_pass(paths: list[Path], fragments_root: str, workers: int):
    """Parse ``paths`` in a process pool, yielding (path, meta); returns ([], []) when all finished,
    else (the paths not finished, those in flight) once a worker died."""
    # the forkserver ends with this process (a SIGKILLed ingest leaves no orphans), its workers with it
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=forkserver_context("pipeline.parse"))
    pending: dict[Future, Path] = {}
    queue = iter(paths)
    finished: set[Path] = set()
    try:
        for path in queue:  # keep at most 2 tasks per worker in flight: bounded memory for results
            pending[pool.submit(_parse_to_fragment, str(path), fragments_root)] = path
            if len(pending) >= 2 * workers:
                break
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: pending[f]):
                meta = fut.result()
                path = pending.pop(fut)
                finished.add(path)
                yield path, meta
                nxt = next(queue, None)
                if nxt is not None:
                    pending[pool.submit(_parse_to_fragment, str(nxt), fragments_root)] = nxt
        return [], []
    except (BrokenProcessPool, OSError) as err:  # from a result, or from a submit once the pool has seen the death
        # CPython's executor marks itself broken and closes its pipes without the lock a submit holds: a submit
        # racing a worker's death can write to a pipe being closed (OSError, EBADF) instead of raising
        # BrokenProcessPool
        if isinstance(err, OSError) and not getattr(pool, "_broken", False):
            raise
        kill_workers(pool)
        return [p for p in paths if p not in finished], sorted(pending.values())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _build(workspace: Workspace, out: Path, manifest: dict[str, dict], report: IngestReport) -> dict:
    pairs: dict[str, list[tuple[str, str]]] = {name: [] for name in _FRAGMENT_TABLES}
    for path, row in sorted(manifest.items()):
        sha = row["fragment_sha256"]
        if not sha:
            continue
        meta_file = fragment_meta_path(workspace, sha)
        meta = json.loads(meta_file.read_text())
        for name, filename in meta.get("tables", {}).items():
            pairs[name].append((str(meta_file.parent / filename), path))
    manifest_table = (pa.Table.from_pylist(list(manifest.values()), schema=FILES.arrow_schema()) if manifest
                      else FILES.arrow_schema().empty_table())
    temp = workspace.root / f".duckdb-tmp-{uuid.uuid4().hex}"
    try:
        report.table_rows = build_tables(out, manifest_table, pairs, temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return {"parser_version": PARSER_VERSION, "created_at": datetime.now(timezone.utc).isoformat(),
            "rows": report.table_rows}


def _free_unreferenced_fragments(workspace: Workspace) -> None:
    """After a failed ingest: delete the cached parses the live manifest does not reference."""
    try:
        manifest = _read_manifest(workspace)
    except (CtrlError, OSError, pa.ArrowException):
        return  # the next ingest repairs the workspace and collects them
    _collect_fragments(workspace, manifest)


def _collect_fragments(workspace: Workspace, manifest: dict[str, dict]) -> None:
    """Drop cached fragments no manifest row references (and caches of older parsers)."""
    live = {r["sha256"] for r in manifest.values()} | {r["fragment_sha256"] for r in manifest.values()}
    root = workspace.fragments_dir
    if not root.exists():
        return
    for version_dir in root.iterdir():
        if version_dir.name != f"p{PARSER_VERSION}":
            shutil.rmtree(version_dir, ignore_errors=True)
            continue
        for bucket in version_dir.iterdir():
            for f in bucket.iterdir():
                if f.name.split(".", 1)[0] not in live:  # also leftovers of killed writers
                    f.unlink(missing_ok=True)
