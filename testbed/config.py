"""The options of ``ctrl testbed generate`` and the evaluation half of ``ctrl testbed train`` (its
training half is the recipe, ``runtime.testbed_recipe.TestbedRecipe``). Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.execution import DTYPE_CHOICES, EXECUTION_HELP
from pipeline.options import option


@dataclass(frozen=True)
class TestbedGenerateConfig:
    """A seeded testbed VQA set to write."""

    out_dir: Path = option(argument=True, is_dir=True, help="Dataset directory to write (dataset.json + images/).")
    num_samples: int = option(500, min=1, help="Samples (one question per image, families in turn).")
    seed: int = option(0, help="Seed: the same seed gives byte-identical files.")
    split: str = option("val", help="Split name recorded in dataset.json (and in the sample ids).")
    name: str = option("testbed", help="Dataset name (results and ingest use it).")
    overwrite: bool = option(False, flags=("--overwrite",), help="Regenerate even when the same dataset is there.")


@dataclass(frozen=True)
class TestbedEvalOptions:
    """Where the trained testbed is cached and how its knob table is measured."""

    cache_dir: Path | None = option(None, is_dir=True, shown_default="$CTRL_CACHE_DIR or ~/.cache/ctrl", help=
        "Model cache (default: $CTRL_CACHE_DIR or ~/.cache/ctrl).")
    force: bool = option(False, flags=("--force",), help="Train even when this recipe is cached or shipped (minutes).")
    eval_samples: int = option(250, min=0, help="Held-out samples for the knob table (0 = no evaluation).")
    eval_dir: Path | None = option(None, is_dir=True, help=
        "Held-out set directory (default: <cache>/testbed-eval-seed<seed+1000>-n<N>).")
    dtype: str = option("auto", choices=DTYPE_CHOICES, help=
        "The knob table's model: " + EXECUTION_HELP["dtype"] + " Training itself is float32.")
