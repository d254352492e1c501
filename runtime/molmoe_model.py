"""MolmoE-1B written natively: the architecture read from a checkpoint's ``config.json`` and its
weights loaded by name, never executing the checkpoint's own Python files.

The origin model (``modeling_molmoe.py`` of ``allenai/MolmoE-1B-0924``) has two parts:

* the vision backbone (``model.vision_backbone``): a CLIP-style ViT over patchified 336-px
  crops whose hidden states at two layers (``vit_layers``) are concatenated, a padding
  embedding added where ``image_masks`` says a patch is padding (``pad_and_partial_pad``),
  2x2 attention pooling with the mean of each 2x2 window as query, and a SwiGLU projector
  into the decoder width. :class:`MolmoVisionBackbone` reproduces it with the origin's module
  and parameter names, so its weights load one to one;
* the decoder (``model.transformer``): OLMoE blocks (pre-norm RMS, fused QKV, q/k RMS norm
  over the full width, llama rotary, softmax-then-top-K routing without renormalisation, SwiGLU
  experts), a final RMS norm and an untied output head. That is exactly transformers'
  ``OlmoeForCausalLM``; :func:`weight_targets` maps (and splits / stacks) the origin tensors
  into its layout, and ``runtime.weights`` streams them into place. Only the input embedding
  differs: the origin's ``wte`` holds the base vocabulary plus ``additional_vocab_size`` new
  rows, so the decoder gets an ``nn.Embedding`` over both while its output head keeps the base
  vocabulary.

Anything in ``config.json`` that selects a variant this module does not implement is refused
by :meth:`MolmoEArchitecture.from_config` with the field's name, rather than run wrongly.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.base import ModelLoadError
from runtime.weights import Piece, Target

if TYPE_CHECKING:
    from transformers import OlmoeForCausalLM

VISION_PREFIX = "model.vision_backbone."
DECODER_PREFIX = "model.transformer."

#: config.json values this implementation covers: field -> (allowed values, what the value selects)
_REQUIRED: dict[str, tuple[tuple[Any, ...], str]] = {
    "block_type": (("moe",), "the MoE decoder block"),
    "layer_norm_type": (("rms",), "RMS norms"),
    "attention_layer_norm": ((True,), "q/k norms"),
    "norm_after": ((False, None), "pre-norm blocks"),
    "rope": ((True,), "rotary positions"),
    "rope_impl": (("llama", None), "llama-style rotary halves"),
    "use_position_ids": ((True, None), "position ids from the attention mask"),
    "alibi": ((False, None), "no ALiBi"),
    "clip_qkv": ((None,), "no QKV clipping"),
    "include_bias": ((False, None), "bias-free decoder linears"),
    "qkv_bias": ((False, None), "bias-free QKV"),
    "weight_tying": ((False, None), "an untied output head"),
    "moe_shared_expert": ((False, None), "no shared expert"),
    "normalize_input_embeds": ((False, None), "unscaled input embeddings"),
    "scale_logits": ((False, None), "unscaled logits"),
    "final_logit_softcapping": ((None,), "no logit soft-capping"),
    "use_cls_feature": ((False, None), "no CLS image feature"),
    "unconditioned": ((False, None), "image-conditioned decoding"),
    "block_group_size": ((1, None), "ungrouped blocks"),
    "image_pooling_2d": (("attention-meanq",), "2x2 attention pooling with a mean query"),
    "image_projector": (("mlp",), "the SwiGLU image projector"),
    "image_padding_embed": (("pad_and_partial_pad", None, ""), "the padding embeddings"),
}


_ABSENT = object()


def _integer(cfg: Mapping[str, Any], key: str, default: Any = _ABSENT) -> Any:
    """``cfg[key]`` as a JSON integer (``default`` when absent or null); a string, a fraction or a
    boolean is refused rather than converted, so a typo cannot become a size."""
    value = cfg.get(key)
    if value is None:
        if default is _ABSENT:
            raise KeyError(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{key} must be an integer, got {value!r}"
        raise ValueError(msg)
    return value


@dataclass(frozen=True)
class MolmoEArchitecture:
    """The sizes ``config.json`` fixes (origin names in comments where they differ)."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    num_experts: int  # moe_num_experts
    top_k: int  # moe_top_k
    expert_hidden: int  # mlp_hidden_size or mlp_ratio * d_model, halved (SwiGLU)
    vocab_size: int  # embedding_size or vocab_size: rows of the output head
    additional_vocab_size: int
    layer_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vit_width: int  # image_emb_dim
    vit_heads: int
    vit_kv_heads: int
    vit_head_dim: int
    vit_mlp_dim: int
    vit_layers_total: int  # image_num_layers
    vit_norm_eps: float
    vit_num_pos: int
    patch_px: int
    crop_px: int
    vit_layers: tuple[int, ...]  # the ViT hidden states concatenated
    pool_h: int
    pool_w: int
    pad_embed: bool
    float32_attention: bool
    #: the context the model was trained on (``max_sequence_length``; 4,096 for MolmoE-1B, whose rope
    #: table spans ``max_position_embeddings`` 32,768): what a KV cache is sized for at first
    max_sequence_length: int | None = None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def patches_per_side(self) -> int:
        return self.crop_px // self.patch_px

    @property
    def tokens_per_crop(self) -> int:
        side = self.patches_per_side
        return ((side + self.pool_h - 1) // self.pool_h) * ((side + self.pool_w - 1) // self.pool_w)

    @property
    def pooled_width(self) -> int:
        return len(self.vit_layers) * self.vit_width

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], source: str = "config.json") -> MolmoEArchitecture:
        """Read and check a MolmoE ``config.json`` mapping; unsupported variants raise ModelLoadError."""
        for field, (allowed, meaning) in _REQUIRED.items():
            if field in cfg and cfg[field] not in allowed:
                msg = (f"{source}: {field}={cfg[field]!r} is not supported (the native MolmoE runtime "
                       f"implements {meaning}: {allowed[0]!r})")
                raise ModelLoadError(msg)
        vb = cfg.get("vision_backbone")
        if not isinstance(vb, Mapping):
            msg = f"{source}: vision_backbone must be an object (the ViT settings)"
            raise ModelLoadError(msg)
        if vb.get("image_model_type", "openai") != "openai":
            msg = f"{source}: vision_backbone.image_model_type={vb.get('image_model_type')!r} is not supported"
            raise ModelLoadError(msg)
        try:
            d_model, n_heads = _integer(cfg, "d_model"), _integer(cfg, "n_heads")
            n_kv = _integer(cfg, "n_kv_heads", n_heads)
            mlp = _integer(cfg, "mlp_hidden_size", _integer(cfg, "mlp_ratio", 4) * d_model)
            crop = vb.get("image_default_input_size", [336, 336])
            arch = cls(
                d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv, n_layers=_integer(cfg, "n_layers"),
                num_experts=_integer(cfg, "moe_num_experts"), top_k=_integer(cfg, "moe_top_k"), expert_hidden=mlp // 2,
                vocab_size=_integer(cfg, "embedding_size", None) or _integer(cfg, "vocab_size"),
                additional_vocab_size=_integer(cfg, "additional_vocab_size", 0),
                layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
                max_position_embeddings=_integer(cfg, "max_position_embeddings", None)
                or _integer(cfg, "max_sequence_length", 4096),
                vit_width=_integer(vb, "image_emb_dim"), vit_heads=_integer(vb, "image_num_heads"),
                vit_kv_heads=_integer(vb, "image_num_key_value_heads", None) or _integer(vb, "image_num_heads"),
                vit_head_dim=_integer(vb, "image_head_dim"), vit_mlp_dim=_integer(vb, "image_mlp_dim"),
                vit_layers_total=_integer(vb, "image_num_layers"), vit_norm_eps=float(vb.get("image_norm_eps", 1e-5)),
                vit_num_pos=_integer(vb, "image_num_pos", 577), patch_px=_integer(vb, "image_patch_size", 14),
                crop_px=int(crop[0]), vit_layers=tuple(int(i) for i in (cfg.get("vit_layers") or [-1])),
                pool_h=_integer(cfg, "image_pooling_h", 2), pool_w=_integer(cfg, "image_pooling_w", 2),
                max_sequence_length=_integer(cfg, "max_sequence_length", None),
                pad_embed=bool(cfg.get("image_padding_embed")), float32_attention=bool(cfg.get("float32_attention",
                                                                                             True)))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            msg = f"{source}: missing or invalid MolmoE setting: {type(exc).__name__}: {exc}"
            raise ModelLoadError(msg) from exc
        arch._check(source)
        return arch

    def kv_cache_bytes(self, dtype: torch.dtype, device: torch.device, float32_attention: bool = False) -> int:
        """What the fast path's KV cache holds from its first captured step: keys and values of every
        block for the trained context (``max_sequence_length``, else ``max_position_embeddings``), in the
        attention's dtype (float32 on a CPU or with ``float32_attention``, else ``dtype``)."""
        positions = self.max_sequence_length or self.max_position_embeddings
        itemsize = 4 if float32_attention or device.type == "cpu" else dtype.itemsize
        return 2 * self.n_layers * self.n_kv_heads * positions * self.head_dim * itemsize

    def parameters_at_least(self) -> int:
        """A lower bound on the checkpoint's parameter count, from the sizes alone (expert and
        attention matrices, the input embedding, the ViT's matrices): what the memory check reads
        before any module is built, so that a config with absurd sizes is refused at once."""
        head_dim = self.d_model // self.n_heads
        attention = self.d_model * (self.n_heads + 2 * self.n_kv_heads) * head_dim + self.d_model * self.d_model
        experts = self.num_experts * 3 * self.d_model * self.expert_hidden
        vit_attention = self.vit_width * (self.vit_heads + 2 * self.vit_kv_heads) * self.vit_head_dim * 2
        vit = self.vit_layers_total * (vit_attention + 2 * self.vit_width * self.vit_mlp_dim)
        return (self.n_layers * (attention + experts) + (self.vocab_size + self.additional_vocab_size) * self.d_model
                + vit)

    def _check(self, source: str) -> None:
        problems = []
        sizes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), int) and not isinstance(getattr(self, f.name), bool)}
        not_positive = [f"{name}={value}" for name, value in sizes.items()
                        if value < (0 if name == "additional_vocab_size" else 1)]
        if not_positive:
            msg = f"{source}: MolmoE sizes must be positive: {', '.join(not_positive)}"
            raise ModelLoadError(msg)
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            problems.append(f"d_model {self.d_model} / n_heads {self.n_heads} / n_kv_heads {self.n_kv_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            problems.append(f"moe_top_k {self.top_k} not in 1..moe_num_experts {self.num_experts}")
        if self.vit_heads * self.vit_head_dim != self.vit_width:
            problems.append("image_num_heads * image_head_dim != image_emb_dim")
        if self.crop_px % self.patch_px or (self.patches_per_side ** 2 + 1) != self.vit_num_pos:
            problems.append(f"image_num_pos {self.vit_num_pos} does not match {self.crop_px}-px crops of "
                            f"{self.patch_px}-px patches")
        if any(not -self.vit_layers_total <= i < self.vit_layers_total for i in self.vit_layers):
            problems.append(f"vit_layers {list(self.vit_layers)} outside the {self.vit_layers_total} ViT layers")
        if problems:
            msg = f"{source}: inconsistent MolmoE sizes: " + "; ".join(problems)
            raise ModelLoadError(msg)


def read_architecture(path: Path) -> tuple[MolmoEArchitecture, dict[str, Any]]:
    """The architecture and the raw mapping of ``path/config.json``."""
    config = path / "config.json"
    try:
        cfg = json.loads(config.read_text())
    except OSError as exc:
        msg = f"{config}: cannot read: {exc.strerror or exc}"
        raise ModelLoadError(msg) from exc
    except ValueError as exc:
        msg = f"{config}: invalid JSON: {exc}"
        raise ModelLoadError(msg) from exc
    if not isinstance(cfg, dict):
        msg = f"{config}: expected a JSON object"
        raise ModelLoadError(msg)
    return MolmoEArchitecture.from_config(cfg, str(config)), cfg


def is_molmoe_config(cfg: Mapping[str, Any]) -> bool:
    """True for a MolmoE config mapping (Molmo's names: d_model, n_layers, a vision backbone, experts)."""
    return (cfg.get("model_type") == "molmo" or "d_model" in cfg) and "moe_num_experts" in cfg


# -- the vision backbone ----------------------------------------------------------------------

def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
               float32: bool) -> torch.Tensor:
    """Bidirectional multi-head attention of (n, len, heads*head_dim) projections (the origin's
    MultiHeadDotProductAttention core: sdpa, optionally in float32)."""
    n, lq, _ = q.shape
    dtype = q.dtype
    q = q.reshape(n, lq, heads, head_dim).transpose(1, 2)
    k = k.reshape(n, k.shape[1], kv_heads, head_dim).transpose(1, 2)
    v = v.reshape(n, v.shape[1], kv_heads, head_dim).transpose(1, 2)
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    if float32:
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(n, lq, heads * head_dim).to(dtype)


