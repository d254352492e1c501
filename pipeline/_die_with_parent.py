"""Imported only by the parser processes (forkserver preload and worker start-up), never by ctrl
itself: on Linux, importing it makes the importing process end with its parent, so a SIGKILLed
``ctrl ingest`` leaves no forkserver or parser behind."""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent ends (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


die_with_parent()
