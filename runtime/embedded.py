"""The runtime of an embedded-format model directory (``runtime.embedded_model``): the seeded
embedded default, the trained testbed, or any directory in that format."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from pipeline import knobs
from pipeline.errors import KnobError
from runtime.base import (
    ImageFeatures,
    ModelInputs,
    ModelLoadError,
    image_token_mean,
    resolve_device,
    resolve_importance_scores,
)
from runtime.decoder_runtime import OlmoeDecoderRuntime
from runtime.embedded_model import (
    CLIP_MEAN,
    CLIP_STD,
    MARKER_FILE,
    RECIPE_FILE,
    EmbeddedSpec,
    ImageProjector,
    VisionBackbone,
    directory_fingerprint,
    is_embedded_dir,
    load_strict,
    own_memory,
    quiet_transformers,
)
from runtime.precision import hold_weights_in, qualify_fingerprint, resolve_dtype


class EmbeddedRuntime(OlmoeDecoderRuntime):
    """``ModelRuntime`` over an embedded-format directory (knobs and generation: ``runtime.decoder_runtime``)."""

    kind = "embedded"

    def __init__(self, path: str | Path, device: str | torch.device = "cpu",
                 importance_scores: str | Path | Mapping[int, float] | None = None,
                 dtype: str | torch.dtype = "auto", fast_path: bool | None = None,
                 float32_attention: bool = False) -> None:
        # transformers takes seconds to import: resolving a model and reading its fingerprint must not pay it
        from safetensors.torch import load_file
        from transformers import (
            CLIPVisionModel,
            OlmoeForCausalLM,
            PreTrainedTokenizerFast,
        )

        self.path = Path(path)
        if not is_embedded_dir(self.path):
            msg = f"{self.path}: not an embedded model directory (no valid {MARKER_FILE})"
            raise ModelLoadError(msg)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        try:
            with quiet_transformers():
                raw = json.loads((self.path / MARKER_FILE).read_text())
                raw["vit_layers"] = tuple(raw.get("vit_layers", EmbeddedSpec.vit_layers))
                self.spec = EmbeddedSpec(**raw)
                self.tokenizer = PreTrainedTokenizerFast.from_pretrained(self.path / "tokenizer", local_files_only=True)
                self.vision = load_strict(CLIPVisionModel, self.path / "vision")
                self.decoder = own_memory(load_strict(OlmoeForCausalLM, self.path / "decoder"))
                proj_cfg = json.loads((self.path / "projector" / "projector.json").read_text())
                self.projector = ImageProjector(**proj_cfg)
                # strict: a missing or unexpected tensor is an error, never a random weight (docs/origin_format.md D25)
                self.projector.load_state_dict(load_file(str(self.path / "projector" / "projector.safetensors")))
        except (OSError, TypeError, ValueError, KeyError, RuntimeError) as exc:
            msg = f"{self.path}: cannot load the embedded model: {exc}"
            raise ModelLoadError(msg) from exc
        self.vision_backbone = VisionBackbone(self.vision, self.projector, self.spec)
        for module in (self.vision_backbone, self.decoder):
            hold_weights_in(module.to(self.device), self.dtype).eval()
            module.requires_grad_(False)

        self._init_decoder(self.decoder, fast_path, float32_attention)
        self.fingerprint = qualify_fingerprint(directory_fingerprint(self.path), self.dtype)
        # a trained testbed has only seen questions about an image: without one it answers noise
        self.answers_without_image = not (self.path / RECIPE_FILE).is_file()
        if not all(isinstance(getattr(layer.mlp.gate, "top_k", None), int) for layer in self._all_layers):
            # transformers < 5 keeps top_k on the MoE block and a plain Linear as gate
            msg = "the embedded runtime needs transformers >= 5 (OLMoE router with a top_k)"
            raise ModelLoadError(msg)
        self._active: tuple[int, ...] | None = None
        self._scores = resolve_importance_scores(importance_scores)
        ids = self.tokenizer.convert_tokens_to_ids(
            [self.spec.image_patch_token, self.spec.image_start_token, self.spec.image_end_token,
             self.spec.eos_token])
        self.image_patch_id, self.image_start_id, self.image_end_id, self.eos_id = (int(i) for i in ids)

    # -- preprocessing
    def format_prompt(self, question: str) -> str:
        return self.spec.prompt_template.format(question=question.strip())

    def tiling(self, width: int, height: int, max_crops: int) -> tuple[int, int]:
        if isinstance(max_crops, bool) or not isinstance(max_crops, (int, np.integer)) or max_crops < 1:
            msg = f"max_crops must be an integer >= 1, got {max_crops!r}"
            raise KnobError(msg)
        rows, cols = knobs.select_tiling(int(height), int(width), int(max_crops), window_px=self.spec.window_px,
                                         total_margin_px=self.spec.total_margin_px)
        return int(rows), int(cols)

    def _to_tensor(self, image: Image.Image) -> torch.Tensor:
        arr = (np.asarray(image, dtype=np.float32) / 255.0 - CLIP_MEAN) / CLIP_STD
        return torch.from_numpy(arr.transpose(2, 0, 1).copy())

    def preprocess(self, image: Image.Image | None, question: str, max_crops: int) -> ModelInputs:
        prompt = self.format_prompt(question)
        text_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if image is None:
            ids = torch.tensor([text_ids], dtype=torch.long)
            return ModelInputs(ids, torch.ones_like(ids), None, None, None, prompt, len(text_ids))
        if image.mode != "RGB":  # convert() copies even an RGB image: a large one would be held twice
            image = image.convert("RGB")
        rows, cols = self.tiling(image.width, image.height, max_crops)
        crop, win, margin = self.spec.crop_px, self.spec.window_px, self.spec.total_margin_px
        resized = image.resize((cols * win + margin, rows * win + margin), Image.Resampling.BICUBIC)
        # global image first, then crops row-major; consecutive crops overlap by the margin
        arrays = [image.resize((crop, crop), Image.Resampling.BICUBIC)]
        arrays += [resized.crop((c * win, r * win, c * win + crop, r * win + crop))
                   for r in range(rows) for c in range(cols)]
        images = torch.stack([self._to_tensor(a) for a in arrays])
        block = [self.image_start_id] + [self.image_patch_id] * self.spec.tokens_per_image + [self.image_end_id]
        ids = torch.tensor([block * len(arrays) + text_ids], dtype=torch.long)
        positions = (ids[0] == self.image_patch_id).nonzero().flatten()
        return ModelInputs(ids, torch.ones_like(ids), images, positions, (rows, cols), prompt, len(text_ids))

    # -- features
    @property
    def image_feature_dim(self) -> int:
        return int(self.decoder.config.hidden_size)

    @property
    def lang_feature_dim(self) -> int:
        return int(self.decoder.config.hidden_size)

    def _image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """(n_arrays, 3, crop, crop) -> (n_arrays, tokens_per_image, decoder width); every array
        is encoded on its own (no attention or pooling across arrays)."""
        return self.vision_backbone(images.to(self.device, torch.float32))

    def encode_images(self, batch: Sequence[ModelInputs]) -> ImageFeatures:
        """The arrays of all requests in one backbone call; text-only requests get zero rows.
        Every token of every array is placed, so the global crop's feature is the mean of array 0."""
        all_tokens = torch.zeros(len(batch), self.image_feature_dim, dtype=torch.float32)
        global_crop = torch.zeros(len(batch), self.image_feature_dim, dtype=torch.float32)
        with_image = [i for i, item in enumerate(batch) if item.images is not None]
        if with_image:
            with torch.inference_mode(), self.precision_context():
                tokens = self._image_tokens(torch.cat([batch[i].images for i in with_image]))
                sizes = [batch[i].images.shape[0] for i in with_image]
                for i, chunk in zip(with_image, torch.split(tokens, sizes)):
                    all_tokens[i] = chunk.reshape(-1, chunk.shape[-1]).mean(0).float().cpu()
                    global_crop[i] = image_token_mean(chunk[0])
        return ImageFeatures(all_tokens, global_crop)

    def lang_features(self, questions: Sequence[str]) -> torch.Tensor:
        result = torch.zeros(len(questions), self.lang_feature_dim, dtype=torch.float32)
        with torch.inference_mode():
            for i, question in enumerate(questions):
                ids = self.tokenizer(self.format_prompt(question), add_special_tokens=False)["input_ids"]
                result[i] = self.text_embeddings(torch.tensor(ids)).mean(0).float().cpu()
        return result

    # -- forward
    def _embed(self, inputs: ModelInputs, extra_ids: Sequence[int] = (),
               image_feature: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = inputs.input_ids.to(self.device)
        if extra_ids:
            ids = torch.cat([ids, torch.tensor([list(extra_ids)], dtype=torch.long, device=self.device)], dim=1)
        embeds = self.text_embeddings(ids)
        feature = None
        if inputs.images is not None:
            per_array = self._image_tokens(inputs.images)
            if image_feature:
                feature = image_token_mean(per_array[0])
            tokens = per_array.reshape(-1, embeds.shape[-1])
            positions = inputs.image_token_positions.to(self.device)
            if positions.numel() != tokens.shape[0]:
                msg = f"{positions.numel()} image placeholders for {tokens.shape[0]} image tokens"
                raise ValueError(msg)
            embeds[0, positions] = tokens.to(embeds.dtype)  # image features replace the placeholders
        return embeds, feature

    # -- module handles
    @property
    def vision_module(self) -> nn.Module:
        return self.vision_backbone

    def num_parameters(self) -> dict[str, int]:
        """Parameter counts per component (the decoder's experts dominate)."""
        return {name: sum(p.numel() for p in module.parameters())
                for name, module in (("vision", self.vision), ("projector", self.projector), ("decoder", self.decoder))}
