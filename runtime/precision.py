"""The precision a model runs in (``--dtype``): what the weights are held in and how they compute.

``--dtype`` names the **storage** dtype: every weight is held in it (bfloat16 halves the memory of
float32). Computing follows bf16 autocast, the way the origin profiled MolmoE-1B on GPUs
(``config.json``: ``precision: amp_bf16``): the inputs and outputs of every matrix product
(linear, convolution) are rounded to the storage dtype and accumulated in float32, while
embeddings, norms, softmax, attention and the residual stream stay float32. The same rule holds on
every device, so a ``--dtype bfloat16`` feature computed on a CPU matches one computed on a GPU up
to summation order.

What differs by device is only the kernel of a product with half weights:

* CUDA: the half-precision kernel, always;
* CPU: the half kernel for up to :data:`CPU_HALF_KERNEL_MAX_ROWS` rows (a decode step, an expert
  that few tokens chose), else the weight converted to float32 for this one call and the float32
  kernel on the rounded inputs: a CPU without bf16 instructions runs the half kernel several
  times slower than float32 for prefill shapes and as fast for a few rows
  (benchmarks/bench_precision.py, docs/results.md). Converted weights live for one product
  only, in a scratch buffer reused from product to product (a fresh 8 MB tensor per expert costs
  its page faults again every time): nothing is held twice. Where autograd may need the weight
  later, the conversion gets its own tensor.

float32 storage runs plain float32 on every device, with no rounding and no interception.

``auto`` is float32 on a CPU (exact, and a bf16 product is slow there) and bfloat16 on a GPU
(float16 on GPUs without bf16 support, before Ampere): the origin's GPU precision, and it fits
MolmoE-1B's 7.2 B weights (13.45 GiB) on a 24 GB card.
"""

from __future__ import annotations

import hashlib
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pipeline.execution import DTYPE_CHOICES, check_dtype_name
from runtime.base import ModelLoadError

_BY_NAME = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: products with at most this many rows use the half kernel on a CPU (see the module docstring)
CPU_HALF_KERNEL_MAX_ROWS = 8
#: weights up to this many values are converted into the reused scratch buffer (64 MiB of float32)
SCRATCH_MAX_VALUES = 16 << 20
_scratch = threading.local()


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """The storage dtype of a ``--dtype`` value on ``device`` (``auto`` as the module docstring says)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _BY_NAME.values():
            msg = f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype}"
            raise ModelLoadError(msg)
        return dtype
    name = str(dtype).strip().lower().removeprefix("torch.")
    check_dtype_name(name)
    if name == "auto":
        device = torch.device(device)
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return _BY_NAME[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def qualify_fingerprint(weights_fingerprint: str, dtype: torch.dtype,
                        vision_attention: torch.dtype | None = None) -> str:
    """The fingerprint of a model run in ``dtype``: the weights' own for float32 (what every
    float32 cache and record already carries), else a hash of both, so that features and
    profile records of two precisions never share a key. ``vision_attention``: the dtype a vision
    tower attends in where it is not the checkpoint's own (the fast path's), hashed in too: its
    image features are another model's."""
    if dtype == torch.float32 and vision_attention is None:
        return weights_fingerprint
    text = f"{weights_fingerprint}\ndtype={dtype_name(dtype)}"
    if vision_attention is not None:
        text += f"\nvision_attention={dtype_name(vision_attention)}"
    return hashlib.sha256(text.encode()).hexdigest()


def compute_context(dtype: torch.dtype) -> AbstractContextManager:
    """The context every forward of a model stored in ``dtype`` runs under (nothing for float32)."""
    return nullcontext() if dtype == torch.float32 else HalfStorageCompute(dtype)


def hold_weights_in(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Convert ``module``'s floating-point parameters to ``dtype`` in place; buffers (rotary
    frequencies, position ids) keep theirs."""
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return module


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1) if x.dim() else 1


def _as_float32(weight: torch.Tensor, for_autograd: bool) -> torch.Tensor:
    """``weight`` converted to float32 for one product: in this thread's scratch buffer, or in a
    tensor of its own when autograd may keep it or it is larger than the buffer may grow."""
    if for_autograd or weight.numel() > SCRATCH_MAX_VALUES:
        return weight.float()
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < weight.numel() or buffer.device != weight.device:
        # a normal tensor, even when first needed under inference_mode: later no_grad forwards write it too
        with torch.inference_mode(False):
            buffer = _scratch.buffer = torch.empty(weight.numel(), dtype=torch.float32, device=weight.device)
    return buffer[:weight.numel()].view(weight.shape).copy_(weight)


class HalfStorageCompute(TorchFunctionMode):
    """bf16-autocast computing over half-precision weights (see the module docstring).

    Intercepts the functions that read weights: ``linear`` and the convolutions (rounded inputs
    and outputs, float32 accumulation), ``embedding`` (the rows, as float32) and ``layer_norm``
    (float32, as autocast runs it). Everything else computes in its inputs' dtype, which is
    float32: a half weight meeting a float32 tensor elsewhere (an RMS-norm scale, a positional
    table) is promoted exactly.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            return self._linear(*args, **kwargs)
        if func in _CONVOLUTIONS:
            return self._convolution(func, *args, **kwargs)
        if func is F.embedding:
            out = func(*args, **kwargs)
            return out.float() if out.dtype == self.dtype else out
        if func is F.layer_norm:
            return self._layer_norm(*args, **kwargs)
        return func(*args, **kwargs)

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.dtype != self.dtype or not x.is_floating_point():
            return F.linear(x, weight, bias)
        out_dtype = x.dtype
        if weight.device.type == "cuda" or _rows(x) <= CPU_HALF_KERNEL_MAX_ROWS:
            out = F.linear(self._round(x), weight, None if bias is None else bias.to(self.dtype))
        else:
            bias32 = None if bias is None else bias.float()
            autograd = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            out = self._round(F.linear(self._round(x).float(), _as_float32(weight, autograd), bias32))
        return out.to(out_dtype)

    def _convolution(self, func: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     *args: Any, **kwargs: Any) -> torch.Tensor:
        if weight.dtype != self.dtype:
            return func(x, weight, bias, *args, **kwargs)
        out_dtype = x.dtype
        if weight.device.type == "cuda":
            out = func(self._round(x), weight, None if bias is None else bias.to(self.dtype), *args, **kwargs)
        else:
            autograd = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            out = self._round(func(self._round(x).float(), _as_float32(weight, autograd),
                                   None if bias is None else bias.float(), *args, **kwargs))
        return out.to(out_dtype)

    def _layer_norm(self, x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
        def up(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.float() if t is not None and t.dtype == self.dtype else t

        return F.layer_norm(up(x), normalized_shape, up(weight), up(bias), eps)


_CONVOLUTIONS = (F.conv1d, F.conv2d, F.conv3d)
