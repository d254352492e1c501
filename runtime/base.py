"""The one model interface: what features/, online/, the profiler and the testbed call.

Two backends implement it: the embedded MolmoE-shaped model (``runtime.embedded``,
built offline from a seed) and a real MolmoE-1B checkpoint directory
(``runtime.molmoe``, implemented natively). Knob changes are always scoped:
``with runtime.knobs(top_k=4, num_active_blocks=12): ...`` restores the model on exit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pipeline import knobs
from pipeline.errors import CtrlError, KnobError, ModelLoadError

#: the crop setting at which the reference image feature is extracted (documented in docs/features.md)
REFERENCE_MAX_CROPS = 6


def resolve_device(device: str | torch.device) -> torch.device:
    """``torch.device`` for a name; a CUDA device that is not available is a user error."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        msg = f"device {device!r} requested but CUDA is not available"
        raise ModelLoadError(msg)
    return dev


def validate_top_k(top_k: int | Mapping[int, int], num_layers: int, num_experts: int) -> dict[int, int]:
    """The ``set_top_k`` argument as {layer: k}, every k an int in 1..num_experts (shared by backends)."""
    items = {i: top_k for i in range(num_layers)} if not isinstance(top_k, Mapping) else dict(top_k)
    out: dict[int, int] = {}
    for layer, k in items.items():
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < num_layers:
            msg = f"top_k layer index must be in 0..{num_layers - 1}, got {layer!r}"
            raise KnobError(msg)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= num_experts:
            msg = f"top_k must be an integer in 1..{num_experts}, got {k!r}"
            raise KnobError(msg)
        out[int(layer)] = int(k)
    return out


def validate_active_blocks(blocks: Sequence[int] | None, num_layers: int) -> tuple[int, ...] | None:
    """Sorted unique block indices containing 0, or None for all blocks (shared by backends)."""
    if blocks is None:
        return None
    if any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) for b in blocks):
        msg = f"active blocks must be integers, got {list(blocks)!r}"
        raise KnobError(msg)
    chosen = sorted({int(b) for b in blocks})
    if not chosen or chosen[0] != 0:
        msg = f"active blocks must include block 0, got {list(blocks)!r}"
        raise KnobError(msg)
    if chosen[-1] >= num_layers:
        msg = f"active blocks must be in 0..{num_layers - 1}, got {list(blocks)!r}"
        raise KnobError(msg)
    return None if len(chosen) == num_layers else tuple(chosen)


def resolve_importance_scores(scores: str | Path | Mapping[int, float] | None) -> dict[int, float] | None:
    """An importance file (``pipeline.knobs.load_importance_scores``) or mapping as {block: score}."""
    if scores is None:
        return None
    if isinstance(scores, Mapping):
        return {int(k): float(v) for k, v in scores.items()}
    return knobs.load_importance_scores(scores)


