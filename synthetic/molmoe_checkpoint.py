"""Random-weight MolmoE checkpoints of any size, written tensor by tensor.

The layout is the released checkpoint's: the origin tensor names and shapes that
``runtime.molmoe_model.weight_targets`` reads for a ``config.json``, safetensors shards named
``model-0000i-of-0000n.safetensors`` (filled in order up to ``max_shard_bytes``, 5 GB as
``save_pretrained`` cuts them) with ``model.safetensors.index.json``, or one
``model.safetensors``; the tokenizer and the other configs are copied from a checkpoint-shaped
source directory. Each tensor is drawn from its own seeded generator and written before the next
is drawn, so memory stays at one tensor whatever the model's size: the real MolmoE-1B config
gives a 14.4 GB bfloat16 checkpoint on a machine that could not hold it twice.

The values are drawn on the CPU by default: the same arguments give the same bytes on every
machine. ``draw_device="cuda"`` draws them with a CUDA generator instead (7.2 B normal values take
a GPU well under a second, a CPU core minutes): the same arguments then give the same bytes on
the same GPU model and torch version, but not the CPU's values.

The weights are scaled like a trained network, not like the tiny reference checkpoints (whose
gains make every knob matter and every rounding explode): matrices with std 1/sqrt(fan_in), the
residual branches' output projections further by 1/sqrt(2 * layers) (GPT-2's initialisation),
norm scales 1, biases 0, embeddings std 1.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from runtime.cache import cache_tmp_dir
from runtime.molmoe_model import MolmoEArchitecture, weight_targets

#: the files of a checkpoint besides its weights (copied from the source directory when present)
CHECKPOINT_FILES = ("generation_config.json", "preprocessor_config.json", "processor_config.json", "tokenizer.json",
                    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_RESIDUAL_OUTPUTS = ("attn.attn_out.weight", "down_proj.weight", "attention.wo.weight", "feed_forward.w2.weight")
_TABLES = ("wte.embedding", "wte.new_embedding", "pad_embed")


def checkpoint_tensors(arch: MolmoEArchitecture) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``arch`` holds (origin names) and its shape, in writing order."""
    tensors: dict[str, tuple[int, ...]] = {}
    for target in weight_targets(arch).values():
        for piece in target.pieces:
            tensors.setdefault(piece.source, piece.shape)
    return tensors


def random_tensor(name: str, shape: tuple[int, ...], arch: MolmoEArchitecture,
                  generator: torch.Generator) -> torch.Tensor:
    """One tensor's float32 values by the rule of the module docstring, on the generator's device."""
    device = generator.device
    if name.endswith(".bias"):
        return torch.zeros(shape, device=device)
    if len(shape) == 1 and name.endswith(".weight"):
        return torch.ones(shape, device=device)  # every 1-D weight of MolmoE is a norm scale
    values = torch.randn(shape, generator=generator, device=device)
    if any(name.endswith(t) for t in _TABLES):
        return values
    std = 1.0 / math.sqrt(shape[-1])
    if name.endswith(_RESIDUAL_OUTPUTS):
        layers = arch.n_layers if name.startswith("model.transformer.") else arch.vit_layers_total
        std /= math.sqrt(2 * layers)
    return values.mul_(std)


def _shards(tensors: dict[str, tuple[int, ...]], itemsize: int, max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in tensors.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _header(names: list[str], tensors: dict[str, tuple[int, ...]], dtype: torch.dtype) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        nbytes = math.prod(tensors[name]) * dtype.itemsize
        entries[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(tensors[name]),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_random_checkpoint(out: Path, config: dict, source_dir: Path, *, dtype: torch.dtype = torch.bfloat16,
                            seed: int = 0, max_shard_bytes: int = 5_000_000_000,
                            progress: Callable[[int, int], None] | None = None,
                            draw_device: str | torch.device = "cpu") -> Path:
    """Write a random-weight checkpoint of ``config`` (a MolmoE ``config.json`` mapping) to ``out``.

    ``source_dir`` supplies the tokenizer and the other configs (:data:`CHECKPOINT_FILES`).
    The directory appears complete or not at all (written beside it, then renamed). Same
    arguments, same bytes. ``progress(bytes_written, total_bytes)`` after every tensor.
    ``draw_device``: where the values are drawn (see the module docstring); the file is the same
    layout either way.
    """
    arch = MolmoEArchitecture.from_config(config)
    tensors = checkpoint_tensors(arch)
    shards = _shards(tensors, dtype.itemsize, max_shard_bytes)
    total = sum(math.prod(s) for s in tensors.values()) * dtype.itemsize
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    tmp = cache_tmp_dir(out)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file in CHECKPOINT_FILES:
            if (source_dir / file).is_file():
                shutil.copyfile(source_dir / file, tmp / file)
        written = 0
        index = 0
        for file, shard in zip(names, shards):
            with (tmp / file).open("wb") as fh:
                fh.write(_header(shard, tensors, dtype))
                for name in shard:
                    generator = torch.Generator(device=draw_device).manual_seed(seed * 1_000_003 + index)
                    values = random_tensor(name, tensors[name], arch, generator).to(dtype).cpu()
                    fh.write(memoryview(values.reshape(-1).view(torch.uint8).numpy()))
                    written += values.numel() * dtype.itemsize
                    index += 1
                    if progress is not None:
                        progress(written, total)
        if len(shards) > 1:
            weight_map = {name: file for file, shard in zip(names, shards) for name in shard}
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
