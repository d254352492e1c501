"""MolmoE-1B's vision tower at full size: what attending in bfloat16 instead of float32 does to its tokens.

    python benchmarks/bench_vit_attention.py                    # random weights, 5 arrays, 2 threads
    python benchmarks/bench_vit_attention.py --checkpoint DIR   # a real checkpoint's vision tower

The fast path on a GPU attends in the weights' dtype (``runtime.molmoe.MolmoERuntime.vision_attends_float32``);
the checkpoint asks for float32 (``float32_attention``). In one run, on the same image arrays:

* ``float32``: float32 weights, float32 attention (the reference);
* ``bf16 weights``: the weights in bfloat16, attention in float32 (what ``--float32-attention`` and
  the eager path run on a GPU);
* ``bf16 attention``: the weights in bfloat16, attention in bfloat16 (the fast path's default).

For each bfloat16 setting against the reference: the relative error of the projected tokens
(median and max over tokens, ``|a - b| / |b|`` per token) and the cosine of the mean of the tokens
(the controller's image feature); and the bf16-attention tokens against the bf16-weights ones (what
the attention's rounding adds). Pure bfloat16 modules on the CPU, not the runtime's CPU compute
(which works in float32): the rounding a GPU's bfloat16 kernels do, up to kernel order.

Random weights (``synthetic.molmoe_checkpoint``'s rule: std 1/sqrt(fan_in), residual outputs scaled
by 1/sqrt(2 x layers)) attend more evenly than trained ones; ``--qk-gain`` sharpens their
attention, and a real checkpoint is the better judge (``--checkpoint``). The image arrays are
seeded smooth random fields in the processor's [-1, 1] range.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def reference_config() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from molmoe_origin import reference_dir

    from benchmarks.molmoe_common import REFERENCE_SUBDIRS

    ref = reference_dir()
    if ref is None:
        sys.exit("the MolmoE reference (../shared/molmoe_reference or $CTRL_MOLMOE_REFERENCE) is needed")
    for sub in REFERENCE_SUBDIRS:
        if (ref / sub / "config.json").is_file():
            return json.loads((ref / sub / "config.json").read_text())
    msg = f"{ref}: no config.json in {', '.join(REFERENCE_SUBDIRS)}"
    raise SystemExit(msg)


def random_vision(arch, seed: int, qk_gain: float = 1.0):
    """The full-size vision tower with seeded random weights by the checkpoint builder's rule, the
    ViT's query and key projections times ``qk_gain`` (attention logits times its square)."""
    import torch

    from runtime.molmoe_model import MolmoVisionBackbone

    vision = MolmoVisionBackbone(arch)
    generator = torch.Generator().manual_seed(seed)
    residual = ("attention.wo.weight", "feed_forward.w2.weight")
    with torch.no_grad():
        for name, param in vision.named_parameters():
            if name.endswith(".bias"):
                param.zero_()
            elif param.ndim == 1 and name.endswith(".weight"):
                param.fill_(1.0)
            elif name == "pad_embed":
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                std = 1.0 / math.sqrt(param.shape[-1])
                if name.endswith(residual) and "image_vit" in name:
                    std /= math.sqrt(2 * arch.vit_layers_total)
                if name.endswith(("attention.wq.weight", "attention.wk.weight")) and "image_vit" in name:
                    std *= qk_gain
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return vision.eval().requires_grad_(False)


def image_arrays(arch, arrays: int, seed: int):
    """(1, arrays, patches, pixels) smooth random images in [-1, 1], and all-ones masks."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)
    side, patch = arch.crop_px, arch.patch_px
    coarse = torch.rand(arrays, 3, side // 24, side // 24, generator=generator) * 2 - 1
    pixels = F.interpolate(coarse, size=(side, side), mode="bilinear", align_corners=False)
    # inside (-1, 1): the origin zeroes an array with any pixel at exactly -1 (its padding test)
    pixels = (pixels + 0.1 * torch.randn(pixels.shape, generator=generator)).clamp(-0.99, 0.99)
    n = side // patch
    patches = pixels.reshape(arrays, 3, n, patch, n, patch).permute(0, 2, 4, 3, 5, 1).reshape(arrays, n * n, -1)
    return patches[None], torch.ones(1, arrays, n * n)


def compare(got, reference) -> dict:
    import torch

    got, reference = got.float().flatten(0, -2), reference.float().flatten(0, -2)
    per_token = ((got - reference).norm(dim=-1) / reference.norm(dim=-1)).tolist()
    cosine = torch.nn.functional.cosine_similarity(got.mean(0), reference.mean(0), dim=0)
    return {"median_rel": statistics.median(per_token), "max_rel": max(per_token), "feature_cosine": float(cosine)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="a MolmoE checkpoint directory (default: random weights "
                        "with the released config)")
    parser.add_argument("--arrays", type=int, default=5, help="image arrays (crops + the global image)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--qk-gain", type=float, default=1.0, help="random weights: the ViT's query and key "
                        "projections scaled by this, for attention as peaked as a trained tower's")
    args = parser.parse_args()
    import copy

    import torch

    from benchmarks.molmoe_common import cpu_name
    from runtime.molmoe_model import MolmoEArchitecture

    torch.set_num_threads(args.threads)
    if args.checkpoint is not None:
        from runtime.molmoe import MolmoERuntime

        runtime = MolmoERuntime(args.checkpoint, dtype="float32", fast_path=False)
        arch, vision32 = runtime.arch, runtime.vision_backbone
        source = str(args.checkpoint)
    else:
        arch = MolmoEArchitecture.from_config(reference_config())
        vision32 = random_vision(arch, args.seed, args.qk_gain)
        source = f"random weights, seed {args.seed}, q/k gain {args.qk_gain:g}"
    images, masks = image_arrays(arch, args.arrays, args.seed)
    vision16 = copy.deepcopy(vision32).to(torch.bfloat16)
    print(f"{source}; {args.arrays} arrays; {cpu_name()}, {args.threads} threads")
    outputs, seconds = {}, {}
    runs = [("float32", vision32, True, torch.float32), ("bf16 weights", vision16, True, torch.bfloat16),
            ("bf16 attention", vision16, False, torch.bfloat16)]
    with torch.inference_mode():
        for name, module, float32, dtype in runs:
            module.set_float32_attention(float32)
            started = time.perf_counter()
            outputs[name], _ = module(images.to(dtype), masks.to(dtype))
            seconds[name] = time.perf_counter() - started
    rows = [("bf16 weights", "float32"), ("bf16 attention", "float32"), ("bf16 attention", "bf16 weights")]
    print("| tokens | against | median rel. error | max rel. error | feature cosine | seconds |")
    print("|---|---|---:|---:|---:|---:|")
    results = []
    for got, against in rows:
        figures = compare(outputs[got], outputs[against])
        results.append({"tokens": got, "against": against, **figures})
        print(f"| {got} | {against} | {figures['median_rel']:.2e} | {figures['max_rel']:.2e} | "
              f"{figures['feature_cosine']:.6f} | {seconds[got]:.1f} |")
    print(json.dumps({"source": source, "arrays": args.arrays, "results": results}))


if __name__ == "__main__":
    main()
