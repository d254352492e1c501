"""Parser processes end with the process that started them (Linux), so a SIGKILLed ``ctrl
ingest`` leaves no forkserver or parser behind. The forkserver imports this module as a preload:
it asks to die with ``ctrl ingest`` and arms every process it forks to die with it in turn, at the
fork itself, because a worker spends seconds importing before any initializer of its own runs."""

from __future__ import annotations

import os
import signal
import sys

_forking_parent: int | None = None


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent ends (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _before_fork() -> None:
    global _forking_parent
    _forking_parent = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent()
    # the parent may have ended between the fork and the prctl: then no signal will come
    if os.getppid() != _forking_parent:
        os._exit(1)


def _is_forkserver() -> bool:
    """True in multiprocessing's forkserver process (started as ``python -c "...forkserver import main..."``)."""
    return sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules


if _is_forkserver() and sys.platform.startswith("linux"):
    die_with_parent()
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
