"""Molmo's input preprocessing, native: the origin ``MolmoProcessor.process`` without remote code.

Reproduces the checkpoint's ``preprocessing_molmo.py`` / ``multimodal_preprocessor.py``
(``MolmoImageProcessor``) with NumPy, torch and PIL only, output for output:

* prompt ``" User: <question> Assistant:"`` (message format "role", always start with a space),
  tokenized without special tokens; the image tokens go before it and BOS (the tokenizer's BOS,
  else its EOS) before everything;
* the tiling rule is ``pipeline.knobs.select_tiling`` on the size less the margins; the image is
  resized (bilinear, antialiased, in float32 on 0..1, aspect kept) and centred with zero padding
  to (rows*window + margin, cols*window + margin), then normalized, so padding is ``-mean/std``;
* overlapping ``crop_px`` crops at a ``window_px`` stride, then a global image (the whole image
  resized and padded to one crop) *prepended* to the crops;
* ``image_masks``: per patch, the fraction of its pixels that are image rather than padding, for
  the crops only, followed by one row of -1. The rows therefore do not line up with ``images``
  (row 0 is the first crop, not the global image): the origin does this and the model was run
  with it, so it is kept. The global image's own fractions are returned beside them
  (``global_image_mask``, not an origin output): what the global crop's tokens get at
  max_crops 1, where row 0 is the global image's, so its feature does not depend on the crops;
* ``image_input_idx``: for each pooled token of each crop, its position in ``input_ids``
  (-100 for the margin tokens a crop does not place), built with the origin's bookkeeping.

Origin quirks kept on purpose: the EXIF orientation is ignored (the origin computes the transposed
image and then uses the untransposed one); the image is converted to RGB first; the scaled size
is computed in float32 (one pixel off float64's for many sizes).

The origin's ``process`` does not read ``preprocessor_config.json``: the geometry comes from the
processor's built-in defaults and the normalization is always CLIP's. ``MolmoImageConfig.from_dir``
reads the file; for MolmoE-1B it holds exactly those values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from pipeline import knobs
from runtime.base import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: OpenAI CLIP normalization, the origin's defaults
CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

IM_START, IM_END, IM_PATCH, IM_COL, IMAGE_PROMPT = "<im_start>", "<im_end>", "<im_patch>", "<im_col>", "<|image|>"
IMAGE_TOKENS: tuple[str, ...] = (IM_START, IM_END, IM_PATCH, IM_COL, IMAGE_PROMPT)
PROMPT_TEMPLATE = " User: {question} Assistant:"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
_UNPLACED = -100


@dataclass(frozen=True)
class MolmoImageConfig:
    """The image geometry and normalization of ``preprocessor_config.json`` (MolmoE-1B values by default)."""

    crop_px: int = 336
    patch_px: int = 14
    overlap_margins: tuple[int, int] = (4, 4)
    tokens_h: int = 12
    tokens_w: int = 12
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    max_crops: int = 12

    @classmethod
    def from_dir(cls, path: Path) -> MolmoImageConfig:
        """The config of a checkpoint directory: its ``preprocessor_config.json`` if present, else the defaults."""
        file = Path(path) / PREPROCESSOR_CONFIG
        if not file.is_file():
            return cls()
        try:
            data = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            msg = f"{file}: unreadable: {e}"
            raise ModelLoadError(msg) from e
        if not isinstance(data, dict):
            msg = f"{file}: expected a JSON object"
            raise ModelLoadError(msg)
        default = cls()
        size = _read(data, file, "base_image_input_size", [default.crop_px] * 2, length=2)
        if size[0] != size[1]:
            msg = f"{file}: field 'base_image_input_size' must be square (the origin cuts square crops), got {size}"
            raise ModelLoadError(msg)
        config = cls(
            crop_px=size[0],
            patch_px=_read(data, file, "image_patch_size", default.patch_px),
            overlap_margins=tuple(_read(data, file, "overlap_margins", list(default.overlap_margins), length=2)),
            tokens_h=_read(data, file, "image_token_length_h", default.tokens_h),
            tokens_w=_read(data, file, "image_token_length_w", default.tokens_w),
            image_mean=tuple(_read(data, file, "image_mean", list(default.image_mean), length=3, kind=float)),
            image_std=tuple(_read(data, file, "image_std", list(default.image_std), length=3, kind=float)),
            max_crops=_read(data, file, "max_crops", default.max_crops),
        )
        problem = config.problem()
        if problem:
            msg = f"{file}: {problem}"
            raise ModelLoadError(msg)
        return config

    def problem(self) -> str | None:
        """Why the origin code could not run with these values (field named), or None."""
        left, right = self.overlap_margins
        checks = [
            (self.patch_px >= 1, "image_patch_size must be >= 1"),
            (self.crop_px >= 1 and self.crop_px % max(self.patch_px, 1) == 0,
             "base_image_input_size must be a positive multiple of image_patch_size"),
            (left >= 0 and right >= 0 and left % 2 == 0, "overlap_margins must be >= 0 with an even left margin"),
            (self.crop_px // max(self.patch_px, 1) > left + right, "overlap_margins leave no crop window"),
            ((self.crop_px // max(self.patch_px, 1) + 1) // 2 == self.tokens_h,
             "image_token_length_h must be (patches per crop side + 1) // 2 (2x2 pooling)"),
            ((self.crop_px // max(self.patch_px, 1) + 1) // 2 == self.tokens_w,
             "image_token_length_w must be (patches per crop side + 1) // 2 (2x2 pooling)"),
            (all(s > 0 for s in self.image_std), "image_std must be > 0"),
            (self.max_crops >= 1, "max_crops must be >= 1"),
        ]
        return next((text for ok, text in checks if not ok), None)

    @property
    def crop_patches(self) -> int:
        """Patches along one side of a crop (24)."""
        return self.crop_px // self.patch_px

    @property
    def window_px(self) -> int:
        """Stride between crops: the crop less both margins (224)."""
        return (self.crop_patches - sum(self.overlap_margins)) * self.patch_px

    @property
    def total_margin_px(self) -> int:
        """Pixels the two margins take from one side (112)."""
        return sum(self.overlap_margins) * self.patch_px

    @property
    def tokens_per_image(self) -> int:
        """Pooled tokens per crop (144)."""
        return self.tokens_h * self.tokens_w

    @property
    def patches_per_crop(self) -> int:
        """ViT patches per crop (576)."""
        return self.crop_patches * self.crop_patches


def _read(data: dict, file: Path, name: str, default: Any, *, length: int | None = None,
          kind: type = int) -> Any:
    """``data[name]`` (or the default) checked to be a ``kind`` or a list of ``length`` of them."""
    value = data.get(name, default)
    items = [value] if length is None else value
    types = (int,) if kind is int else (int, float)
    ok = (isinstance(items, list) and len(items) == (length or 1)
          and all(isinstance(x, types) and not isinstance(x, bool) for x in items))
    if not ok:
        noun = "an integer" if kind is int else "a number"
        what = noun if length is None else f"a list of {length} {'integers' if kind is int else 'numbers'}"
        msg = f"{file}: field {name!r} must be {what}, got {value!r}"
        raise ModelLoadError(msg)
    return value


@dataclass
class MolmoProcessed:
    """The origin processor's outputs for one (image, question)."""

    #: int64 (seq,): BOS, the image tokens, the prompt tokens
    input_ids: torch.Tensor
    #: float32 (crops + 1, patches_per_crop, patch_px * patch_px * 3), global image first
    images: torch.Tensor | None
    #: int64 (crops + 1, tokens_per_image): position in input_ids of each pooled token, -100 where unplaced
    image_input_idx: torch.Tensor | None
    #: float32 (crops + 1, patches_per_crop): image fraction of each crop patch, then a row of -1
    image_masks: torch.Tensor | None
    #: float32 (patches_per_crop,): image fraction of each patch of the global image (not an origin output)
    global_image_mask: torch.Tensor | None
    #: (rows, cols) of the crops
    tiling: tuple[int, int] | None
    #: tokens of the prompt only (no BOS, no image tokens)
    num_text_tokens: int


