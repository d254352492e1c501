"""Whether a model's weights fit where they are to be loaded, asked before anything is allocated.

A model too large for the host is otherwise killed by the kernel's OOM killer with no message
(or takes the machine into swap); one that does not fit on a GPU fails midway with a CUDA
out-of-memory error. :func:`check_fits` refuses it with one line instead: what the weights need in
the chosen dtype, what is free, and the ``--dtype`` that would fit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.resources import host_available_bytes
from runtime.base import ModelLoadError
from runtime.precision import dtype_name

#: memory a loaded model needs besides its weights and KV cache: activations, the runtime itself
HEADROOM_BYTES = 1 << 30
_GIB = float(1 << 30)


def device_available_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device (None for other devices)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def _candidates(device: torch.device) -> list[torch.dtype]:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return [torch.float32, torch.float16]
    return [torch.float32, torch.bfloat16]


def check_fits(what: str, weight_bytes: Callable[[torch.dtype], int], dtype: torch.dtype, device: torch.device,
               available: int | None = None, cache_bytes: Callable[[torch.dtype], int] | None = None) -> None:
    """Raise ModelLoadError (one line) unless ``weight_bytes(dtype)``, ``cache_bytes(dtype)`` (the KV cache
    the model holds at that dtype; none without it) and :data:`HEADROOM_BYTES` fit in the free memory of
    ``device`` (the host for a CPU). ``available`` overrides the reading."""
    if available is None:
        available = device_available_bytes(device) if device.type == "cuda" else host_available_bytes()
    if available is None:
        return

    def total(d: torch.dtype) -> int:
        return weight_bytes(d) + (cache_bytes(d) if cache_bytes is not None else 0) + HEADROOM_BYTES

    need = weight_bytes(dtype)
    if total(dtype) <= available:
        return
    place = f"GPU {device}" if device.type == "cuda" else "host"
    fitting = [d for d in _candidates(device) if d != dtype and total(d) <= available and weight_bytes(d) < need]
    if fitting:
        alt = fitting[0]
        advice = f"--dtype {dtype_name(alt)} ({weight_bytes(alt) / _GIB:.1f} GiB) would fit"
    else:
        smallest = min(_candidates(device), key=weight_bytes)
        advice = (f"no --dtype fits ({dtype_name(smallest)} needs {weight_bytes(smallest) / _GIB:.1f} GiB); free "
                  "memory or use a device with more")
    cache = "" if cache_bytes is None else f"{cache_bytes(dtype) / _GIB:.1f} GiB of KV cache and "
    msg = (f"{what}: the weights need {need / _GIB:.1f} GiB in {dtype_name(dtype)} (+{cache}"
           f"{HEADROOM_BYTES / _GIB:.0f} GiB to run) and {available / _GIB:.1f} GiB of {place} memory is free; "
           f"{advice}")
    raise ModelLoadError(msg)
