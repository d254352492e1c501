"""The embedded model's format: a MolmoE-shaped VLM generated from a seed, needing no download.

It is composed from transformers' own classes so that the knobs act on the same kind of
execution path as in MolmoE-1B (``docs/origin_format.md`` §1):

* vision: a small ``CLIPVisionModel`` (112-px crops, 14-px patches -> 8x8 patches) run on
  Molmo-style overlapping crops plus a global image placed first; the two last ViT hidden
  states are concatenated (Molmo uses two layers too), 2x2 mean-pooled -> 16 tokens per
  image array, then a SwiGLU MLP projects them into the decoder width;
* decoder: ``OlmoeForCausalLM`` with 16 layers and 64 experts, top-8 routing without
  renormalisation (as MolmoE), small width;
* tokenizer: a byte-level BPE trained in-process on a fixed built-in corpus (deterministic),
  wrapped as ``PreTrainedTokenizerFast``.

Prompt format (Molmo style, image block first)::

    [<im_start> <im_patch>*16 <im_end>] * (crops + 1)  " User: <question> Assistant:"

``ModelInputs.prompt`` is the text part; the image block is prepended as token ids.

Crop geometry: a 1-patch (14 px) margin per side leaves an 84-px window, total margin 28 px;
the image is resized to (rows*84+28, cols*84+28) and cut into rows*cols overlapping 112-px
crops (``pipeline.knobs.select_tiling`` with window_px=84, total_margin_px=28).

Directory format (``build_embedded_model`` writes it; any directory laid out like this loads)::

    ctrl_embedded.json   format marker, version, seed, geometry, prompt and token names
    vision/              CLIPVisionModel.save_pretrained
    projector/           projector.safetensors + projector.json
    decoder/             OlmoeForCausalLM.save_pretrained (experts fused per block; the
                         per-expert layout of older directories loads too)
    tokenizer/           PreTrainedTokenizerFast.save_pretrained

Weights are drawn from ``torch.Generator().manual_seed(seed)`` parameter by parameter with
std = gain/sqrt(fan_in) (embeddings std 1, router and expert outputs with gains > 1):
transformers' default std 0.02 makes the router and experts almost inert, so top_k and block
skipping would barely move the outputs.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pipeline import knobs
from runtime.base import ModelLoadError
from runtime.cache import cache_tmp_dir, default_cache_root
from runtime.formats import EMBEDDED_VERSION

if TYPE_CHECKING:
    from transformers import PreTrainedModel

EMBEDDED_FORMAT = "ctrl-embedded-vlm"
MARKER_FILE = "ctrl_embedded.json"
#: the file in a trained testbed directory that records its recipe and training log
RECIPE_FILE = "testbed.json"

PAD_TOKEN, EOS_TOKEN = "<pad>", "<|endoftext|>"
IMAGE_PATCH_TOKEN, IMAGE_START_TOKEN, IMAGE_END_TOKEN = "<im_patch>", "<im_start>", "<im_end>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, IMAGE_PATCH_TOKEN, IMAGE_START_TOKEN, IMAGE_END_TOKEN)
PROMPT_TEMPLATE = " User: {question} Assistant:"

# CLIP normalisation, as Molmo's preprocessor uses
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


@dataclass(frozen=True)
class EmbeddedSpec:
    """What the directory's marker file records: everything preprocessing needs."""

    format: str = EMBEDDED_FORMAT
    version: int = EMBEDDED_VERSION
    seed: int = 0
    crop_px: int = 112
    patch_px: int = 14
    margin_patches: int = 1
    pool: int = 2
    #: ViT hidden states concatenated before pooling (Molmo: [-2, -9])
    vit_layers: tuple[int, ...] = (-1, -2)
    prompt_template: str = PROMPT_TEMPLATE
    pad_token: str = PAD_TOKEN
    eos_token: str = EOS_TOKEN
    image_patch_token: str = IMAGE_PATCH_TOKEN
    image_start_token: str = IMAGE_START_TOKEN
    image_end_token: str = IMAGE_END_TOKEN

    @property
    def window_px(self) -> int:
        return self.crop_px - 2 * self.margin_patches * self.patch_px

    @property
    def total_margin_px(self) -> int:
        return 2 * self.margin_patches * self.patch_px

    @property
    def tokens_per_image(self) -> int:
        side = self.crop_px // self.patch_px // self.pool
        return side * side