@dataclass
class ModelInputs:
    """One preprocessed request.

    input_ids: int64, shape (1, seq_len): the prompt as the model sees it, image placeholder
        tokens included.
    attention_mask: int64, shape (1, seq_len).
    images: float32, the global image first then the crops (first dimension num_crops + 1) in
        the backend's layout (embedded: (n, 3, crop_px, crop_px); MolmoE: Molmo's patchified
        (n, patches, patch_px * patch_px * 3)); None for a text-only request.
    image_token_positions: int64, shape (num_image_tokens,): where image features replace
        placeholder embeddings; None without an image.
    tiling: (rows, cols) chosen by the tiling rule; None without an image.
    prompt: the formatted prompt text.
    num_text_tokens: tokens of the formatted prompt text alone (no BOS, no image tokens).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    images: torch.Tensor | None
    image_token_positions: torch.Tensor | None
    tiling: tuple[int, int] | None
    prompt: str
    num_text_tokens: int = 0

    @property
    def num_crops(self) -> int:
        return 0 if self.tiling is None else self.tiling[0] * self.tiling[1]


def greedy_decode(first_token: int, next_token: Callable[[int], int], eos_id: int, max_new_tokens: int,
                  until: Callable[[int], bool] | None = None) -> list[int]:
    """The token loop every generation path shares.

    ``first_token`` comes from the prefill's last logits; ``next_token(previous)`` runs one decode
    step with ``previous`` as input and returns the next token (its argmax; a server may sample).
    Stops after EOS (kept), after ``max_new_tokens`` tokens, or once ``until(token)`` is true for
    the token just added (a server's stop sequence).
    """
    if max_new_tokens < 1:
        return []
    tokens = [int(first_token)]
    while not (until is not None and until(tokens[-1])) and tokens[-1] != eos_id and len(tokens) < max_new_tokens:
        tokens.append(int(next_token(tokens[-1])))
    return tokens


@dataclass
class GenerationResult:
    """Generated token ids (without the prompt, EOS included when produced) and their text."""

    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class RowKnobs:
    """One request's configuration as the decoder runs it: its active blocks (sorted, block 0 first)
    and its top-K per block (one entry per decoder block, skipped ones included)."""

    blocks: tuple[int, ...]
    top_k: tuple[int, ...]


@dataclass
class BatchRequest:
    """One row of :meth:`ModelRuntime.generate_batch`: a request's inputs, its token limit and its
    own knobs. ``top_k``: every block's (int) or some blocks' (mapping; the others keep the
    runtime's current); ``active_blocks`` explicitly or ``num_active_blocks`` by the importance rule.
    A knob left None is the runtime's current one (``runtime.knobs(...)`` around the call sets them)."""

    inputs: ModelInputs
    max_new_tokens: int = 16
    top_k: int | Mapping[int, int] | None = None
    active_blocks: Sequence[int] | None = None
    num_active_blocks: int | None = None


@dataclass
class PrefixRequest:
    """One row of :meth:`ModelRuntime.answer_prefixes`: a request continued from its prefix
    (:meth:`ModelRuntime.prefill_prefix`) with the knobs of :meth:`ModelRuntime.knobs_after_prefix`."""

    prefix: PrefixState
    knobs: RowKnobs
    max_new_tokens: int = 16


@dataclass
class ImageFeatures:
    """Both image features of a batch of requests, from one vision pass: float32, shape
    (len(batch), image_feature_dim) each, on the CPU, zero rows for text-only requests.

    all_tokens: the projected image tokens mean-pooled over every token the request places (the
        global image and all crops, at the request's max_crops): the reference feature,
        extracted at ``REFERENCE_MAX_CROPS`` for analysis. A server never computes it: stage 1
        picks the crops before the vision tower runs.
    global_crop: the same mean over the global image's tokens alone (the first image array: the
        whole image resized to one crop). The vision tower encodes every array on its own, so
        this is identical at every max_crops and the request's own vision pass yields it; it is
        what stage 2 of the controller reads (``PrefixState.image_feature`` during a request).
    """

    all_tokens: torch.Tensor
    global_crop: torch.Tensor


def image_token_mean(tokens: torch.Tensor) -> torch.Tensor:
    """(tokens, d) -> float32 (d,) on the CPU: the one reduction every image feature uses, so a
    feature computed at extraction and the same feature computed during a request agree bit for bit."""
    return tokens.float().mean(0).cpu()


@dataclass
class PrefixState:
    """A prefill run up to the insertion point (two-stage online execution, docs/origin_format.md §7.3).

    Shared by every rollout with the same (request, crops, insertion position): blocks before
    the insertion point run with the model's default top-K whatever stage 2 later chooses.

    insertion_position: p; blocks 0..p-1 have run (p = 0: none, the state holds the decoder
        inputs; stage 2 then runs between the vision tower and block 0).
    embeds: (1, seq, d) decoder inputs: text embeddings, image features scattered in and the
        extra (budget) token appended last when one was given. Detached: reusable for a
        gradient-carrying recompute (:meth:`ModelRuntime.latency_token`).
    hidden: (1, seq, d) residual stream after block p-1 (no final norm); ``embeds`` when p = 0.
    cache: backend KV cache holding blocks 0..p-1 (read-only for the members).
    extra_tokens: 1 when the budget token was appended. It is read by stage 2 (the latency
        token) and then dropped: :meth:`ModelRuntime.prefill_suffix` continues with the prompt
        alone, so the answer is the model's own for the chosen knobs. A model never trained
        with such a token answers from it badly (the trained testbed emitted EOS at once).
    image_feature: float32 (d,) on the CPU: the global-crop image feature
        (:attr:`ImageFeatures.global_crop`) from this request's own vision pass, equal to the
        one ``ctrl extract-features`` caches; None for a text-only request.
    """

    inputs: ModelInputs
    insertion_position: int
    embeds: torch.Tensor
    hidden: torch.Tensor
    cache: object
    extra_tokens: int = 0
    image_feature: torch.Tensor | None = None

    @property
    def latency_token(self) -> torch.Tensor:
        """(d,): the hidden state of the last position after the insertion block."""
        return self.hidden[0, -1]

    @property
    def seq_len(self) -> int:
        return int(self.hidden.shape[1])


@dataclass
class DecodeState:
    """One rollout after its prefill: cache with every active block (a ``FastSession`` on the fast
    path), the active blocks, the attention mask so far and the logits of the last position
    (float32, (vocab,))."""

    cache: object
    active_blocks: tuple[int, ...]
    #: the eager path's mask over the positions so far (None on the fast path, whose cache counts them)
    attention_mask: torch.Tensor | None
    logits: torch.Tensor

    @property
    def positions(self) -> int:
        """Positions in the cache so far: the prompt's and one per decode step."""
        if self.attention_mask is None:
            return int(self.cache.position)  # type: ignore[attr-defined]
        return int(self.attention_mask.shape[1])


class ModelRuntime(ABC):
    """Load once, then preprocess / extract features / generate with knobs."""

    #: "embedded" or "molmoe"
    kind: str
    #: identifies weights + config + preprocessing + dtype: cached features are keyed by it
    fingerprint: str
    #: the dtype the weights are held in (``runtime.precision``)
    dtype: torch.dtype = torch.float32
    #: whether a question without an image gets a meaningful answer (False for a model trained on image
    #: questions only: the testbed); ``ctrl serve`` refuses image-less requests to such a model
    answers_without_image: bool = True
    num_layers: int
    num_experts: int
    default_top_k: int
    device: torch.device

    # -- preprocessing
    @abstractmethod
    def format_prompt(self, question: str) -> str:
        """The prompt text the model is given for a question."""

    @abstractmethod
    def tiling(self, width: int, height: int, max_crops: int) -> tuple[int, int]:
        """(rows, cols) the preprocessor would use for an image of this size (no pixels needed)."""

    @abstractmethod
    def preprocess(self, image: Image.Image | None, question: str, max_crops: int) -> ModelInputs:
        """Tokenize the formatted prompt and cut the image into crops + 1 global image."""

    # -- features
    @property
    @abstractmethod
    def image_feature_dim(self) -> int: ...

    @property
    @abstractmethod
    def lang_feature_dim(self) -> int: ...

    @abstractmethod
    def encode_images(self, batch: Sequence[ModelInputs]) -> ImageFeatures:
        """Both image features of each request (see :class:`ImageFeatures`) from one pass of
        the vision backbone (after pooling and projection)."""

    def image_features(self, batch: Sequence[ModelInputs]) -> torch.Tensor:
        """float32, shape (len(batch), image_feature_dim): the vision backbone's output
        (after pooling and projection) mean-pooled over all image tokens of each request."""
        return self.encode_images(batch).all_tokens

    def global_image_features(self, batch: Sequence[ModelInputs]) -> torch.Tensor:
        """float32, shape (len(batch), image_feature_dim): the mean of each request's global-crop
        tokens, the feature stage 2 reads (identical at every max_crops)."""
        return self.encode_images(batch).global_crop

    @abstractmethod
    def text_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input-embedding table (``wte``) applied to ids: shape (*input_ids.shape, dim)."""

    @abstractmethod
    def lang_features(self, questions: Sequence[str]) -> torch.Tensor:
        """float32, shape (len(questions), lang_feature_dim): mean of the input embeddings of
        each formatted prompt's text tokens (image placeholders excluded)."""

    # -- knobs
    @abstractmethod
    def set_top_k(self, top_k: int | Mapping[int, int]) -> None:
        """MoE top-K for every decoder layer (int) or per layer index (mapping; others keep theirs)."""

    @abstractmethod
    def current_top_k(self) -> list[int]:
        """The top-K each decoder layer uses now."""

    #: the active decoder blocks (None: all) and the importance scores; set by subclasses
    _active: tuple[int, ...] | None = None
    _scores: dict[int, float] | None = None

    def set_active_blocks(self, blocks: Sequence[int] | None) -> None:
        """Run only these decoder blocks (must include 0); None runs all."""
        self._active = validate_active_blocks(blocks, self.num_layers)

    def current_active_blocks(self) -> list[int]:
        return list(range(self.num_layers)) if self._active is None else list(self._active)

    @contextmanager
    def knobs(self, *, top_k: int | Mapping[int, int] | None = None, num_active_blocks: int | None = None,
              active_blocks: Sequence[int] | None = None) -> Iterator[ModelRuntime]:
        """Apply knobs for the duration of the block, then restore the previous state.

        ``num_active_blocks`` picks blocks with the runtime's importance rule
        (``pipeline.knobs.select_active_blocks``); ``active_blocks`` gives them explicitly.
        """
        saved_top_k, saved_blocks = self.current_top_k(), self.current_active_blocks()
        try:
            if top_k is not None:
                self.set_top_k(top_k)
            if active_blocks is not None and num_active_blocks is not None:
                msg = "pass num_active_blocks or active_blocks, not both"
                raise ValueError(msg)
            if num_active_blocks is not None:
                active_blocks = self.blocks_for(num_active_blocks)
            if active_blocks is not None:
                self.set_active_blocks(active_blocks)
            yield self
        finally:
            self.set_top_k(dict(enumerate(saved_top_k)))
            self.set_active_blocks(saved_blocks if len(saved_blocks) < self.num_layers else None)

    def blocks_for(self, num_active_blocks: int, first_kept: int = 1) -> tuple[int, ...]:
        """The blocks kept for a block count (importance file if given, else the default rule);
        blocks 0..first_kept-1 always run (the online insertion position)."""
        try:
            return knobs.select_active_blocks(int(num_active_blocks), self.num_layers, self._scores,
                                              first_kept=int(first_kept))
        except ValueError as exc:
            raise KnobError(str(exc)) from exc

    @property
    def execution(self) -> dict[str, object]:
        """The execution path, as recorded beside measured latencies (``compiled``: the fast path,
        ``cuda_graphs``, ``attention_dtype``); a runtime without a fast path runs the eager one."""
        return {"compiled": False, "cuda_graphs": False, "attention_dtype": "float32"}

    @property
    def graph_captures(self) -> int:
        """CUDA graph captures run since the model loaded (decode steps, prefill blocks, the vision
        path): a served request during which it grew paid a capture (0 without graphs)."""
        return 0

    # -- limits and cancellation
    @property
    def context_length(self) -> int | None:
        """The longest sequence the model was built for (its position range), None where unknown."""
        return None

    def prompt_token_count(self, question: str) -> int:
        """Tokens of the question's formatted prompt, as :meth:`preprocess` tokenizes it (no image tokens)."""
        return int(self.preprocess(None, question, 1).num_text_tokens)

    @contextmanager
    def between_blocks(self, check: Callable[[int], None]) -> Iterator[None]:
        """Call ``check(i)`` before decoder block i runs, in every forward inside the ``with`` block.

        An exception ``check`` raises stops the forward there: a prefill whose request is no longer
        wanted ends within one block's time instead of running every block (the runtimes restore
        their knobs and layer lists on the way out)."""
        handles = [layer.register_forward_pre_hook(lambda _module, _args, i=i: check(i))
                   for i, layer in enumerate(self.decoder_layers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    # -- generation
    #: the end-of-sequence token id (generation stops after it)
    eos_id: int

    def special_texts(self) -> tuple[str, ...]:
        """The texts the tokenizer reads as one of its special tokens (the image placeholders, the end
        of text...): a question that spells one would be tokenized as that token, not as text."""
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is None:
            return ()
        texts = set(getattr(tokenizer, "all_special_tokens", ()))
        texts.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                     if getattr(t, "special", False))
        return tuple(sorted(t for t in texts if t))

    def decode_text(self, token_ids: Sequence[int]) -> str:
        """Generated ids as text, special tokens skipped (what the metrics score)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)  # type: ignore[attr-defined]

    def row_knobs(self, *, top_k: int | Mapping[int, int] | None = None, active_blocks: Sequence[int] | None = None,
                  num_active_blocks: int | None = None) -> RowKnobs:
        """One request's knobs resolved against the runtime's current ones (checked: KnobError)."""
        per_block = self.current_top_k()
        if top_k is not None:
            for i, k in validate_top_k(top_k, self.num_layers, self.num_experts).items():
                per_block[i] = k
        if active_blocks is not None and num_active_blocks is not None:
            msg = "pass num_active_blocks or active_blocks, not both"
            raise KnobError(msg)
        if num_active_blocks is not None:
            active_blocks = self.blocks_for(num_active_blocks)
        if active_blocks is None:
            blocks = tuple(self.current_active_blocks())
        else:
            blocks = validate_active_blocks(active_blocks, self.num_layers) or tuple(range(self.num_layers))
        return RowKnobs(blocks, tuple(per_block))

    def knobs_after_prefix(self, insertion_position: int, top_k: int, num_active_blocks: int) -> RowKnobs:
        """The knobs of a request continued from its prefix at insertion point p: ``top_k`` in blocks
        p.. (blocks before p keep the current top-K they ran with) and the blocks kept for
        ``num_active_blocks`` (blocks 0..p-1 always: they ran)."""
        p = int(insertion_position)
        return self.row_knobs(top_k={i: int(top_k) for i in range(p, self.num_layers)},
                              active_blocks=self.blocks_for(num_active_blocks, first_kept=max(p, 1)))

    @abstractmethod
    def generate(self, inputs: ModelInputs, max_new_tokens: int = 16, *, top_k: int | Mapping[int, int] | None = None,
                 active_blocks: Sequence[int] | None = None,
                 num_active_blocks: int | None = None) -> GenerationResult:
        """Greedy decoding, KV cache on, with this request's knobs (each one left None: the
        runtime's current)."""

    def generate_batch(self, requests: Sequence[BatchRequest], *,
                       max_rows: int | None = None) -> list[GenerationResult | CtrlError]:
        """Greedy decoding of many requests in shared passes, each with its own knobs; one result per
        request, in order: its generation, or the error that refused it (the others still run).
        ``max_rows`` bounds the rows decoding at once (None: the runtime's choice); the rest join
        as rows leave."""
        msg = f"the {self.kind} runtime does not implement batched generation"
        raise CtrlError(msg)

    @property
    def batches(self) -> bool:
        """Whether :meth:`generate_batch` and :meth:`answer_prefixes` run (not only refuse)."""
        return False

    def answer_prefixes(self, rows: Sequence[PrefixRequest], *,
                        max_rows: int | None = None) -> list[GenerationResult]:
        """Greedy decoding of many requests from their prefixes in shared passes: each row's prefill
        continues from its prefix without the budget token (as :meth:`prefill_suffix`) with its own
        knobs, then its decode steps; one result per row, in order. ``max_rows`` as in
        :meth:`generate_batch`. The prefixes are not modified."""
        msg = f"the {self.kind} runtime does not implement batched generation"
        raise CtrlError(msg)

    # -- two-stage execution (online phase): prefill split at the insertion position
    @property
    def hidden_size(self) -> int:
        """Width of the decoder's residual stream (the budget token's size)."""
        raise self._no_two_stage()

    def embedding_rms(self) -> float:
        """Root mean square of the input-embedding table: the scale a budget token should have."""
        raise self._no_two_stage()

    def _no_two_stage(self) -> CtrlError:
        return CtrlError(f"the {self.kind} runtime does not implement two-stage online execution "
                         "(prefill_prefix / prefill_suffix / decode_step), which ctrl train --online needs")

    def prefill_prefix(self, inputs: ModelInputs, insertion_position: int,
                       extra_embedding: torch.Tensor | None = None) -> PrefixState:
        """Embed (vision tower included), append ``extra_embedding`` (d,) as the last position,
        and run blocks 0..p-1 of the prefill with the current top-K of those blocks; the state
        carries the request's global-crop image feature. p = 0 (only without
        ``extra_embedding``: the latency token needs a block) runs no block, so that
        :meth:`prefill_suffix` runs every active block with the top-K then chosen."""
        raise self._no_two_stage()

    def latency_token(self, embeds: torch.Tensor, insertion_position: int) -> torch.Tensor:
        """Blocks 0..p-1 on ``embeds`` without cache, autograd on: the last position's hidden
        state (d,), differentiable w.r.t. ``embeds`` (trains the budget token through the LLM)."""
        raise self._no_two_stage()

    def prefill_suffix(self, prefix: PrefixState, active_blocks: Sequence[int]) -> DecodeState:
        """Finish the prefill from ``prefix`` without its extra (budget) token, with the active
        blocks >= p (current top-K), then the final norm and LM head: the first token comes
        from the last prompt position. ``prefix`` is not modified: many members share it."""
        raise self._no_two_stage()

    def decode_step(self, state: DecodeState, token: int) -> None:
        """One decode step with the state's active blocks: appends ``token`` and updates the
        state's logits, cache and attention mask (no token is added besides ``token``)."""
        raise self._no_two_stage()

    # -- module handles for hooks (online latency measurement)
    @property
    @abstractmethod
    def vision_module(self) -> torch.nn.Module: ...

    @property
    @abstractmethod
    def decoder_layers(self) -> Sequence[torch.nn.Module]:
        """All decoder blocks in order, whether active or not."""
