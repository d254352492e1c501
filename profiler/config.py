"""The options of ``ctrl profile``, each declared once on its field (``pipeline.options``).

Imports no torch: ``ctrl --help`` builds the command's options from these fields.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import CtrlError
from pipeline.execution import check_dtype_name, execution_field
from pipeline.knobs import EXP6_MAX_CROPS, EXP6_NUM_ACTIVE_BLOCKS, EXP6_TOP_K, Config, balanced_combinations
from pipeline.options import option

_CONFIG_ITEM = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*/\s*(\d+)\s*$")


def parse_configs(spec: str | Sequence[Config]) -> tuple[list[Config], str]:
    """The configurations of ``--configs`` and the strategy name written into the files.

    ``balanced`` (default): the origin's balanced strategy over the exp6 defaults,
    {2,6,10} x {4,8,12} x {12,14,16}; ``full``: all 75 combinations of the defaults;
    otherwise an explicit list ``C/K/B,C/K/B`` (max_crops / top_k / num_active_blocks).
    """
    if not isinstance(spec, str):
        items = [tuple(int(v) for v in c) for c in spec]
        if not items or any(len(c) != 3 for c in items):
            msg = f"configs must be (max_crops, top_k, num_active_blocks) triples, got {spec!r}"
            raise CtrlError(msg)
        return list(dict.fromkeys(items)), "custom"  # type: ignore[arg-type]
    text = spec.strip()
    if text.lower() == "balanced":
        return balanced_combinations(EXP6_MAX_CROPS, EXP6_TOP_K, EXP6_NUM_ACTIVE_BLOCKS), "balanced"
    if text.lower() == "full":
        return [(c, k, b) for c in EXP6_MAX_CROPS for k in EXP6_TOP_K for b in EXP6_NUM_ACTIVE_BLOCKS], "full"
    configs: list[Config] = []
    for item in text.split(","):
        m = _CONFIG_ITEM.match(item)
        if m is None:
            msg = (f"--configs: bad entry {item.strip()!r} in {spec!r}: expected C/K/B "
                   "(max_crops/top_k/num_active_blocks), e.g. 2/4/12,6/8/16, or 'balanced' or 'full'")
            raise CtrlError(msg)
        c, k, b = (int(g) for g in m.groups())
        if min(c, k, b) < 1:
            msg = f"--configs: {item.strip()!r}: every value must be >= 1"
            raise CtrlError(msg)
        configs.append((c, k, b))
    return list(dict.fromkeys(configs)), "custom"


@dataclass
class ProfileConfig:
    """What ``ctrl profile`` runs (``profiler.sweep``'s docstring says how it measures)."""

    datasets: Sequence[Path] = option(help="Dataset directory (dataset.json + images/); repeatable.",
                                      flags=("--dataset",))
    model: str = option("embedded", help="'embedded' (built offline from a seed), 'testbed' (the trained testbed, "
                        "see `ctrl testbed train`), a local model directory or a Hugging Face id "
                        "org/name[@revision] in the local HF cache.")
    configs: str | Sequence[Config] = option("balanced", help="'balanced' (27), 'full' (75) or a list C/K/B,C/K/B "
                                             "(max_crops/top_k/num_active_blocks).")
    num_samples: int | None = option(None, help="The first N samples of each dataset (default: all).", min=1)
    world_size: int = option(1, help="Ranks simulated in this process, one after the other (each writes its own "
                             "rank file, then a deterministic merge); under torchrun every process is one rank.",
                             min=1)
    out_dir: Path = option(Path("results/profile"), help="Results directory (exp5_accuracy_<dataset>/, "
                           "exp6_latency_<dataset>/).", flags=("--out",), is_dir=True)
    max_new_tokens: int = option(16, help="Generation cap per request.", min=1)
    batch_size: int = option(1, help="Requests generated together for exp5's accuracy, all at one configuration "
                             "(1: every generation alone, exp5 and exp6 from the same ones). Above 1, exp6's "
                             "latencies come from separate generations alone, on --latency-samples.", min=1)
    latency_samples: int | None = option(None, help="Samples whose latency exp6 records at batch size 1: a "
                                         "seeded subset of each dataset's (default: all).", min=1)
    latency_seed: int = option(0, help="Seed of the --latency-samples subset.", min=0)
    device: str = execution_field("device")
    # recorded in every file: a file of another dtype is another run's
    dtype: str = execution_field("dtype")
    warmup: int = option(1, help="Unmeasured generations before each configuration (per rank).", min=0)
    threads: int = execution_field("threads")
    # recorded in every file with the attention's dtype: a file of another path is another run's
    fast_path: bool = execution_field("fast_path", more_help="Profiles of the two paths never mix.")
    float32_attention: bool = execution_field("float32_attention")
    #: filled by __post_init__ from ``configs``
    combinations: list[Config] = field(default_factory=list, init=False)
    strategy: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if not self.datasets:
            msg = "give at least one --dataset DIR (a directory with dataset.json and images/)"
            raise CtrlError(msg)
        self.datasets = tuple(Path(d).expanduser() for d in self.datasets)
        for d in self.datasets:
            if not d.is_dir():
                msg = f"--dataset {d}: no such directory (a dataset directory holds dataset.json and images/)"
                raise CtrlError(msg)
        bounds = (("--num-samples", self.num_samples, 1), ("--world-size", self.world_size, 1),
                  ("--max-new-tokens", self.max_new_tokens, 1), ("--warmup", self.warmup, 0),
                  ("--batch-size", self.batch_size, 1), ("--latency-samples", self.latency_samples, 1),
                  ("--latency-seed", self.latency_seed, 0),
                  ("--threads", self.threads, 0))
        for flag, value, low in bounds:
            if value is not None and value < low:
                msg = f"{flag} must be >= {low}, got {value}"
                raise CtrlError(msg)
        check_dtype_name(self.dtype)
        self.out_dir = Path(self.out_dir).expanduser()
        self.combinations, self.strategy = parse_configs(self.configs)