# -- architecture (small enough for 2 CPU cores; the decoder keeps MolmoE's 16 x 64 experts, top-8)
_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
           "hidden_act": "quick_gelu"}
_DECODER = {"hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "norm_topk_prob": False, "tie_word_embeddings": False}
_PROJECTOR_HIDDEN = 128
_TOKENIZER_VOCAB = 1024
# init gains (std = gain / sqrt(fan_in)); chosen so top_k 2 vs 8 and dropping blocks visibly move logits
ROUTER_INIT_GAIN = 4.0
_GAINS = (("embed_tokens", None), ("mlp.gate.weight", ROUTER_INIT_GAIN), ("experts.down_proj", 4.0), ("lm_head", 2.0))


class ImageProjector(nn.Module):
    """Molmo's image projector: a SwiGLU MLP from pooled ViT features to the decoder width."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(in_dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(in_dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars or info logs while saving/loading our small local models; state restored."""
    from transformers.utils import logging as hf_logging  # deferred, as in _build_tokenizer()

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


class VisionBackbone(nn.Module):
    """ViT + 2x2 pooling + projector in one module, like Molmo's ``vision_backbone``: a forward
    hook on it brackets the whole vision path (latency measurement, §3)."""

    def __init__(self, vit: nn.Module, projector: ImageProjector, spec: EmbeddedSpec) -> None:
        super().__init__()
        self.vit, self.projector = vit, projector
        self.vit_layers, self.pool = tuple(spec.vit_layers), spec.pool
        self.side = spec.crop_px // spec.patch_px

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(n_arrays, 3, crop, crop) -> (n_arrays, tokens_per_image, decoder width)."""
        out = self.vit(pixel_values=images, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i] for i in self.vit_layers], dim=-1)[:, 1:]  # drop CLS
        n, _, dim = feats.shape
        grid = feats.transpose(1, 2).reshape(n, dim, self.side, self.side)
        pooled = nn.functional.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)
        return self.projector(pooled)


# -- tokenizer ---------------------------------------------------------------------------------

def _tokenizer_corpus() -> list[str]:
    """A fixed VQA-like corpus: templates x word lists, fully deterministic."""
    words = {  # split below: one readable line per word class
        "colors": "red blue green yellow black white brown orange pink purple gray silver",
        "objects": "cat dog man woman person car bus train truck bike plane boat bird horse sheep cow table chair "
                   "bed sign clock phone laptop pizza cake ball kite umbrella tree street room kitchen building "
                   "window door book bottle cup shirt hat grass sky water",
        "numbers": "zero one two three four five six seven eight nine ten eleven twelve",
        "places": "on in under near behind next to at the left right top bottom of",
        "verbs": "doing holding eating wearing playing riding sitting standing looking reading",
    }
    colors, objects, numbers, places, verbs = (words[k].split() for k in ("colors", "objects", "numbers", "places",
                                                                           "verbs"))
    qwords = ("What is the color of the {o}?", "How many {o}s are there?", "Is there a {o} in the image?",
              "What is the {o} {v}?", "Where is the {o}?", "What does the sign say?", "Is the {o} {c}?",
              "What number is on the {o}?", "Which {o} is bigger?", "Why is the {o} here?",
              "What time is it?", "Who is {v} the {o}?", "What brand is the {o}?")
    corpus: list[str] = []
    for (i, o), c, v in zip(enumerate(itertools.islice(itertools.cycle(objects), 600)),
                            itertools.cycle(colors), itertools.cycle(verbs)):
        q = qwords[i % len(qwords)].format(o=o, c=c, v=v)
        answer = [c, numbers[i % len(numbers)], "yes" if i % 2 else "no", f"{o} {places[i % len(places)]}"][i % 4]
        corpus.append(PROMPT_TEMPLATE.format(question=q) + " " + answer)
    corpus += [" ".join(str(n) for n in range(k, k + 20)) for k in range(0, 2100, 20)]
    corpus += [" ".join(colors + objects + numbers + places + verbs), "A B C D E Answer: , . ! ? ' \" : ; - ( ) $ % &"]
    return corpus


def _build_tokenizer():
    # transformers and tokenizers take seconds to import: only building or loading a model pays for them
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # byte level: any question tokenizes (no unknown token), and decoding is exact
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_tokenizer_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                                   extra_special_tokens=[IMAGE_PATCH_TOKEN, IMAGE_START_TOKEN, IMAGE_END_TOKEN])


# -- the directory -----------------------------------------------------------------------------

def _seeded_init(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter from one seeded generator, in sorted-name order."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim == 1 and "class_embedding" not in name:
                # norm weights 1, biases 0 (RMSNorm / LayerNorm / Linear bias)
                param.fill_(0.0 if name.endswith("bias") else 1.0)
                continue
            fan_in = param.shape[-1] if param.ndim in (1, 2, 3) else math.prod(param.shape[1:])
            gain = 1.0
            for pattern, value in _GAINS:
                if pattern in name:
                    gain = math.sqrt(fan_in) if value is None else value  # None: std 1
                    break
            param.copy_(torch.randn(param.shape, generator=gen) * (gain / math.sqrt(fan_in)))


def write_embedded_model(directory: Path, seed: int = 0, *, pool: int = EmbeddedSpec.pool) -> None:
    """Build the seeded model and save it into ``directory`` (which must exist and be empty).

    ``pool``: the side of the mean-pooling window over the ViT's patch grid (2: 16 image tokens per
    crop, the embedded default; 1: all 64 patches, four times the decoder's image tokens). Only the
    geometry changes: every weight is drawn as for the default, so a parameter that exists in both
    has the same values."""
    from transformers import (  # deferred, as in _build_tokenizer()
        CLIPVisionConfig,
        CLIPVisionModel,
        OlmoeConfig,
        OlmoeForCausalLM,
    )

    side = EmbeddedSpec.crop_px // EmbeddedSpec.patch_px
    if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1 or side % pool:
        msg = f"pool must be a positive integer that divides the {side}-patch grid, got {pool!r}"
        raise ValueError(msg)
    spec = EmbeddedSpec(seed=seed, pool=pool)
    tokenizer = _build_tokenizer()
    vision_cfg = CLIPVisionConfig(image_size=spec.crop_px, patch_size=spec.patch_px, **_VISION)
    decoder_cfg = OlmoeConfig(
        vocab_size=len(tokenizer), num_hidden_layers=knobs.NUM_TOTAL_BLOCKS, num_experts=knobs.NUM_EXPERTS,
        num_experts_per_tok=knobs.DEFAULT_TOP_K, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **_DECODER)
    vision = CLIPVisionModel(vision_cfg).eval()
    decoder = OlmoeForCausalLM(decoder_cfg).eval()
    projector = ImageProjector(len(spec.vit_layers) * vision_cfg.hidden_size, _PROJECTOR_HIDDEN,
                               decoder_cfg.hidden_size)
    # separate generators per component keep each one's weights independent of the others' sizes
    _seeded_init(vision, seed)
    _seeded_init(projector, seed + 1)
    _seeded_init(decoder, seed + 2)

    save_embedded_model(directory, spec, vision, decoder, tokenizer, projector)


def save_embedded_model(directory: Path, spec: EmbeddedSpec, vision: nn.Module, decoder: nn.Module, tokenizer: object,
                        projector: ImageProjector, extra_files: dict[str, str | bytes] | None = None) -> None:
    """Write the directory format (module docstring) into ``directory``; ``extra_files`` (name -> text
    or bytes) are written before the marker, which goes last: a directory with a marker is complete."""
    from safetensors.torch import save_file  # deferred with transformers: saving needs both

    # the decoder in its in-memory layout (experts fused per block), not the per-expert layout
    # transformers writes by default: loading that one converts it key by key, ~1 s per load
    native = {"save_original_format": False} if _accepts(decoder.save_pretrained, "save_original_format") else {}
    with quiet_transformers():
        vision.save_pretrained(directory / "vision")
        decoder.save_pretrained(directory / "decoder", **native)
        tokenizer.save_pretrained(directory / "tokenizer")  # type: ignore[attr-defined]
    (directory / "projector").mkdir(exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in projector.state_dict().items()},
              str(directory / "projector" / "projector.safetensors"), metadata={"format": "pt"})
    proj_cfg = {"in_dim": projector.w1.in_features, "hidden_dim": projector.w1.out_features,
                "out_dim": projector.w2.out_features}
    (directory / "projector" / "projector.json").write_text(json.dumps(proj_cfg, indent=2, sort_keys=True) + "\n")
    for name, content in (extra_files or {}).items():
        if isinstance(content, bytes):
            (directory / name).write_bytes(content)
        else:
            (directory / name).write_text(content)
    (directory / MARKER_FILE).write_text(json.dumps(asdict(spec), indent=2, sort_keys=True) + "\n")


def _accepts(function: Any, name: str) -> bool:
    return name in inspect.signature(function).parameters


def is_embedded_dir(path: str | Path) -> bool:
    """True if ``path`` holds a complete embedded model (its marker names our format)."""
    marker = Path(path) / MARKER_FILE
    try:
        return json.loads(marker.read_text()).get("format") == EMBEDDED_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def build_embedded_model(seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    """Write the seeded embedded model into the cache (reused when present) and return its directory.

    The directory is ``<cache_dir or default_cache_root()>/embedded-v<version>-seed<seed>``. It is
    written to a temporary sibling and renamed into place, so a crash never leaves a half model
    and concurrent builders simply race to the same content.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / f"embedded-v{EMBEDDED_VERSION}-seed{seed}"
    if is_embedded_dir(target):
        return target
    tmp = cache_tmp_dir(target)
    try:
        write_embedded_model(tmp, seed)
        publish_model_dir(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def publish_model_dir(src: Path, target: Path, replace: bool = False) -> None:
    """Rename a complete model directory into place. An existing ``target`` is removed first when
    it is incomplete (no marker: an old crash) or ``replace`` is set; losing a race to another
    builder that published a complete directory is not an error."""
    if target.exists() and (replace or not is_embedded_dir(target)):
        shutil.rmtree(target)
    try:
        os.replace(src, target)
    except OSError:
        if not is_embedded_dir(target):  # not a lost race: a real error
            raise


def load_strict(cls: type[PreTrainedModel], directory: Path) -> PreTrainedModel:
    """``cls.from_pretrained`` from a local directory; any missing/unexpected/mismatched weight is an error."""
    model, info = cls.from_pretrained(directory, local_files_only=True, output_loading_info=True)
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        msg = f"{directory}: weights do not match the config: {problems}"
        raise ModelLoadError(msg)
    return model


def own_memory(model: nn.Module) -> nn.Module:
    """``model`` with its tensors copied into memory of their own. Loaded tensors map the file at
    whatever offset it holds them, and the fused experts' kernels round differently on memory
    that is not 64-byte aligned: freshly allocated tensors compute what the per-expert layout
    (which loading assembles into new tensors) computes, bit for bit."""
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            tensor.data = tensor.data.clone()
    return model


def directory_fingerprint(directory: Path) -> str:
    """sha256 over every file's relative path and bytes (config, weights, tokenizer, marker)."""
    h = hashlib.sha256(f"{EMBEDDED_FORMAT}:{EMBEDDED_VERSION}\n".encode())
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(path.relative_to(directory).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()
