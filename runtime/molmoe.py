"""The MolmoE-1B backend: a local checkpoint directory run by ctrl's own implementation.

Expected directory (the ``allenai/MolmoE-1B-0924`` layout): ``config.json`` (Molmo's keys:
``d_model``, ``n_layers``, ``moe_num_experts``, ``vision_backbone``, ...), weights
(``model.safetensors``, sharded ``model-*.safetensors`` with their index, or
``pytorch_model*.bin``), ``tokenizer.json`` with its configs and ``preprocessor_config.json``.
The checkpoint's own Python files are never executed (they are not even needed): the model is
``runtime.molmoe_model`` (vision backbone with the origin's module names, decoder as
transformers' ``OlmoeForCausalLM`` with renamed weights) and the preprocessing is
``runtime.molmoe_processor``. Both are tested against the origin code
(``tests/test_molmoe_native.py``, ``tests/test_molmoe_processor.py``).

Knobs, cached generation and the two-stage online execution come from
``runtime.decoder_runtime`` (shared with the embedded model): per-block top-K on each router,
active blocks swapped in for every forward (skipped blocks never run and keep no cache),
max_crops through Molmo's tiling. What is MolmoE's own: the image features are *added* to the
embeddings of the ``<im_patch>`` tokens at ``image_input_idx`` (the origin's ``index_add_``),
and the global-crop feature takes the global image's own padding mask
(``MolmoVisionBackbone.forward``): the origin's ``image_masks`` give it the first crop's.

Loading streams: the modules are built on the meta device, each tensor is read once from its
file into its final place in the ``--dtype`` and on the device (``runtime.weights``), after a
check that the weights fit (``runtime.memory``); the fingerprint comes from digests known
without reading or computed from the bytes the load reads anyway (``runtime.fingerprint``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from pipeline.errors import KnobError
from runtime import fingerprint
from runtime.base import (
    ImageFeatures,
    ModelInputs,
    ModelLoadError,
    image_token_mean,
    resolve_device,
    resolve_importance_scores,
)
from runtime.cuda_graphs import GraphCache
from runtime.decoder_runtime import OlmoeDecoderRuntime
from runtime.fast_decoder import GraphedFunction, default_fast_path, fast_attention_dtype
from runtime.memory import check_fits
from runtime.molmoe_model import (
    MolmoVisionBackbone,
    assign_weights,
    build_decoder,
    is_molmoe_config,
    read_architecture,
    split_fused_attention,
    weight_targets,
)
from runtime.molmoe_processor import IMAGE_TOKENS, MolmoImageConfig, MolmoProcessor, load_molmo_tokenizer
from runtime.precision import qualify_fingerprint, resolve_dtype
from runtime.weights import WeightIndex, check_targets, stream_weights, target_bytes

_PROMPT_TEMPLATE = " User: {question} Assistant:"  # message_format "role", always_start_with_space
#: bump when the native implementation changes what it computes: it enters the fingerprint
NATIVE_VERSION = 1
#: ViT graphs kept (one per number of image arrays: at most 13 for MolmoE-1B's 12 crops and the global image)
MAX_VIT_GRAPHS = 16


@dataclass
class MolmoEInputs(ModelInputs):
    """ModelInputs plus what Molmo's forward needs besides pixels.

    ``images`` has Molmo's patchified layout (crops + 1, patches, patch*patch*3), the global
    image first; ``image_masks`` (crops + 1, patches) and ``image_input_idx`` (crops + 1,
    tokens per crop; negative = not placed) are the processor's own outputs;
    ``global_image_mask`` (patches,) is the global image's own padding fractions (the global-crop
    feature; ``runtime.molmoe_processor``).
    """

    image_masks: torch.Tensor | None = None
    image_input_idx: torch.Tensor | None = None
    global_image_mask: torch.Tensor | None = None


def check_checkpoint_dir(path: Path) -> None:
    """Raise ModelLoadError unless ``path`` looks like a MolmoE checkpoint directory (naming what is missing)."""
    if not path.is_dir():
        msg = f"{path}: not a directory (expected a MolmoE-1B checkpoint directory)"
        raise ModelLoadError(msg)
    config = path / "config.json"
    if not config.is_file():
        msg = (f"{path}: neither an embedded model (no ctrl_embedded.json) nor a MolmoE checkpoint "
               "(no config.json)")
        raise ModelLoadError(msg)
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        msg = f"{config}: cannot read the model config: {exc}"
        raise ModelLoadError(msg) from exc
    if not isinstance(cfg, dict) or not is_molmoe_config(cfg):
        msg = (f"{config}: not a MolmoE config (expected Molmo's d_model, n_layers, moe_num_experts and "
               "vision_backbone); the directory is neither an embedded model nor a MolmoE checkpoint")
        raise ModelLoadError(msg)
    odd = sorted(p.name for pattern in ("*.safetensors", "pytorch_model*.bin", "*.json") for p in path.glob(pattern)
                 if not p.is_file())
    if odd:  # reading a FIFO would wait forever, a directory fails late
        msg = f"{path}: {', '.join(odd)}: not a regular file (a FIFO, socket, device or directory)"
        raise ModelLoadError(msg)
    missing = []
    if not any(any(path.glob(p)) for p in ("*.safetensors", "pytorch_model*.bin")):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not (path / "tokenizer.json").is_file():
        missing.append("tokenizer.json")
    if missing:
        raise ModelLoadError(f"{path}: MolmoE checkpoint is missing " + "; ".join(missing))


def checkpoint_fingerprint(path: Path, computed: Mapping[Path, str] | None = None) -> str:
    """The weights' fingerprint of a checkpoint directory (``runtime.fingerprint``; float32's)."""
    return fingerprint.checkpoint_fingerprint(path, f"molmoe-native:{NATIVE_VERSION}", computed)


def known_checkpoint_fingerprint(path: Path) -> str | None:
    """:func:`checkpoint_fingerprint` when no weight file must be read for it, else None."""
    return fingerprint.known_fingerprint(path, f"molmoe-native:{NATIVE_VERSION}")


class MolmoERuntime(OlmoeDecoderRuntime):
    """``ModelRuntime`` over a MolmoE-1B checkpoint directory (see the module docstring)."""

    kind = "molmoe"

    def __init__(self, path: str | Path, device: str | torch.device = "cpu",
                 importance_scores: str | Path | Mapping[int, float] | None = None,
                 dtype: str | torch.dtype = "auto", fast_path: bool | None = None,
                 float32_attention: bool = False) -> None:
        self.path = Path(path)
        check_checkpoint_dir(self.path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.arch, _ = read_architecture(self.path)
        # before any module exists: a config.json whose sizes cannot fit is refused in a moment
        self._float32_attention = bool(float32_attention)
        check_fits(str(self.path), lambda dtype: self.arch.parameters_at_least() * dtype.itemsize, self.dtype,
                   self.device, cache_bytes=self._cache_bytes)
        self.tokenizer = load_molmo_tokenizer(self.path)
        self.image_config = MolmoImageConfig.from_dir(self.path)
        self._check_geometry()
        self.processor = MolmoProcessor(self.tokenizer, self.image_config)
        self.eos_id = int(self.tokenizer.eos_token_id)
        with torch.device("meta"):
            vision = MolmoVisionBackbone(self.arch)
        decoder = build_decoder(self.arch, self.eos_id, self.tokenizer.pad_token_id)
        digests = self._load_weights(vision, decoder)
        for module in (vision, decoder):
            module.eval()
            module.requires_grad_(False)
        self.vision_backbone = vision
        self._vit_graphs: dict[bool, GraphedFunction] = {}
        self._vision_float32, self._vision_graphed = self.arch.float32_attention, False  # as set last
        self._init_decoder(decoder, fast_path, float32_attention)
        if len(self.tokenizer) > self.arch.vocab_size + self.arch.additional_vocab_size:
            msg = (f"{self.path}: the tokenizer has {len(self.tokenizer)} tokens, more than the "
                   f"{self.arch.vocab_size + self.arch.additional_vocab_size} embeddings of the model")
            raise ModelLoadError(msg)
        self._active: tuple[int, ...] | None = None
        self._scores = resolve_importance_scores(importance_scores)
        self.weights_fingerprint = checkpoint_fingerprint(self.path, digests)

    def _cache_bytes(self, dtype: torch.dtype) -> int:
        """The KV cache the memory check counts beside the weights (the fast path's, at the trained context)."""
        return self.arch.kv_cache_bytes(dtype, self.device, self._float32_attention)

    def _load_weights(self, vision: nn.Module, decoder: nn.Module) -> dict[Path, str]:
        """Stream the checkpoint into the meta-device modules (module docstring); returns the
        digests of the weight files hashed on the way (those not known before)."""
        index = WeightIndex(self.path)
        targets = weight_targets(self.arch)
        check_targets(index, targets)
        check_fits(str(self.path), lambda dtype: target_bytes(targets, dtype), self.dtype, self.device,
                   cache_bytes=self._cache_bytes)
        state, digests = stream_weights(index, targets, self.dtype, self.device,
                                        hash_files=fingerprint.unknown_weight_files(self.path))
        fused = split_fused_attention(state, self.arch)
        for prefix, module in (("vision.", vision), ("decoder.", decoder)):
            assign_weights(module, {n[len(prefix):]: t for n, t in state.items() if n.startswith(prefix)}, self.path)
        for i, weight in fused.items():  # q/k/v_proj are views of it: the fast path's one product reads it
            decoder.model.layers[i].self_attn.fused_qkv_weight = weight
        return digests

    def set_execution(self, fast_path: bool | None = None, float32_attention: bool = False) -> None:
        """The decoder's path (``OlmoeDecoderRuntime.set_execution``); the vision tower follows it
        (:meth:`vision_attends_float32`), and on the fast path on a GPU its whole path runs as a CUDA
        graph per number of image arrays (the same kernels as uncaptured: graphs do not change the
        features)."""
        super().set_execution(fast_path, float32_attention)
        self._use_vision_path(self.vision_attends_float32(), graphed=self.fast is not None and self.fast.use_graphs)

    def vision_attends_float32(self) -> bool:
        """Whether a request's vision tower attends in float32: as the origin does (the checkpoint's
        ``float32_attention``), except on the fast path where the decoder attends in the weights'
        dtype (a GPU without ``--float32-attention``). Image features then differ from the origin's
        (within docs/results.md's tolerance), and :attr:`fingerprint` says so."""
        fast = self.fast
        return self.arch.float32_attention and (fast is None or fast.attention_dtype == torch.float32)

    @property
    def fingerprint(self) -> str:
        """The weights' fingerprint qualified by the dtype and, where the vision tower does not attend
        as the checkpoint says (:meth:`vision_attends_float32`), by the dtype it attends in: the image
        features' identity (the feature cache's key, what a controller is matched to)."""
        return qualify_fingerprint(self.weights_fingerprint, self.dtype, self._vision_attention_qualifier())

    def _vision_attention_qualifier(self) -> torch.dtype | None:
        return None if self.vision_attends_float32() == self.arch.float32_attention else self.dtype


    def _use_vision_path(self, float32: bool, *, graphed: bool | None = None) -> None:
        """The vision tower attending in float32 or not; where its graphs are on (``graphed``, else as
        set last), replayed from that attention dtype's graph set."""
        if graphed is None and self._vision_float32 == float32:
            return
        self._vision_graphed = self._vision_graphed if graphed is None else graphed
        self._vision_float32 = float32
        vision = self.vision_backbone
        vision.set_float32_attention(float32)
        if not self._vision_graphed:
            vision.runner = None
            return
        # one graph set per attention dtype, kept: switching paths keeps the captured graphs
        if float32 not in self._vit_graphs:
            cache = GraphCache.for_device(self.device, max_graphs=MAX_VIT_GRAPHS, label="vision tower")
            self._vit_graphs[float32] = GraphedFunction(vision.encode, cache)
        vision.runner = self._vit_graphs[float32]

    @property
    def graph_captures(self) -> int:
        return super().graph_captures + sum(graphs.cache.stats.captures for graphs in self._vit_graphs.values())

    def capture_vision(self, arrays: int) -> bool:
        """Capture the vision path (ViT, pooling, projector) for ``arrays`` image arrays (crops and the
        global image) now, rather than in the first request with that many (a server's warm-up).
        Returns whether a graph was captured (False without vision graphs or when it is held already)."""
        self._use_vision_path(self.vision_attends_float32())
        runner = self.vision_backbone.runner
        if not isinstance(runner, GraphedFunction) or not runner.cache.enabled:
            return False
        a = self.arch
        # what a request passes: the processor's float32 arrays and masks, batch 1; values do not matter to a capture
        patches = a.patches_per_side ** 2
        images = torch.zeros(1, int(arrays), patches, a.patch_px * a.patch_px * 3, device=self.device)
        masks = torch.ones(1, int(arrays), patches, device=self.device)
        before = runner.cache.stats.captures
        with torch.inference_mode(), self.precision_context():
            runner(images, masks)
        return runner.cache.stats.captures > before

    def _check_geometry(self) -> None:
        ic, a = self.image_config, self.arch
        if (ic.crop_px, ic.patch_px, ic.tokens_per_image) != (a.crop_px, a.patch_px, a.tokens_per_crop):
            msg = (f"{self.path}: preprocessor_config.json ({ic.crop_px}-px crops, {ic.patch_px}-px patches, "
                   f"{ic.tokens_per_image} tokens per crop) does not match config.json ({a.crop_px}-px crops, "
                   f"{a.patch_px}-px patches, {a.tokens_per_crop} tokens per crop)")
            raise ModelLoadError(msg)

    # -- preprocessing
    def format_prompt(self, question: str) -> str:
        # not stripped: the origin processor tokenizes the question as given
        return _PROMPT_TEMPLATE.format(question=question)

    def _check_max_crops(self, max_crops: int) -> int:
        if isinstance(max_crops, bool) or not isinstance(max_crops, (int, np.integer)) or max_crops < 1:
            msg = f"max_crops must be an integer >= 1, got {max_crops!r}"
            raise KnobError(msg)
        return int(max_crops)

    def tiling(self, width: int, height: int, max_crops: int) -> tuple[int, int]:
        return self.processor.tiling(int(width), int(height), self._check_max_crops(max_crops))

    def preprocess(self, image: Image.Image | None, question: str, max_crops: int) -> MolmoEInputs:
        out = self.processor.process(image, question, self._check_max_crops(max_crops))
        ids = out.input_ids.long().reshape(1, -1)
        prompt = self.format_prompt(question)
        if out.images is None:
            return MolmoEInputs(ids, torch.ones_like(ids), None, None, None, prompt,
                                num_text_tokens=out.num_text_tokens)
        idx = out.image_input_idx.long()
        return MolmoEInputs(ids, torch.ones_like(ids), out.images.float(), idx[idx >= 0].flatten(), out.tiling,
                            prompt, num_text_tokens=out.num_text_tokens, image_masks=out.image_masks.float(),
                            image_input_idx=idx, global_image_mask=out.global_image_mask.float())

    def special_texts(self) -> tuple[str, ...]:
        """The tokenizer's special tokens and the image tokens (added tokens a question could spell)."""
        return tuple(sorted(set(super().special_texts()) | set(IMAGE_TOKENS)))

    def decode_text(self, token_ids: Sequence[int]) -> str:
        """Generated ids as text, as the origin's tokenizer (transformers 4.4x) decoded them: special
        tokens skipped and, where the tokenizer config asks for it, spaces before punctuation
        removed (transformers 5 no longer applies that clean-up to BPE tokenizers)."""
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if self.tokenizer.clean_up_tokenization_spaces:
            text = self.tokenizer.clean_up_tokenization(text)
        return text

    # -- features
    @property
    def image_feature_dim(self) -> int:
        return self.arch.d_model

    @property
    def lang_feature_dim(self) -> int:
        return self.arch.d_model

    def _image_tokens(self, inputs: MolmoEInputs,
                      global_crop: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The vision backbone's output for one request, (crops + 1, tokens per crop, d_model),
        and with ``global_crop`` the global-crop feature (float32 (d_model,) on the CPU): the
        mean of the global image's placed tokens with its own padding mask."""
        self._use_vision_path(self.vision_attends_float32())
        masks = None if inputs.image_masks is None else inputs.image_masks[None].to(self.device)
        own = inputs.global_image_mask if global_crop else None
        if global_crop and own is None and self.vision_backbone.pad_embed is not None:
            msg = "inputs without global_image_mask (use MolmoERuntime.preprocess) for a model with padding embeddings"
            raise ValueError(msg)
        if own is not None and inputs.image_masks is not None and torch.equal(own, inputs.image_masks[0]):
            own = None  # compared on the host: array 0's tokens are the global image's own
        tokens, global_tokens = self.vision_backbone(inputs.images[None].to(self.device), masks,
                                                     None if own is None else own[None].to(self.device))
        if not global_crop:
            return tokens[0], None
        # the placed rows found on the host: a boolean mask on the device would wait for the vision pass
        placed = torch.nonzero(inputs.image_input_idx[0] >= 0).squeeze(1).to(self.device)
        return tokens[0], image_token_mean(global_tokens[0].index_select(0, placed))

    def encode_images(self, batch: Sequence[ModelInputs]) -> ImageFeatures:
        """Means of the projected image tokens the processor places (image_input_idx >= 0): of all
        of them, and of the global crop's; zeros for a text-only request. One request at a time:
        crop counts differ between requests. The vision tower attends as requests' do (the
        fingerprint says how)."""
        all_tokens = torch.zeros(len(batch), self.image_feature_dim, dtype=torch.float32)
        global_crop = torch.zeros(len(batch), self.image_feature_dim, dtype=torch.float32)
        with torch.inference_mode(), self.precision_context():
            for i, item in enumerate(batch):
                if item.images is None:
                    continue
                feats, global_feature = self._image_tokens(item, global_crop=True)  # type: ignore[arg-type]
                valid = item.image_input_idx.to(self.device) >= 0  # type: ignore[attr-defined]
                all_tokens[i] = feats[valid].float().mean(0).cpu()
                global_crop[i] = global_feature
        return ImageFeatures(all_tokens, global_crop)

    def lang_features(self, questions: Sequence[str]) -> torch.Tensor:
        result = torch.zeros(len(questions), self.lang_feature_dim, dtype=torch.float32)
        with torch.inference_mode():
            for i, question in enumerate(questions):
                ids = self.processor.text_tokens(question)
                result[i] = self.text_embeddings(torch.tensor(ids)).float().mean(0).cpu()
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
            # which image tokens land in the prompt, found on the host from the preprocessor's positions
            # (a boolean mask on the device would stop the host until the vision pass is done)
            idx = inputs.image_input_idx.reshape(-1).cpu().numpy()  # type: ignore[attr-defined]
            rows = np.flatnonzero((idx >= 0) & (idx < embeds.shape[1]))
            positions = torch.from_numpy(idx[rows]).to(self.device, non_blocking=True)
            rows_index = torch.from_numpy(rows).to(self.device, non_blocking=True)
            feats, feature = self._image_tokens(inputs, global_crop=image_feature)  # type: ignore[arg-type]
            # added to the <im_patch> embeddings, as the origin does
            tokens = feats.reshape(idx.shape[0], -1).index_select(0, rows_index)
            embeds[0].index_add_(0, positions, tokens.to(embeds.dtype))
        return embeds, feature

    # -- module handles
    @property
    def vision_module(self) -> nn.Module:
        return self.vision_backbone


def vision_attention_qualifier(path: Path, device: torch.device, dtype: torch.dtype, fast_path: bool | None,
                               float32_attention: bool) -> torch.dtype | None:
    """What :attr:`MolmoERuntime.fingerprint` qualifies by for the checkpoint at ``path`` loaded so,
    from its config alone: the vision tower's attention dtype where it is not the checkpoint's."""
    arch, _ = read_architecture(path)
    fast = default_fast_path(device) if fast_path is None else fast_path
    if not arch.float32_attention or not fast:
        return None
    return None if fast_attention_dtype(device, dtype, float32_attention) == torch.float32 else dtype
