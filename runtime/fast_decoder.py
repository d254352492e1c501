"""The fast path of an ``OlmoeForCausalLM`` decoder: a static KV cache, fixed-shape decode steps
with no host synchronisation, the routed experts as grouped matmuls, and on a GPU every decode
step of a configuration captured once as a CUDA graph and replayed.

The eager path (transformers' ``OlmoeModel.forward`` with a ``DynamicCache``, the experts one
after the other; ``runtime.decoder_runtime``) stays the reference: it is what the native MolmoE
runtime is tested against the origin with. This module computes the same blocks from the same
weight tensors (no copy) in the same order and rounding, with three differences:

* **the KV cache** is one buffer per runtime, ``(layers, kv_heads, capacity, head_dim)`` for
  keys and values, written in place at each position (``index_copy_`` with the position as a
  device tensor). A decode step attends over a fixed-length window of it (a power of two, the
  *bucket*, at least the positions so far) with a mask, so its shapes do not change from step to
  step. On a CPU the capacity doubles when a request needs more; with CUDA graphs it is the
  model's context length from the start (a graph reads the buffer it was captured on).
* **the experts** of every token are one sort of the (slot, token) pairs by expert and two or
  three ``grouped_mm`` calls over all experts' stacked weights, the group offsets computed on the
  device (``searchsorted``): nothing reads the expert counts on the host, and an expert no token
  chose is never read. The rows and their order are the eager path's, so on a CPU in float32 the
  result is the same bit for bit. Where ``grouped_mm`` does not run (a GPU before SM80, or
  weights that are not bfloat16 on a GPU) a decode step gathers its K experts' weights instead
  and a prefill uses the block's own experts module.
* **attention** runs in the storage dtype (bfloat16 on a GPU: SDPA's flash and memory-efficient
  kernels) unless ``float32_attention``, the origin's rule, is asked for; in float32 storage the
  two are the same.

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

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: torch's grouped product (public from torch 2.9 on; the private op before), None where it is missing
grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
#: the smallest attention window of a decode step (positions); windows are powers of two from here
MIN_BUCKET = 64
#: captured decode steps kept at once; beyond, the least recently replayed is dropped (its pool memory
#: is shared with the others, so this bounds the graphs' own executable state, not the pool)
MAX_GRAPHS = 512


def bucket_for(positions: int) -> int:
    """The attention window of a decode step that attends to ``positions`` positions: the smallest
    power of two >= ``positions``, at least :data:`MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << max(0, positions - 1).bit_length())


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


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """``OlmoeRMSNorm`` of a float32 ``x``: the same operations in the same order (its rounding)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    logits: torch.Tensor


@dataclass
class GraphStats:
    """The captured decode steps: how many are held, how many captures ran and how long they took."""

    graphs: int = 0
    captures: int = 0
    capture_s: float = 0.0


class FastDecoder:
    """Fixed-shape execution of ``decoder`` (an ``OlmoeForCausalLM``); see the module docstring.

    ``layers``: all decoder blocks in order (the runtime's own list: the fast path reads their
    weights and calls their hooks). ``graphs``: capture decode steps as CUDA graphs (a GPU only).
    The caller holds the precision context (``runtime.precision``) around every call, as for
    the eager path.
    """

    def __init__(self, decoder: nn.Module, layers: Sequence[nn.Module], device: torch.device, *,
                 float32_attention: bool = False, graphs: bool = True) -> None:
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
        weight = layers[0].mlp.experts.gate_up_proj
        self.weight_dtype = weight.dtype
        # a CPU keeps float32 attention: its half-precision kernels are slower, and the precision rule
        # computes its products in float32 there anyway
        half_attention = not float32_attention and self.device.type != "cpu"
        self.attention_dtype = weight.dtype if half_attention else torch.float32
        self.float32_attention = bool(float32_attention)
        self.grouped = grouped_mm_supported(self.device, weight.dtype)
        self.use_graphs = bool(graphs) and self.device.type == "cuda"
        #: decode steps that never read a device value on the host (what a graph captures): always on
        #: a GPU; a CPU, where reading costs nothing, loops over a token's chosen experts instead
        #: (torch's grouped_mm on a CPU multiplies every expert's group, empty or not)
        self.sync_free = self.device.type != "cpu"
        #: fewer, larger kernels where a step is made of launches (a GPU): torch's fused RMS norm, one
        #: product for q, k and v (a copy of their weights, made at first use), the rotary embedding
        #: of q and k at once, the attention's bfloat16 output straight into its projection, a
        #: decode step's experts summed without a scatter. It rounds differently from the eager
        #: path, so a CPU keeps the eager path's formulation (tests turn this on there too)
        self.fused = self.device.type == "cuda"
        self._qkv: dict[int, torch.Tensor] = {}
        self._float_weights: dict[int, torch.Tensor] = {}
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._owner = 0
        #: why graphs were turned off (a capture that failed), None while they work
        self.graph_error: str | None = None
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None
        self.stats = GraphStats()
        # the inputs of a decode step, at fixed addresses (what a captured graph reads)
        with torch.inference_mode(False):
            self._token = torch.zeros(1, dtype=torch.long, device=self.device)
            self._position = torch.zeros(1, dtype=torch.long, device=self.device)
            self._expert_ids = torch.arange(self.num_experts, device=self.device)

    # -- the cache
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def ensure_capacity(self, positions: int) -> None:
        """Grow the cache to hold ``positions`` positions (the next power of two, up to the context
        length), keeping what it holds; captured graphs read the old buffer and are dropped."""
        if positions <= self.capacity:
            return
        capacity = bucket_for(positions)
        if self.use_graphs:  # the whole context at once: a graph reads the buffer it was captured on
            capacity = max(capacity, bucket_for(self.context_length))
        shape = (len(self.layers), self.kv_heads, capacity, self.head_dim)
        with torch.inference_mode(False):  # written in place under no_grad too, never an inference tensor
            keys = torch.zeros(shape, dtype=self.attention_dtype, device=self.device)
            values = torch.zeros(shape, dtype=self.attention_dtype, device=self.device)
        if self.keys is not None:
            keys[:, :, :self.capacity] = self.keys
            values[:, :, :self.capacity] = self.values
        self.keys, self.values = keys, values
        self._graphs.clear()
        self.stats.graphs = 0

    def release(self) -> None:
        """Drop the KV cache, the captured graphs and the fused weight copies (their memory goes
        back to the allocator); the next request allocates and captures again."""
        self.keys = self.values = None
        self._graphs.clear()
        self._qkv.clear()
        self._float_weights.clear()
        self.stats.graphs = 0
        self._owner += 1

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by the cache and (on a GPU) reserved by the graphs' shared pool."""
        cache = 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()
        fused = sum(w.numel() * w.element_size() for w in self._qkv.values())
        pool = 0
        if self._pool is not None and self.device.type == "cuda":
            for segment in torch.cuda.memory_snapshot():
                if tuple(segment.get("segment_pool_id") or ()) == tuple(self._pool):
                    pool += int(segment.get("total_size", 0))
        return {"kv_cache": cache, "graph_pool": pool, "fused_weights": fused}

    # -- the blocks
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (tokens, head_dim) at ``positions`` (int64, device), as ``OlmoeRotaryEmbedding``."""
        inv_freq = self.decoder.model.rotary_emb.inv_freq
        freqs = positions[:, None].float() * inv_freq[None].to(device=positions.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _attention(self, index: int, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
        """The attention of block ``index`` for (tokens, d) ``x``: with ``mask`` None a prefill
        from position 0 (causal over the tokens, K/V written at 0..tokens-1), else one decode token
        at ``self._position`` attending over the cache positions ``mask`` (1, 1, 1, window) spans:
        0 where a position is filled, -inf after."""
        attn = layer.self_attn
        tokens = x.shape[0]
        h = _rms(x, layer.input_layernorm)
        q = _rms(attn.q_proj(h), attn.q_norm).view(tokens, self.num_heads, self.head_dim).transpose(0, 1)
        k = _rms(attn.k_proj(h), attn.k_norm).view(tokens, self.kv_heads, self.head_dim).transpose(0, 1)
        v = attn.v_proj(h).view(tokens, self.kv_heads, self.head_dim).transpose(0, 1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        adt = self.attention_dtype
        out = self._attend(index, q.to(adt), k.to(adt), v.to(adt), mask)
        out = out.transpose(0, 1).reshape(tokens, self.num_heads * self.head_dim).to(x.dtype)
        return x + attn.o_proj(out)

    def _attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Write block ``index``'s K/V (kv_heads, tokens, dim) into the cache and attend with q
        (heads, tokens, dim), all in the attention dtype: a prefill's K/V at 0..tokens-1, causal
        over themselves (``mask`` None), or one decode token's at ``self._position`` over the
        window ``mask`` spans. Returns (heads, tokens, dim)."""
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

    def _moe(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The MoE half of a block on float32 (tokens, d) ``x``, with the router's own top-K."""
        h = (self._norm if self.fused else _rms)(x, layer.post_attention_layernorm)
        gate = layer.mlp.gate
        logits = F.linear(h, gate.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        weights, index = torch.topk(probs, int(gate.top_k), dim=-1)
        weights = weights.to(logits.dtype)
        experts = layer.mlp.experts
        rows = index.numel()
        if index.shape[0] == 1 and not self.sync_free:
            return x + self._looped_experts(experts, h, index, weights)
        if self.grouped and not (self.device.type == "cpu" and self.weight_dtype != torch.float32 and rows > 8):
            return x + self._grouped_experts(experts, h, index, weights)
        if index.shape[0] == 1:
            return x + self._gathered_experts(experts, h, index, weights)
        # a GPU without grouped_mm for these weights, or a half-precision prefill on a CPU (where the
        # block's own module converts each expert's weights for a float32 product)
        return x + experts(h, index, weights)

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.weight_dtype == torch.float32 else x.to(self.weight_dtype)

    def _grouped_experts(self, experts: nn.Module, h: torch.Tensor, index: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
        tokens = h.shape[0]
        flat = index.t().reshape(-1)  # position = slot * tokens + token: the eager path's row order
        order = torch.argsort(flat, stable=True)
        rows, slots = order % tokens, order // tokens
        offsets = torch.searchsorted(flat.index_select(0, order), self._expert_ids, right=True).to(torch.int32)
        inputs = self._round(h.index_select(0, rows))
        w = experts.gate_up_proj
        inter = w.shape[1] // 2
        if self.device.type == "cpu" and getattr(experts, "split_gate_up", False):
            # the eager module's two products (the origin's rounding), bit for bit on a CPU
            gate = grouped_mm(inputs, w[:, :inter].transpose(1, 2), offs=offsets).float()
            up = grouped_mm(inputs, w[:, inter:].transpose(1, 2), offs=offsets).float()
        else:  # gate and up as one product
            gate_up = grouped_mm(inputs, w.transpose(1, 2), offs=offsets).float()
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
        act = self._round(F.silu(gate) * up)
        out = grouped_mm(act, experts.down_proj.transpose(1, 2), offs=offsets).float()
        out = out * weights[rows, slots, None]
        return torch.zeros_like(h).index_add_(0, rows, out.to(h.dtype))

    def _looped_experts(self, experts: nn.Module, h: torch.Tensor, index: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
        """One token's K experts one after the other in ascending order (the eager path's products
        and sum), their ids read on the host: a CPU's decode step."""
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

    def _gathered_experts(self, experts: nn.Module, h: torch.Tensor, index: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
        """One token's K experts from their gathered weights (a copy of K experts: where grouped_mm
        does not run), summed in ascending expert order as the eager path does."""
        chosen, order = torch.sort(index[0])
        w = experts.gate_up_proj.index_select(0, chosen)  # (K, 2I, d)
        inter = w.shape[1] // 2
        x = self._round(h)[0]
        gate = torch.matmul(w[:, :inter], x).float()
        up = torch.matmul(w[:, inter:], x).float()
        act = self._round(F.silu(gate) * up)
        out = torch.matmul(experts.down_proj.index_select(0, chosen), act[:, :, None])[..., 0].float()
        out = out * weights[0].index_select(0, order)[:, None]
        rows = torch.zeros(out.shape[0], dtype=torch.long, device=h.device)
        return torch.zeros_like(h).index_add_(0, rows, out.to(h.dtype))

    def _block(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        layer = self.layers[index]
        if self.fused:
            x = self._attention_fused(index, layer, x, cos, sin, mask)
            return self._moe_fused(layer, x) if x.shape[0] == 1 and self.grouped else self._moe(layer, x)
        x = self._attention(index, layer, x, cos, sin, mask)
        return self._moe(layer, x)

    # -- the fused formulation (``fused``)
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

    def _attention_fused(self, index: int, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """:meth:`_attention` with fewer kernels (see ``fused``)."""
        attn = layer.self_attn
        tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.kv_heads, self.head_dim
        qkv = F.linear(self._norm(x, layer.input_layernorm), self._qkv_weight(index, attn))
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        q = self._norm(qkv[:, :q_end], attn.q_norm).view(tokens, heads, dim)
        k = self._norm(qkv[:, q_end:k_end], attn.k_norm).view(tokens, kv_heads, dim)
        qk = torch.cat((q, k), dim=1).transpose(0, 1)  # (heads + kv_heads, tokens, dim): one rotation
        adt = self.attention_dtype
        qk = (qk * cos + _rotate_half(qk) * sin).to(adt)
        q, k = qk[:heads], qk[heads:]
        v = qkv[:, k_end:].view(tokens, kv_heads, dim).transpose(0, 1).to(adt)
        out = self._attend(index, q, k, v, mask)
        # in the attention's dtype straight into the projection, which rounds its input to it anyway
        out = out.transpose(0, 1).reshape(tokens, heads * dim)
        return x + attn.o_proj(out).to(x.dtype)

    def _moe_fused(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The MoE half of a decode step (one token) with fewer kernels (see ``fused``): its K
        chosen experts sorted, their rows one copy of the token, their outputs summed."""
        h = self._round(self._norm(x, layer.post_attention_layernorm))
        gate = layer.mlp.gate
        probs = F.softmax(F.linear(h, gate.weight), dim=-1, dtype=torch.float)
        weights, index = torch.topk(probs, int(gate.top_k), dim=-1)
        chosen, order = torch.sort(index[0])
        offsets = torch.searchsorted(chosen, self._expert_ids, right=True).to(torch.int32)
        experts = layer.mlp.experts
        w = experts.gate_up_proj
        inter = w.shape[1] // 2
        rows = h.expand(chosen.shape[0], -1).contiguous()
        gate_up = grouped_mm(rows, w.transpose(1, 2), offs=offsets).float()
        act = self._round(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        out = grouped_mm(act, experts.down_proj.transpose(1, 2), offs=offsets).float()
        return x + (out * weights[0].index_select(0, order)[:, None]).sum(0, keepdim=True)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits (vocab,) of a (1, d) hidden state after the last block (final norm, head)."""
        norm = self._norm if self.fused else _rms
        return self.decoder.lm_head(norm(hidden, self.decoder.model.norm)).float()[0]

    # -- prefill
    def prefill(self, hidden: torch.Tensor, blocks: Sequence[int], *, reserve: int = 0) -> torch.Tensor:
        """Run ``blocks`` over the (tokens, d) float32 ``hidden`` at positions 0..tokens-1, writing
        their K/V into the cache (sized for ``tokens + reserve`` positions); returns the hidden
        states after the last of them (no final norm). Every block's hooks run around it."""
        tokens = hidden.shape[0]
        self.ensure_capacity(tokens + reserve)
        self._owner += 1  # the cache now holds this request: earlier sessions are over
        cos, sin = self._rope(torch.arange(tokens, device=self.device), hidden.dtype)
        x = hidden
        for i in blocks:
            layer = self.layers[i]
            call_pre_hooks(layer)
            x = self._block(i, x, cos, sin, None)
            call_post_hooks(layer)
        return x

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
        float32 logits (vocab,) (on a GPU the graph's output buffer, overwritten by the next step)."""
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
        if self.use_graphs:
            logits = self._replay(session, window)
        else:
            logits = self._step(session.blocks, window)
        for layer in layers:
            call_post_hooks(layer)
        session.position += 1
        return logits

    def greedy_step(self, session: FastSession, token: int) -> int:
        """:meth:`step`, then the greedy next token, chosen on the device and read once."""
        self.step(session, token)
        return int(self._token[0])

    def _step(self, blocks: Sequence[int], window: int) -> torch.Tensor:
        """The decode step itself: fixed shapes, no host synchronisation (what a graph captures)."""
        x = self.decoder.model.embed_tokens(self._token)
        cos, sin = self._rope(self._position, x.dtype)
        filled = torch.arange(window, device=self.device) <= self._position
        mask = torch.zeros(window, dtype=self.attention_dtype, device=self.device).masked_fill(
            ~filled, float("-inf"))[None, None, None]
        for i in blocks:
            x = self._block(i, x, cos, sin, mask)
        logits = self.logits(x)
        self._token.copy_(logits.argmax().reshape(1))
        return logits

    def _replay(self, session: FastSession, window: int) -> torch.Tensor:
        captured = self._graph(session.blocks, session.top_k, window)
        if captured is None:  # the capture failed: the same step, launched kernel by kernel
            return self._step(session.blocks, window)
        captured.graph.replay()
        return captured.logits

    def _graph(self, blocks: tuple[int, ...], top_k: tuple[int, ...], window: int) -> _Graph | None:
        """The captured step of ``blocks`` at ``top_k`` over ``window`` positions, captured now if
        it is not yet; None when a capture fails (graphs are then off for this decoder)."""
        key = (blocks, top_k, window)
        captured = self._graphs.get(key)
        if captured is not None:
            self._graphs[key] = self._graphs.pop(key)  # the most recently used last
            return captured
        if not self.use_graphs:
            return None
        try:
            captured = self._capture(blocks, window)
        except RuntimeError as exc:  # a kernel that cannot be captured
            self.use_graphs = False
            self.graph_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            warnings.warn(f"CUDA graph capture failed, decode steps run uncaptured: {self.graph_error}",
                          RuntimeWarning, stacklevel=3)
            return None
        self._graphs[key] = captured
        while len(self._graphs) > MAX_GRAPHS:
            del self._graphs[next(iter(self._graphs))]
        self.stats.graphs = len(self._graphs)
        return captured

    def _capture(self, blocks: Sequence[int], window: int) -> _Graph:
        """Capture the step of ``blocks`` over ``window`` positions, on the model's device. Its warm-up
        and capture write K/V at the window's last position, which a request writes before it ever
        reads it; the step's inputs (token, position) are the request's again afterwards, whether the
        capture worked or not (the uncaptured step that follows a failure reads them)."""
        started = time.perf_counter()
        saved_token, saved_position = self._token.clone(), self._position.clone()
        try:
            self._position.fill_(window - 1)
            with torch.cuda.device(self.device):  # a model on cuda:N captures there, not on cuda:0
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # kernels chosen and workspaces allocated outside the capture
                        self._step(blocks, window)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    logits = self._step(blocks, window)
        finally:
            self._token.copy_(saved_token)
            self._position.copy_(saved_position)
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - started
        return _Graph(graph, logits)

    def capture(self, blocks: Sequence[int], positions: int) -> None:
        """Capture the decode step of ``blocks`` (with the routers' current top-K) for the window of
        ``positions`` positions ahead of its first use (a server's warm-up). Nothing on a CPU."""
        if not self.use_graphs:
            return
        self.ensure_capacity(positions)
        blocks = tuple(int(b) for b in blocks)
        self._graph(blocks, tuple(int(self.layers[i].mlp.gate.top_k) for i in blocks), bucket_for(positions))


class GraphedFunction:
    """``fn`` of one tensor, captured as a CUDA graph per input shape and replayed (the vision
    tower's ViT on the fast path): the same kernels on the same inputs, so the same output bit for
    bit, without the per-operation launches. The input is copied into the graph's own buffer and
    the output cloned out of it. At most ``max_graphs`` shapes are kept (the least recently used
    goes); a capture that fails turns the graphs off with a warning, and ``fn`` runs as it is.
    Used without autograd only: with gradients enabled ``fn`` runs as it is."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                 max_graphs: int = 16) -> None:
        self.fn, self.device, self.max_graphs = fn, torch.device(device), int(max_graphs)
        self._graphs: dict[tuple, tuple[torch.Tensor, object, torch.Tensor]] = {}
        self._pool = None
        #: why the graphs were turned off (a capture that failed), None while they work
        self.error: str | None = None

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.error is not None or torch.is_grad_enabled() or x.device.type != "cuda":
            return self.fn(x)
        key = (tuple(x.shape), x.dtype)
        entry = self._graphs.pop(key, None)
        if entry is None:
            try:
                entry = self._capture(x)
            except RuntimeError as exc:
                self.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                warnings.warn(f"CUDA graph capture failed, the function runs uncaptured: {self.error}",
                              RuntimeWarning, stacklevel=2)
                return self.fn(x)
        self._graphs[key] = entry  # the most recently used last
        while len(self._graphs) > self.max_graphs:
            del self._graphs[next(iter(self._graphs))]
        static_input, graph, static_output = entry
        static_input.copy_(x)
        graph.replay()
        return static_output.clone()

    def _capture(self, x: torch.Tensor) -> tuple[torch.Tensor, object, torch.Tensor]:
        with torch.cuda.device(self.device):  # the function's device, not the current one
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.inference_mode(False):
                static_input = x.detach().clone()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.fn(static_input)  # kernels chosen and workspaces allocated outside the capture
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                static_output = self.fn(static_input)
        return static_input, graph, static_output
