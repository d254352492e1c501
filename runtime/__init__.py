"""The model runtime: one interface (``runtime.base.ModelRuntime``) over the embedded model and a
MolmoE-1B checkpoint, what feature extraction, online training, the profiler and the testbed
all run the model through.

Besides the backends: ``runtime.registry`` resolves ``--model`` names, ``runtime.timing`` measures
requests with hooks, ``runtime.scoring`` scores generated answers, ``runtime.images`` finds and
opens images, ``runtime.distributed`` places a process in a torchrun job.

Names are imported on first use: ``runtime.testbed_recipe`` alone (what ``ctrl --help`` reads) loads
no torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    # the interface
    "ModelRuntime": "runtime.base", "ModelInputs": "runtime.base", "GenerationResult": "runtime.base",
    "ImageFeatures": "runtime.base", "PrefixState": "runtime.base", "DecodeState": "runtime.base",
    "ModelLoadError": "runtime.base", "REFERENCE_MAX_CROPS": "runtime.base",
    # loading
    "ExecutionOptions": "pipeline.execution", "load_runtime": "runtime.registry",
    "model_fingerprint": "runtime.registry", "resolve_model": "runtime.registry",
    "build_embedded_model": "runtime.embedded_model", "TestbedRecipe": "runtime.testbed_recipe",
    "testbed_model_dir": "runtime.registry", "cached_testbed_dir": "runtime.registry",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        msg = f"module 'runtime' has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(import_module(_EXPORTS[name]), name)
