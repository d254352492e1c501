"""The real MolmoE-1B backend: a local checkpoint directory loaded with its own (remote) code.

Expected directory (the ``allenai/MolmoE-1B-0924`` layout): ``config.json`` with an
``auto_map``, the checkpoint's Python files (modeling / config / processing), weights
(``*.safetensors`` or ``pytorch_model*.bin``, with their index when sharded), tokenizer and
preprocessor files. Nothing is downloaded (``local_files_only=True``); the checkpoint's remote
code must support the installed transformers version.

Module paths used (``origin_formats.md`` §1.2), checked at load with a clear error:

* ``model.model.transformer.blocks[i]`` - the 16 decoder blocks; ``.mlp.top_k`` is read by
  ``torch.topk`` at every forward, so ``set_top_k`` writes it per block (Knob2);
* ``model.model.transformer.wte`` - the input embedding (base + additional vocabulary);
* ``model.model.vision_backbone`` - ViT + 2x2 attention pooling + projector, called with
  (patchified images, image masks).

How blocks are skipped (Knob3), and its limits. ``MolmoModel.forward`` loops over
``transformer.blocks`` with ``enumerate`` and indexes the legacy cache list
``past_key_values[block_idx]``, asserting ``len(past_key_values) == config.n_layers``. For the
duration of one forward / one generation the runtime therefore replaces ``transformer.blocks``
by a ModuleList of the active blocks only and sets ``config.n_layers`` to their number; both are
restored in a ``finally``. Consequences:

* skipped blocks are never called: no fake K/V (unlike the origin's BlockMaskWrapper, D24), no
  hook fires on them, so latency hooks must target ``decoder_layers[b]`` for active ``b`` only;
* the cache list holds exactly one real (K, V) per active block, in active order; it is valid
  only for the block set it was produced with (a generation never changes knobs midway), and
  ``past_length`` comes from block 0, which is always active;
* the model's own forward is used unchanged (causal bias, mask, image scatter with ``+=`` and
  bounds filtering): only the block list differs, so nothing in D24 is re-implemented;
* ``config.n_layers`` is shared by the model objects while the knob is applied: do not run
  two threads on one runtime.

Generation is a plain greedy loop over ``model(...)`` with the legacy cache (what
``prepare_inputs_for_generation`` does: images at prefill only, then the last token with
``position_ids = last + 1``), so it does not depend on ``GenerationMixin`` internals. On CUDA
the forward runs under bf16 autocast, as the origin did; on CPU in float32.

Untested here (no checkpoint in this environment): ``tests/test_model_runtime.py`` runs the same
knob checks against it when ``CTRL_MOLMOE_PATH`` names a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from pipeline import knobs
from pipeline.errors import KnobError
from runtime.base import (
    GenerationResult,
    ModelInputs,
    ModelLoadError,
    ModelRuntime,
    greedy_decode,
    resolve_device,
    resolve_importance_scores,
    validate_top_k,
)
from runtime.cache import default_cache_root

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
_PROMPT_TEMPLATE = " User: {question} Assistant:"  # message_format "role", always_start_with_space


@dataclass
class MolmoEInputs(ModelInputs):
    """ModelInputs plus what Molmo's forward needs besides pixels.

    ``images`` is unpatchified to (n, 3, 336, 336) so it has the shape the interface documents;
    ``image_masks`` (n, 576) and ``image_input_idx`` (n, 144; -1 = token not placed) are the
    processor's own outputs. ``image_token_positions`` = the valid entries of ``image_input_idx``.
    """

    image_masks: torch.Tensor | None = None
    image_input_idx: torch.Tensor | None = None


def check_checkpoint_dir(path: Path) -> None:
    """Raise ModelLoadError naming what is missing from a MolmoE checkpoint directory."""
    if not path.is_dir():
        msg = f"{path}: not a directory (expected a MolmoE-1B checkpoint directory)"
        raise ModelLoadError(msg)
    missing = []
    config = path / "config.json"
    if not config.is_file():
        missing.append("config.json")
    else:
        try:
            cfg = json.loads(config.read_text())
        except ValueError as exc:
            msg = f"{config}: invalid JSON: {exc}"
            raise ModelLoadError(msg) from exc
        if "auto_map" not in cfg:
            missing.append("config.json 'auto_map' (the checkpoint's remote-code entry points)")
    if not any(any(path.glob(p)) for p in _WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not any(path.glob("*.py")):
        missing.append("the checkpoint's Python files (modeling_*.py, preprocessing_*.py)")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        missing.append("tokenizer files (tokenizer.json / tokenizer_config.json)")
    if missing:
        raise ModelLoadError(f"{path}: not a MolmoE checkpoint, missing: " + "; ".join(missing))


def checkpoint_fingerprint(path: Path) -> str:
    """sha256 over every file's relative path and content digest (weights, config, code, tokenizer).

    Digests of multi-GB weight files are cached under ``<cache root>/fingerprints`` keyed by
    absolute path, size and mtime, so only the first load of a checkpoint pays for hashing.
    """
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()
    cache_file = default_cache_root() / "fingerprints" / f"{key}.json"
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    fresh: dict[str, list] = {}
    h = hashlib.sha256(b"molmoe-checkpoint\n")
    for file in sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        rel = file.relative_to(path).as_posix()
        stat = file.stat()
        entry = cached.get(rel)
        if entry and entry[0] == stat.st_size and entry[1] == stat.st_mtime_ns:
            digest = entry[2]
        else:
            d = hashlib.sha256()
            with file.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    d.update(chunk)
            digest = d.hexdigest()
        fresh[rel] = [stat.st_size, stat.st_mtime_ns, digest]
        h.update(rel.encode() + b"\0" + digest.encode() + b"\n")
    if fresh != cached:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(fresh))
            os.replace(tmp, cache_file)
        except OSError:
            pass  # the cache only saves time
    return h.hexdigest()


def _unpatchify(patches: torch.Tensor, patch: int) -> torch.Tensor:
    """(n, h*w, patch*patch*3) in Molmo's '(h dh) (w dw) c -> (h w) (dh dw c)' order -> (n, 3, H, W)."""
    n, num, _ = patches.shape
    side = round(num ** 0.5)
    x = patches.reshape(n, side, side, patch, patch, 3).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(n, 3, side * patch, side * patch)


