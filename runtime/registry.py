"""Named models and how ``--model`` resolves: what every command that runs a model loads.

* ``embedded``: the seeded embedded model (``runtime.embedded_model``), built into the model
  cache on first use;
* ``testbed``: the embedded model trained on the testbed task (``ctrl testbed train``,
  ``testbed.train``) with the current :class:`TestbedRecipe`, found in the model cache by the
  recipe's hash; never trained implicitly (it takes minutes);
* an existing local directory, loaded as the embedded format when it carries the embedded
  marker and as a MolmoE-1B checkpoint otherwise (``runtime.molmoe``, which refuses a directory
  that is neither with a clear error);
* ``org/name[@revision]`` (not an existing directory): a Hugging Face Hub id, the snapshot in the
  local Hugging Face cache (``runtime.hub``; never downloaded).

Every model runs in a ``dtype`` (``runtime.precision``): ``auto`` is float32 on a CPU and bfloat16
on a GPU, and the fingerprint of a model in another dtype than float32 says so.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.execution import ExecutionOptions
from runtime.base import ModelLoadError, ModelRuntime
from runtime.cache import default_cache_root
from runtime.embedded import EmbeddedRuntime
from runtime.embedded_model import (
    build_embedded_model,
    directory_fingerprint,
    is_embedded_dir,
)
from runtime.hub import is_hub_id, resolve_hub_id
from runtime.molmoe import MolmoERuntime, known_checkpoint_fingerprint, vision_attention_qualifier
from runtime.precision import qualify_fingerprint, resolve_dtype
from runtime.testbed_recipe import TESTBED_VERSION, TestbedRecipe

__all__ = ["TESTBED_VERSION", "TestbedRecipe", "cached_testbed_dir", "load_runtime", "model_fingerprint",
           "resolve_model", "testbed_model_dir"]

def testbed_model_dir(recipe: TestbedRecipe = TestbedRecipe(), cache_dir: str | Path | None = None) -> Path:
    """Where the testbed of ``recipe`` lives in the model cache (whether it is there or not)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return root / f"testbed-v{TESTBED_VERSION}-{recipe.recipe_hash()}"


def cached_testbed_dir(recipe: TestbedRecipe = TestbedRecipe(), cache_dir: str | Path | None = None) -> Path | None:
    """The trained testbed's directory when it is in the cache, else None (nothing is trained)."""
    target = testbed_model_dir(recipe, cache_dir)
    return target if is_embedded_dir(target) else None


def resolve_model(model: str) -> tuple[str, Path]:
    """("embedded" | "molmoe", directory) for a ``--model`` value; builds the embedded model when needed."""
    if model == "embedded":
        return "embedded", build_embedded_model()
    if model == "testbed":
        path = cached_testbed_dir()
        if path is None:
            msg = ("--model testbed: the trained testbed is not in the cache; "
                   "run `ctrl testbed train` first (seconds with the default recipe, whose weights are shipped)")
            raise ModelLoadError(msg)
        return "embedded", path
    path = Path(model).expanduser()
    if not path.is_dir():
        if is_hub_id(model):
            path = resolve_hub_id(model)
        else:
            msg = (f"{model}: no such model directory (use 'embedded', 'testbed', a local directory or a "
                   "Hugging Face id org/name[@revision])")
            raise ModelLoadError(msg)
    return ("embedded" if is_embedded_dir(path) else "molmoe"), path


def load_runtime(model: str = "embedded", execution: ExecutionOptions | None = None,
                 importance_scores: Path | None = None) -> ModelRuntime:
    """A ready runtime for a ``--model`` value (see the module docstring), run as ``execution``
    says (device, the weights' dtype (``runtime.precision``), the fast path or the eager one;
    default: :class:`ExecutionOptions`'s). The threads are the caller's to apply, around its work
    (``runtime.timing.cpu_threads``).

    ``importance_scores``: an importance file (docs/origin_format.md §6) used by ``blocks_for`` /
    ``knobs(num_active_blocks=...)``;
    without it the default block rule of ``pipeline.knobs.select_active_blocks`` applies.
    """
    execution = execution or ExecutionOptions()
    kind, path = resolve_model(model)
    runtime_class = EmbeddedRuntime if kind == "embedded" else MolmoERuntime
    return runtime_class(path, device=execution.device, importance_scores=importance_scores, dtype=execution.dtype,
                         fast_path=execution.fast_path, float32_attention=execution.float32_attention)


def model_fingerprint(model: str = "embedded", dtype: str = "auto", device: str = "cpu",
                      execution: ExecutionOptions | None = None) -> str | None:
    """The fingerprint ``load_runtime(model, execution)`` would report (``execution``'s device and
    dtype, else ``device`` and ``dtype`` on the default path), without loading the weights: lets a
    fully cached feature run skip the model altogether. None when it cannot be known without
    reading a checkpoint's weights (their first load computes it in passing)."""
    execution = execution or ExecutionOptions(device=device, dtype=dtype)
    kind, path = resolve_model(model)
    weights = directory_fingerprint(path) if kind == "embedded" else known_checkpoint_fingerprint(path)
    if weights is None:
        return None
    torch_dtype = resolve_dtype(execution.dtype, execution.device)
    vision = None if kind == "embedded" else vision_attention_qualifier(
        path, torch.device(execution.device), torch_dtype, execution.fast_path, execution.float32_attention)
    return qualify_fingerprint(weights, torch_dtype, vision)
