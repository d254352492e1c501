"""Every served request, appended to the workspace as one JSON line (view ``requests``).

One file per server process, ``workspace/requests/<start time>-<pid>.jsonl``, opened with
``O_APPEND``: each record is one complete line handed to the kernel in a single ``write``
before the response is sent, so a server killed at any moment (SIGKILL included) leaves only
whole lines, and every answered request is on disk in the page cache. A line is never
rewritten. (Surviving a power cut as well would need an fsync per request; the log is fsynced
when the server stops.) The reader (``pipeline.catalog``) skips a line it cannot parse, so
even a torn tail from a crashed file system costs that line alone.
"""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from pipeline.workspace import Workspace


class RequestLog:
    """Append-only JSON-lines writer; safe to call from several threads."""

    def __init__(self, workspace: Workspace) -> None:
        directory = workspace.requests_dir
        directory.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        self.path: Path = directory / f"{stamp}-{os.getpid()}.jsonl"
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def append(self, record: dict[str, Any]) -> None:
        """Write one record as one line (one ``write`` call)."""
        line = orjson.dumps(record, option=orjson.OPT_NAIVE_UTC | orjson.OPT_UTC_Z) + b"\n"
        with self._lock:
            if self._fd is None:
                msg = f"request log {self.path} is closed"
                raise RuntimeError(msg)
            written = os.write(self._fd, line)
            while written < len(line):  # a regular file takes the whole line; a short write is finished, not lost
                written += os.write(self._fd, line[written:])

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
