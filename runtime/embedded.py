"""The runtime of an embedded-format model directory (``runtime.embedded_model``): the seeded
embedded default, the trained testbed, or any directory in that format."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from pipeline import knobs
from pipeline.errors import KnobError
from runtime.base import (
    DecodeState,
    GenerationResult,
    ModelInputs,
    ModelLoadError,
    ModelRuntime,
    PrefixState,
    greedy_decode,
    resolve_device,
    resolve_importance_scores,
    validate_active_blocks,
    validate_top_k,
)
from runtime.embedded_model import (
    CLIP_MEAN,
    CLIP_STD,
    MARKER_FILE,
    EmbeddedSpec,
    ImageProjector,
    VisionBackbone,
    directory_fingerprint,
    is_embedded_dir,
    load_strict,
    quiet_transformers,
)


class EmbeddedRuntime(ModelRuntime):
    """``ModelRuntime`` over an embedded-format directory.

    Knobs act on the execution path: ``set_top_k`` writes each layer's router
    (``layers[i].mlp.gate.top_k``, which ``torch.topk`` reads at every forward); with active
    blocks set, every forward temporarily replaces ``decoder.model.layers`` by a ModuleList of the
    active layers only, so skipped layers are never called. Their attention modules keep their
    original ``layer_idx``: the ``DynamicCache`` (built with all 16 slots) holds real K/V for the
    active layers and nothing for the skipped ones, and positions come from layer 0, always active.
    """

    kind = "embedded"

    def __init__(self, path: str | Path, device: str | torch.device = "cpu",
                 importance_scores: str | Path | Mapping[int, float] | None = None) -> None:
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
        try:
            with quiet_transformers():
                raw = json.loads((self.path / MARKER_FILE).read_text())
                raw["vit_layers"] = tuple(raw.get("vit_layers", EmbeddedSpec.vit_layers))
                self.spec = EmbeddedSpec(**raw)
                self.tokenizer = PreTrainedTokenizerFast.from_pretrained(self.path / "tokenizer", local_files_only=True)
                self.vision = load_strict(CLIPVisionModel, self.path / "vision")
                self.decoder = load_strict(OlmoeForCausalLM, self.path / "decoder")
                proj_cfg = json.loads((self.path / "projector" / "projector.json").read_text())
                self.projector = ImageProjector(**proj_cfg)
                # strict: a missing or unexpected tensor is an error, never a silently random weight (D25)
                self.projector.load_state_dict(load_file(str(self.path / "projector" / "projector.safetensors")))
        except (OSError, TypeError, ValueError, KeyError, RuntimeError) as exc:
            msg = f"{self.path}: cannot load the embedded model: {exc}"
            raise ModelLoadError(msg) from exc
        self.vision_backbone = VisionBackbone(self.vision, self.projector, self.spec)
        for module in (self.vision_backbone, self.decoder):
            module.to(self.device).eval()
            module.requires_grad_(False)

        cfg = self.decoder.config
        self.num_layers = cfg.num_hidden_layers
        self.num_experts = cfg.num_experts
        self.default_top_k = cfg.num_experts_per_tok
        self.fingerprint = directory_fingerprint(self.path)
        self._all_layers = self.decoder.model.layers  # the full ModuleList, restored after every forward
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
            return ModelInputs(ids, torch.ones_like(ids), None, None, None, prompt)
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
        return ModelInputs(ids, torch.ones_like(ids), images, positions, (rows, cols), prompt)

    # -- features
    @property
    def image_feature_dim(self) -> int:
        return int(self.decoder.config.hidden_size)

    @property
    def lang_feature_dim(self) -> int:
        return int(self.decoder.config.hidden_size)

    def _image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """(n_arrays, 3, crop, crop) -> (n_arrays, tokens_per_image, decoder width)."""
        return self.vision_backbone(images.to(self.device, torch.float32))

    def image_features(self, batch: Sequence[ModelInputs]) -> torch.Tensor:
        """Text-only requests get a zero row (they have no image tokens)."""
        result = torch.zeros(len(batch), self.image_feature_dim, dtype=torch.float32)
        with_image = [i for i, item in enumerate(batch) if item.images is not None]
        if not with_image:
            return result
        with torch.inference_mode():
            tokens = self._image_tokens(torch.cat([batch[i].images for i in with_image]))
            sizes = [batch[i].images.shape[0] for i in with_image]
            for i, chunk in zip(with_image, torch.split(tokens, sizes)):
                result[i] = chunk.reshape(-1, chunk.shape[-1]).mean(0).float().cpu()
        return result

    def text_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.get_input_embeddings()(input_ids.to(self.device))

    def lang_features(self, questions: Sequence[str]) -> torch.Tensor:
        result = torch.zeros(len(questions), self.lang_feature_dim, dtype=torch.float32)
        with torch.inference_mode():
            for i, question in enumerate(questions):
                ids = self.tokenizer(self.format_prompt(question), add_special_tokens=False)["input_ids"]
                result[i] = self.text_embeddings(torch.tensor(ids)).mean(0).float().cpu()
        return result

    # -- knobs
    def set_top_k(self, top_k: int | Mapping[int, int]) -> None:
        per_layer = validate_top_k(top_k, self.num_layers, self.num_experts)
        for i, k in per_layer.items():
            self._all_layers[i].mlp.gate.top_k = k

    def current_top_k(self) -> list[int]:
        return [int(layer.mlp.gate.top_k) for layer in self._all_layers]

    @contextmanager
    def _run_active_blocks(self) -> Iterator[None]:
        """Swap in the active layers for one forward/generation; always restore the full list."""
        if self._active is None:
            yield
            return
        self.decoder.model.layers = nn.ModuleList([self._all_layers[i] for i in self._active])
        try:
            yield
        finally:
            self.decoder.model.layers = self._all_layers

    # -- forward / generation
    def _embed(self, inputs: ModelInputs, extra_ids: Sequence[int] = ()) -> torch.Tensor:
        ids = inputs.input_ids.to(self.device)
        if extra_ids:
            ids = torch.cat([ids, torch.tensor([list(extra_ids)], dtype=torch.long, device=self.device)], dim=1)
        embeds = self.text_embeddings(ids)
        if inputs.images is not None:
            tokens = self._image_tokens(inputs.images).reshape(-1, embeds.shape[-1])
            positions = inputs.image_token_positions.to(self.device)
            if positions.numel() != tokens.shape[0]:
                msg = f"{positions.numel()} image placeholders for {tokens.shape[0]} image tokens"
                raise ValueError(msg)
            embeds[0, positions] = tokens.to(embeds.dtype)  # image features replace the placeholders
        return embeds

    def forward_logits(self, inputs: ModelInputs, extra_ids: Sequence[int] = ()) -> torch.Tensor:
        """float32 logits (seq_len, vocab) of one full forward without cache, under the current knobs;
        ``extra_ids`` are appended after the prompt (e.g. tokens generated so far)."""
        with torch.inference_mode(), self._run_active_blocks():
            embeds = self._embed(inputs, extra_ids)
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
            out = self.decoder(inputs_embeds=embeds, attention_mask=mask, use_cache=False)
            return out.logits[0].float().cpu()

    def generate(self, inputs: ModelInputs, max_new_tokens: int = 16) -> GenerationResult:
        from transformers import DynamicCache  # deferred, as in __init__

        with torch.inference_mode(), self._run_active_blocks():
            # one slot per layer, indexed by each attention's original layer_idx
            cache = DynamicCache(config=self.decoder.config)
            mask = inputs.attention_mask.to(self.device)
            out = self.decoder(inputs_embeds=self._embed(inputs), attention_mask=mask, past_key_values=cache,
                               use_cache=True, logits_to_keep=1)

            def next_token(token: int) -> int:
                nonlocal mask
                mask = torch.cat([mask, mask.new_ones((1, 1))], dim=1)
                step = self.decoder(input_ids=torch.tensor([[token]], device=self.device), attention_mask=mask,
                                    past_key_values=cache, use_cache=True, logits_to_keep=1)
                return int(step.logits[0, -1].argmax())

            tokens = greedy_decode(int(out.logits[0, -1].argmax()), next_token, self.eos_id, max_new_tokens)
        return GenerationResult(tokens, self.decode_text(tokens))

    # -- two-stage execution (online phase)
    @property
    def hidden_size(self) -> int:
        return int(self.decoder.config.hidden_size)

    def embedding_rms(self) -> float:
        weight = self.decoder.get_input_embeddings().weight
        return float(weight.detach().float().pow(2).mean().sqrt())

    @contextmanager
    def _layers(self, indices: Sequence[int], final_norm: bool = True) -> Iterator[None]:
        """Run exactly these decoder layers (and the final norm or not) inside the block.

        ``OlmoeModel.forward`` is reused as is (mask, rotary positions, cache writes): only its
        layer list and norm are swapped, so nothing of the attention path is re-implemented.
        """
        model = self.decoder.model
        norm = model.norm
        model.layers = nn.ModuleList([self._all_layers[i] for i in indices])
        if not final_norm:
            model.norm = nn.Identity()
        try:
            yield
        finally:
            model.layers, model.norm = self._all_layers, norm

    def _check_insertion(self, insertion_position: int) -> int:
        if isinstance(insertion_position, bool) or not 1 <= int(insertion_position) < self.num_layers:
            msg = f"insertion position must be in 1..{self.num_layers - 1}, got {insertion_position!r}"
            raise KnobError(msg)
        return int(insertion_position)

    def prefill_prefix(self, inputs: ModelInputs, insertion_position: int,
                       extra_embedding: torch.Tensor | None = None) -> PrefixState:
        from transformers import DynamicCache  # deferred, as in __init__

        p = self._check_insertion(insertion_position)
        with torch.no_grad(), self._layers(range(p), final_norm=False):
            embeds = self._embed(inputs)
            if extra_embedding is not None:
                token = extra_embedding.detach().to(self.device, embeds.dtype).reshape(1, 1, -1)
                embeds = torch.cat([embeds, token], dim=1)
            cache = DynamicCache(config=self.decoder.config)
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
            out = self.decoder.model(inputs_embeds=embeds, attention_mask=mask, past_key_values=cache, use_cache=True)
        return PrefixState(inputs, p, embeds, out.last_hidden_state, cache,
                           extra_tokens=0 if extra_embedding is None else 1)

    def latency_token(self, embeds: torch.Tensor, insertion_position: int) -> torch.Tensor:
        p = self._check_insertion(insertion_position)
        with torch.enable_grad(), self._layers(range(p), final_norm=False):
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
            out = self.decoder.model(inputs_embeds=embeds.to(self.device), attention_mask=mask, use_cache=False)
        return out.last_hidden_state[0, -1]

    def prefill_suffix(self, prefix: PrefixState, active_blocks: Sequence[int]) -> DecodeState:
        from transformers import DynamicCache  # deferred, as in __init__

        p = prefix.insertion_position
        active = validate_active_blocks(active_blocks, self.num_layers) or tuple(range(self.num_layers))
        if active[:p] != tuple(range(p)):
            msg = f"active blocks {list(active)} must include blocks 0..{p - 1}: they ran before stage 2"
            raise KnobError(msg)
        suffix = [b for b in active if b >= p]
        # the budget token is last and nothing before it attended to it (causal): dropping its
        # position leaves exactly the prompt's states
        seq = prefix.seq_len - prefix.extra_tokens
        hidden = prefix.hidden[:, :seq]
        mask = torch.ones((1, seq), dtype=torch.long, device=self.device)
        # a fresh cache: the members of a group must not write into the shared prefix's cache
        cache = DynamicCache(config=self.decoder.config)
        with torch.no_grad():
            if suffix:
                with self._layers(suffix):
                    positions = torch.arange(seq, device=self.device)[None]
                    out = self.decoder.model(inputs_embeds=hidden, attention_mask=mask, position_ids=positions,
                                             past_key_values=cache, use_cache=True)
                hidden = out.last_hidden_state
            else:
                hidden = self.decoder.model.norm(hidden)
            logits = self.decoder.lm_head(hidden[:, -1]).float()[0]
            for i in range(p):  # the prefix's K/V (update() copies: the shared cache stays intact)
                layer = prefix.cache.layers[i]
                cache.update(layer.keys[:, :, :seq], layer.values[:, :, :seq], i)
        return DecodeState(cache, active, mask, logits)

    def decode_step(self, state: DecodeState, token: int) -> None:
        state.attention_mask = torch.cat([state.attention_mask, state.attention_mask.new_ones((1, 1))], dim=1)
        with torch.no_grad(), self._layers(state.active_blocks):
            out = self.decoder(input_ids=torch.tensor([[int(token)]], device=self.device),
                               attention_mask=state.attention_mask, past_key_values=state.cache, use_cache=True,
                               logits_to_keep=1)
        state.logits = out.logits[0, -1].float()

    # -- module handles
    @property
    def vision_module(self) -> nn.Module:
        return self.vision_backbone

    @property
    def decoder_layers(self) -> Sequence[nn.Module]:
        return list(self._all_layers)

    def num_parameters(self) -> dict[str, int]:
        """Parameter counts per component (the decoder's experts dominate)."""
        return {name: sum(p.numel() for p in module.parameters())
                for name, module in (("vision", self.vision), ("projector", self.projector), ("decoder", self.decoder))}
