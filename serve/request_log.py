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

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from pipeline.workspace import Workspace


class RequestLogGone(OSError):
    """The workspace the request log was in is gone: requests can no longer be recorded."""


class RequestLog:
    """Append-only JSON-lines writer; safe to call from several threads.

    A write that fails (a full disk) does not fail the request: :meth:`append` returns False, the
    first failure of a run of them and the recovery after it are reported through ``warn``
    (stderr by default), and a line cut short by the failure is ended before the next record,
    so the damage stays one line that the reader skips."""

    def __init__(self, workspace: Workspace, *, path: Path | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        if path is None:
            directory = workspace.requests_dir
            directory.mkdir(parents=True, exist_ok=True)
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
            path = directory / f"{stamp}-{os.getpid()}.jsonl"
            #: the directory whose loss means the workspace is gone (not only its requests/ folder)
            self.root: Path = Path(workspace.root)
        else:
            self.root = path.parent
        self.path: Path = path
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        #: why requests can no longer be recorded (None while they can)
        self.gone: str | None = None
        self._lock = threading.Lock()
        self._warn = warn or _to_stderr
        #: records that could not be written since the log was opened
        self.failures = 0
        self._unrecorded = 0  # records lost since the last one written
        self._torn = False  # the last write stopped inside a line
        self._reopen_failed = False  # the file at the path could not be created again (warned once)

    def check(self) -> None:
        """Make sure records still reach the file at :attr:`path`: a file removed or replaced while
        serving (the descriptor would write to a file no one can read) is reopened at the same path
        (a reopening that fails is tried again at the next request, which :meth:`append` then
        counts as not recorded); :class:`RequestLogGone` when the workspace itself is gone."""
        with self._lock:
            warning, _ = self._check_locked()
        self._say(warning)
        if self.gone is not None:
            raise RequestLogGone(self.gone)

    def _check_locked(self) -> tuple[str | None, bool]:
        """(a warning to print, whether the descriptor writes to the file at :attr:`path`)."""
        if self.gone is not None:
            raise RequestLogGone(self.gone)
        if self._fd is None:
            msg = f"request log {self.path} is closed"
            raise RuntimeError(msg)
        try:
            on_disk = os.stat(self.path)
        except OSError:
            on_disk = None
        held = os.fstat(self._fd)
        if on_disk is not None and (on_disk.st_ino, on_disk.st_dev) == (held.st_ino, held.st_dev):
            return None, True
        if not self.root.is_dir():
            # the reply names no path (it may reach anyone); the server's log does
            self.gone = "the workspace was removed while serving, so requests can no longer be recorded"
            return (f"error: the workspace {self.root} was removed while serving: requests can no longer be "
                    f"recorded in {self.path}, so this server answers every request 503 from now on; restart it "
                    "on a workspace"), False
        try:
            self.path.parent.mkdir(exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            if self._unrecorded or self._reopen_failed:  # warned already, when recording stopped
                return None, False
            self._reopen_failed = True
            folder = self.path.parent
            reason = (f"{folder} is not a folder" if folder.exists() and not folder.is_dir()
                      else str(exc.strerror or exc))
            return (f"warning: request log {self.path} was removed while serving and cannot be created again "
                    f"({reason}); requests are answered but not recorded until it can "
                    "(ctrl_request_log_failures_total counts them)"), False
        os.close(self._fd)
        self._fd, self._torn, self._reopen_failed = fd, False, False
        return (f"warning: request log {self.path} was {'replaced' if on_disk else 'removed'} while serving; "
                "recording to the file now at that path"), True

    def append(self, record: dict[str, Any]) -> bool:
        """Write one record as one line (one ``write`` call); False when it could not be written,
        :class:`RequestLogGone` when the workspace is gone (see :meth:`check`)."""
        line = orjson.dumps(record, option=orjson.OPT_NAIVE_UTC | orjson.OPT_UTC_Z) + b"\n"
        complete = False
        with self._lock:
            warning, usable = self._check_locked()
            if self.gone is None and not usable:
                self.failures += 1
                self._unrecorded += 1
            elif self.gone is None:
                if self._torn:
                    line = b"\n" + line
                written = 0
                try:
                    while written < len(line):  # a regular file takes the whole line; a short write is finished
                        written += os.write(self._fd, line[written:])
                except OSError as e:
                    if written:  # the file now ends inside this line, unless only its leading newline got out
                        self._torn = not (written == 1 and line.startswith(b"\n"))
                    self.failures += 1
                    self._unrecorded += 1
                    if self._unrecorded == 1 and warning is None:
                        warning = (f"warning: request log {self.path}: {e.strerror or e}; requests are answered but "
                                   "not recorded until writing works again (ctrl_request_log_failures_total counts "
                                   "them)")
                else:
                    complete, self._torn = True, False
                    if self._unrecorded:
                        warning = (f"request log {self.path}: recording again ({self._unrecorded} request(s) were "
                                   "not recorded)")
                        self._unrecorded = 0
        self._say(warning)
        if self.gone is not None:
            raise RequestLogGone(self.gone)
        return complete

    def _say(self, warning: str | None) -> None:
        """Print a warning outside the lock; one that cannot be written (stderr on the full disk) is dropped."""
        if warning is not None:
            with contextlib.suppress(OSError):
                self._warn(warning)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                with contextlib.suppress(OSError):  # a full disk or a device: what was written stays
                    os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
