"""What the worker does with each generated token: pick it (greedy, or seeded temperature / top-p
sampling) and turn the tokens so far into text, stopping at a stop sequence.

:class:`TextStream` detokenises incrementally: after each token it decodes all the tokens so far
and passes on the part of the text that can no longer change or be cut (a stream's deltas), so
the deltas concatenate to exactly the text a non-streaming reply returns (where the tokenizer only
rewrites what these rules hold back). It holds back

* trailing U+FFFD: the start of a multi-byte character whose remaining bytes are still to come;
* trailing whitespace, and a trailing ``" '"``, ``" n"`` or ``" n'"``: a tokenizer's clean-up
  (``clean_up_tokenization_spaces``: ``" ."`` -> ``"."``, ``" n't"`` -> ``"n't"``) may still
  rewrite them when the next token comes;
* the longest tail that is the start of a stop sequence, until it is known not to be one.

The controller's decisions were trained on greedy answers: sampling changes the text, not the
knobs it chose (docs/serving.md#requests).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import torch

#: endings a tokenizer's clean-up of spaces may still rewrite once more text follows
#: (the proper prefixes of transformers' patterns " .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", ...)
_UNSETTLED_ENDINGS = (" n'", " n", " '")


def held_back(text: str, stop: Sequence[str] = ()) -> int:
    """How many characters at the end of ``text`` may still change or turn out to start a stop
    sequence, and so must not be sent yet."""
    trimmed = text.rstrip("\ufffd")
    unsettled = len(text) - len(trimmed)
    spaces = len(trimmed) - len(trimmed.rstrip())
    if spaces:
        unsettled += spaces
    else:
        unsettled += next((len(e) for e in _UNSETTLED_ENDINGS if trimmed.endswith(e)), 0)
    for s in stop:  # the longest tail that is a proper prefix of a stop sequence
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if k <= unsettled:
                break
            if text.endswith(s[:k]):
                unsettled = k
                break
    return unsettled


class TextStream:
    """The text of the tokens generated so far, cut before the first stop sequence; ``emit`` (when
    given) receives each part of it that is settled, in order (called from the worker thread)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (),
                 emit: Callable[[str], None] | None = None) -> None:
        self._decode, self.stop, self._emit = decode, tuple(stop), emit
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0  # characters of ``text`` passed to ``emit``
        #: the stop sequence that ended the text, None while none has
        self.stop_hit: str | None = None

    def push(self, token: int) -> bool:
        """Add one token; True when the text now holds a stop sequence (generation should stop)."""
        self.tokens.append(int(token))
        text = self._decode(self.tokens)
        # a stop sequence cannot start before what was sent: that part was held back while it could
        found = [(i, s) for s in self.stop if (i := text.find(s, self.sent)) >= 0]
        if found:
            cut, self.stop_hit = min(found)
            self.text = text[:cut]
            self._send(len(self.text))
            return True
        self.text = text
        self._send(len(text) - held_back(text, self.stop))
        return False

    def finish(self) -> str:
        """Send what was held back (generation has ended) and return the whole text."""
        if self.stop_hit is None:
            self._send(len(self.text))
        return self.text

    def _send(self, end: int) -> None:
        if end > self.sent:
            delta, self.sent = self.text[self.sent:end], end
            if self._emit is not None:
                self._emit(delta)


def draw_seed() -> int:
    """A random seed for a sampled request that gave none (recorded, so its answer can be reproduced)."""
    return secrets.randbits(63)


class TokenPicker:
    """The next token from a decode step's logits: the argmax at temperature 0, else a sample at
    ``temperature`` from the smallest set of tokens holding ``top_p`` of the probability, drawn
    with a generator of its own on the logits' device (same seed, same logits: same tokens)."""

    def __init__(self, temperature: float, top_p: float, seed: int | None, device: torch.device) -> None:
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.generator: torch.Generator | None = None
        if self.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed((draw_seed() if seed is None else int(seed)) & 0xFFFF_FFFF_FFFF_FFFF)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.generator is None:
            return int(logits.argmax())
        return sample_token(logits, self.temperature, self.top_p, self.generator)


#: temperatures below this decode greedily: the logits divided by them overflow float32
MIN_TEMPERATURE = 1e-4


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token drawn from softmax(logits / temperature) restricted to its top-p nucleus: the most
    probable tokens up to and including the one at which their mass reaches ``top_p``.

    Drawn by inverting the cumulative distribution with one uniform number, and the nucleus found
    among the top tokens (more of them only while their mass falls short): a sort or a multinomial
    over the whole vocabulary costs milliseconds a token on a CPU."""
    logits = logits.float().reshape(-1)
    if temperature < MIN_TEMPERATURE:  # the limit of softmax(l / t) as t -> 0; dividing would overflow
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    order = None
    if top_p < 1.0:
        k = min(probs.numel(), 64)
        top, order = probs.topk(k)
        while k < probs.numel() and float(top.sum()) < top_p:
            k = min(probs.numel(), k * 8)
            top, order = probs.topk(k)
        before = top.cumsum(0) - top  # the mass of the more probable tokens
        outside = before >= top_p
        outside[0] = False  # the most probable token always stays (a top_p below float32's range reads as 0)
        probs = top.masked_fill(outside, 0.0)
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=generator, device=cdf.device, dtype=cdf.dtype) * cdf[-1]
    index = torch.searchsorted(cdf, u, right=True).clamp_max(cdf.numel() - 1)
    return int(index if order is None else order[index])
