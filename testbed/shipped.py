"""The trained testbed's weights as shipped with the package: the recipe's result without the training.

A testbed trained with ``train_experts=False`` differs from the seeded embedded model (its
non-expert parameters rounded to float16 values) only in

* the non-expert parameters the recipe trained (ViT, projector, attention queries and keys,
  routers, norms; the parts in ``TestbedRecipe.frozen`` stay as seeded), rounded to float16 at the
  end of training, and
* the low-rank updates of the expert weights (``testbed.lowrank``; float16 factors, merged
  elementwise).

This file holds exactly those values, so the seed model plus this file rebuilds the trained
directory byte for byte (:func:`materialise`), in seconds instead of the training's minutes.

Format: an xz-compressed safetensors file (float16 tensors named ``vision.*``, ``projector.*`` and
``decoder.*`` as in the runtime's modules, ``lora.layers.<i>.<weight>.u|v`` for the expert
updates) whose metadata records the format, the recipe hash it was trained with and the trained
directory's ``testbed.json`` text (whose config gives the seed and the image pooling).

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
from runtime.embedded_model import RECIPE_FILE, EmbeddedSpec, save_embedded_model, write_embedded_model
from testbed.lowrank import LORA_FILE, apply_low_rank_factors

SHIPPED_FORMAT = "ctrl-testbed-weights"
#: the weights shipped with the package (lookup by recipe hash: :func:`shipped_recipe_hash`)
SHIPPED_WEIGHTS = Path(__file__).with_name("trained_weights.safetensors.xz")


class ShippedWeightsError(ValueError):
    """A shipped-weights file that cannot be read or does not fit the model."""


#: shipped-name prefix of the expert update factors
_LORA_PREFIX = "lora."


def serialize_factors(factors: dict[str, torch.Tensor]) -> bytes:
    """The bytes of a trained directory's :data:`testbed.lowrank.LORA_FILE`."""
    from safetensors.torch import save

    return save({name: factors[name].contiguous() for name in sorted(factors)})


def trained_parameters(runtime: EmbeddedRuntime) -> dict[str, torch.nn.Parameter]:
    """The non-expert parameters (those a ``train_experts=False`` recipe may train and rounds to
    float16), by shipped name."""
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
    from safetensors.torch import load

    runtime = EmbeddedRuntime(model_dir, dtype="float32")
    seeded = trained_parameters(_seed_runtime(recipe["config"]))
    tensors = {}
    for name, param in trained_parameters(runtime).items():
        half = param.detach().half()
        if not torch.equal(half.float(), param.detach()):
            msg = f"{model_dir}: parameter {name} is not float16-exact (trained with an older recipe?)"
            raise ShippedWeightsError(msg)
        if not torch.equal(half, seeded[name].detach().half()):  # the untrained ones come from the seed
            tensors[name] = half.contiguous()
    if (model_dir / LORA_FILE).is_file():
        for name, factor in load((model_dir / LORA_FILE).read_bytes()).items():
            tensors[_LORA_PREFIX + name] = factor.contiguous()
    metadata = {"format": SHIPPED_FORMAT, "recipe_hash": recipe["recipe_hash"], "recipe_file": recipe_text}
    data = lzma.compress(save(tensors, metadata=metadata), preset=9 | lzma.PRESET_EXTREME)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    with tempfile.TemporaryDirectory() as scratch:
        rebuilt = Path(scratch) / "model"
        rebuilt.mkdir()
        materialise(rebuilt, tmp)
        different = [p.relative_to(rebuilt).as_posix() for p in sorted(rebuilt.rglob("*")) if p.is_file()
                     and p.read_bytes() != (model_dir / p.relative_to(rebuilt)).read_bytes()]
    if different:
        tmp.unlink()
        msg = f"{model_dir}: the packed weights do not rebuild these files: {', '.join(different)}"
        raise ShippedWeightsError(msg)
    tmp.replace(out)
    return len(data)


def _seed_runtime(config: dict) -> EmbeddedRuntime:
    """The seeded embedded model a recipe (``testbed.json``'s config) starts from."""
    with tempfile.TemporaryDirectory() as scratch:
        write_embedded_model(Path(scratch), seed=config.get("base_seed", 0),
                             pool=config.get("image_pool", EmbeddedSpec.pool))
        return EmbeddedRuntime(Path(scratch), dtype="float32")


def materialise(directory: Path, path: Path = SHIPPED_WEIGHTS) -> dict:
    """Write the trained testbed of the shipped file into the empty ``directory``: the seeded embedded
    model (non-expert parameters rounded to float16) with the shipped parameters put in and the
    expert updates merged. Returns the recipe record (``testbed.json``)."""
    from safetensors.torch import load

    metadata, payload = _read(path)
    tensors = load(payload)
    record = json.loads(metadata["recipe_file"])
    runtime = _seed_runtime(record.get("config", {}))
    params = trained_parameters(runtime)
    factors = {name[len(_LORA_PREFIX):]: t for name, t in tensors.items() if name.startswith(_LORA_PREFIX)}
    unexpected = sorted(n for n in tensors if not n.startswith(_LORA_PREFIX) and n not in params)
    if unexpected:
        msg = f"{path}: does not fit the embedded model (unexpected {unexpected[:3]})"
        raise ShippedWeightsError(msg)
    with torch.no_grad():
        for name, param in params.items():
            value = tensors.get(name, param.detach().half())
            if value.shape != param.shape:
                msg = f"{path}: {name} has shape {tuple(value.shape)}, the model {tuple(param.shape)}"
                raise ShippedWeightsError(msg)
            param.copy_(value.float())
        if factors:
            try:
                apply_low_rank_factors(runtime.decoder_layers, factors)
            except (KeyError, RuntimeError) as exc:
                msg = f"{path}: its expert updates do not fit the embedded model ({exc})"
                raise ShippedWeightsError(msg) from exc
    extra: dict[str, str | bytes] = {RECIPE_FILE: metadata["recipe_file"]}
    if factors:
        extra[LORA_FILE] = serialize_factors(factors)
    save_embedded_model(directory, runtime.spec, runtime.vision, runtime.decoder, runtime.tokenizer, runtime.projector,
                        extra_files=extra)
    return record


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

