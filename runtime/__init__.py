"""The model runtime: one interface (``runtime.base.ModelRuntime``) over the embedded model and a
MolmoE-1B checkpoint, what feature extraction, online training, the profiler and the testbed
all run the model through.

Besides the backends: ``runtime.registry`` resolves ``--model`` names, ``runtime.timing`` measures
requests with hooks, ``runtime.scoring`` scores generated answers, ``runtime.images`` finds and
opens images, ``runtime.distributed`` places a process in a torchrun job.
"""

from pipeline.execution import ExecutionOptions
from runtime.base import (
    REFERENCE_MAX_CROPS,
    DecodeState,
    GenerationResult,
    ImageFeatures,
    ModelInputs,
    ModelLoadError,
    ModelRuntime,
    PrefixState,
)
from runtime.embedded_model import build_embedded_model
from runtime.registry import (
    TestbedRecipe,
    cached_testbed_dir,
    load_runtime,
    model_fingerprint,
    resolve_model,
    testbed_model_dir,
)

__all__ = [
    # the interface
    "ModelRuntime",
    "ModelInputs",
    "GenerationResult",
    "ImageFeatures",
    "PrefixState",
    "DecodeState",
    "ModelLoadError",
    "REFERENCE_MAX_CROPS",
    # loading
    "ExecutionOptions",
    "load_runtime",
    "model_fingerprint",
    "resolve_model",
    "build_embedded_model",
    "TestbedRecipe",
    "testbed_model_dir",
    "cached_testbed_dir",
]
