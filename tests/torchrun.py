"""Start a function in N processes the way ``torchrun`` starts a command.

As under torchrun, the launcher (this test process) hosts the rendezvous store and every rank
joins it as a client (``TORCHELASTIC_USE_AGENT_STORE``); each rank gets RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT and one CPU thread. A rank that finished its work leaves the
process group and exits at once: what is tested is the work, and a rare abort of gloo's
threads during interpreter shutdown (seen about once in 50 runs on a loaded 2-core machine)
must not fail it. Each rank dumps its Python stacks on a fatal signal (faulthandler); a failure
message carries those dumps.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, port: int, env: dict[str, str], fault_dir: str, fn: Callable[..., None],
               args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True", **env)
    torch.set_num_threads(1)
    faults = open(Path(fault_dir, f"rank{rank}.log"), "w")  # open until the process ends
    faulthandler.enable(faults, all_threads=True)
    fn(rank, *args)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., None], args: tuple[Any, ...] = (), world: int = 2, env: dict[str, str] | None = None,
              timeout_s: float = 300.0) -> None:
    """Run ``fn(rank, *args)`` in ``world`` spawned processes; fails the test when one hangs or dies."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=world, is_master=True,
                                       timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="ctrl-ranks-") as fault_dir:
        context = mp.start_processes(_rank_main, args=(world, store.port, env or {}, fault_dir, fn, args),
                                     nprocs=world, start_method="spawn", join=False)
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    pytest.fail("the ranks did not finish: one waits for the other")
        except mp.ProcessExitedException as e:
            dumps = "\n".join(f"rank {r}:\n{Path(fault_dir, f'rank{r}.log').read_text()}" for r in range(world))
            pytest.fail(f"{e}\n{dumps}")
    del store