class MolmoAttention(nn.Module):
    """Origin ``MultiHeadDotProductAttention``: wq/wk/wv/wo with biases (ViT blocks and pooling).
    ``float32``: attend in float32 (the checkpoint's ``float32_attention``, as the origin does)
    rather than in the weights' dtype; :meth:`MolmoVisionBackbone.set_float32_attention` sets it."""

    def __init__(self, arch: MolmoEArchitecture, input_dim: int) -> None:
        super().__init__()
        self.arch = arch
        self.float32 = arch.float32_attention
        inner = arch.vit_heads * arch.vit_head_dim
        kv = arch.vit_kv_heads * arch.vit_head_dim
        self.wq = nn.Linear(input_dim, inner)
        self.wk = nn.Linear(input_dim, kv)
        self.wv = nn.Linear(input_dim, kv)
        self.wo = nn.Linear(inner, arch.vit_width)

    def forward(self, inputs_q: torch.Tensor, inputs_kv: torch.Tensor | None = None) -> torch.Tensor:
        kv = inputs_q if inputs_kv is None else inputs_kv
        a = self.arch
        out = _attention(self.wq(inputs_q), self.wk(kv), self.wv(kv), a.vit_heads, a.vit_kv_heads, a.vit_head_dim,
                         self.float32)
        return self.wo(out)