def _patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """Inverse of ``_unpatchify``: (n, 3, H, W) -> (n, h*w, patch*patch*3)."""
    n, c, height, width = images.shape
    h, w = height // patch, width // patch
    x = images.reshape(n, c, h, patch, w, patch).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(n, h * w, patch * patch * c)


class MolmoERuntime(ModelRuntime):
    """``ModelRuntime`` over a MolmoE-1B checkpoint directory (see the module docstring)."""

    kind = "molmoe"

    def __init__(self, path: str | Path, device: str | torch.device = "cpu",
                 importance_scores: str | Path | Mapping[int, float] | None = None) -> None:
        self.path = Path(path)
        check_checkpoint_dir(self.path)
        self.device = resolve_device(device)
        self._load()
        self._check_layout()
        self.num_layers = len(self._blocks)
        self.num_experts = int(self._blocks[0].mlp.num_experts)
        self.default_top_k = int(self._blocks[0].mlp.top_k)
        self._active: tuple[int, ...] | None = None
        self._scores = resolve_importance_scores(importance_scores)
        # crop geometry from the processor (Molmo defaults: 336-px crops, 4-patch margins, 14-px patches)
        ip = getattr(self.processor, "image_processor", None)
        self._patch = int(getattr(ip, "image_patch_size", 14))
        self._crop = int((getattr(ip, "base_image_input_size", None) or [336, 336])[0])
        margins = getattr(ip, "overlap_margins", None) or [4, 4]
        self._total_margin = (int(margins[0]) + int(margins[1])) * self._patch
        self._window = self._crop - self._total_margin
        self.eos_id = int(self.tokenizer.eos_token_id)
        with torch.inference_mode():
            self._dim = int(self.text_embeddings(torch.zeros(1, dtype=torch.long)).shape[-1])
        self.fingerprint = checkpoint_fingerprint(self.path)

    def _load(self) -> None:
        """The model, processor and tokenizer with the checkpoint's own code; every weight present."""
        try:
            from transformers import AutoModelForCausalLM, AutoProcessor  # deferred: seconds to import

            model, info = AutoModelForCausalLM.from_pretrained(
                self.path, trust_remote_code=True, local_files_only=True, output_loading_info=True)
            self.processor = AutoProcessor.from_pretrained(self.path, trust_remote_code=True, local_files_only=True)
        except Exception as exc:  # remote code can raise anything; the user needs one clear line
            msg = f"{self.path}: cannot load the MolmoE checkpoint: {type(exc).__name__}: {exc}"
            raise ModelLoadError(msg) from exc
        # a missing tensor would silently stay random (origin D25): refuse
        missing = list(info.get("missing_keys") or [])
        if missing:
            msg = f"{self.path}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}"
            raise ModelLoadError(msg)
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = getattr(self.processor, "tokenizer", None)
        if self.tokenizer is None:
            msg = f"{self.path}: the processor has no tokenizer"
            raise ModelLoadError(msg)

    def _check_layout(self) -> None:
        """The module paths the knobs act on (origin_formats §1.2), or a clear error naming what is missing."""
        inner = getattr(self.model, "model", None)
        transformer = getattr(inner, "transformer", None)
        if transformer is None or not isinstance(transformer, nn.ModuleDict) or "blocks" not in transformer:
            msg = (f"{self.path}: expected model.model.transformer.blocks (origin_formats §1.2); "
                   "block groups or another layout are not supported")
            raise ModelLoadError(msg)
        if "wte" not in transformer or getattr(inner, "vision_backbone", None) is None:
            msg = f"{self.path}: expected model.model.transformer.wte and model.model.vision_backbone"
            raise ModelLoadError(msg)
        self._inner, self._transformer = inner, transformer
        self._blocks: nn.ModuleList = transformer["blocks"]  # the full list, restored after every forward
        for i, block in enumerate(self._blocks):
            mlp = getattr(block, "mlp", None)
            if not isinstance(getattr(mlp, "top_k", None), int) or not hasattr(mlp, "num_experts"):
                msg = (f"{self.path}: block {i} has no MoE mlp with an integer top_k "
                       "(expected blocks[i].mlp.top_k, blocks[i].mlp.num_experts)")
                raise ModelLoadError(msg)
        if not hasattr(inner.config, "n_layers"):
            msg = f"{self.path}: config has no n_layers; block skipping cannot keep the cache consistent"
            raise ModelLoadError(msg)

    # -- preprocessing
    def format_prompt(self, question: str) -> str:
        return _PROMPT_TEMPLATE.format(question=question.strip())

    def tiling(self, width: int, height: int, max_crops: int) -> tuple[int, int]:
        if isinstance(max_crops, bool) or not isinstance(max_crops, (int, np.integer)) or max_crops < 1:
            msg = f"max_crops must be an integer >= 1, got {max_crops!r}"
            raise KnobError(msg)
        rows, cols = knobs.select_tiling(int(height), int(width), int(max_crops), window_px=self._window,
                                         total_margin_px=self._total_margin)
        return int(rows), int(cols)

    def preprocess(self, image: Image.Image | None, question: str, max_crops: int) -> MolmoEInputs:
        tiling = None if image is None else self.tiling(image.width, image.height, max_crops)
        image = None if image is None else image.convert("RGB")
        # the processor formats " User: <question> Assistant:" itself and prepends BOS (= EOS)
        out = self.processor.process(text=question.strip(), images=image, images_kwargs={"max_crops": int(max_crops)})
        ids = out["input_ids"].long().reshape(1, -1)
        prompt = self.format_prompt(question)
        if image is None:
            return MolmoEInputs(ids, torch.ones_like(ids), None, None, None, prompt)
        patches, idx = out["images"].float(), out["image_input_idx"].long()
        if patches.shape[0] != tiling[0] * tiling[1] + 1:
            # our tiling() would then misreport the crops the model sees: refuse rather than drift (D11)
            msg = (f"{self.path}: processor produced {patches.shape[0]} image arrays for tiling "
                   f"{tiling} (expected crops + 1 = {tiling[0] * tiling[1] + 1})")
            raise ModelLoadError(msg)
        return MolmoEInputs(ids, torch.ones_like(ids), _unpatchify(patches, self._patch), idx[idx >= 0].flatten(),
                            tiling, prompt, image_masks=out.get("image_masks"), image_input_idx=idx)

    # -- features
    @property
    def image_feature_dim(self) -> int:
        return self._dim

    @property
    def lang_feature_dim(self) -> int:
        return self._dim

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()

    def _vision_kwargs(self, inputs: MolmoEInputs) -> dict[str, torch.Tensor]:
        masks = inputs.image_masks
        return {"images": _patchify(inputs.images, self._patch)[None].to(self.device),
                "image_masks": None if masks is None else masks[None].to(self.device),
                "image_input_idx": inputs.image_input_idx[None].to(self.device)}

    def image_features(self, batch: Sequence[ModelInputs]) -> torch.Tensor:
        """Mean of the projected image tokens the processor places (image_input_idx >= 0); zeros
        for a text-only request. One request at a time: crop counts differ between requests."""
        result = torch.zeros(len(batch), self.image_feature_dim, dtype=torch.float32)
        with torch.inference_mode(), self._autocast():
            for i, item in enumerate(batch):
                if item.images is None:
                    continue
                kw = self._vision_kwargs(item)
                feats, _ = self._inner.vision_backbone(kw["images"], kw["image_masks"])
                valid = kw["image_input_idx"][0] >= 0  # (n, 144)
                result[i] = feats[0][valid].float().mean(0).cpu()
        return result

    def text_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._transformer["wte"](input_ids.to(self.device))

    def lang_features(self, questions: Sequence[str]) -> torch.Tensor:
        result = torch.zeros(len(questions), self.lang_feature_dim, dtype=torch.float32)
        with torch.inference_mode():
            for i, question in enumerate(questions):
                ids = self.tokenizer.encode(self.format_prompt(question), add_special_tokens=False)
                result[i] = self.text_embeddings(torch.tensor(ids)).float().mean(0).cpu()
        return result

    # -- knobs
    def set_top_k(self, top_k: int | Mapping[int, int]) -> None:
        for i, k in validate_top_k(top_k, self.num_layers, self.num_experts).items():
            self._blocks[i].mlp.top_k = k

    def current_top_k(self) -> list[int]:
        return [int(block.mlp.top_k) for block in self._blocks]

    @contextmanager
    def _run_active_blocks(self) -> Iterator[None]:
        if self._active is None:
            yield
            return
        config, saved_n = self._inner.config, self._inner.config.n_layers
        self._transformer["blocks"] = nn.ModuleList([self._blocks[i] for i in self._active])
        config.n_layers = len(self._active)  # MolmoModel asserts len(past_key_values) == n_layers
        try:
            yield
        finally:
            self._transformer["blocks"] = self._blocks
            config.n_layers = saved_n

    # -- forward / generation
    def forward_logits(self, inputs: ModelInputs, extra_ids: Sequence[int] = ()) -> torch.Tensor:
        """float32 logits (seq_len, vocab) of one full forward without cache, under the current knobs."""
        ids = inputs.input_ids.to(self.device)
        if extra_ids:
            ids = torch.cat([ids, torch.tensor([list(extra_ids)], dtype=torch.long, device=self.device)], dim=1)
        kw = self._vision_kwargs(inputs) if inputs.images is not None else {}
        mask = torch.ones_like(ids)
        with torch.inference_mode(), self._autocast(), self._run_active_blocks():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=torch.cumsum(mask, -1) - 1,
                             use_cache=False, **kw)
        return out.logits[0].float().cpu()

    def generate(self, inputs: ModelInputs, max_new_tokens: int = 16) -> GenerationResult:
        ids = inputs.input_ids.to(self.device)
        mask = torch.ones_like(ids)
        kw = self._vision_kwargs(inputs) if inputs.images is not None else {}
        with torch.inference_mode(), self._autocast(), self._run_active_blocks():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=torch.cumsum(mask, -1) - 1,
                             use_cache=True, last_logits_only=True, **kw)
            cache = out.past_key_values

            def next_token(token: int) -> int:
                nonlocal mask, cache
                mask = torch.cat([mask, mask.new_ones((1, 1))], dim=1)
                step = self.model(input_ids=torch.tensor([[token]], device=self.device), attention_mask=mask,
                                  position_ids=torch.tensor([[mask.shape[1] - 1]], device=self.device),
                                  past_key_values=cache, use_cache=True, last_logits_only=True)
                cache = step.past_key_values
                return int(step.logits[0, -1].argmax())

            tokens = greedy_decode(int(out.logits[0, -1].argmax()), next_token, self.eos_id, max_new_tokens)
        return GenerationResult(tokens, self.decode_text(tokens))

    # -- module handles
    @property
    def vision_module(self) -> nn.Module:
        return self._inner.vision_backbone

    @property
    def decoder_layers(self) -> Sequence[nn.Module]:
        return list(self._blocks)
