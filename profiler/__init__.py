"""``ctrl profile``: measure a model's knob sweep and write exp5 / exp6 trees that ``ctrl ingest`` reads.

The profiler produces ingest *input*: it runs the model (``runtime``) on a VQA dataset
(``testbed.dataset``) under every configuration of a sweep and writes the origin's file format
(``pipeline.origin_format``) with the origin's measurement defects fixed. ``profiler.archive``
packs such a tree into one small Parquet file (the shipped sample data) and back. Names are
imported on first use: ``profiler.config`` alone (what ``ctrl --help`` reads) loads no torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ProfileConfig": "profiler.config",
    "parse_configs": "profiler.config",
    "profile_model": "profiler.sweep",
    "ProfileReport": "profiler.sweep",
    "DatasetReport": "profiler.sweep",
    "format_report": "profiler.sweep",
    "PROFILE_VERSION": "profiler.tree",
    "TreeWriter": "profiler.tree",
    "pack_profile": "profiler.archive",
    "unpack_profile": "profiler.archive",
    "UnpackReport": "profiler.archive",
}

__all__ = [
    # configs and runners
    "ProfileConfig",
    "profile_model",
    "parse_configs",
    "ProfileReport",
    "DatasetReport",
    "format_report",
    # the tree and its archive
    "PROFILE_VERSION",
    "TreeWriter",
    "pack_profile",
    "unpack_profile",
    "UnpackReport",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        msg = f"module 'profiler' has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(import_module(_EXPORTS[name]), name)
