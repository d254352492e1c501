"""What the embedded model and MolmoE share: an ``OlmoeForCausalLM`` decoder run with knobs.

Both backends hold their decoder as transformers' ``OlmoeForCausalLM`` (the embedded model
natively, MolmoE-1B with its weights renamed, ``runtime.molmoe_model``), so the knobs, cached
generation and the two-stage online execution are written once here. A backend supplies
preprocessing, features and ``_embed`` (text embeddings with the image features placed, and on
request the global-crop image feature from the same vision pass).

Knobs act on the execution path: ``set_top_k`` writes each layer's router
(``layers[i].mlp.gate.top_k``, which ``torch.topk`` reads at every forward); with active
blocks set, every forward temporarily replaces ``decoder.model.layers`` by a ModuleList of the
active layers only, so skipped layers are never called. Their attention modules keep their
original ``layer_idx``: the ``DynamicCache`` (built with all slots) holds real K/V for the
active layers and nothing for the skipped ones, and positions come from layer 0, always active.
"""

from __future__ import annotations

import functools
import inspect
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeline.errors import CtrlError, KnobError
from pipeline.resources import host_available_bytes
from runtime.base import (
    BatchRequest,
    DecodeState,
    GenerationResult,
    ModelInputs,
    ModelRuntime,
    PrefixRequest,
    PrefixState,
    RowKnobs,
    greedy_decode,
    validate_active_blocks,
    validate_top_k,
)
from runtime.batched_decoder import BatchedDecoder, BatchRow, RowPrefix
from runtime.fast_decoder import FastDecoder, FastPrefixCache, FastSession, default_fast_path
from runtime.memory import device_available_bytes
from runtime.precision import compute_context

if TYPE_CHECKING:
    from transformers import OlmoeForCausalLM


#: rows a batched generate decodes at once when nothing bounds it (memory may bound it lower)
MAX_BATCH_ROWS = 32
#: memory kept free beside a batch's KV cache: activations of a packed prefill, the vision pass
BATCH_HEADROOM_BYTES = 1 << 30


def _check_max_rows(max_rows: int | None) -> None:
    if max_rows is not None and (isinstance(max_rows, bool) or int(max_rows) < 1):
        msg = f"max_rows must be a positive integer, got {max_rows!r}"
        raise ValueError(msg)


@dataclass(frozen=True)
class _PendingRow:
    """A row waiting to join a batch: its index among the results, how to make its input (the
    embeddings and, from a prefix, the blocks that ran), its knobs, token limit and positions."""

    index: int
    inputs: Callable[[], tuple[torch.Tensor, RowPrefix | None]]
    knobs: RowKnobs
    max_new_tokens: int
    positions: int


@functools.cache
def _cache_argument() -> str:
    """The keyword under which the installed transformers' Olmoe forward takes the KV cache:
    ``cache`` in newer releases, which deprecate the older ``past_key_values``."""
    from transformers import OlmoeModel

    return "cache" if "cache" in inspect.signature(OlmoeModel.forward).parameters else "past_key_values"


def with_cache(cache: object) -> dict[str, object]:
    """``cache`` as the keyword argument of an Olmoe forward."""
    return {_cache_argument(): cache}


