"""The origin MolmoE code as a test reference: tiny checkpoints and the origin model in-process.

``../shared/molmoe_reference`` (or ``$CTRL_MOLMOE_REFERENCE``) holds the origin model and
processor files and ``build_tiny_molmoe.py``, which writes a random-weight checkpoint with the
real layout. The origin *model* runs here (it needs einops); the origin *processor* needs
torchvision and is checked through a committed fixture instead (tests/test_molmoe_processor.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _origin_checkout() -> Path | None:
    """The repository this checkout was cloned from, when that is a local directory (CI clones)."""
    try:
        url = subprocess.run(["git", "-C", str(REPO), "config", "--get", "remote.origin.url"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    path = Path(url.removeprefix("file://")) if url else None
    return path if path is not None and path.is_absolute() and path.is_dir() else None


def reference_dir() -> Path | None:
    """The reference folder: ``$CTRL_MOLMOE_REFERENCE``, else ``../shared/molmoe_reference`` beside this
    checkout or beside the local repository it was cloned from; None when there is none."""
    if "CTRL_MOLMOE_REFERENCE" in os.environ:
        candidates = [Path(os.environ["CTRL_MOLMOE_REFERENCE"])]
    else:
        candidates = [REPO.parent / "shared" / "molmoe_reference"]
        origin = _origin_checkout()
        if origin is not None:
            candidates.append(origin.parent / "shared" / "molmoe_reference")
    return next((p for p in candidates if (p / "build_tiny_molmoe.py").is_file()), None)


SKIP_REASON = ("the origin MolmoE reference (../shared/molmoe_reference or $CTRL_MOLMOE_REFERENCE) "
               "is not present")


def build_tiny(out: Path, *args: str) -> Path:
    """Write a tiny random-weight checkpoint with the real layout (``--v5-fixes`` code files);
    skips the calling test where the reference is absent."""
    ref = reference_dir()
    if ref is None:
        import pytest

        pytest.skip(SKIP_REASON)
    subprocess.run([sys.executable, str(ref / "build_tiny_molmoe.py"), str(out), "--v5-fixes", "--force", *args],
                   check=True, capture_output=True, text=True)
    return out


def _builder():
    ref = reference_dir()
    spec = importlib.util.spec_from_file_location("build_tiny_molmoe", ref / "build_tiny_molmoe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ORIGIN: dict[str, object] = {}


def origin_modules():
    """(config module, modeling module) of the origin code, imported once as the builder does
    (P1-P5 only: the origin code itself, made to stand alone)."""
    if not _ORIGIN:
        builder = _builder()
        _, patched, _ = builder.patched_sources(builder.DEFAULT_SOURCE)
        src = Path(tempfile.mkdtemp(prefix="molmoe-origin-"))
        for name, text in patched.items():
            (src / name).write_text(text)
        _ORIGIN["modules"] = builder.import_origin(src)
    return _ORIGIN["modules"]


def load_origin_model(checkpoint: Path) -> torch.nn.Module:
    """The origin ``MolmoForCausalLM`` with the checkpoint's weights (strict), float32, eval."""
    from safetensors.torch import load_file

    conf, modeling = origin_modules()
    cfg = json.loads((checkpoint / "config.json").read_text())
    config = conf.MolmoConfig(**{k: v for k, v in cfg.items() if k != "auto_map"})
    model = modeling.MolmoForCausalLM(config)
    state = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        state.update(load_file(str(file)))
    model.load_state_dict(state, strict=True)
    return model.eval()


def origin_forward(model: torch.nn.Module, inputs, **kwargs):
    """One origin forward of a runtime's ``MolmoEInputs`` (batch of one), float32, no cache."""
    ids = inputs.input_ids
    kw = {}
    if inputs.images is not None:
        kw = {"images": inputs.images[None], "image_masks": inputs.image_masks[None],
              "image_input_idx": inputs.image_input_idx[None]}
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=kwargs.pop("use_cache", False),
                     **kw, **kwargs)


def origin_greedy(model: torch.nn.Module, inputs, max_new_tokens: int, eos_id: int) -> list[int]:
    """Greedy decoding with the origin model's own legacy KV cache (what its
    ``prepare_inputs_for_generation`` feeds: images at prefill, then one token per step)."""
    out = origin_forward(model, inputs, use_cache=True, last_logits_only=True)
    cache, length = out.past_key_values, inputs.input_ids.shape[1]
    tokens = [int(out.logits[0, -1].argmax())]
    while tokens[-1] != eos_id and len(tokens) < max_new_tokens:
        length += 1
        with torch.no_grad():
            step = model(input_ids=torch.tensor([[tokens[-1]]]), attention_mask=torch.ones(1, length, dtype=torch.long),
                         position_ids=torch.tensor([[length - 1]]), past_key_values=cache, use_cache=True,
                         last_logits_only=True)
        cache = step.past_key_values
        tokens.append(int(step.logits[0, -1].argmax()))
    return tokens
