"""The embedded default model: a MolmoE-shaped VLM generated from a seed, needing no download.

It is composed from transformers' own classes so that the knobs act on the same kind of
execution path as in MolmoE-1B (``origin_formats.md`` §1):

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
    decoder/             OlmoeForCausalLM.save_pretrained
    tokenizer/           PreTrainedTokenizerFast.save_pretrained

Weights are drawn from ``torch.Generator().manual_seed(seed)`` parameter by parameter with
std = gain/sqrt(fan_in) (embeddings std 1, router and expert outputs with gains > 1):
transformers' default std 0.02 makes the router and experts almost inert, so top_k and block
skipping would barely move the outputs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from features.model.base import (
    DecodeState,
    GenerationResult,
    ModelInputs,
    ModelLoadError,
    ModelRuntime,
    PrefixState,
    resolve_device,
    resolve_importance_scores,
    validate_active_blocks,
    validate_top_k,
)
from pipeline import knobs
from pipeline.errors import KnobError

EMBEDDED_FORMAT = "ctrl-embedded-vlm"
#: bump when the build recipe changes: it names the cache directory and enters the fingerprint
EMBEDDED_VERSION = 1
MARKER_FILE = "ctrl_embedded.json"

PAD_TOKEN, EOS_TOKEN = "<pad>", "<|endoftext|>"
IMAGE_PATCH_TOKEN, IMAGE_START_TOKEN, IMAGE_END_TOKEN = "<im_patch>", "<im_start>", "<im_end>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, IMAGE_PATCH_TOKEN, IMAGE_START_TOKEN, IMAGE_END_TOKEN)
PROMPT_TEMPLATE = " User: {question} Assistant:"

# CLIP normalisation, as Molmo's preprocessor uses
_CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
_CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


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
_GAINS = (("embed_tokens", None), ("mlp.gate.weight", 4.0), ("experts.down_proj", 4.0), ("lm_head", 2.0))


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
    from transformers.utils import logging as hf_logging

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


# -- build -------------------------------------------------------------------------------------

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


def write_embedded_model(directory: Path, seed: int = 0) -> None:
    """Build the seeded model and save it into ``directory`` (which must exist and be empty)."""
    from safetensors.torch import save_file
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModel,
        OlmoeConfig,
        OlmoeForCausalLM,
    )

    spec = EmbeddedSpec(seed=seed)
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

    with quiet_transformers():
        vision.save_pretrained(directory / "vision")
        decoder.save_pretrained(directory / "decoder")
        tokenizer.save_pretrained(directory / "tokenizer")
    (directory / "projector").mkdir()
    save_file({k: v.contiguous() for k, v in projector.state_dict().items()},
              str(directory / "projector" / "projector.safetensors"), metadata={"format": "pt"})
    proj_cfg = {"in_dim": projector.w1.in_features, "hidden_dim": _PROJECTOR_HIDDEN,
                "out_dim": decoder_cfg.hidden_size}
    (directory / "projector" / "projector.json").write_text(json.dumps(proj_cfg, indent=2, sort_keys=True) + "\n")
    # the marker goes last: a directory with a marker is complete
    (directory / MARKER_FILE).write_text(json.dumps(asdict(spec), indent=2, sort_keys=True) + "\n")


def default_cache_root() -> Path:
    """``$CTRL_CACHE_DIR`` if set, else ``~/.cache/ctrl``."""
    env = os.environ.get("CTRL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ctrl"


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


def cache_tmp_dir(target: Path) -> Path:
    """A temporary sibling of ``target`` (same filesystem, so the final rename is atomic), with
    ordinary permissions (mkdtemp makes it private; the cache is an ordinary directory)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


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


def _load_strict(cls, directory: Path):
    """``cls.from_pretrained`` from a local directory; any missing/unexpected/mismatched weight is an error."""
    model, info = cls.from_pretrained(directory, local_files_only=True, output_loading_info=True)
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise ModelLoadError(f"{directory}: weights do not match the config: {problems}")
    return model


