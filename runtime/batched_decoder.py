"""Many requests through an ``OlmoeForCausalLM`` decoder in shared passes, each row with its own knobs.

A :class:`BatchedDecoder` holds the rows of a batch: each is one request's decoding with its own
top-K per block, its own active blocks and its own token limit. Rows join with a prefill of their
prompts (:meth:`BatchedDecoder.join`), every unfinished row advances one token per decode step
(:meth:`BatchedDecoder.step`), and a row leaves at EOS, at its limit, at its stop rule or when it
is cancelled; new rows may join between steps (the primitive a server's continuous batching needs).

**Layout.** A prefill is *packed*: the joining rows' prompts are concatenated into one
(tokens, d) sequence, so every product over tokens (projections, router, experts, head) reads each
weight once for all rows, and no padding is computed; attention alone runs per row, causal over
the row's own tokens. A decode step stacks one token per row. The KV cache has one slot per row,
``(blocks, slots, kv_heads, capacity, head_dim)``, grown by doubling when a row needs more slots or
positions; a step attends over a window covering the longest row, each row masked to its own
positions.

**The knobs in a batch.** A block runs on exactly the rows whose configuration includes it (their
tokens gathered, the block computed, the results written back): a row without block b never enters
it and its residual passes. The router takes each token's top ``K`` of its own row (one
``torch.topk`` per distinct K in the pass, so tied probabilities break as they do for the row
alone); only the chosen (token, expert) pairs are multiplied, so a row at top-K 4 runs 4 experts per token whatever its
neighbours run. Rows of one configuration and rows of many share a pass the same way: the
products over tokens are shared, a block's subset is chosen per block.

**Numerics.** The operations are the fast path's CPU formulation (``runtime.fast_decoder``): the
eager modules' norms, products and rotation in float32 (half-precision weights: inputs rounded to
the weights' dtype as the precision rule says), attention in float32. A batched product may sum in
another order than the same product on one row, so a row's logits equal its batch-1 logits within
rounding, not bit for bit (tests/test_batched_decoder.py states the tolerance).

**Rows from a prefix.** A row may join from a prefill already run up to block p (a request's
shared prefix, ``PrefixState``): its input is then the hidden state after block p-1 and its
:class:`RowPrefix` carries blocks 0..p-1's K/V, copied into the row's slot; the row's prefill
runs its blocks from p on, and its decode steps run all its blocks (those before p at the
top-K they prefilled with, as its knobs say).

**Hooks.** The decoder blocks' forward hooks run around every block of every pass (pre-hooks
before it, post-hooks after), once per pass for all rows in it, as the fast path calls them: a
timer sees each block a pass runs. A row's :meth:`BatchRow.cancel` (from any thread) takes it out
of the batch before the next block; the others continue.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from runtime.base import RowKnobs
from runtime.fast_decoder import (
    bucket_for,
    call_post_hooks,
    call_pre_hooks,
    grouped_mm,
    rms_norm,
    rope_tables,
    rotated_qkv,
)

#: why a row left the batch
FINISH_REASONS = ("eos", "length", "stop", "cancelled")


@dataclass(frozen=True)
class RowPrefix:
    """The part of a row's prefill that ran before it joined: blocks 0..``start``-1, whose float32
    K/V are ``keys`` and ``values``, (start, kv_heads, prompt tokens, head_dim) each."""

    start: int
    keys: torch.Tensor
    values: torch.Tensor


@dataclass(eq=False)
class BatchRow:
    """One request's decoding in a batch.

    ``tokens`` grows by one per step the row takes part in; ``logits`` are the float32 (vocab,)
    logits the last token was picked from; ``finish_reason`` is one of :data:`FINISH_REASONS` once
    the row has left. ``expert_products`` counts the (token, expert) products run for this row's
    tokens (where the decoder counts them, :attr:`BatchedDecoder.count_products`)."""

    index: int
    knobs: RowKnobs
    prompt_tokens: int
    max_new_tokens: int
    #: the first block its prefill runs in the batch (blocks before it ran before it joined)
    start: int = 0
    pick: Callable[[torch.Tensor], int] | None = None
    until: Callable[[int], bool] | None = None
    tokens: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    finish_reason: str | None = None
    expert_products: int = 0
    slot: int = -1
    position: int = 0
    _cancelled: bool = False

    def cancel(self) -> None:
        """Take the row out of the batch before the decoder's next block (safe from another thread)."""
        self._cancelled = True

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class BatchedDecoder:
    """The rows of a batch over ``decoder``'s weights (see the module docstring). ``layers``: all
    decoder blocks in order (their weights are read and their hooks called); ``eos_id`` ends a row.
    The caller holds the precision context (``runtime.precision``) around every call."""

    def __init__(self, decoder: nn.Module, layers: Sequence[nn.Module], device: torch.device, eos_id: int) -> None:
        cfg = decoder.config
        self.decoder, self.layers, self.device, self.eos_id = decoder, list(layers), torch.device(device), int(eos_id)
        self.num_heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.num_experts = int(cfg.num_experts)
        self.scaling = self.head_dim ** -0.5
        self.weight_dtype = self.layers[0].mlp.experts.gate_up_proj.dtype
        self.split_gate_up = bool(getattr(self.layers[0].mlp.experts, "split_gate_up", False))
        self.expert_ids = torch.arange(self.num_experts, device=self.device)
        #: count each row's (token, expert) products into ``BatchRow.expert_products`` (reads the
        #: routing on the host: free on a CPU, a sync per block on a GPU)
        self.count_products = self.device.type == "cpu"
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.rows: list[BatchRow] = []
        self._joined = 0

    # -- the cache
    @property
    def slots(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[1])

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[3])

    @property
    def bytes_per_position(self) -> int:
        """The KV cache's bytes for one position of one row (K and V of every block, float32)."""
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * 4

    def cache_bytes(self) -> int:
        return 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()

    def _ensure(self, slots: int, positions: int) -> None:
        """Room for ``slots`` rows of ``positions`` positions (both grown by doubling, kept K/V copied)."""
        if slots <= self.slots and positions <= self.capacity:
            return
        new_slots = max(slots, 2 * self.slots if slots > self.slots else self.slots, 1)
        new_capacity = max(positions, 2 * self.capacity if positions > self.capacity else self.capacity, 1)
        shape = (len(self.layers), new_slots, self.kv_heads, new_capacity, self.head_dim)
        with torch.inference_mode(False):
            keys = torch.zeros(shape, dtype=torch.float32, device=self.device)
            values = torch.zeros(shape, dtype=torch.float32, device=self.device)
        if self.keys is not None:
            keys[:, :self.slots, :, :self.capacity] = self.keys
            values[:, :self.slots, :, :self.capacity] = self.values
        self.keys, self.values = keys, values

    def _free_slot(self, taken: set[int]) -> int:
        return next(s for s in range(len(taken) + 1) if s not in taken)

    # -- rows
    @property
    def live(self) -> list[BatchRow]:
        """The rows still decoding, in the order they joined."""
        return [row for row in self.rows if not row.done]

    def join(self, embeds: Sequence[torch.Tensor], knobs: Sequence[RowKnobs], max_new_tokens: Sequence[int], *,
             pick: Sequence[Callable[[torch.Tensor], int] | None] | None = None,
             until: Sequence[Callable[[int], bool] | None] | None = None,
             prefixes: Sequence[RowPrefix | None] | None = None) -> list[BatchRow]:
        """Prefill new rows together and pick each one's first token: ``embeds[i]`` is row i's float32
        (tokens, d) decoder input, ``knobs[i]`` its configuration, ``max_new_tokens[i]`` its limit
        (>= 1); ``pick[i]`` turns its logits into a token (None: greedy), ``until[i]`` is its stop
        rule on each new token; ``prefixes[i]``: the blocks its prefill ran before it joined (then
        ``embeds[i]`` is the hidden state after them). A row whose first token ends it leaves at once."""
        count = len(embeds)
        if not (len(knobs) == len(max_new_tokens) == count):
            msg = "join needs one configuration and one token limit per row"
            raise ValueError(msg)
        if any(int(n) < 1 for n in max_new_tokens):
            msg = "a row's max_new_tokens must be at least 1"
            raise ValueError(msg)
        pick = list(pick) if pick is not None else [None] * count
        until = list(until) if until is not None else [None] * count
        prefixes = list(prefixes) if prefixes is not None else [None] * count
        for i, prefix in enumerate(prefixes):
            if prefix is not None:
                self._check_prefix(prefix, knobs[i], int(embeds[i].shape[0]))
        taken = {row.slot for row in self.live}
        new: list[BatchRow] = []
        for i in range(count):
            start = 0 if prefixes[i] is None else int(prefixes[i].start)
            row = BatchRow(self._joined, knobs[i], int(embeds[i].shape[0]), int(max_new_tokens[i]), start,
                           pick[i], until[i])
            self._joined += 1
            row.slot = self._free_slot(taken)
            taken.add(row.slot)
            new.append(row)
        if not new:
            return new
        self._ensure(max(taken) + 1, max(r.prompt_tokens + r.max_new_tokens for r in self.live + new))
        for row, prefix in zip(new, prefixes, strict=True):
            if prefix is not None and prefix.start:
                self.keys[:prefix.start, row.slot, :, :row.prompt_tokens] = prefix.keys.to(self.device, torch.float32)
                self.values[:prefix.start, row.slot, :, :row.prompt_tokens] = prefix.values.to(self.device,
                                                                                               torch.float32)
        x = torch.cat([e.to(self.device, torch.float32) for e in embeds])
        positions = torch.cat([torch.arange(r.prompt_tokens, device=self.device) for r in new])
        cos, sin = rope_tables(self.decoder, positions)
        starts = [0]
        for r in new:
            starts.append(starts[-1] + r.prompt_tokens)
        spans = {r.index: (starts[j], starts[j + 1]) for j, r in enumerate(new)}
        x = self._through_blocks(x, cos, sin, new, lambda members: self._token_index(
            [spans[r.index] for r in members], x.shape[0]), prefill=True)
        # the rows belong to the batch once their prefill is complete (an exception leaves it as it was)
        self.rows = self.live + new
        joined = self._drop_cancelled(new)
        if joined:
            last = torch.tensor([spans[r.index][1] - 1 for r in joined], device=self.device)
            logits = self._logits(x.index_select(0, last))
            for r, row_logits in zip(joined, logits, strict=True):
                r.position = r.prompt_tokens
                self._take(r, row_logits)
        return new

    def _check_prefix(self, prefix: RowPrefix, knobs: RowKnobs, tokens: int) -> None:
        p = int(prefix.start)
        shape = (p, self.kv_heads, tokens, self.head_dim)
        if not 0 <= p < len(self.layers) or tuple(prefix.keys.shape) != shape or tuple(prefix.values.shape) != shape:
            msg = (f"a row's prefix of blocks 0..{p - 1} needs K/V of shape {shape}, "
                   f"got {tuple(prefix.keys.shape)} and {tuple(prefix.values.shape)}")
            raise ValueError(msg)
        if knobs.blocks[:p] != tuple(range(p)):
            msg = f"a row joining after block {p - 1} must keep blocks 0..{p - 1} (they ran), got {list(knobs.blocks)}"
            raise ValueError(msg)

    def step(self) -> list[BatchRow]:
        """One decode step for every live row: its last token at its next position through its own
        blocks, then its next token. Returns the rows that left during the step."""
        rows = self._drop_cancelled(self.live)
        if not rows:
            return []
        self._ensure(self.slots, max(r.position + 1 for r in rows))
        tokens = torch.tensor([r.tokens[-1] for r in rows], device=self.device)
        x = self.decoder.model.embed_tokens(tokens).float()
        positions = torch.tensor([r.position for r in rows], device=self.device)
        cos, sin = rope_tables(self.decoder, positions)
        order = {r.index: j for j, r in enumerate(rows)}

        def step_index(members: list[BatchRow]) -> torch.Tensor | None:
            picked = [order[r.index] for r in members]
            return None if picked == list(range(len(rows))) else torch.tensor(picked, device=self.device)

        x = self._through_blocks(x, cos, sin, rows, step_index, prefill=False)
        left = [r for r in rows if r.done]  # cancelled during the step
        kept = [r for r in rows if not r.done]
        if kept:
            logits = self._logits(x.index_select(0, torch.tensor([order[r.index] for r in kept], device=self.device)))
            for r, row_logits in zip(kept, logits, strict=True):
                r.position += 1
                self._take(r, row_logits)
                if r.done:
                    left.append(r)
        return left

    def _through_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: list[BatchRow],
                        index_of: Callable[[list[BatchRow]], torch.Tensor | None], *, prefill: bool) -> torch.Tensor:
        """``x`` (the pass's tokens of ``rows``) through every block some row has, each block on its
        member rows' tokens only (``index_of(members)``: their positions in ``x``, None for all),
        hooks around it; a row cancelled meanwhile drops out at the next block."""
        # a prefill runs a row's blocks from its start on; a step runs all of them
        def runs(r: BatchRow, b: int) -> bool:
            return b in r.knobs.blocks and (not prefill or b >= r.start)

        for b in sorted({b for r in rows for b in r.knobs.blocks if runs(r, b)}):
            members = [r for r in self._drop_cancelled(rows) if runs(r, b)]
            if not members:
                continue
            idx = index_of(members)
            layer = self.layers[b]
            call_pre_hooks(layer)
            xs = x if idx is None else x.index_select(0, idx)
            out = self._block(b, xs, cos if idx is None else cos.index_select(0, idx),
                              sin if idx is None else sin.index_select(0, idx), members, prefill=prefill)
            x = out if idx is None else x.index_copy(0, idx, out)
            call_post_hooks(layer)
        return x

    def _drop_cancelled(self, rows: Sequence[BatchRow]) -> list[BatchRow]:
        for r in rows:
            if r._cancelled and not r.done:
                r.finish_reason = "cancelled"
        return [r for r in rows if not r.done]

    def _take(self, row: BatchRow, logits: torch.Tensor) -> None:
        """Append the row's next token from its logits and end the row where it is over."""
        row.logits = logits
        token = int(logits.argmax()) if row.pick is None else int(row.pick(logits))
        row.tokens.append(token)
        if row.until is not None and row.until(token):
            row.finish_reason = "stop"
        elif token == self.eos_id:
            row.finish_reason = "eos"
        elif len(row.tokens) >= row.max_new_tokens:
            row.finish_reason = "length"

    def _token_index(self, spans: list[tuple[int, int]], total: int) -> torch.Tensor | None:
        """The packed positions of these rows' tokens (None: every token of the pass)."""
        if sum(end - start for start, end in spans) == total:
            return None
        return torch.cat([torch.arange(start, end, device=self.device) for start, end in spans])

    # -- computing
    def _round(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.weight_dtype == torch.float32 else x.to(self.weight_dtype)

    def _block(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               members: list[BatchRow], *, prefill: bool) -> torch.Tensor:
        """Block ``index`` on the (tokens, d) float32 ``x`` of ``members`` (their tokens in order)."""
        layer = self.layers[index]
        attn = layer.self_attn
        q, k, v = (t.float() for t in rotated_qkv(layer, x, self.num_heads, self.kv_heads, self.head_dim, cos, sin))
        attend = self._attend_prefill if prefill else self._attend_step
        out = attend(index, q, k, v, members)  # (tokens, heads * dim)
        x = x + attn.o_proj(out.to(x.dtype))
        counts = [r.prompt_tokens for r in members] if prefill else [1] * len(members)
        return x + self._moe(layer, index, x, members, counts)

    def _attend_prefill(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        members: list[BatchRow]) -> torch.Tensor:
        outs, start = [], 0
        for r in members:
            end = start + r.prompt_tokens
            kr, vr = k[:, start:end], v[:, start:end]
            self.keys[index, r.slot, :, :r.prompt_tokens] = kr
            self.values[index, r.slot, :, :r.prompt_tokens] = vr
            kr, vr = self._repeat_kv(kr), self._repeat_kv(vr)
            out = F.scaled_dot_product_attention(q[None, :, start:end], kr[None], vr[None],
                                                 is_causal=end - start > 1, scale=self.scaling)[0]
            outs.append(out.transpose(0, 1).reshape(end - start, -1))
            start = end
        return torch.cat(outs)

    def _attend_step(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     members: list[BatchRow]) -> torch.Tensor:
        rows = len(members)
        slots = torch.tensor([r.slot for r in members], device=self.device)
        positions = torch.tensor([r.position for r in members], device=self.device)
        # q, k, v: (heads, rows, dim), one token per row
        self.keys[index, slots, :, positions] = k.transpose(0, 1)
        self.values[index, slots, :, positions] = v.transpose(0, 1)
        window = min(bucket_for(max(r.position for r in members) + 1), self.capacity)
        keys = self._repeat_kv(self.keys[index, slots, :, :window], dim=1)
        values = self._repeat_kv(self.values[index, slots, :, :window], dim=1)
        filled = torch.arange(window, device=self.device)[None] <= positions[:, None]
        mask = torch.zeros(rows, window, device=self.device).masked_fill(~filled, float("-inf"))
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[:, :, None], keys, values,
                                             attn_mask=mask[:, None, None], scale=self.scaling)
        return out.reshape(rows, -1)

    def _repeat_kv(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if self.kv_heads == self.num_heads:
            return x
        return x.repeat_interleave(self.num_heads // self.kv_heads, dim=dim)

    def _moe(self, layer: nn.Module, index: int, x: torch.Tensor, members: list[BatchRow],
             counts: list[int]) -> torch.Tensor:
        """The routed experts of ``x``'s tokens, each token at its own row's top-K in this block."""
        h = rms_norm(x, layer.post_attention_layernorm)
        gate = layer.mlp.gate
        logits = F.linear(h, gate.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        row_k = [r.knobs.top_k[index] for r in members]
        kmax = max(row_k)
        tokens = h.shape[0]
        mixed_k = min(row_k) < kmax
        # each token's row (on the host), where per-row top-K or the product count needs it
        owner = (torch.repeat_interleave(torch.arange(len(members)), torch.tensor(counts))
                 if mixed_k or self.count_products else None)
        if not mixed_k:
            weights, chosen = torch.topk(probs, kmax, dim=-1)
        else:
            # each K's tokens get their own topk call: topk(p, 4) and topk(p, 12)[:4] may order tied
            # probabilities differently, and a row must route as it does alone
            token_k = torch.tensor(row_k)[owner]
            weights = torch.zeros(tokens, kmax, dtype=probs.dtype, device=self.device)
            chosen = torch.full((tokens, kmax), self.num_experts, dtype=torch.long, device=self.device)
            for k in sorted(set(row_k)):
                at = torch.nonzero(token_k == k).flatten().to(self.device)
                w_k, c_k = torch.topk(probs.index_select(0, at), k, dim=-1)
                weights[at, :k], chosen[at, :k] = w_k, c_k  # the rest: the sentinel expert, sorted last
        weights = weights.to(logits.dtype)
        flat = chosen.t().reshape(-1)  # position = slot * tokens + token: the eager path's row order
        kept = sum(k * n for k, n in zip(row_k, counts, strict=True))
        order = torch.argsort(flat, stable=True)[:kept]
        rows, slots = order % tokens, order // tokens
        by_expert = flat.index_select(0, order)
        if self.count_products:
            for r, n in zip(members, torch.bincount(owner[rows.cpu()], minlength=len(members)).tolist(), strict=True):
                r.expert_products += int(n)
        experts = layer.mlp.experts
        inputs = self._round(h.index_select(0, rows))
        w, down = experts.gate_up_proj, experts.down_proj
        inter = w.shape[1] // 2
        if grouped_mm is not None and (self.weight_dtype == torch.float32 or kept <= 8):
            offsets = torch.searchsorted(by_expert, self.expert_ids, right=True, out_int32=True)
            if self.split_gate_up:
                gate_out = grouped_mm(inputs, w[:, :inter].transpose(1, 2), offs=offsets).float()
                up = grouped_mm(inputs, w[:, inter:].transpose(1, 2), offs=offsets).float()
            else:
                gate_up = grouped_mm(inputs, w.transpose(1, 2), offs=offsets).float()
                gate_out, up = gate_up[:, :inter], gate_up[:, inter:]
            act = self._round(F.silu(gate_out) * up)
            out = grouped_mm(act, down.transpose(1, 2), offs=offsets).float()
        else:  # half weights over many rows: one product per expert (the precision rule converts each once)
            out = torch.empty(kept, h.shape[1], device=self.device)
            start = 0
            for expert, count in enumerate(torch.bincount(by_expert, minlength=self.num_experts).tolist()):
                if not count:
                    continue
                part = inputs[start:start + count]
                if self.split_gate_up:
                    gate_out, up = F.linear(part, w[expert, :inter]).float(), F.linear(part, w[expert, inter:]).float()
                else:
                    gate_up = F.linear(part, w[expert]).float()
                    gate_out, up = gate_up[:, :inter], gate_up[:, inter:]
                act = self._round(F.silu(gate_out) * up)
                out[start:start + count] = F.linear(act, down[expert]).float()
                start += count
        out = out * weights[rows, slots, None]
        return torch.zeros_like(h).index_add_(0, rows, out.to(h.dtype))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits (rows, vocab) of hidden states after their last block (final norm, head)."""
        return self.decoder.lm_head(rms_norm(hidden, self.decoder.model.norm)).float()
