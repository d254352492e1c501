"""Worker processes that end with ctrl: the forkserver context every pool of ctrl starts from, and the
killing of a pool's workers where its shutdown would wait for them."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.context import BaseContext


def forkserver_context(*preload: str) -> BaseContext:
    """multiprocessing's forkserver context, its server importing ``preload`` once (what every worker then
    has without importing it) and :mod:`pipeline._die_with_parent` (the server, and every worker it forks,
    ends with this process). Forkserver, not fork: this process may run threads (DuckDB's, polars', a
    progress bar's), and a forked child can inherit one of their locks held. The server is one per
    process: the preload of the pool that starts it holds for every later pool."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["pipeline._die_with_parent", *preload])
    return context


def kill_workers(pool: ProcessPoolExecutor) -> None:
    """Kill every live worker of ``pool``: its shutdown would otherwise wait for them. A broken pool
    terminates its workers itself, but a worker it was starting while another died can escape that
    (CPython's executor marks itself broken without the lock ``submit`` spawns under) and would then
    wait for work forever, and the pool's shutdown with it. Call it once every submit has returned: the
    pool's process table is then complete."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        if process.is_alive():
            process.kill()
