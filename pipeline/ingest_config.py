"""The options of ``ctrl ingest``, each declared once on its field (``pipeline.options``).

Imports neither pyarrow nor DuckDB: ``ctrl --help`` builds the command's options from these fields.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import CtrlError
from pipeline.options import WORKSPACE_CLI, WORKSPACE_HELP, option

#: the most parser processes an ingest starts: more only add memory and start-up time
MAX_WORKERS = 4 * (os.cpu_count() or 1)


@dataclass
class IngestConfig:
    """Options of ``ctrl ingest`` (the help of each is on its field)."""

    paths: list[Path] = option(help="Result files or directories (searched recursively for *.json).",
                               argument=True, exists=True)
    workspace: Path | None = option(None, help=WORKSPACE_HELP, **WORKSPACE_CLI)
    strict: bool = option(False, help="Stop at the first bad file and change nothing (otherwise bad files are "
                          "reported, recorded with status 'error' and the rest is ingested).", flags=("--strict",))
    num_workers: int = option(0, help="Parser processes; 0 = one per core (max 4), 1 = parse in-process.", min=0,
                              panel="Performance")

    def __post_init__(self) -> None:
        self.paths = [Path(p) for p in self.paths]
        if not self.paths:
            msg = "no input paths given\nHint: ctrl ingest exp5_dir exp6_dir"
            raise CtrlError(msg)
        missing = [str(p) for p in self.paths if not p.exists()]
        if missing:
            msg = f"input path does not exist: {missing[0]}"
            raise CtrlError(msg)
        if self.num_workers < 0:
            msg = f"num_workers must be >= 0, got {self.num_workers!r}"
            raise CtrlError(msg)
        if self.num_workers > MAX_WORKERS:
            msg = (f"--num-workers {self.num_workers} is more parser processes than ctrl starts (at most "
                   f"{MAX_WORKERS}: 4 per core of this machine); 0 picks one per core, at most 4")
            raise CtrlError(msg)

    @property
    def resolved_workers(self) -> int:
        return self.num_workers or max(1, min(4, os.cpu_count() or 1))
