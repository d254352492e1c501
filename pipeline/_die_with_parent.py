"""Parser processes end with the process that started them (Linux), so a SIGKILLed ``ctrl
ingest`` leaves no forkserver or parser behind: the parser workers call :func:`die_with_parent`
at start-up, and the forkserver, which imports this module as a preload, calls it on import."""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent ends (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _is_forkserver() -> bool:
    """True in multiprocessing's forkserver process (started as ``python -c "...forkserver import main..."``)."""
    return sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules


if _is_forkserver():
    die_with_parent()
