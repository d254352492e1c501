"""Low-rank updates of the testbed's expert weights: trained as a parametrization, merged bit-exactly.

Each expert weight ``W`` (``gate_up_proj``, ``down_proj``: one matrix per expert) trains as
``W + U V`` with ``U`` (experts, rows, rank) starting at zero and ``V`` (experts, rank, cols) a
seeded random draw. The product is a sum of rank-one outer products computed elementwise
(:func:`merge_low_rank`), never a matmul, so the merged weights are the same bits on any machine
and thread count: the shipped factors rebuild the trained experts exactly (``testbed.shipped``).
"""

from __future__ import annotations

import math

import torch
from torch.nn.utils import parametrize

#: the expert weights that get an update, as named on transformers' OLMoE experts module
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
#: the file in a trained testbed directory that holds the float16 factors (absent without an update)
LORA_FILE = "expert_lora.safetensors"


def merge_low_rank(weight: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``weight + u @ v`` per expert, summed one rank-one term at a time, elementwise."""
    out = weight
    for j in range(u.shape[-1]):
        out = out + u[:, :, j:j + 1] * v[:, j:j + 1, :]
    return out


class LowRankUpdate(torch.nn.Module):
    """The parametrization ``W -> W + U V`` (``U`` zeros, ``V`` ~ N(0, 1/cols))."""

    def __init__(self, shape: torch.Size, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        experts, rows, cols = shape
        self.u = torch.nn.Parameter(torch.zeros(experts, rows, rank))
        self.v = torch.nn.Parameter(torch.randn(experts, rank, cols, generator=generator) / math.sqrt(cols))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return merge_low_rank(weight, self.u, self.v)


def add_low_rank_updates(decoder_layers: list[torch.nn.Module], rank: int, seed: int) -> list[torch.nn.Parameter]:
    """Register an update of ``rank`` on every expert weight (the weights themselves frozen);
    returns the factors, in layer order (u, v per weight)."""
    generator = torch.Generator().manual_seed(seed)
    factors = []
    for layer in decoder_layers:
        experts = layer.mlp.experts
        experts.requires_grad_(False)
        for name in EXPERT_WEIGHTS:
            update = LowRankUpdate(getattr(experts, name).shape, rank, generator)
            parametrize.register_parametrization(experts, name, update)
            factors += [update.u, update.v]
    return factors


def merge_low_rank_updates(decoder_layers: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Round every factor to a float16 value, merge it into its weight and remove the
    parametrization; returns the float16 factors by name (``layers.<i>.<weight>.u`` / ``.v``)."""
    factors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, layer in enumerate(decoder_layers):
            experts = layer.mlp.experts
            for name in EXPERT_WEIGHTS:
                update = getattr(experts.parametrizations, name)[0]
                for key in ("u", "v"):
                    param = getattr(update, key)
                    half = param.detach().half()
                    if not torch.isfinite(half).all():
                        msg = f"expert update layers.{i}.{name}.{key} does not fit float16 (training diverged?)"
                        raise ValueError(msg)
                    param.copy_(half.float())
                    factors[f"layers.{i}.{name}.{key}"] = half.contiguous()
                parametrize.remove_parametrizations(experts, name, leave_parametrized=True)
            experts.requires_grad_(False)
    return factors


def apply_low_rank_factors(decoder_layers: list[torch.nn.Module], factors: dict[str, torch.Tensor]) -> None:
    """Merge stored factors (:func:`merge_low_rank_updates`' result) into the expert weights in place."""
    with torch.no_grad():
        for i, layer in enumerate(decoder_layers):
            experts = layer.mlp.experts
            for name in EXPERT_WEIGHTS:
                weight = getattr(experts, name)
                u, v = factors[f"layers.{i}.{name}.u"].float(), factors[f"layers.{i}.{name}.v"].float()
                weight.copy_(merge_low_rank(weight.detach().clone(), u, v))
