"""How a command runs the model: the device, the weights' dtype, the CPU threads, the fast path or
the eager reference, and the attention's dtype on the fast path.

Declared once here, default and help: the config of every command that loads the model takes its
fields from :func:`execution_field` and hands them whole to :func:`runtime.load_runtime` as an
:class:`ExecutionOptions`. Importing this module imports no torch (``ctrl --help`` reads it).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

from pipeline.errors import ModelLoadError
from pipeline.options import option

#: the values of ``--dtype``
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")

#: each option's help, written once (the CLI, the configs and docs/cli.md read it here)
EXECUTION_HELP: dict[str, str] = {
    "device": "cpu, cuda or cuda:N (under torchrun each rank uses its own GPU, cuda:LOCAL_RANK).",
    "dtype": "Weights held in this dtype: auto (float32 on CPU, bfloat16 on CUDA), bfloat16, float16 or float32; "
             "part of the model's fingerprint, so features, runs and profiles of another dtype are another model's.",
    "threads": "CPU threads of the model's operations, at most the CPUs this process may use (0 = torch's default, "
               "one per core). 1 by default: with more threads than free cores, torch's spinning workers made "
               "requests several times slower and their measured latencies noisy.",
    "fast_path": "The fast path: a static KV cache and decode steps of fixed shapes with no host synchronisation, the "
                 "experts as grouped matmuls, each configuration's step captured once as a CUDA graph on a GPU "
                 "(--eager: the eager reference path); recorded beside every measured latency. --compile/--no-compile "
                 "are the old names, still accepted.",
    "float32_attention": "On the fast path, attend in float32 as the origin does, in the decoder and in MolmoE's "
                         "vision tower (default: in the weights' dtype on a GPU; a CPU always attends in "
                         "float32). The vision tower's attention dtype is part of the model's fingerprint: "
                         "features and controllers of the other are another model's.",
}


@dataclass(frozen=True)
class ExecutionOptions:
    """See the module docstring; each field's help is :data:`EXECUTION_HELP`'s."""

    device: str = "cpu"
    dtype: str = "auto"
    threads: int = 1
    fast_path: bool = True
    float32_attention: bool = False

    @classmethod
    def of(cls, config: Any) -> ExecutionOptions:
        """The execution options of a command's ``config``: its fields of these names (a config
        without one, such as a feature run without threads, has the default)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)})


#: each option's command-line form beyond its help (``pipeline.options.option``)
EXECUTION_CLI: dict[str, dict[str, Any]] = {
    "dtype": {"choices": DTYPE_CHOICES},
    "threads": {"min": 0},
    "fast_path": {"flags": ("--fast-path/--eager", "--compile/--no-compile")},
}


def check_dtype_name(name: str) -> None:
    """Raise ModelLoadError unless ``name`` is one of :data:`DTYPE_CHOICES` (what configs accept)."""
    if name not in DTYPE_CHOICES:
        msg = f"--dtype {name!r}: expected one of {', '.join(DTYPE_CHOICES)}"
        raise ModelLoadError(msg)


def execution_field(name: str, *, more_help: str = "", **cli: Any) -> Any:
    """A config field for execution option ``name``: its default, help and command-line form from
    here (``more_help``: what this command adds to the help; ``cli``: what it changes of the form,
    as :func:`pipeline.options.option` takes it)."""
    default = next(f.default for f in fields(ExecutionOptions) if f.name == name)
    assert default is not MISSING
    text = EXECUTION_HELP[name] + (f" {more_help}" if more_help else "")
    return option(default, help=text, **{**EXECUTION_CLI.get(name, {}), **cli})