def load_molmo_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer from its ``tokenizer.json`` (local files only, no remote code)."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        msg = f"{path}: no tokenizer.json (the MolmoE tokenizer files are expected beside the weights)"
        raise ModelLoadError(msg)
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        msg = f"{path}: cannot load the tokenizer: {e}"
        raise ModelLoadError(msg) from e


class MolmoProcessor:
    """Turns an image and a question into MolmoE inputs exactly as the origin processor does."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: MolmoImageConfig) -> None:
        problem = config.problem()
        if problem:
            msg = f"invalid Molmo image config: {problem}"
            raise ValueError(msg)
        self.tokenizer = tokenizer
        self.config = config
        ids = tokenizer.encode("".join(IMAGE_TOKENS), add_special_tokens=False)
        if len(ids) != len(IMAGE_TOKENS):
            msg = f"the tokenizer does not have the Molmo image tokens {IMAGE_TOKENS} as single tokens"
            raise ModelLoadError(msg)
        self.token_ids: dict[str, int] = dict(zip(IMAGE_TOKENS, ids, strict=True))
        # the origin's `bos_token_id or eos_token_id`: OLMo has no BOS and uses EOS as the separator
        self.bos_id: int = tokenizer.bos_token_id or tokenizer.eos_token_id

    def tiling(self, width: int, height: int, max_crops: int) -> tuple[int, int]:
        """(rows, cols) of crops for an image of this size: the origin rule."""
        return knobs.select_tiling(int(height), int(width), int(max_crops), window_px=self.config.window_px,
                                   total_margin_px=self.config.total_margin_px)

    def text_tokens(self, question: str) -> list[int]:
        """Tokens of the prompt for a question (no BOS)."""
        return list(self.tokenizer.encode(PROMPT_TEMPLATE.format(question=question), add_special_tokens=False))

    def process(self, image: Image.Image | None, question: str, max_crops: int) -> MolmoProcessed:
        """Model inputs for an image (None: text only) and a question with up to ``max_crops`` crops."""
        text = np.asarray(self.text_tokens(question), dtype=np.int64)
        if image is None:
            ids = np.concatenate([[self.bos_id], text]).astype(np.int64)
            return MolmoProcessed(torch.from_numpy(ids), None, None, None, None, None, len(text))
        # the origin converts to RGB and ignores the EXIF orientation (see the module docstring)
        pixels = np.array(image.convert("RGB"), dtype=np.uint8)
        images, image_tokens, patch_order, masks, global_mask, tiling = self._image_to_patches_and_tokens(
            pixels, max_crops)
        image_input_idx = self._build_image_input_idx(image_tokens, patch_order)
        ids = np.concatenate([[self.bos_id], image_tokens, text]).astype(np.int64)
        # BOS shifts every placed position by one
        image_input_idx = np.where(image_input_idx < 0, image_input_idx, image_input_idx + 1).astype(np.int64)
        return MolmoProcessed(
            input_ids=torch.from_numpy(ids),
            images=torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)),
            image_input_idx=torch.from_numpy(image_input_idx),
            image_masks=torch.from_numpy(np.ascontiguousarray(masks, dtype=np.float32)),
            global_image_mask=torch.from_numpy(np.ascontiguousarray(global_mask, dtype=np.float32)),
            tiling=tiling,
            num_text_tokens=len(text),
        )

    @staticmethod
    def _unit_pixels(image: np.ndarray) -> torch.Tensor:
        """(H, W, 3) uint8 -> contiguous float32 (3, H, W) in [0, 1], what :meth:`_resize_and_pad` reads."""
        pixels = torch.empty((3, *image.shape[:2]), dtype=torch.float32)
        return pixels.copy_(torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)).div_(255.0)

    def _resize_and_pad(self, pixels: torch.Tensor, out_h: int, out_w: int) -> tuple[np.ndarray, np.ndarray]:
        """The image (:meth:`_unit_pixels`) scaled to fit (out_h, out_w), centred, zero-padded,
        normalized; and its bool pixel mask. ``pixels`` is not modified."""
        height, width = pixels.shape[1:]
        # float32 throughout, as the origin's training code: it decides the scaled size
        scale = min(np.float32(out_w) / np.float32(width), np.float32(out_h) / np.float32(height))
        scaled_h = int(np.float32(height) * scale)
        scaled_w = int(np.float32(width) * scale)
        if scaled_h < 1 or scaled_w < 1:
            msg = f"image of {width}x{height} px is too elongated to resize into {out_w}x{out_h} px"
            raise ValueError(msg)
        # every step on contiguous (3, H, W) planes, where per-channel arithmetic is vectorised; the
        # float32 values are those of the origin's order: to [0, 1], resize, clip, minus the mean, over the std
        if (scaled_h, scaled_w) != (height, width):
            pixels = torch.nn.functional.interpolate(pixels[None], size=[scaled_h, scaled_w], mode="bilinear",
                                                     align_corners=False, antialias=True)[0]
        else:  # normalized in place below: the caller's pixels stay as they are
            pixels = pixels.clone()
        mean = torch.tensor(self.config.image_mean, dtype=torch.float32)
        std = torch.tensor(self.config.image_std, dtype=torch.float32)
        pad = (torch.zeros(3) - mean) / std  # the normalized zero around the image
        pixels.clamp_(0.0, 1.0)
        top = (out_h - scaled_h) // 2
        left = (out_w - scaled_w) // 2
        canvas = torch.empty((3, out_h, out_w), dtype=torch.float32)
        for c in range(3):
            canvas[c].fill_(pad[c])
            canvas[c, top:top + scaled_h, left:left + scaled_w] = pixels[c].sub_(mean[c]).div_(std[c])
        mask = np.zeros((out_h, out_w), dtype=bool)
        mask[top:top + scaled_h, left:left + scaled_w] = True
        # (H, W, 3), the layout the crops' patches are read from (``_crop_patches``), in one copy
        return torch.empty((out_h, out_w, 3), dtype=torch.float32).copy_(canvas.permute(1, 2, 0)).numpy(), mask

    def _crop_patches(self, canvas: np.ndarray, rows: int, cols: int, out: np.ndarray | None = None) -> np.ndarray:
        """The (rows x cols) crops of ``canvas`` (H, W[, c]) at the window's stride, patchified as
        :meth:`_patchify` would the stacked crops: (rows * cols, patches, pixels per patch), written
        into ``out`` where given. One copy: the crops overlap by the margins, read through a view."""
        cfg = self.config
        side, p, window = cfg.crop_patches, cfg.patch_px, cfg.window_px
        rest = canvas.shape[2:]
        strides = canvas.strides
        view = np.lib.stride_tricks.as_strided(
            canvas, shape=(rows, cols, side, side, p, p, *rest),
            strides=(window * strides[0], window * strides[1], p * strides[0], p * strides[1], *strides),
            writeable=False)
        if out is None:
            out = np.empty((rows * cols, side * side, p * p * int(np.prod(rest, dtype=np.int64))), dtype=canvas.dtype)
        out.reshape(rows, cols, side, side, p, p, *rest)[...] = view
        return out

    def _patchify(self, crops: np.ndarray) -> np.ndarray:
        """(n, H, W[, c]) -> (n, patches, pixels per patch): row-major patches, each (dy, dx[, c]) flattened."""
        n, side = crops.shape[0], self.config.crop_patches
        p = self.config.patch_px
        rest = crops.shape[3:]
        arr = crops.reshape(n, side, p, side, p, *rest)
        arr = np.swapaxes(arr, 2, 3)
        return arr.reshape(n, side * side, -1)

    def _image_to_patches_and_tokens(self, image: np.ndarray, max_crops: int):
        """The origin's ``MolmoImageProcessor.image_to_patches_and_tokens``, plus the global image's
        own patch masks."""
        cfg = self.config
        height, width = image.shape[:2]
        left_margin, right_margin = cfg.overlap_margins
        crop_window_patches = cfg.crop_patches - (left_margin + right_margin)
        window, margin, crop = cfg.window_px, cfg.total_margin_px, cfg.crop_px
        rows, cols = self.tiling(width, height, max_crops)
        pixels = self._unit_pixels(image)  # once for both resizes
        src, img_mask = self._resize_and_pad(pixels, rows * window + margin, cols * window + margin)

        ordering_arr = []
        on = 0
        for i in range(rows):
            crop_y0, crop_h = _crop_extent(i, rows, cfg.crop_patches, left_margin, right_margin)
            for j in range(cols):
                crop_x0, crop_w = _crop_extent(j, cols, cfg.crop_patches, left_margin, right_margin)
                pooled_w, pooled_h = (crop_w + 1) // 2, (crop_h + 1) // 2
                order = np.full((cfg.tokens_h, cfg.tokens_w), -1, dtype=np.int32)
                order[crop_y0:crop_y0 + pooled_h, crop_x0:crop_x0 + pooled_w] = np.arange(
                    on, on + pooled_h * pooled_w, dtype=np.int32).reshape(pooled_h, pooled_w)
                ordering_arr.append(order)
                on += pooled_h * pooled_w
        # the global image's patches first, then every crop's, written once into the request's array
        pixels_per_patch = cfg.patch_px * cfg.patch_px * src.shape[2]
        patches = np.empty((1 + rows * cols, cfg.crop_patches ** 2, pixels_per_patch), dtype=src.dtype)
        self._crop_patches(src, rows, cols, patches[1:])
        masks = self._crop_patches(img_mask, rows, cols).astype(np.float32).mean(axis=-1)
        patch_ordering = np.stack(ordering_arr).reshape(-1)
        valid = patch_ordering >= 0

        # crop-by-crop order -> left-to-right over the whole image, projected back onto the valid slots
        ordering_rh = patch_ordering.reshape(rows, cols, cfg.tokens_h, cfg.tokens_w).transpose(0, 2, 1, 3).reshape(-1)
        patch_ordering[valid] = ordering_rh[ordering_rh >= 0]

        ids = self.token_ids
        h = rows * crop_window_patches + (right_margin + left_margin)
        w = cols * crop_window_patches + (right_margin + left_margin)
        per_row = np.concatenate([np.full(((w + 1) // 2,), ids[IM_PATCH]), [ids[IM_COL]]])
        crop_tokens = [[ids[IM_START]], np.tile(per_row, [(h + 1) // 2]), [ids[IM_END]]]

        resized, resized_mask = self._resize_and_pad(pixels, crop, crop)
        global_mask = self._patchify(resized_mask[None]).astype(np.float32).mean(axis=-1)[0]
        patches[0] = self._patchify(resized[None])[0]
        patch_ordering = np.where(patch_ordering >= 0, patch_ordering + cfg.tokens_per_image, -1)
        patch_ordering = np.concatenate([np.arange(0, cfg.tokens_per_image), patch_ordering], 0)
        global_row = np.concatenate([np.full((cfg.tokens_w,), ids[IM_PATCH]), [ids[IM_COL]]])
        global_tokens = [[ids[IM_START]], np.tile(global_row, [cfg.tokens_h]), [ids[IM_END]]]
        image_tokens = np.concatenate(global_tokens + crop_tokens, 0).astype(np.int64)
        masks = np.pad(masks, [[0, 1], [0, 0]], constant_values=-1)
        return patches, image_tokens, patch_ordering, masks, global_mask, (rows, cols)

    def _build_image_input_idx(self, image_tokens: np.ndarray, patch_order: np.ndarray) -> np.ndarray:
        """The origin's ``build_image_input_idx``: patch order -> position of each pooled token."""
        positions = np.nonzero(image_tokens == self.token_ids[IM_PATCH])[0].astype(np.int32)
        patch_order = patch_order.reshape(-1)
        valid = patch_order >= 0
        n_valid = int(valid.sum())
        if len(positions) != n_valid:
            msg = f"{len(positions)} image patch tokens for {n_valid} placed patches"
            raise RuntimeError(msg)
        sorted_ixs = np.zeros([len(positions)], np.int32)
        sorted_ixs[patch_order[valid]] = np.arange(n_valid, dtype=np.int32)
        sorted_ixs_ex = np.full(patch_order.shape, -1)
        sorted_ixs_ex[valid] = sorted_ixs
        placed = (sorted_ixs_ex >= 0).astype(np.int32)
        idx = positions[sorted_ixs_ex * placed]
        idx = idx * placed + _UNPLACED * (1 - placed)
        return idx.reshape(-1, self.config.tokens_per_image)


def _crop_extent(index: int, count: int, crop_patches: int, left_margin: int, right_margin: int) -> tuple[int, int]:
    """Where crop ``index`` of ``count`` along one axis starts in its pooled grid, and how many
    patches it contributes: inner crops drop both overlap margins, the first keeps its left
    one, the last its right one."""
    start = 0 if index == 0 else left_margin // 2
    size = crop_patches - (right_margin + left_margin)
    size += left_margin if index == 0 else 0
    size += right_margin if index == count - 1 else 0
    return start, size