class MolmoViTMLP(nn.Module):
    def __init__(self, arch: MolmoEArchitecture) -> None:
        super().__init__()
        self.w1 = nn.Linear(arch.vit_width, arch.vit_mlp_dim)
        self.w2 = nn.Linear(arch.vit_mlp_dim, arch.vit_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.w1(x)
        return self.w2(x * torch.sigmoid(1.702 * x))  # quick GELU


class MolmoViTBlock(nn.Module):
    def __init__(self, arch: MolmoEArchitecture) -> None:
        super().__init__()
        self.attention = MolmoAttention(arch, arch.vit_width)
        self.feed_forward = MolmoViTMLP(arch)
        self.attention_norm = nn.LayerNorm(arch.vit_width, eps=arch.vit_norm_eps)
        self.ffn_norm = nn.LayerNorm(arch.vit_width, eps=arch.vit_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class _ViTBlocks(nn.Module):
    def __init__(self, arch: MolmoEArchitecture) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList(MolmoViTBlock(arch) for _ in range(arch.vit_layers_total))


class MolmoViT(nn.Module):
    """Origin ``VisionTransformer``: linear patch embedding, CLS token, learned positions, pre-LN."""

    def __init__(self, arch: MolmoEArchitecture) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(arch.vit_width))
        self.positional_embedding = nn.Parameter(torch.zeros(arch.vit_num_pos, arch.vit_width))
        self.patch_embedding = nn.Linear(arch.patch_px * arch.patch_px * 3, arch.vit_width, bias=False)
        self.pre_ln = nn.LayerNorm(arch.vit_width, eps=arch.vit_norm_eps)
        self.transformer = _ViTBlocks(arch)

    def forward(self, patches: torch.Tensor) -> list[torch.Tensor]:
        """(n, patches, pixels) -> the hidden state after every block, each (n, 1 + patches, width)."""
        x = self.patch_embedding(patches)
        cls = self.class_embedding.view(1, 1, -1).expand(x.shape[0], -1, -1).to(x.dtype)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding[None].to(x.dtype)
        x = self.pre_ln(x)
        states = []
        for block in self.transformer.resblocks:
            x = block(x)
            states.append(x)
        return states


class MolmoImageProjector(nn.Module):
    """SwiGLU MLP from pooled features to the decoder width: w2(silu(w1 x) * w3 x)."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(in_dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, out_dim, bias=False)
        self.w3 = nn.Linear(in_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MolmoVisionBackbone(nn.Module):
    """Origin ``MolmoPretrainedVisionBackbone``: ViT -> padding embeddings -> 2x2 attention
    pooling (mean query) -> projector; a forward hook on it brackets the whole vision path.
    ``runner``: what runs :meth:`encode` (the fast path's CUDA graphs; None: called as is)."""

    runner: Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]] | None = None

    def __init__(self, arch: MolmoEArchitecture) -> None:
        super().__init__()
        self.arch = arch
        self.image_vit = MolmoViT(arch)
        self.image_pooling_2d = MolmoAttention(arch, arch.pooled_width)
        self.image_projector = MolmoImageProjector(arch.vit_width, arch.expert_hidden, arch.d_model)
        self.pad_embed = nn.Parameter(torch.zeros(2, arch.pooled_width)) if arch.pad_embed else None

    @property
    def float32_attention(self) -> bool:
        """Whether the ViT and the pooling attend in float32 (see :class:`MolmoAttention`)."""
        return self.image_pooling_2d.float32

    def set_float32_attention(self, float32: bool) -> None:
        """Attend in float32 (True) or in the weights' dtype (False) in every attention of the path."""
        for module in self.modules():
            if isinstance(module, MolmoAttention):
                module.float32 = bool(float32)

    def forward(self, images: torch.Tensor, image_masks: torch.Tensor | None,
                global_masks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, arrays, patches, pixels) + masks (batch, arrays, patches) -> the tokens
        (batch, arrays, tokens, d_model) and the global image's tokens (batch, tokens, d_model).

        The padding embeddings follow ``image_masks`` row by row, and the processor's rows are
        shifted by one (row 0 describes the first crop): array 0, the global image, gets the
        first crop's padding, which changes with the tiling. ``global_masks`` (batch, patches),
        the global image's own fractions, give its tokens as at max_crops 1 (where row 0 is its
        own): only the padding, pooling and projector run again for that one array, from the
        same ViT states. Pass them only where they differ from ``image_masks[:, 0]`` (the caller
        compares the processor's tensors on the host); without them the global tokens are array 0's."""
        run = self.encode if self.runner is None else self.runner
        tokens, global_feats = run(images, image_masks)
        if self.pad_embed is None or global_masks is None:
            return tokens, tokens[:, 0]
        return tokens, self.pool_and_project(global_feats[:, None], global_masks[:, None])[:, 0]

    def encode(self, images: torch.Tensor, image_masks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole vision path of (batch, arrays, patches, pixels) ``images``, fixed shapes and no
        host read (what a CUDA graph captures): the tokens (batch, arrays, tokens, d_model) and the
        global image's ViT features (batch, patches, width) for its own padding."""
        batch, arrays, num_patches, pixels = images.shape
        flat = images.reshape(batch * arrays, num_patches, pixels)
        # arrays that are all -1 are batch padding: their features are zeroed
        real = torch.all(flat != -1, dim=(1, 2), keepdim=True)
        feats = (self.vit_features(flat) * real).reshape(batch, arrays, num_patches, -1)
        return self.pool_and_project(feats, image_masks), feats[:, 0]

    def vit_features(self, patches: torch.Tensor) -> torch.Tensor:
        """(n, patches, pixels) -> the ViT's hidden states at ``vit_layers``, concatenated, without
        the CLS position: (n, patches, 2 * vit_width)."""
        states = self.image_vit(patches)
        return torch.cat([states[i] for i in self.arch.vit_layers], dim=-1)[:, 1:]

    def pool_and_project(self, feats: torch.Tensor, image_masks: torch.Tensor | None) -> torch.Tensor:
        """ViT features (batch, arrays, patches, width) -> tokens (batch, arrays, tokens, d_model):
        padding embeddings, 2x2 attention pooling, projector."""
        a = self.arch
        batch, arrays = feats.shape[:2]
        if self.pad_embed is not None:
            if image_masks is None:
                msg = "image_masks are required by a model with padding embeddings"
                raise ValueError(msg)
            all_pad = (image_masks == 0).to(feats.dtype)
            partial = ((image_masks < 1) & (image_masks != 0)).to(feats.dtype)
            feats = feats + self.pad_embed[0] * all_pad[..., None] + self.pad_embed[1] * partial[..., None]
        side = a.patches_per_side
        feats = feats.reshape(batch, arrays, side, side, -1)
        if side % a.pool_h == 1:  # pad so that 2x2 windows tile the grid
            feats = F.pad(feats, (0, 0, 0, 1, 0, 1))
        h, w = feats.shape[2] // a.pool_h, feats.shape[3] // a.pool_w
        windows = feats.reshape(batch, arrays, h, a.pool_h, w, a.pool_w, -1).permute(0, 1, 2, 4, 3, 5, 6)
        windows = windows.reshape(batch * arrays * h * w, a.pool_h * a.pool_w, -1)
        pooled = self.image_pooling_2d(windows.mean(-2, keepdim=True), windows)
        return self.image_projector(pooled.reshape(batch, arrays, h * w, -1))


# -- the decoder --------------------------------------------------------------------------------

class MolmoEExperts(nn.Module):
    """The experts of one MoE block in transformers' layout (``gate_up_proj`` (E, 2*I, d),
    ``down_proj`` (E, d, I)) computed as the origin does: gate and up as two matmuls, experts in
    ascending order, results added per token. transformers' one fused gate/up matmul rounds
    differently, and with 64 experts a 1e-6 difference flips a near-tied routing a few blocks later."""

    #: the fast path (``runtime.fast_decoder``) keeps gate and up apart where it must round as this module does
    split_gate_up = True

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        tokens = top_k_index.shape[0]
        # every (slot, token) pair grouped by expert, slot-major within an expert: the rows and the
        # row order the origin's per-expert torch.where gives, with one host sync per block (the
        # counts) instead of one per expert, so a GPU is not left idle between the experts
        flat = top_k_index.t().reshape(-1)  # position = slot * tokens + token
        order = torch.argsort(flat, stable=True)
        slots, rows = order // tokens, order % tokens
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        inter = self.intermediate
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            slot, token = slots[start:start + count], rows[start:start + count]
            start += count
            x = hidden_states[token]
            w = self.gate_up_proj[expert]
            h = F.silu(F.linear(x, w[:inter])) * F.linear(x, w[inter:])
            h = F.linear(h, self.down_proj[expert]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out


def olmoe_config(arch: MolmoEArchitecture, eos_token_id: int | None, pad_token_id: int | None):
    """transformers' ``OlmoeConfig`` equal to the MolmoE decoder (output head: base vocabulary)."""
    from transformers import OlmoeConfig  # deferred: transformers takes seconds to import

    return OlmoeConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.d_model, intermediate_size=arch.expert_hidden,
        num_hidden_layers=arch.n_layers, num_attention_heads=arch.n_heads, num_key_value_heads=arch.n_kv_heads,
        max_position_embeddings=arch.max_position_embeddings, rms_norm_eps=arch.layer_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
        num_experts=arch.num_experts, num_experts_per_tok=arch.top_k, norm_topk_prob=False,
        tie_word_embeddings=False, attention_bias=False, clip_qkv=None,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None,
        # kept as an attribute of the config: the fast path sizes its KV cache for it
        max_sequence_length=arch.max_sequence_length)


def build_decoder(arch: MolmoEArchitecture, eos_token_id: int | None, pad_token_id: int | None) -> OlmoeForCausalLM:
    """An ``OlmoeForCausalLM`` on the meta device (no memory, no init) with the wider input embedding."""
    from transformers import OlmoeForCausalLM  # deferred, as in olmoe_config()

    config = olmoe_config(arch, eos_token_id, pad_token_id)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        decoder = OlmoeForCausalLM(config)
        decoder.model.embed_tokens = nn.Embedding(arch.vocab_size + arch.additional_vocab_size, arch.d_model)
        for layer in decoder.model.layers:
            layer.mlp.experts = MolmoEExperts(arch.num_experts, arch.d_model, arch.expert_hidden)
    return decoder


def weight_targets(arch: MolmoEArchitecture) -> dict[str, Target]:
    """Every tensor of the vision backbone (``vision.<name>``) and the decoder (``decoder.<name>``,
    ``OlmoeForCausalLM`` names) and the origin checkpoint tensors that fill it: the experts of a
    block stacked into one ``gate_up_proj`` / ``down_proj`` each, the fused QKV kept as one tensor
    (``self_attn.qkv_proj.weight``, which :func:`split_fused_attention` turns into the q/k/v
    projections' views), the two embedding tables of ``wte`` concatenated."""
    t, d, kv = DECODER_PREFIX, arch.d_model, arch.n_kv_heads * arch.head_dim
    inter = arch.expert_hidden

    def whole(name: str, *shape: int) -> Target:
        return Target(shape, (Piece(name, shape),))

    vocab = arch.vocab_size + arch.additional_vocab_size
    embed = [Piece(f"{t}wte.embedding", (arch.vocab_size, d))]
    if arch.additional_vocab_size:
        embed.append(Piece(f"{t}wte.new_embedding", (arch.additional_vocab_size, d)))
    targets = {"decoder.model.embed_tokens.weight": Target((vocab, d), tuple(embed)),
               "decoder.model.norm.weight": whole(f"{t}ln_f.weight", d),
               "decoder.lm_head.weight": whole("lm_head.weight", arch.vocab_size, d)}
    for i in range(arch.n_layers):
        src, dst = f"{t}blocks.{i}.", f"decoder.model.layers.{i}."
        targets.update({
            f"{dst}{FUSED_QKV}": whole(f"{src}attn.att_proj.weight", d + 2 * kv, d),
            f"{dst}self_attn.o_proj.weight": whole(f"{src}attn.attn_out.weight", d, d),
            f"{dst}self_attn.q_norm.weight": whole(f"{src}attn.q_norm.weight", d),
            f"{dst}self_attn.k_norm.weight": whole(f"{src}attn.k_norm.weight", kv),
            f"{dst}input_layernorm.weight": whole(f"{src}attn.attn_norm.weight", d),
            f"{dst}post_attention_layernorm.weight": whole(f"{src}mlp.ff_norm.weight", d),
            f"{dst}mlp.gate.weight": whole(f"{src}mlp.gate.weight", arch.num_experts, d),
        })
        experts = range(arch.num_experts)
        # (experts, 2 * inter, d) flat is gate_0, up_0, gate_1, up_1, ...: each written in its place
        targets[f"{dst}mlp.experts.gate_up_proj"] = Target((arch.num_experts, 2 * inter, d), tuple(
            Piece(f"{src}mlp.experts.{e}.{proj}.weight", (inter, d)) for e in experts for proj in ("gate_proj",
                                                                                                    "up_proj")))
        targets[f"{dst}mlp.experts.down_proj"] = Target((arch.num_experts, d, inter), tuple(
            Piece(f"{src}mlp.experts.{e}.down_proj.weight", (d, inter)) for e in experts))
    with torch.device("meta"):  # shapes only: no memory, no init
        vision = MolmoVisionBackbone(arch).state_dict()
    for name, tensor in vision.items():
        targets[f"vision.{name}"] = whole(VISION_PREFIX + name, *tensor.shape)
    return targets


#: the target of a block's fused query, key and value projection (the checkpoint's ``att_proj``)
FUSED_QKV = "self_attn.qkv_proj.weight"


def split_fused_attention(state: dict[str, torch.Tensor], arch: MolmoEArchitecture) -> dict[int, torch.Tensor]:
    """Replace each block's fused QKV tensor in ``state`` (:func:`weight_targets`) by the q, k and v
    projections' weights as row views of it, so one copy serves the eager path's three products and
    the fast path's one; returns the fused tensors by block (the fast path reads them)."""
    d, kv = arch.d_model, arch.n_kv_heads * arch.head_dim
    fused = {}
    for i in range(arch.n_layers):
        dst = f"decoder.model.layers.{i}."
        weight = state.pop(f"{dst}{FUSED_QKV}")
        state[f"{dst}self_attn.q_proj.weight"] = weight[:d]
        state[f"{dst}self_attn.k_proj.weight"] = weight[d:d + kv]
        state[f"{dst}self_attn.v_proj.weight"] = weight[d + kv:]
        fused[i] = weight
    return fused


def assign_weights(module: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Put the loaded tensors into a meta-device ``module`` as its parameters (no copy), rebuild
    the buffers that are not weights (rotary frequencies) on their device, and refuse a module
    left with a meta tensor."""
    module.load_state_dict(state, strict=True, assign=True)
    device = next(iter(state.values())).device
    for sub in module.modules():
        if isinstance(getattr(sub, "inv_freq", None), torch.Tensor) and sub.inv_freq.is_meta:
            inv_freq = sub.compute_default_rope_parameters(sub.config)[0].to(device)
            sub.register_buffer("inv_freq", inv_freq, persistent=False)
            sub.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        msg = f"{path}: no weights for {left[:3]}"
        raise ModelLoadError(msg)