def directory_fingerprint(directory: Path) -> str:
    """sha256 over every file's relative path and bytes (config, weights, tokenizer, marker)."""
    h = hashlib.sha256(f"{EMBEDDED_FORMAT}:{EMBEDDED_VERSION}\n".encode())
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(path.relative_to(directory).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


# -- runtime -----------------------------------------------------------------------------------

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
        from safetensors.torch import load_file
        from transformers import (
            CLIPVisionModel,
            OlmoeForCausalLM,
            PreTrainedTokenizerFast,
        )

        self.path = Path(path)
        if not is_embedded_dir(self.path):
            raise ModelLoadError(f"{self.path}: not an embedded model directory (no valid {MARKER_FILE})")
        self.device = resolve_device(device)
        try:
            with quiet_transformers():
                raw = json.loads((self.path / MARKER_FILE).read_text())
                raw["vit_layers"] = tuple(raw.get("vit_layers", EmbeddedSpec.vit_layers))
                self.spec = EmbeddedSpec(**raw)
                self.tokenizer = PreTrainedTokenizerFast.from_pretrained(self.path / "tokenizer", local_files_only=True)
                self.vision = _load_strict(CLIPVisionModel, self.path / "vision")
                self.decoder = _load_strict(OlmoeForCausalLM, self.path / "decoder")
                proj_cfg = json.loads((self.path / "projector" / "projector.json").read_text())
                self.projector = ImageProjector(**proj_cfg)
                # strict: a missing or unexpected tensor is an error, never a silently random weight (D25)
                self.projector.load_state_dict(load_file(str(self.path / "projector" / "projector.safetensors")))
        except (OSError, TypeError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"{self.path}: cannot load the embedded model: {exc}") from exc
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
            raise ModelLoadError("the embedded runtime needs transformers >= 5 (OLMoE router with a top_k)")
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
            raise KnobError(f"max_crops must be an integer >= 1, got {max_crops!r}")
        rows, cols = knobs.select_tiling(int(height), int(width), int(max_crops), window_px=self.spec.window_px,
                                         total_margin_px=self.spec.total_margin_px)
        return int(rows), int(cols)

    def _to_tensor(self, image: Image.Image) -> torch.Tensor:
        arr = (np.asarray(image, dtype=np.float32) / 255.0 - _CLIP_MEAN) / _CLIP_STD
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
                raise ValueError(f"{positions.numel()} image placeholders for {tokens.shape[0]} image tokens")
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
        from transformers import DynamicCache

        tokens: list[int] = []
        with torch.inference_mode(), self._run_active_blocks():
            # one slot per layer, indexed by each attention's original layer_idx
            cache = DynamicCache(config=self.decoder.config)
            mask = inputs.attention_mask.to(self.device)
            out = self.decoder(inputs_embeds=self._embed(inputs), attention_mask=mask, past_key_values=cache,
                               use_cache=True, logits_to_keep=1)
            for step in range(max_new_tokens):
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                if token == self.eos_id or step == max_new_tokens - 1:
                    break
                mask = torch.cat([mask, mask.new_ones((1, 1))], dim=1)
                out = self.decoder(input_ids=torch.tensor([[token]], device=self.device), attention_mask=mask,
                                   past_key_values=cache, use_cache=True, logits_to_keep=1)
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
            raise KnobError(f"insertion position must be in 1..{self.num_layers - 1}, got {insertion_position!r}")
        return int(insertion_position)

    def prefill_prefix(self, inputs: ModelInputs, insertion_position: int,
                       extra_embedding: torch.Tensor | None = None) -> PrefixState:
        from transformers import DynamicCache

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
        from transformers import DynamicCache

        p = prefix.insertion_position
        active = validate_active_blocks(active_blocks, self.num_layers) or tuple(range(self.num_layers))
        if active[:p] != tuple(range(p)):
            raise KnobError(f"active blocks {list(active)} must include blocks 0..{p - 1}: they ran before stage 2")
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
