"""The fast path of an ``OlmoeForCausalLM`` decoder: a static KV cache, fixed-shape decode steps
with no host synchronisation, the routed experts as grouped matmuls, and on a GPU every decode
step of a configuration captured once as a CUDA graph and replayed.

The eager path (transformers' ``OlmoeModel.forward`` with a ``DynamicCache``, the experts one
after the other; ``runtime.decoder_runtime``) stays the reference: it is what the native MolmoE
runtime is tested against the origin with. This module computes the same blocks from the same
weight tensors (no copy) in the same order, with two differences that hold everywhere:

* **the KV cache** is one buffer per runtime, ``(layers, kv_heads, capacity, head_dim)`` for
  keys and values, written in place at each position (``index_copy_`` with the position as a
  device tensor). A decode step attends over a fixed-length window of it (a power of two, the
  *bucket*, at least the positions so far) with a mask, so its shapes do not change from step to
  step. Without CUDA graphs the capacity doubles when a request needs more; with them it is the
  model's trained context from the start (a graph reads the buffer it was captured on).
* **the experts** of a prefill's tokens are one sort of the (slot, token) pairs by expert and
  two or three ``grouped_mm`` calls over all experts' stacked weights, the group offsets computed
  on the device (``searchsorted``): an expert no token chose is never read.

How a block is computed is a *formulation*, one of two, chosen by the device:

* :class:`CpuFormulation`, the eager path's rounding bit for bit in float32: each norm, product
  and rotation as the eager modules do them, float32 attention, and a decode step's K experts one
  after the other (their ids read on the host, which costs nothing on a CPU, where torch's
  ``grouped_mm`` would multiply every expert's group, empty or not).
* :class:`CudaFormulation`, fewer and larger kernels for a device whose step is made of launches,
  and no host read anywhere in a decode step (what a CUDA graph captures): torch's fused RMS norm,
  the checkpoint's fused q/k/v weight as one product, q and k rotated at once, attention in the
  storage dtype (SDPA's flash and memory-efficient kernels) unless ``float32_attention``, and a
  decode step's experts as grouped products summed without a scatter. Where a card's
  ``grouped_mm`` is not one kernel (:func:`grouped_mm_supported`), a decode step gathers its K
  experts' weights instead and a prefill runs the experts module's loop.

What the knobs do is unchanged: a configuration's blocks are the only ones computed (a skipped
block is not in the step at all), its top-K is the width of the routing (fewer experts read),
and crops lengthen the prompt.

The hooks that time a request and cancel it (``runtime.timing``, ``ModelRuntime.between_blocks``)
are registered on the decoder blocks, which this path never calls as modules. It calls their
hooks itself: around every block of a prefill, and around a whole decode step (every active
block's pre-hooks, in order, before the step; their post-hooks after it), so a timer sees each
active block once per pass, its first entry before the step and its last exit after, and a
cancellation check runs between steps, never inside a captured one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from runtime.cuda_graphs import Captured, GraphCache, GraphStats, restored

#: torch's grouped product (public from torch 2.9 on; the private op before), None where it is missing
grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
#: the smallest attention window of a decode step (positions); windows are powers of two from here
MIN_BUCKET = 64
#: captured decode steps kept at once; beyond, the least recently replayed is dropped (its pool memory
#: is shared with the others, so this bounds the graphs' own executable state, not the pool)
MAX_GRAPHS = 512
#: a captured prefill's prompt is padded to a multiple of this many tokens (its shapes are the graph's)
PREFILL_BUCKET = 64
#: captured prefill blocks kept at once: (block, its top-K, token bucket)
MAX_PREFILL_GRAPHS = 1024


def bucket_for(positions: int) -> int:
    """The attention window of a decode step that attends to ``positions`` positions: the smallest
    power of two >= ``positions``, at least :data:`MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << max(0, positions - 1).bit_length())


def prefill_bucket_for(tokens: int) -> int:
    """The padded length of a captured prefill of ``tokens`` tokens: the next multiple of
    :data:`PREFILL_BUCKET`."""
    return -(-int(tokens) // PREFILL_BUCKET) * PREFILL_BUCKET


def default_fast_path(device: torch.device | str) -> bool:
    """Whether the fast path is on when nothing asks: on a GPU, always; on a
    CPU too, where it measured faster than the eager path (docs/results.md)."""
    return torch.device(device).type in ("cuda", "cpu")


#: the compute capabilities (majors) whose bfloat16 grouped GEMM torch runs as one kernel (CUTLASS:
#: Hopper, Blackwell); elsewhere it may loop over the groups reading their offsets on the host, which a
#: CUDA graph cannot capture and which syncs a decode step twice per block
GROUPED_MM_CAPABILITIES = (9, 10)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fast path multiplies the experts with :data:`grouped_mm` for weights of ``dtype`` on
    ``device``: on a CPU for every dtype; on a GPU for bfloat16 on the capabilities of
    :data:`GROUPED_MM_CAPABILITIES`, where a tiny call also captures into a CUDA graph. Other GPUs (an
    A100, L4, L40S, RTX 4090) take the sync-free path without it: a decode step gathers its token's K
    experts' weights and multiplies them batched (a copy of those weights per block and step), a
    prefill runs the experts module's own loop."""
    if grouped_mm is None:
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(device)[0] not in GROUPED_MM_CAPABILITIES:
        return False
    try:  # a kernel can still be missing from a build, or sync: it must run and capture
        with torch.cuda.device(device):
            a = torch.zeros(2, 16, dtype=dtype, device=device)
            b = torch.zeros(2, 16, 16, dtype=dtype, device=device)
            offsets = torch.tensor([1, 2], dtype=torch.int32, device=device)
            grouped_mm(a, b.transpose(1, 2), offs=offsets)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                grouped_mm(a, b.transpose(1, 2), offs=offsets)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def call_pre_hooks(module: nn.Module) -> None:
    """Run the forward pre-hooks registered on ``module`` (with no arguments), as its call would."""
    for hook in list(module._forward_pre_hooks.values()):
        hook(module, ())


def call_post_hooks(module: nn.Module) -> None:
    """Run the forward hooks registered on ``module`` (no arguments, no output), as its call would."""
    for hook in list(module._forward_hooks.values()):
        hook(module, (), None)


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """``OlmoeRMSNorm`` of a float32 ``x``: the same operations in the same order (its rounding)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(decoder: nn.Module, positions: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (tokens, head_dim) at ``positions`` (int64, device), as ``OlmoeRotaryEmbedding``."""
    inv_freq = decoder.model.rotary_emb.inv_freq
    freqs = positions[:, None].float() * inv_freq[None].to(device=positions.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotated_qkv(layer: nn.Module, x: torch.Tensor, heads: int, kv_heads: int, dim: int, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's queries, keys and values of float32 (tokens, d) ``x`` as the eager modules make them
    (input norm, projections, q/k norms, rotation): (heads or kv_heads, tokens, dim)."""
    attn, tokens = layer.self_attn, x.shape[0]
    h = rms_norm(x, layer.input_layernorm)
    q = rms_norm(attn.q_proj(h), attn.q_norm).view(tokens, heads, dim).transpose(0, 1)
    k = rms_norm(attn.k_proj(h), attn.k_norm).view(tokens, kv_heads, dim).transpose(0, 1)
    v = attn.v_proj(h).view(tokens, kv_heads, dim).transpose(0, 1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


@dataclass
class FastPrefixCache:
    """K/V of the blocks before the insertion point (``PrefixState.cache`` on the fast path):
    (blocks, kv_heads, prompt length, head_dim) each, the prompt's positions only."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class FastSession:
    """One request's decoding on the fast path (``DecodeState.cache``): its blocks and top-K, the
    next position to write and the decoder whose cache holds it (only its latest session is live)."""

    blocks: tuple[int, ...]
    top_k: tuple[int, ...]
    position: int
    owner: int
    decoder: FastDecoder


class Formulation:
    """How the fast path computes a block and the head (see the module docstring): the operations,
    their rounding and their kernels. It reads the weights and the KV cache of its ``fast`` decoder."""

    #: a decode step reads no device value on the host (what a CUDA graph can capture)
    sync_free: ClassVar[bool]

    def __init__(self, fast: FastDecoder) -> None:
        self.fast = fast

    @property
    def prefill_sync_free(self) -> bool:
        """A prefill's block reads no device value on the host either (a graph can capture it)."""
        return False

    @property
    def attention_dtype(self) -> torch.dtype:
        """The dtype of the KV cache and of the attention's products."""
        raise NotImplementedError

    def block(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """Block ``index`` on float32 (tokens, d) ``x``: a prefill from position 0 (``mask`` None) or
        one decode token at the decoder's position over the window ``mask`` spans."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits (vocab,) of a (1, d) hidden state after the last block (final norm, head)."""
        raise NotImplementedError

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables :meth:`block` reads, from ``OlmoeRotaryEmbedding``'s cos and sin (made
        once per pass, not per block)."""
        return cos, sin

    def copies_bytes(self) -> int:
        """Bytes of weight copies this formulation made (0 where it reads the loaded tensors)."""
        return 0

    def release(self) -> None:
        """Drop the weight copies (made again at first use)."""

    # -- shared by both
    def _round(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to the weights' dtype, as a product in that dtype rounds its input."""
        dtype = self.fast.weight_dtype
        return x if dtype == torch.float32 else x.to(dtype)

    def _router(self, layer: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's logits, its top-K weights (in the logits' dtype) and their expert ids."""
        gate = layer.mlp.gate
        logits = F.linear(h, gate.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        weights, index = torch.topk(probs, int(gate.top_k), dim=-1)
        return logits, weights.to(logits.dtype), index

    def _grouped_experts(self, experts: nn.Module, h: torch.Tensor, index: torch.Tensor,
                         weights: torch.Tensor, split: bool) -> torch.Tensor:
        """Every token's chosen experts as grouped products, rows in the eager path's order; ``split``
        keeps gate and up as two products (the eager module's rounding)."""
        tokens = h.shape[0]
        flat = index.t().reshape(-1)  # position = slot * tokens + token: the eager path's row order
        order = torch.argsort(flat, stable=True)
        rows, slots = order % tokens, order // tokens
        offsets = torch.searchsorted(flat.index_select(0, order), self.fast.expert_ids, right=True, out_int32=True)
        inputs = self._round(h.index_select(0, rows))
        w = experts.gate_up_proj
        inter = w.shape[1] // 2
        if split:
            gate = grouped_mm(inputs, w[:, :inter].transpose(1, 2), offs=offsets).float()
            up = grouped_mm(inputs, w[:, inter:].transpose(1, 2), offs=offsets).float()
        else:
            gate_up = grouped_mm(inputs, w.transpose(1, 2), offs=offsets).float()
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
        act = self._round(F.silu(gate) * up)
        out = grouped_mm(act, experts.down_proj.transpose(1, 2), offs=offsets).float()
        out = out * weights[rows, slots, None]
        return torch.zeros_like(h).index_add_(0, rows, out.to(h.dtype))


class CpuFormulation(Formulation):
    """The eager path's operations and rounding (bit for bit in float32), float32 attention (a CPU's
    half-precision kernels are slower, and the precision rule computes in float32 there anyway), a
    decode step's experts looped over on the host."""

    sync_free = False

    @property
    def attention_dtype(self) -> torch.dtype:
        return torch.float32

    def block(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        fast, layer = self.fast, self.fast.layers[index]
        attn = layer.self_attn
        tokens, heads, dim = x.shape[0], fast.num_heads, fast.head_dim
        q, k, v = rotated_qkv(layer, x, heads, fast.kv_heads, dim, cos, sin)
        adt = self.attention_dtype
        out = fast.attend(index, q.to(adt), k.to(adt), v.to(adt), mask)
        x = x + attn.o_proj(out.transpose(0, 1).reshape(tokens, heads * dim).to(x.dtype))
        return x + self._moe(layer, x)

    def _moe(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, layer.post_attention_layernorm)
        _, weights, index = self._router(layer, h)
        experts = layer.mlp.experts
        if index.shape[0] == 1:
            return self._looped_experts(experts, h, index, weights)
        # a half-precision prefill of more than a few rows: the module converts each expert's weights
        # once for a float32 product, which beats grouped_mm's per-row conversion
        if grouped_mm is not None and (self.fast.weight_dtype == torch.float32 or index.numel() <= 8):
            return self._grouped_experts(experts, h, index, weights, getattr(experts, "split_gate_up", False))
        return experts(h, index, weights)

    def _looped_experts(self, experts: nn.Module, h: torch.Tensor, index: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
        """One token's K experts one after the other in ascending order (the eager path's products
        and sum), their ids read on the host."""
        chosen, order = torch.sort(index[0])
        slot_weights = weights[0].index_select(0, order)
        w, down = experts.gate_up_proj, experts.down_proj
        inter = w.shape[1] // 2
        split = getattr(experts, "split_gate_up", False)
        x = self._round(h)
        out = torch.zeros_like(h)
        for j, expert in enumerate(chosen.tolist()):
            if split:
                gate, up = F.linear(x, w[expert, :inter]).float(), F.linear(x, w[expert, inter:]).float()
            else:
                gate_up = F.linear(x, w[expert]).float()
                gate, up = gate_up[:, :inter], gate_up[:, inter:]
            act = self._round(F.silu(gate) * up)
            out += (F.linear(act, down[expert]).float() * slot_weights[j]).to(h.dtype)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fast.decoder.lm_head(rms_norm(hidden, self.fast.decoder.model.norm)).float()[0]


class CudaFormulation(Formulation):
    """Fewer, larger kernels and no host read in a decode step (see the module docstring).
    ``grouped``: the experts as grouped products (None: where :func:`grouped_mm_supported` says
    the card runs them as one kernel); else a decode step gathers its K experts' weights (a copy of
    them per block and step) and a prefill runs the experts module's own loop. ``float32_attention``:
    attend in float32, as the origin does, instead of the storage dtype."""

    sync_free = True

    def __init__(self, fast: FastDecoder, *, grouped: bool | None = None, float32_attention: bool = False) -> None:
        super().__init__(fast)
        self.grouped = grouped_mm_supported(fast.device, fast.weight_dtype) if grouped is None else bool(grouped)
        self.float32_attention = bool(float32_attention)
        self._qkv: dict[int, torch.Tensor] = {}
        self._float_weights: dict[int, torch.Tensor] = {}

    @property
    def attention_dtype(self) -> torch.dtype:
        return torch.float32 if self.float32_attention else self.fast.weight_dtype

    @property
    def prefill_sync_free(self) -> bool:
        return self.grouped  # the experts module's own loop reads the expert counts on the host

    def block(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        layer = self.fast.layers[index]
        x = self._attention(index, layer, x, cos, sin, mask)
        h = self._norm(x, layer.post_attention_layernorm)
        experts = layer.mlp.experts
        if x.shape[0] == 1:
            return x + (self._decode_experts(layer, h) if self.grouped else self._gathered_experts(layer, h))
        _, weights, index_ = self._router(layer, h)
        if self.grouped:
            return x + self._grouped_experts(experts, h, index_, weights, split=False)
        return x + experts(h, index_, weights)

    def _attention(self, index: int, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
        fast, attn = self.fast, layer.self_attn
        tokens, heads, kv_heads, dim = x.shape[0], fast.num_heads, fast.kv_heads, fast.head_dim
        qkv = F.linear(self._norm(x, layer.input_layernorm), self._qkv_weight(index, attn))
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        q = self._norm(qkv[:, :q_end], attn.q_norm).view(tokens, heads, dim)
        k = self._norm(qkv[:, q_end:k_end], attn.k_norm).view(tokens, kv_heads, dim)
        qk = torch.cat((q, k), dim=1).transpose(0, 1)  # (heads + kv_heads, tokens, dim): one rotation
        adt = self.attention_dtype
        # rotate_half(qk) * sin is the halves swapped times the signed sin of :meth:`rotary`, exactly
        qk = (qk * cos + torch.roll(qk, dim // 2, dims=-1) * sin).to(adt)
        q, k = qk[:heads], qk[heads:]
        v = qkv[:, k_end:].view(tokens, kv_heads, dim).transpose(0, 1).to(adt)
        out = fast.attend(index, q, k, v, mask)
        # in the attention's dtype straight into the projection, which rounds its input to it anyway
        out = out.transpose(0, 1).reshape(tokens, heads * dim)
        return x + attn.o_proj(out).to(x.dtype)

    def _decode_experts(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """One token's K chosen experts: sorted, their rows one copy of the token, two grouped
        products, their outputs summed (no scatter)."""
        h = self._round(h)
        gate = layer.mlp.gate
        probs = F.softmax(F.linear(h, gate.weight), dim=-1, dtype=torch.float)
        weights, index = torch.topk(probs, int(gate.top_k), dim=-1)
        chosen, order = torch.sort(index[0])
        offsets = torch.searchsorted(chosen, self.fast.expert_ids, right=True, out_int32=True)
        experts = layer.mlp.experts
        w = experts.gate_up_proj
        inter = w.shape[1] // 2
        rows = h.expand(chosen.shape[0], -1).contiguous()
        gate_up = grouped_mm(rows, w.transpose(1, 2), offs=offsets).float()
        act = self._round(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        out = grouped_mm(act, experts.down_proj.transpose(1, 2), offs=offsets).float()
        return (out * weights[0].index_select(0, order)[:, None]).sum(0, keepdim=True)

    def _gathered_experts(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """One token's K experts from their gathered weights (where grouped_mm is not one kernel),
        summed in ascending expert order as the eager path does."""
        _, weights, index = self._router(layer, h)
        experts = layer.mlp.experts
        chosen, order = torch.sort(index[0])
        w = experts.gate_up_proj.index_select(0, chosen)  # (K, 2I, d)
        inter = w.shape[1] // 2
        gate_up = torch.matmul(w, self._round(h)[0]).float()  # gate and up as one product
        act = self._round(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        out = torch.matmul(experts.down_proj.index_select(0, chosen), act[:, :, None])[..., 0].float()
        out = out * weights[0].index_select(0, order)[:, None]
        return out.to(h.dtype).sum(0, keepdim=True)

    def _norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """An RMS norm in one kernel (its scale kept in float32 beside a half-precision weight)."""
        weight = norm.weight
        if weight.dtype != torch.float32:
            weight = self._float_weights.get(id(norm.weight))
            if weight is None:
                with torch.inference_mode(False):
                    weight = self._float_weights[id(norm.weight)] = norm.weight.detach().float()
        return F.rms_norm(x, (x.shape[-1],), weight, norm.variance_epsilon)

    def _qkv_weight(self, index: int, attn: nn.Module) -> torch.Tensor:
        """The block's q, k and v weights as one (rows, d) tensor: the loader's fused tensor where the
        three are its views (MolmoE: its checkpoint stores them fused), else a copy made once."""
        fused = getattr(attn, "fused_qkv_weight", None)
        if (fused is not None and fused.dtype == attn.q_proj.weight.dtype
                and fused.data_ptr() == attn.q_proj.weight.data_ptr()
                and attn.v_proj.weight.data_ptr() + attn.v_proj.weight.numel() * fused.element_size()
                == fused.data_ptr() + fused.numel() * fused.element_size()):
            return fused
        weight = self._qkv.get(index)
        if weight is None:
            with torch.inference_mode(False):
                weight = self._qkv[index] = torch.cat(
                    [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
        return weight

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, and sin with its first half negated: a block then rotates with one roll of q and k
        instead of a negation and a concatenation (the same values: negating is exact)."""
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fast.decoder.lm_head(self._norm(hidden, self.fast.decoder.model.norm)).float()[0]

    def copies_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self._qkv.values())

    def release(self) -> None:
        self._qkv.clear()
        self._float_weights.clear()


def fast_attention_dtype(device: torch.device | str, weight_dtype: torch.dtype,
                         float32_attention: bool = False) -> torch.dtype:
    """The dtype :func:`formulation_for`'s formulation attends in on ``device``, known before any
    model is built: the weights' on a GPU unless ``float32_attention``, float32 on a CPU."""
    if torch.device(device).type == "cuda" and not float32_attention:
        return weight_dtype
    return torch.float32


def formulation_for(fast: FastDecoder, float32_attention: bool = False) -> Formulation:
    """The device's formulation: :class:`CudaFormulation` on a GPU, :class:`CpuFormulation` elsewhere."""
    if fast.device.type == "cuda":
        return CudaFormulation(fast, float32_attention=float32_attention)
    return CpuFormulation(fast)


class FastDecoder:
    """Fixed-shape execution of ``decoder`` (an ``OlmoeForCausalLM``); see the module docstring.

    ``layers``: all decoder blocks in order (the runtime's own list: the fast path reads their
    weights and calls their hooks). ``formulation``: how blocks are computed (None: the device's,
    :func:`formulation_for`). ``graphs``: capture decode steps as CUDA graphs (on a GPU, with a
    sync-free formulation). The caller holds the precision context (``runtime.precision``) around
    every call, as for the eager path.
    """

    def __init__(self, decoder: nn.Module, layers: Sequence[nn.Module], device: torch.device, *,
                 float32_attention: bool = False, graphs: bool = True,
                 formulation: Callable[[FastDecoder], Formulation] | None = None) -> None:
        cfg = decoder.config
        self.decoder, self.layers, self.device = decoder, list(layers), torch.device(device)
        self.num_heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.num_experts = int(cfg.num_experts)
        #: the positions a captured decode step's cache spans at first: the trained context where the
        #: config names it (MolmoE-1B: 4,096 of the rope table's 32,768); a longer request grows it
        self.context_length = int(getattr(cfg, "max_sequence_length", None) or cfg.max_position_embeddings)
        self.scaling = self.head_dim ** -0.5
        self.weight_dtype = layers[0].mlp.experts.gate_up_proj.dtype
        self.float32_attention = bool(float32_attention)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._owner = 0
        # the inputs of a decode step, at fixed addresses (what a captured graph reads)
        with torch.inference_mode(False):
            self._token = torch.zeros(1, dtype=torch.long, device=self.device)
            self._position = torch.zeros(1, dtype=torch.long, device=self.device)
            self.expert_ids = torch.arange(self.num_experts, device=self.device)
        self.formulation: Formulation = (formulation(self) if formulation is not None
                                         else formulation_for(self, self.float32_attention))
        #: the captured decode steps by (blocks, top-K, window); None without CUDA graphs
        self.graphs: GraphCache | None = None
        #: the captured prefill blocks by (block, top-K, token bucket); None without them
        self.prefill_graphs: GraphCache | None = None
        # a prefill's static inputs per token bucket: the hidden states and the rotary table
        self._prefill_inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if graphs and self.device.type == "cuda" and self.formulation.sync_free:
            self.graphs = GraphCache.for_device(self.device, max_graphs=MAX_GRAPHS, label="decode step")
            if self.formulation.prefill_sync_free:
                self.prefill_graphs = GraphCache.for_device(self.device, max_graphs=MAX_PREFILL_GRAPHS,
                                                            label="prefill block")

    @property
    def attention_dtype(self) -> torch.dtype:
        return self.formulation.attention_dtype

    @property
    def use_graphs(self) -> bool:
        """Decode steps run as captured graphs (False without them, or after a capture failed)."""
        return self.graphs is not None and self.graphs.enabled

    @property
    def graph_error(self) -> str | None:
        """Why graphs were turned off (a capture that failed), None while they work."""
        return None if self.graphs is None else self.graphs.error

    @property
    def stats(self) -> GraphStats:
        return GraphStats() if self.graphs is None else self.graphs.stats

    def use(self, formulation: Formulation, graphs: GraphCache | None = None,
            prefill_graphs: GraphCache | None = None) -> None:
        """Compute with ``formulation`` (and capture decode steps into ``graphs``, prefill blocks into
        ``prefill_graphs``) from now on; the cache, the graphs and the copies of the previous
        formulation are dropped."""
        self.release()
        self.formulation, self.graphs, self.prefill_graphs = formulation, graphs, prefill_graphs

    def _caches(self) -> list[GraphCache]:
        return [cache for cache in (self.graphs, self.prefill_graphs) if cache is not None]

    @property
    def graph_captures(self) -> int:
        """Captures run by this decoder's graph caches (decode steps and prefill blocks)."""
        return sum(cache.stats.captures for cache in self._caches())

    # -- the cache
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def ensure_capacity(self, positions: int) -> None:
        """Grow the cache to hold ``positions`` positions (the next power of two, at least the trained
        context with graphs), keeping what it holds; captured graphs read the old buffer and are dropped."""
        if positions <= self.capacity:
            return
        capacity = bucket_for(positions)
        if self.graphs is not None:  # the whole context at once: a graph reads the buffer it was captured on
            capacity = max(capacity, bucket_for(self.context_length))
        shape = (len(self.layers), self.kv_heads, capacity, self.head_dim)
        dtype = self.attention_dtype
        with torch.inference_mode(False):  # written in place under no_grad too, never an inference tensor
            keys = torch.zeros(shape, dtype=dtype, device=self.device)
            values = torch.zeros(shape, dtype=dtype, device=self.device)
        if self.keys is not None:
            keys[:, :, :self.capacity] = self.keys
            values[:, :, :self.capacity] = self.values
        self.keys, self.values = keys, values
        for cache in self._caches():
            cache.clear()

    def release(self) -> None:
        """Drop the KV cache, the captured graphs and the formulation's weight copies (their memory
        goes back to the allocator); the next request allocates and captures again."""
        self.keys = self.values = None
        for cache in self._caches():
            cache.clear()
        self._prefill_inputs.clear()
        self.formulation.release()
        self._owner += 1

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by the cache, (on a GPU) reserved by the graphs' shared pool, and held by the
        formulation's weight copies."""
        cache = 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()
        pool = sum(cache.pool_bytes() for cache in self._caches())
        return {"kv_cache": cache, "graph_pool": pool, "fused_weights": self.formulation.copies_bytes()}

    # -- what both formulations share
    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (tokens, head_dim) at ``positions`` (int64, device), as ``OlmoeRotaryEmbedding``."""
        return rope_tables(self.decoder, positions, dtype)

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Write block ``index``'s K/V (kv_heads, tokens, dim) into the cache and attend with q
        (heads, tokens, dim), all in the attention dtype: a prefill's K/V at 0..tokens-1, causal
        over themselves (``mask`` None), or one decode token's at the step's position over the
        window ``mask`` (1, 1, 1, window) spans: 0 where a position is filled, -inf after.
        Returns (heads, tokens, dim)."""
        tokens = q.shape[1]
        if mask is None:
            self.keys[index, :, :tokens] = k
            self.values[index, :, :tokens] = v
            keys, values, causal = k, v, tokens > 1
        else:
            window = mask.shape[-1]
            self.keys[index].index_copy_(1, self._position, k)
            self.values[index].index_copy_(1, self._position, v)
            keys, values = self.keys[index, :, :window], self.values[index, :, :window]
            causal = False
        if self.kv_heads != self.num_heads:
            keys = keys.repeat_interleave(self.num_heads // self.kv_heads, dim=0)
            values = values.repeat_interleave(self.num_heads // self.kv_heads, dim=0)
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, is_causal=causal,
                                              scale=self.scaling)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits (vocab,) of a (1, d) hidden state after the last block (final norm, head)."""
        return self.formulation.logits(hidden)

    # -- prefill
    def prefill(self, hidden: torch.Tensor, blocks: Sequence[int], *, reserve: int = 0) -> torch.Tensor:
        """Run ``blocks`` over the (tokens, d) float32 ``hidden`` at positions 0..tokens-1, writing
        their K/V into the cache (sized for ``tokens + reserve`` positions); returns the hidden
        states after the last of them (no final norm). Every block's hooks run around it."""
        tokens = hidden.shape[0]
        if self.prefill_graphs is not None and self.prefill_graphs.enabled and tokens > 1:
            return self._captured_prefill(hidden, blocks, reserve)
        self.ensure_capacity(tokens + reserve)
        self._owner += 1  # the cache now holds this request: earlier sessions are over
        cos, sin = self.formulation.rotary(*self.rope(torch.arange(tokens, device=self.device), hidden.dtype))
        x = hidden
        for i in blocks:
            layer = self.layers[i]
            call_pre_hooks(layer)
            x = self.formulation.block(i, x, cos, sin, None)
            call_post_hooks(layer)
        return x

    def _captured_prefill(self, hidden: torch.Tensor, blocks: Sequence[int], reserve: int) -> torch.Tensor:
        """:meth:`prefill` as one captured graph per block, the prompt padded to its token bucket.
        The padding rows come after every prompt token, so causal attention keeps them out of the
        prompt's rows; their K/V land at positions a decode step writes before it reads them."""
        tokens = hidden.shape[0]
        bucket = prefill_bucket_for(tokens)
        self.ensure_capacity(max(tokens + reserve, bucket))
        self._owner += 1
        static = self._prefill_inputs.get(bucket)
        if static is None or static[0].dtype != hidden.dtype:
            with torch.inference_mode(False):
                x = torch.zeros(bucket, hidden.shape[1], dtype=hidden.dtype, device=self.device)
                cos, sin = self.formulation.rotary(*self.rope(torch.arange(bucket, device=self.device), hidden.dtype))
            static = self._prefill_inputs[bucket] = (x, cos, sin)
        x, cos, sin = static
        x[:tokens] = hidden
        x[tokens:] = 0

        def body(i: int) -> tuple[torch.Tensor]:
            # the block's result written back into its input: a graph keeps no output of its own (at
            # 1,024 graphs of a few MiB each that would be gigabytes), its temporaries are the pool's
            x.copy_(self.formulation.block(i, x, cos, sin, None))
            return (x,)

        for i in blocks:
            layer = self.layers[i]
            call_pre_hooks(layer)
            key = (int(i), int(layer.mlp.gate.top_k), bucket)
            # a capture's warm-up runs the block on x in place: x is the request's again after it
            captured = self.prefill_graphs.get(key, lambda i=i: body(i), around=lambda: restored(x))
            if captured is None:  # the capture failed: this block and the rest uncaptured, on the same rows
                body(i)
            else:
                captured.replay()
            call_post_hooks(layer)
        return x[:tokens].clone()

    def capture_prefill(self, blocks: Sequence[int], tokens: int) -> int:
        """Capture the prefill blocks ``blocks`` (at the routers' current top-K) for prompts of
        ``tokens`` tokens' bucket ahead of their first use (a server's warm-up). Returns how many
        graphs were captured (0 without prefill graphs, or where they are held). It writes K/V,
        so it runs between requests only."""
        if self.prefill_graphs is None or not self.prefill_graphs.enabled:
            return 0
        bucket = prefill_bucket_for(tokens)
        missing = [i for i in blocks
                   if (int(i), int(self.layers[i].mlp.gate.top_k), bucket) not in self.prefill_graphs]
        if not missing:
            return 0
        before = self.prefill_graphs.stats.captures
        hidden = torch.zeros(int(tokens), int(self.decoder.config.hidden_size), device=self.device)  # float32
        self._captured_prefill(hidden, missing, 0)
        return self.prefill_graphs.stats.captures - before

    def keep_prefix(self, blocks: int, tokens: int) -> FastPrefixCache:
        """A copy of the K/V of blocks 0..``blocks``-1 at positions 0..tokens-1 (the prefix's, which
        a later request may overwrite in the cache)."""
        self.ensure_capacity(tokens)
        return FastPrefixCache(self.keys[:blocks, :, :tokens].clone(), self.values[:blocks, :, :tokens].clone())

    def restore_prefix(self, prefix: FastPrefixCache, reserve: int = 0) -> None:
        """Put a kept prefix's K/V back at blocks 0..p-1, positions 0..tokens-1."""
        blocks, _, tokens, _ = prefix.keys.shape
        self.ensure_capacity(tokens + reserve)
        self._owner += 1
        self.keys[:blocks, :, :tokens] = prefix.keys
        self.values[:blocks, :, :tokens] = prefix.values

    # -- decode
    def session(self, blocks: Sequence[int], position: int) -> FastSession:
        """The decoding of the request whose prefill just ran: the next token goes at ``position``."""
        top_k = tuple(int(self.layers[i].mlp.gate.top_k) for i in blocks)
        return FastSession(tuple(int(b) for b in blocks), top_k, int(position), self._owner, self)

    def step(self, session: FastSession, token: int) -> torch.Tensor:
        """One decode step: ``token`` at the session's position through its blocks; returns the
        float32 logits (vocab,) (with graphs the graph's output buffer, overwritten by the next step)."""
        if session.owner != self._owner:
            msg = "this decoding state is no longer valid: another request has run on the model since"
            raise RuntimeError(msg)
        top_k = tuple(int(self.layers[i].mlp.gate.top_k) for i in session.blocks)
        if top_k != session.top_k:
            msg = f"the top-K changed during decoding ({session.top_k} -> {top_k})"
            raise RuntimeError(msg)
        self.ensure_capacity(session.position + 1)
        window = bucket_for(session.position + 1)
        layers = [self.layers[i] for i in session.blocks]
        for layer in layers:  # a check that raises stops the request before the step, not inside it
            call_pre_hooks(layer)
        self._token.fill_(int(token))
        self._position.fill_(session.position)
        captured = self._graph(session.blocks, session.top_k, window) if self.use_graphs else None
        if captured is None:  # no graphs, or the capture failed: the same step, launched kernel by kernel
            logits = self._step(session.blocks, window)
        else:
            captured.replay()
            logits = captured.outputs[0]
        for layer in layers:
            call_post_hooks(layer)
        session.position += 1
        return logits

    def greedy_step(self, session: FastSession, token: int) -> int:
        """:meth:`step`, then the greedy next token, chosen on the device and read once."""
        self.step(session, token)
        return int(self._token[0])

    def _step(self, blocks: Sequence[int], window: int) -> torch.Tensor:
        """The decode step itself: fixed shapes, no host synchronisation with a sync-free
        formulation (what a graph captures)."""
        x = self.decoder.model.embed_tokens(self._token)
        cos, sin = self.formulation.rotary(*self.rope(self._position, x.dtype))
        filled = torch.arange(window, device=self.device) <= self._position
        mask = torch.zeros(window, dtype=self.attention_dtype, device=self.device).masked_fill(
            ~filled, float("-inf"))[None, None, None]
        for i in blocks:
            x = self.formulation.block(i, x, cos, sin, mask)
        logits = self.formulation.logits(x)
        self._token.copy_(logits.argmax().reshape(1))
        return logits

    def _graph(self, blocks: tuple[int, ...], top_k: tuple[int, ...], window: int) -> Captured | None:
        """The captured step of ``blocks`` at ``top_k`` over ``window`` positions (captured now if
        it is not yet); None when the capture failed (graphs are then off for this decoder)."""
        return self.graphs.get((blocks, top_k, window), lambda: (self._step(blocks, window),),
                               around=lambda: self._capturing(window))

    @contextmanager
    def _capturing(self, window: int) -> Iterator[None]:
        """A capture's warm-up and capture write K/V at the window's last position, which a request
        writes before it ever reads it; the step's inputs (token, position) are the request's again
        afterwards, whether the capture worked or not (the uncaptured step after a failure reads them)."""
        with restored(self._token, self._position):
            self._position.fill_(window - 1)
            yield

    def capture(self, blocks: Sequence[int], positions: int) -> bool:
        """Capture the decode step of ``blocks`` (with the routers' current top-K) for the window of
        ``positions`` positions ahead of its first use (a server's warm-up). Returns whether a new
        graph was captured (False without graphs, when it is held already, or when it failed)."""
        if not self.use_graphs:
            return False
        self.ensure_capacity(positions)
        blocks = tuple(int(b) for b in blocks)
        key = (blocks, tuple(int(self.layers[i].mlp.gate.top_k) for i in blocks), bucket_for(positions))
        if key in self.graphs:
            return False
        return self._graph(*key) is not None


class GraphedFunction:
    """``fn`` of tensors, captured per input shapes and dtypes into ``graphs`` and replayed (the
    vision tower's whole path on the fast path): the same kernels on the same inputs, so the same
    outputs bit for bit, without the per-operation launches. The inputs are copied into the graph's
    own buffers and the outputs (a tensor, or a tuple of two or more) cloned out of them. A capture
    that fails turns the graphs off with a warning, and ``fn`` runs as it is; so it does with
    gradients enabled or with an input that is not a tensor."""

    def __init__(self, fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], graphs: GraphCache) -> None:
        self.fn, self.cache = fn, graphs
        self._inputs: dict[tuple, tuple[torch.Tensor, ...]] = {}

    @property
    def graphs(self) -> int:
        return len(self.cache)

    @property
    def error(self) -> str | None:
        return self.cache.error

    def __call__(self, *inputs: torch.Tensor):
        if (not self.cache.enabled or torch.is_grad_enabled()
                or not all(isinstance(x, torch.Tensor) for x in inputs)):
            return self.fn(*inputs)
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        static = self._inputs.get(key)
        if static is None or key not in self.cache:
            with torch.inference_mode(False):
                static = self._inputs[key] = tuple(x.detach().clone() for x in inputs)

        def body() -> tuple[torch.Tensor, ...]:
            out = self.fn(*static)
            return out if isinstance(out, tuple) else (out,)

        captured = self.cache.get(key, body)
        if captured is None:
            self._inputs.pop(key, None)
            return self.fn(*inputs)
        for dropped in [k for k in self._inputs if k not in self.cache]:  # evicted graphs' inputs
            del self._inputs[dropped]
        for buffer, x in zip(static, inputs, strict=True):
            buffer.copy_(x)
        captured.replay()
        outputs = tuple(t.clone() for t in captured.outputs)
        return outputs if len(outputs) > 1 else outputs[0]