class OlmoeDecoderRuntime(ModelRuntime):
    """``ModelRuntime`` whose decoder is ``self.decoder`` (an ``OlmoeForCausalLM``); see the module docstring."""

    decoder: OlmoeForCausalLM
    #: the full layer list, restored after every forward that runs a subset
    _all_layers: nn.ModuleList
    #: the fast path (``runtime.fast_decoder``) when it is on, else None (the eager path)
    fast: FastDecoder | None = None

    def _init_decoder(self, decoder: OlmoeForCausalLM, fast_path: bool | None = None,
                      float32_attention: bool = False) -> None:
        """Adopt ``decoder`` (already on the device, eval, frozen), read the knob ranges from it
        and choose the execution path (:meth:`set_execution`)."""
        self.decoder = decoder
        cfg = decoder.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_experts = int(cfg.num_experts)
        self.default_top_k = int(cfg.num_experts_per_tok)
        self._all_layers = decoder.model.layers
        # one fast path per attention dtype, kept: switching paths keeps the cache and the captured graphs
        self._fast_decoders: dict[bool, FastDecoder] = {}
        self.set_execution(fast_path, float32_attention)

    def set_execution(self, fast_path: bool | None = None, float32_attention: bool = False) -> None:
        """The fast path (``fast_path``: True), the eager reference (False) or the device's default
        (None: ``runtime.fast_decoder.default_fast_path``); ``float32_attention``: the fast path
        attends in float32, as the origin does, instead of the storage dtype."""
        enabled = default_fast_path(self.device) if fast_path is None else bool(fast_path)
        if not enabled:
            self.fast = None
            return
        key = bool(float32_attention)
        if key not in self._fast_decoders:
            self._fast_decoders[key] = FastDecoder(self.decoder, self._all_layers, self.device, float32_attention=key)
        self.fast = self._fast_decoders[key]

    @property
    def execution(self) -> dict[str, object]:
        """The execution path as recorded beside measured latencies: ``compiled`` (the fast path),
        ``cuda_graphs`` and the attention dtype."""
        fast = self.fast
        attention = "float32" if fast is None else str(fast.attention_dtype).removeprefix("torch.")
        return {"compiled": fast is not None, "cuda_graphs": bool(fast is not None and fast.use_graphs),
                "attention_dtype": attention}

    @abstractmethod
    def _embed(self, inputs: ModelInputs, extra_ids: Sequence[int] = (),
               image_feature: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(1, seq, d) decoder inputs: the prompt's (and ``extra_ids``') embeddings with the image
        features placed; with ``image_feature``, also the global-crop feature (float32 (d,) on the
        CPU, ``ImageFeatures.global_crop``) from the same vision pass, else None (None too
        without an image)."""

    @property
    def context_length(self) -> int | None:
        return int(self.decoder.config.max_position_embeddings)

    def precision_context(self) -> AbstractContextManager:
        """The context of every forward: products rounded to the storage dtype (``runtime.precision``)."""
        return compute_context(self.dtype)

    def text_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """float32 rows of the input embedding (exact: a half table's rows promote without rounding)."""
        return self.decoder.get_input_embeddings()(input_ids.to(self.device)).float()

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
    def forward_logits(self, inputs: ModelInputs, extra_ids: Sequence[int] = ()) -> torch.Tensor:
        """float32 logits (seq_len, vocab) of one full forward without cache, under the current knobs;
        ``extra_ids`` are appended after the prompt (e.g. tokens generated so far)."""
        with torch.inference_mode(), self.precision_context(), self._run_active_blocks():
            embeds, _ = self._embed(inputs, extra_ids)
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
            out = self.decoder(inputs_embeds=embeds, attention_mask=mask, use_cache=False)
            return out.logits[0].float().cpu()

    def generate(self, inputs: ModelInputs, max_new_tokens: int = 16, *, top_k: int | Mapping[int, int] | None = None,
                 active_blocks: Sequence[int] | None = None,
                 num_active_blocks: int | None = None) -> GenerationResult:
        if top_k is None and active_blocks is None and num_active_blocks is None:
            return self._generate(inputs, max_new_tokens)
        with self.knobs(top_k=top_k, active_blocks=active_blocks, num_active_blocks=num_active_blocks):
            return self._generate(inputs, max_new_tokens)

    def _generate(self, inputs: ModelInputs, max_new_tokens: int) -> GenerationResult:
        if self.fast is not None:
            return self._generate_fast(inputs, max_new_tokens)
        from transformers import DynamicCache  # deferred: transformers takes seconds to import

        with torch.inference_mode(), self.precision_context(), self._run_active_blocks():
            # one slot per layer, indexed by each attention's original layer_idx
            cache = DynamicCache(config=self.decoder.config)
            mask = inputs.attention_mask.to(self.device)
            out = self.decoder(inputs_embeds=self._embed(inputs)[0], attention_mask=mask, **with_cache(cache),
                               use_cache=True, logits_to_keep=1)

            def next_token(token: int) -> int:
                nonlocal mask
                mask = torch.cat([mask, mask.new_ones((1, 1))], dim=1)
                step = self.decoder(input_ids=torch.tensor([[token]], device=self.device), attention_mask=mask,
                                    **with_cache(cache), use_cache=True, logits_to_keep=1)
                return int(step.logits[0, -1].argmax())

            tokens = greedy_decode(int(out.logits[0, -1].argmax()), next_token, self.eos_id, max_new_tokens)
        return GenerationResult(tokens, self.decode_text(tokens))

    def _generate_fast(self, inputs: ModelInputs, max_new_tokens: int) -> GenerationResult:
        fast = self.fast
        blocks = self._active or tuple(range(self.num_layers))
        with torch.inference_mode(), self.precision_context():
            embeds = self._embed(inputs)[0][0]
            hidden = fast.prefill(embeds, blocks, reserve=max_new_tokens)
            session = fast.session(blocks, embeds.shape[0])
            first = int(fast.logits(hidden[-1:]).argmax())
            tokens = greedy_decode(first, lambda token: fast.greedy_step(session, token), self.eos_id, max_new_tokens)
        return GenerationResult(tokens, self.decode_text(tokens))

    # -- batches
    def batch_decoder(self) -> BatchedDecoder:
        """An empty batch over this runtime's decoder (``runtime.batched_decoder``): rows join with
        :meth:`decoder_inputs` of their requests and their :meth:`row_knobs`, and leave as they end.
        Call it under :meth:`batch_context`."""
        return BatchedDecoder(self.decoder, self._all_layers, self.device, self.eos_id)

    @contextmanager
    def batch_context(self) -> Iterator[None]:
        """What every call into a batch runs under: no autograd, the precision rule."""
        with torch.inference_mode(), self.precision_context():
            yield

    def decoder_inputs(self, inputs: ModelInputs) -> torch.Tensor:
        """float32 (tokens, d): the request's prompt embeddings with its image features placed (its
        vision pass), what a row of a batch is prefilled from."""
        return self._embed(inputs)[0][0].float()

    def batch_rows_that_fit(self, tokens_per_row: int, available: int | None = None) -> int:
        """How many rows of ``tokens_per_row`` positions (prompt and answer) the batch's KV cache can
        hold in the device's free memory (the host's on a CPU), beside :data:`BATCH_HEADROOM_BYTES`."""
        if available is None:
            available = (device_available_bytes(self.device) if self.device.type == "cuda"
                         else host_available_bytes())
        if available is None:
            return MAX_BATCH_ROWS
        per_row = self.batch_decoder().bytes_per_position * max(int(tokens_per_row), 1)
        # the cache doubles when it grows: the rows must fit at twice their size
        return max(0, (available - BATCH_HEADROOM_BYTES) // (2 * per_row))

    @property
    def batches(self) -> bool:
        return True

    def generate_batch(self, requests: Sequence[BatchRequest], *,
                       max_rows: int | None = None) -> list[GenerationResult | CtrlError]:
        _check_max_rows(max_rows)
        results: list[GenerationResult | CtrlError | None] = [None] * len(requests)
        pending: list[_PendingRow] = []
        for i, request in enumerate(requests):
            try:
                knobs = self._checked_row(request)
            except CtrlError as exc:
                results[i] = CtrlError(f"request {i}: {exc}")
                continue
            if int(request.max_new_tokens) == 0:
                results[i] = GenerationResult([], "")
            else:
                pending.append(_PendingRow(i, lambda r=request: (self.decoder_inputs(r.inputs), None), knobs,
                                           int(request.max_new_tokens),
                                           int(request.inputs.input_ids.shape[-1]) + int(request.max_new_tokens)))
        if pending:
            self._run_batch(pending, self._rows_at_once(pending, max_rows), results)
        return results  # type: ignore[return-value]

    def answer_prefixes(self, rows: Sequence[PrefixRequest], *,
                        max_rows: int | None = None) -> list[GenerationResult]:
        _check_max_rows(max_rows)
        results: list[GenerationResult | CtrlError | None] = [None] * len(rows)
        pending = []
        for i, row in enumerate(rows):
            if int(row.max_new_tokens) < 1:
                msg = f"row {i}: max_new_tokens must be at least 1, got {row.max_new_tokens!r}"
                raise CtrlError(msg)
            positions = row.prefix.seq_len - row.prefix.extra_tokens + int(row.max_new_tokens)
            pending.append(_PendingRow(i, lambda r=row: self.row_prefix(r.prefix), row.knobs, int(row.max_new_tokens),
                                       positions))
        if pending:
            self._run_batch(pending, self._rows_at_once(pending, max_rows), results)
        for result in results:
            if isinstance(result, CtrlError):
                raise result
        return results  # type: ignore[return-value]

    def row_prefix(self, prefix: PrefixState) -> tuple[torch.Tensor, RowPrefix | None]:
        """A prefix state as a batch row's input: the float32 (prompt tokens, d) hidden state after
        block p-1 (without the budget token; nothing before it attended to it) and blocks 0..p-1's
        K/V (None at p = 0: no block ran, the row is prefilled from its embeddings)."""
        p, seq = prefix.insertion_position, prefix.seq_len - prefix.extra_tokens
        hidden = prefix.hidden[0, :seq].float()
        if not p:
            return hidden, None
        if isinstance(prefix.cache, FastPrefixCache):  # the prompt's positions already
            keys, values = prefix.cache.keys[:p, :, :seq], prefix.cache.values[:p, :, :seq]
        else:
            layers = [prefix.cache.layers[i] for i in range(p)]
            keys = torch.stack([layer.keys[0, :, :seq] for layer in layers])
            values = torch.stack([layer.values[0, :, :seq] for layer in layers])
        return hidden, RowPrefix(p, keys.float(), values.float())

    def _rows_at_once(self, pending: list[_PendingRow], max_rows: int | None) -> int:
        longest = max(row.positions for row in pending)
        fits = self.batch_rows_that_fit(longest)
        if max_rows is not None and int(max_rows) > fits:
            msg = (f"a batch of {max_rows} rows of up to {longest} positions does not fit in the free memory "
                   f"of {self.device}: at most {fits} rows do")
            raise CtrlError(msg)
        return max(1, min(len(pending), MAX_BATCH_ROWS if max_rows is None else int(max_rows), fits))

    def _checked_row(self, request: BatchRequest) -> RowKnobs:
        """A request's knobs, its token limit and its inputs checked before it joins a batch."""
        n = request.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            msg = f"max_new_tokens must be a non-negative integer, got {n!r}"
            raise CtrlError(msg)
        ids = request.inputs.input_ids
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            msg = f"input_ids must be a (1, tokens) tensor with at least one token, got {shape}"
            raise CtrlError(msg)
        limit = self.context_length
        if limit is not None and ids.shape[1] + n > limit:
            msg = f"{ids.shape[1]} prompt tokens and {n} new tokens exceed the model's {limit} positions"
            raise CtrlError(msg)
        return self.row_knobs(top_k=request.top_k, active_blocks=request.active_blocks,
                              num_active_blocks=request.num_active_blocks)

    def _run_batch(self, pending: list[_PendingRow], rows_at_once: int,
                   results: list[GenerationResult | CtrlError | None]) -> None:
        """Rows join as others leave, at most ``rows_at_once`` decoding together, until all are done."""
        batch = self.batch_decoder()
        queue = list(reversed(pending))
        running: dict[int, tuple[int, BatchRow]] = {}
        with self.batch_context():
            while queue or batch.live:
                embeds, prefixes, knobs, limits, order = [], [], [], [], []
                while queue and len(batch.live) + len(order) < rows_at_once:
                    row = queue.pop()
                    try:
                        embed, prefix = row.inputs()
                    except torch.OutOfMemoryError:
                        raise
                    except (CtrlError, ValueError, IndexError, TypeError, RuntimeError) as exc:
                        results[row.index] = CtrlError(f"request {row.index}: its inputs could not be embedded: {exc}")
                        continue
                    embeds.append(embed)
                    prefixes.append(prefix)
                    knobs.append(row.knobs)
                    limits.append(row.max_new_tokens)
                    order.append(row.index)
                if order:
                    for i, joined in zip(order, batch.join(embeds, knobs, limits, prefixes=prefixes), strict=True):
                        running[joined.index] = (i, joined)
                if batch.live:
                    batch.step()
                for key, (i, row) in list(running.items()):
                    if row.done:
                        results[i] = GenerationResult(list(row.tokens), self.decode_text(row.tokens))
                        del running[key]

    @property
    def captured_graphs(self) -> int:
        """Decode steps held as CUDA graphs (0 on the eager path and on a CPU)."""
        return 0 if self.fast is None else self.fast.stats.graphs

    @property
    def graph_captures(self) -> int:
        return sum(fast.graph_captures for fast in self._fast_decoders.values())

    def capture_decode(self, blocks: Sequence[int], positions: int) -> bool:
        """Capture the decode step of ``blocks`` at the current top-K for the window of a request at
        ``positions`` positions now, rather than at its first use (a server's warm-up). Returns
        whether a graph was captured (False without CUDA graphs or when it is held already)."""
        if self.fast is None:
            return False
        with torch.inference_mode(), self.precision_context():
            return self.fast.capture(blocks, positions)

    def capture_prefill(self, blocks: Sequence[int], tokens: int) -> int:
        """Capture the prefill of ``blocks`` at the current top-K for prompts of ``tokens`` tokens'
        bucket now, rather than in the first request of that length (a server's warm-up, between
        requests). Returns the graphs captured (0 without prefill graphs or where they are held)."""
        if self.fast is None:
            return 0
        with torch.inference_mode(), self.precision_context():
            return self.fast.capture_prefill(blocks, tokens)

    # -- two-stage execution (online phase)
    @property
    def hidden_size(self) -> int:
        return int(self.decoder.config.hidden_size)

    def embedding_rms(self) -> float:
        weight = self.decoder.get_input_embeddings().weight
        return float(weight.detach().float().pow(2).mean().sqrt())

    @contextmanager
    def running_layers(self, indices: Sequence[int], final_norm: bool = True) -> Iterator[None]:
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

    def _check_insertion(self, insertion_position: int, lowest: int = 1) -> int:
        if isinstance(insertion_position, bool) or not lowest <= int(insertion_position) < self.num_layers:
            msg = f"insertion position must be in {lowest}..{self.num_layers - 1}, got {insertion_position!r}"
            if lowest and not isinstance(insertion_position, bool) and int(insertion_position) == 0:
                msg += " (position 0 runs no block before stage 2, so there is no latency token to read a budget token)"
            raise KnobError(msg)
        return int(insertion_position)

    def prefill_prefix(self, inputs: ModelInputs, insertion_position: int,
                       extra_embedding: torch.Tensor | None = None) -> PrefixState:
        from transformers import DynamicCache  # deferred: transformers takes seconds to import

        p = self._check_insertion(insertion_position, lowest=0 if extra_embedding is None else 1)
        with torch.no_grad(), self.precision_context():
            embeds, image_feature = self._embed(inputs, image_feature=True)
            if extra_embedding is not None:
                token = extra_embedding.detach().to(self.device, embeds.dtype).reshape(1, 1, -1)
                embeds = torch.cat([embeds, token], dim=1)
            extra = 0 if extra_embedding is None else 1
            if self.fast is not None:
                seq = embeds.shape[1] - extra
                hidden = self.fast.prefill(embeds[0], range(p))[None] if p else embeds
                return PrefixState(inputs, p, embeds, hidden, self.fast.keep_prefix(p, seq),
                                   extra_tokens=extra, image_feature=image_feature)
            cache = DynamicCache(config=self.decoder.config)
            hidden = embeds
            if p:
                with self.running_layers(range(p), final_norm=False):
                    mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
                    out = self.decoder.model(inputs_embeds=embeds, attention_mask=mask, **with_cache(cache),
                                             use_cache=True)
                hidden = out.last_hidden_state
        return PrefixState(inputs, p, embeds, hidden, cache, extra_tokens=0 if extra_embedding is None else 1,
                           image_feature=image_feature)

    def latency_token(self, embeds: torch.Tensor, insertion_position: int) -> torch.Tensor:
        p = self._check_insertion(insertion_position)
        with torch.enable_grad(), self.precision_context(), self.running_layers(range(p), final_norm=False):
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
            out = self.decoder.model(inputs_embeds=embeds.to(self.device), attention_mask=mask, use_cache=False)
        return out.last_hidden_state[0, -1]

    def prefill_suffix(self, prefix: PrefixState, active_blocks: Sequence[int]) -> DecodeState:
        from transformers import DynamicCache  # deferred: transformers takes seconds to import

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
        if isinstance(prefix.cache, FastPrefixCache):
            return self._suffix_fast(prefix, active, suffix, hidden[0])
        mask = torch.ones((1, seq), dtype=torch.long, device=self.device)
        # a fresh cache: the members of a group must not write into the shared prefix's cache
        cache = DynamicCache(config=self.decoder.config)
        with torch.no_grad(), self.precision_context():
            if suffix:
                with self.running_layers(suffix):
                    positions = torch.arange(seq, device=self.device)[None]
                    out = self.decoder.model(inputs_embeds=hidden, attention_mask=mask, position_ids=positions,
                                             **with_cache(cache), use_cache=True)
                hidden = out.last_hidden_state
            else:
                hidden = self.decoder.model.norm(hidden)
            logits = self.decoder.lm_head(hidden[:, -1]).float()[0]
            for i in range(p):  # the prefix's K/V (update() copies: the shared cache stays intact)
                layer = prefix.cache.layers[i]
                cache.update(layer.keys[:, :, :seq], layer.values[:, :, :seq], i)
        return DecodeState(cache, active, mask, logits)

    def _suffix_fast(self, prefix: PrefixState, active: tuple[int, ...], suffix: list[int],
                     hidden: torch.Tensor) -> DecodeState:
        if self.fast is None:
            msg = "a prefix state of the fast path needs the fast path (it was turned off since)"
            raise RuntimeError(msg)
        with torch.no_grad(), self.precision_context():
            self.fast.restore_prefix(prefix.cache)
            if suffix:
                hidden = self.fast.prefill(hidden, suffix)
            logits = self.fast.logits(hidden[-1:])
        return DecodeState(self.fast.session(active, hidden.shape[0]), active, None, logits)

    def decode_step(self, state: DecodeState, token: int) -> None:
        if isinstance(state.cache, FastSession):  # decoded by the fast path that prefilled it
            with torch.no_grad(), self.precision_context():
                state.logits = state.cache.decoder.step(state.cache, token)
            return
        state.attention_mask = torch.cat([state.attention_mask, state.attention_mask.new_ones((1, 1))], dim=1)
        with torch.no_grad(), self.precision_context(), self.running_layers(state.active_blocks):
            out = self.decoder(input_ids=torch.tensor([[int(token)]], device=self.device),
                               attention_mask=state.attention_mask, **with_cache(state.cache), use_cache=True,
                               logits_to_keep=1)
        state.logits = out.logits[0, -1].float()

    @property
    def decoder_layers(self) -> Sequence[nn.Module]:
        return list(self._all_layers)
