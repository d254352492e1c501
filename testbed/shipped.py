"""The trained testbed's weights as shipped with the package: the recipe's result without the training.

A testbed trained with ``train_experts=False`` differs from the seeded embedded model only in its
~0.65 M non-expert parameters (ViT, projector, attention, router, norms, embeddings, LM head),
rounded to float16 at the end of training. This file holds exactly those values, so the seed
model plus this file rebuilds the trained directory byte for byte (:func:`materialise`), in
seconds instead of the training's minutes.

Format: an xz-compressed safetensors file (float16 tensors named ``vision.*``, ``projector.*``
and ``decoder.*`` as in the runtime's modules) whose metadata records the format, the recipe hash
it was trained with and the trained directory's ``testbed.json`` text.

Maintainers re-pack after changing the recipe (``python -m testbed.shipped MODEL_DIR``); the
pack step rebuilds the directory from the file it wrote and refuses to keep a file that does
not reproduce the model.
"""

from __future__ import annotations

import argparse
import json
import lzma
import struct
import tempfile
from pathlib import Path

import torch

from runtime.embedded import EmbeddedRuntime
from runtime.embedded_model import save_embedded_model, write_embedded_model
from runtime.registry import RECIPE_FILE

SHIPPED_FORMAT = "ctrl-testbed-weights"
#: the weights shipped with the package (lookup by recipe hash: :func:`shipped_recipe_hash`)
SHIPPED_WEIGHTS = Path(__file__).with_name("trained_weights.safetensors.xz")


class ShippedWeightsError(ValueError):
    """A shipped-weights file that cannot be read or does not fit the model."""


def trained_parameters(runtime: EmbeddedRuntime) -> dict[str, torch.nn.Parameter]:
    """The parameters a ``train_experts=False`` recipe trains, by shipped name (experts excluded)."""
    named = {}
    for prefix, module in (("vision", runtime.vision), ("projector", runtime.projector), ("decoder", runtime.decoder)):
        for name, param in module.named_parameters():
            if ".mlp.experts." not in name:
                named[f"{prefix}.{name}"] = param
    return named


def _read(path: Path) -> tuple[dict[str, str], bytes]:
    """(metadata, safetensors bytes) of a shipped file; ShippedWeightsError naming the file otherwise."""
    try:
        payload = lzma.decompress(path.read_bytes())
        (header_len,) = struct.unpack("<Q", payload[:8])
        header = json.loads(payload[8:8 + header_len])
    except (OSError, lzma.LZMAError, struct.error, ValueError) as exc:
        msg = f"{path}: not a readable shipped-weights file ({exc})"
        raise ShippedWeightsError(msg) from exc
    metadata = header.get("__metadata__") or {}
    if metadata.get("format") != SHIPPED_FORMAT:
        msg = f"{path}: not a shipped-weights file (format {metadata.get('format')!r}, expected {SHIPPED_FORMAT!r})"
        raise ShippedWeightsError(msg)
    return metadata, payload


def shipped_recipe_hash(path: Path = SHIPPED_WEIGHTS) -> str | None:
    """The recipe hash the file at ``path`` was trained with; None when there is no file."""
    if not path.is_file():
        return None
    metadata, _ = _read(path)
    return metadata.get("recipe_hash")


def pack(model_dir: Path, out: Path = SHIPPED_WEIGHTS) -> int:
    """Write the trained parameters of a testbed directory to ``out`` (atomically); returns its size.

    Refuses a directory whose experts were trained or whose trained parameters are not float16
    values, and checks that :func:`materialise` rebuilds ``model_dir`` from the new file.
    """
    from safetensors.torch import save

    recipe_text = (model_dir / RECIPE_FILE).read_text()
    recipe = json.loads(recipe_text)
    if recipe.get("config", {}).get("train_experts", True):
        msg = f"{model_dir}: its experts were trained; only a train_experts=False testbed can be shipped"
        raise ShippedWeightsError(msg)
    runtime = EmbeddedRuntime(model_dir, dtype="float32")
    tensors = {}
    for name, param in trained_parameters(runtime).items():
        half = param.detach().half()
        if not torch.equal(half.float(), param.detach()):
            msg = f"{model_dir}: parameter {name} is not float16-exact (trained with an older recipe?)"
            raise ShippedWeightsError(msg)
        tensors[name] = half.contiguous()
    metadata = {"format": SHIPPED_FORMAT, "recipe_hash": recipe["recipe_hash"], "recipe_file": recipe_text}
    data = lzma.compress(save(tensors, metadata=metadata), preset=9 | lzma.PRESET_EXTREME)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    with tempfile.TemporaryDirectory() as scratch:
        rebuilt = Path(scratch) / "model"
        rebuilt.mkdir()
        materialise(rebuilt, tmp, base_seed=recipe["config"]["base_seed"])
        different = [p.relative_to(rebuilt).as_posix() for p in sorted(rebuilt.rglob("*")) if p.is_file()
                     and p.read_bytes() != (model_dir / p.relative_to(rebuilt)).read_bytes()]
    if different:
        tmp.unlink()
        msg = f"{model_dir}: the packed weights do not rebuild these files: {', '.join(different)}"
        raise ShippedWeightsError(msg)
    tmp.replace(out)
    return len(data)


def materialise(directory: Path, path: Path = SHIPPED_WEIGHTS, base_seed: int = 0) -> dict:
    """Write the trained testbed of the shipped file into the empty ``directory``: the seeded embedded
    model with the shipped parameters put in. Returns the recipe record (``testbed.json``)."""
    from safetensors.torch import load

    metadata, payload = _read(path)
    tensors = load(payload)
    with tempfile.TemporaryDirectory() as scratch:
        write_embedded_model(Path(scratch), seed=base_seed)
        runtime = EmbeddedRuntime(Path(scratch), dtype="float32")
    params = trained_parameters(runtime)
    if set(tensors) != set(params):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        msg = f"{path}: does not fit the embedded model (missing {missing[:3]}, unexpected {extra[:3]})"
        raise ShippedWeightsError(msg)
    with torch.no_grad():
        for name, param in params.items():
            if tensors[name].shape != param.shape:
                msg = f"{path}: {name} has shape {tuple(tensors[name].shape)}, the model {tuple(param.shape)}"
                raise ShippedWeightsError(msg)
            param.copy_(tensors[name].float())
    save_embedded_model(directory, runtime.spec, runtime.vision, runtime.decoder, runtime.tokenizer, runtime.projector,
                        extra_files={RECIPE_FILE: metadata["recipe_file"]})
    return json.loads(metadata["recipe_file"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m testbed.shipped",
                                     description="Pack a trained testbed directory into the shipped weights.")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--out", type=Path, default=SHIPPED_WEIGHTS)
    args = parser.parse_args(argv)
    size = pack(args.model_dir, args.out)
    print(f"{args.out}: {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()

