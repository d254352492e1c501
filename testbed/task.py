"""The testbed task: a seeded procedural visual question answering set, generated offline.

Every sample is one image (224-448 px per side, varying aspect ratio, a plain background) and
one question about it. The default question families differ in what the knobs buy them:

============  ====================================  ==========================================
family        question                              what it needs
============  ====================================  ==========================================
``color``     What color is the background?         coarse: the global image suffices
``presence``  Is there a big shape?                 coarse: one big shape (or none), visible
                                                    at one crop
``texture``   What pattern is the background?       detail: ``plain``, ``lines`` or ``grid``,
                                                    the background colour +- a delta in 1-2 px
                                                    stripes or checks (mean-preserving): the
                                                    112-px global view averages it away, only
                                                    crops show it
``mix``       What color is the background mixed    a fact held in the weights: a made-up
              with blue?                            table of 64 (background, colour) pairs
                                                    (:func:`mix_of`), which only the decoder's
                                                    experts can hold: more experts and blocks
                                                    answer it better
============  ====================================  ==========================================

More families can be drawn (``TaskSpec(families=...)``): ``relation`` (What color is the shape
on the left? two shapes), ``dot`` (What color is the small dot? one dot of 2-4 px radius),
``speck`` (Is there a small dot?), ``count`` (How many small dots are there? 1-4) and
``digit`` (What digit is on the label? a 3x5-pixel-font digit scaled x2-x3). They are not in
the default mix: the last four did not get beyond their answer priors in training runs of
minutes on 2 CPU cores, and ``relation`` gave its training time to ``mix`` (docs/decisions.md).

Answers are single short words or digits (colours, ``yes``/``no``, digits), stored ten times
as the ``answers`` list (like the ten human answers of VQA v2, so the VQA score of a correct
answer is 1). Glyphs are drawn from a built-in 3x5 bitmap font, never from a system font, so
the output is byte-identical for a seed on any machine with the same Pillow/zlib (PNG
encoding is deterministic): sample ``i`` is drawn from its own generator seeded by
``(seed, i)``, so a larger set of the same seed starts with the smaller one, and its family is
``families[i % len(families)]``.
"""

from __future__ import annotations

import functools
import hashlib
import io
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from testbed.dataset import VqaSample, read_dataset, write_dataset

__all__ = ["COLORS", "DIGITS", "EXTRA_FAMILIES", "FAMILIES", "TaskSpec", "generate_dataset", "make_sample", "mix_of"]

#: the palette: name -> RGB (names are single tokens of the embedded tokenizer)
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 60, 220), "yellow": (235, 215, 40),
    "purple": (140, 40, 170), "orange": (240, 130, 20), "white": (245, 245, 245), "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle")
#: digits the ``digit`` family prints (visually distinct in the 3x5 font)
DIGITS = "1478"
#: the default families (a generated set cycles through them)
FAMILIES = ("color", "presence", "texture", "mix")
#: further families the generator can draw (``TaskSpec(families=...)``); the default training
#: recipe does not learn them (see the module docstring)
EXTRA_FAMILIES = ("relation", "dot", "speck", "count", "digit")
#: the ``texture`` family's patterns (the answers: "plain" 2 tokens, the others 4 with the embedded tokenizer)
TEXTURES = ("plain", "lines", "grid")
#: per-channel +- of a pattern around the background colour (less where the colour is near 0 or 255)
TEXTURE_CONTRAST = 60
#: how many times the answer is repeated in ``answers`` (VQA v2 has ten human answers)
NUM_ANSWERS = 10

# a 3x5 bitmap font: rows top to bottom, "#" = ink
_FONT = {
    "0": ("###", "#.#", "#.#", "#.#", "###"), "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"), "3": ("###", "..#", "###", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"), "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"), "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"), "9": ("###", "#.#", "###", "..#", "###"),
}


@dataclass(frozen=True)
class TaskSpec:
    """What a generated set looks like (all sizes in pixels)."""

    min_side: int = 224
    max_side: int = 448
    #: the families drawn, in turn: sample i has family ``families[i % len(families)]``
    families: tuple[str, ...] = FAMILIES

    def __post_init__(self) -> None:
        unknown = [f for f in self.families if f not in FAMILIES + EXTRA_FAMILIES]
        if unknown or not self.families:
            msg = f"unknown or no families {unknown}; known: {', '.join(FAMILIES + EXTRA_FAMILIES)}"
            raise ValueError(msg)
        if not 16 <= self.min_side <= self.max_side:
            msg = f"need 16 <= min_side <= max_side, got {self.min_side}, {self.max_side}"
            raise ValueError(msg)


# -- drawing ----------------------------------------------------------------------------------

def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        s = r * 0.9
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    else:  # triangle, pointing up
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)


def _draw_glyph(draw: ImageDraw.ImageDraw, char: str, x: int, y: int, scale: int, fill) -> None:
    for row, bits in enumerate(_FONT[char]):
        for col, bit in enumerate(bits):
            if bit == "#":
                draw.rectangle((x + col * scale, y + row * scale, x + (col + 1) * scale - 1,
                                y + (row + 1) * scale - 1), fill=fill)


def _other_colors(rng: random.Random, exclude: Sequence[str], n: int) -> list[str]:
    return rng.sample([c for c in COLORS if c not in exclude], n)


def _place(rng: random.Random, w: int, h: int, r: float, taken: list[tuple[float, float, float]],
           gap: float = 4.0) -> tuple[float, float]:
    """A centre for a disc of radius r inside the image, not overlapping ``taken`` (best effort)."""
    for _ in range(200):
        cx, cy = rng.uniform(r + 2, w - r - 2), rng.uniform(r + 2, h - r - 2)
        if all((cx - x) ** 2 + (cy - y) ** 2 > (r + rr + gap) ** 2 for x, y, rr in taken):
            break
    taken.append((cx, cy, r))
    return cx, cy


def _clutter(rng: random.Random, draw: ImageDraw.ImageDraw, w: int, h: int, background: str,
             taken: list[tuple[float, float, float]], n: int) -> None:
    """Medium shapes that are not the answer: they make the coarse questions less trivial."""
    for _ in range(n):
        r = rng.uniform(0.06, 0.1) * min(w, h)
        cx, cy = _place(rng, w, h, r, taken)
        _draw_shape(draw, rng.choice(("square", "triangle")), cx, cy, r, COLORS[_other_colors(rng, [background], 1)[0]])


# -- families ---------------------------------------------------------------------------------

def _color(rng, image, w, h, bg):
    draw = ImageDraw.Draw(image)
    taken: list = []
    _clutter(rng, draw, w, h, bg, taken, rng.randint(1, 3))
    return "What color is the background?", bg


def _presence(rng, image, w, h, bg):
    draw = ImageDraw.Draw(image)
    present = rng.random() < 0.5
    if present:
        r = rng.uniform(0.18, 0.26) * min(w, h)
        cx, cy = _place(rng, w, h, r, [])
        _draw_shape(draw, rng.choice(SHAPES), cx, cy, r, COLORS[_other_colors(rng, [bg], 1)[0]])
    return "Is there a big shape?", "yes" if present else "no"


def _dot_radius(w: int, h: int) -> float:
    return max(2.0, min(w, h) / 110)  # 2-4 px: about a pixel in the 112-px global view


def _dot(rng, image, w, h, bg):
    draw = ImageDraw.Draw(image)
    color = _other_colors(rng, [bg], 1)[0]
    r = _dot_radius(w, h)
    cx, cy = _place(rng, w, h, r, [])
    _draw_shape(draw, "circle", cx, cy, r, COLORS[color])
    return "What color is the small dot?", color


def _speck(rng, image, w, h, bg):
    draw = ImageDraw.Draw(image)
    present = rng.random() < 0.5
    if present:
        r = _dot_radius(w, h)
        cx, cy = _place(rng, w, h, r, [])
        _draw_shape(draw, "circle", cx, cy, r, COLORS["black" if bg in ("white", "yellow", "orange") else "white"])
    return "Is there a small dot?", "yes" if present else "no"


def _count(rng, image, w, h, bg):
    draw = ImageDraw.Draw(image)
    taken: list = []
    n = rng.randint(1, 4)
    dot = "black" if bg in ("white", "yellow", "orange") else "white"  # high contrast, as printed dots
    r = _dot_radius(w, h)
    for _ in range(n):
        cx, cy = _place(rng, w, h, r, taken, gap=6 * r)
        _draw_shape(draw, "circle", cx, cy, r, COLORS[dot])
    return "How many small dots are there?", str(n)


def _digit(rng, image, w, h, bg):
    draw = ImageDraw.Draw(image)
    digit = rng.choice(DIGITS)
    scale = 2 if min(w, h) < 336 else 3
    gw, gh = 3 * scale, 5 * scale
    pad = scale
    label_bg, ink = ("white", "black") if bg not in ("white", "yellow") else ("black", "white")
    x = rng.randint(4, w - gw - 2 * pad - 4)
    y = rng.randint(4, h - gh - 2 * pad - 4)
    draw.rectangle((x, y, x + gw + 2 * pad - 1, y + gh + 2 * pad - 1), fill=COLORS[label_bg])
    _draw_glyph(draw, digit, x + pad, y + pad, scale, COLORS[ink])
    return "What digit is on the label?", digit


def mix_of(background: str, color: str) -> str:
    """The answer of a ``mix`` question: a made-up mixing table over the palette (seeded, fixed),
    each (background, colour) pair to a palette colour drawn uniformly, so that neither colour
    alone tells the answer: a table of 64 entries the decoder has to hold."""
    return _mix_table()[(background, color)]


@functools.cache
def _mix_table() -> dict[tuple[str, str], str]:
    names = list(COLORS)
    draw = random.Random(20261126)
    return {(a, b): draw.choice(names) for a in names for b in names}


def _mix(rng, image, w, h, bg):
    draw = ImageDraw.Draw(image)
    taken: list = []
    _clutter(rng, draw, w, h, bg, taken, rng.randint(1, 3))
    color = rng.choice(list(COLORS))
    return f"What color is the background mixed with {color}?", mix_of(bg, color)


def _texture_step(side: int) -> int:
    """Stripe / check width in pixels along a side: 1 below 336 px, 2 from 336 px. Either way a
    period is <= 1.3 px in the 112-px global view (averaged away by the resize filter) and
    1.7-2.5 px in 3-column crops (visible): the pattern needs the crops."""
    return max(1, round(side / 224))


def _texture(rng, image, w, h, bg):
    """A background pattern of the background colour +- delta per channel (mean-preserving:
    blurred, every pattern looks like the plain background)."""
    pattern = rng.choice(TEXTURES)
    if pattern != "plain":
        base = COLORS[bg]
        delta = [min(TEXTURE_CONTRAST, c, 255 - c) for c in base]
        hi = tuple(c + d for c, d in zip(base, delta))
        lo = tuple(c - d for c, d in zip(base, delta))
        # lines vary along x only; a grid vanishes as soon as either axis is averaged away
        step = _texture_step(w if pattern == "lines" else max(w, h))
        cols = (np.arange(w) // step) % 2
        rows = (np.arange(h) // step) % 2
        if pattern == "lines":
            on = np.broadcast_to(cols[None, :] == 0, (h, w))
        else:
            on = (rows[:, None] + cols[None, :]) % 2 == 0
        image.paste(Image.fromarray(np.where(on[..., None], np.array(hi, np.uint8), np.array(lo, np.uint8))))
    return "What pattern is the background?", pattern


def _relation(rng, image, w, h, bg):
    draw = ImageDraw.Draw(image)
    colors = _other_colors(rng, [bg], 2)
    shapes = [rng.choice(SHAPES) for _ in colors]
    for side, (shape, color) in enumerate(zip(shapes, colors)):  # 0: left part, 1: right part
        r = rng.uniform(0.1, 0.15) * min(w, h)
        cx = rng.uniform(r + 2, 0.45 * w - r) if side == 0 else rng.uniform(0.55 * w + r, w - r - 2)
        cy = rng.uniform(r + 2, h - r - 2)
        _draw_shape(draw, shape, cx, cy, r, COLORS[color])
    side = rng.randrange(2)
    return f"What color is the shape on the {('left', 'right')[side]}?", colors[side]


_MAKERS: dict[str, Callable] = {"color": _color, "presence": _presence, "dot": _dot, "speck": _speck,
                                "relation": _relation, "texture": _texture, "count": _count, "digit": _digit,
                                "mix": _mix}


def _sample_rng(seed: int, index: int) -> random.Random:
    digest = hashlib.sha256(f"ctrl-testbed:{seed}:{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def make_sample(seed: int, index: int, spec: TaskSpec = TaskSpec()) -> tuple[str, str, str, Image.Image]:
    """(family, question, answer, image) of sample ``index`` of the set with this seed."""
    rng = _sample_rng(seed, index)
    family = spec.families[index % len(spec.families)]
    w = rng.randrange(spec.min_side, spec.max_side + 1, 16)
    h = rng.randrange(spec.min_side, spec.max_side + 1, 16)
    bg = rng.choice(list(COLORS))
    image = Image.new("RGB", (w, h), COLORS[bg])
    question, answer = _MAKERS[family](rng, image, w, h, bg)
    return family, question, answer, image


def _png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def _matches(sample: VqaSample, image_path: Path, seed: int, index: int, spec: TaskSpec) -> bool:
    family, question, answer, image = make_sample(seed, index, spec)
    return ((sample.family, sample.question, sample.answers[0]) == (family, question, answer)
            and image_path.read_bytes() == _png_bytes(image))


def generate_dataset(root: str | Path, num_samples: int, seed: int = 0, split: str = "train",
                     name: str = "testbed", spec: TaskSpec = TaskSpec(), overwrite: bool = False) -> Path:
    """Write ``num_samples`` samples into ``root`` (images/<image_id>.png + dataset.json); returns root.

    An existing dataset with the same name, split and sample ids is reused as is (nothing is
    redrawn); ``overwrite`` regenerates it. ``dataset.json`` is written last, so an
    interrupted run leaves no readable half dataset.
    """
    if num_samples < 1:
        msg = f"num_samples must be >= 1, got {num_samples}"
        raise ValueError(msg)
    root = Path(root)
    ids = [f"tb{seed}-{split}-{i:06d}" for i in range(num_samples)]
    if not overwrite and (root / "dataset.json").exists():
        try:
            existing = read_dataset(root)
        except Exception:  # a foreign or broken file is regenerated
            existing = None
        if (existing is not None and existing.name == name and existing.split == split
                and [s.example_id for s in existing.samples] == ids
                and all(existing.image_path(s).is_file() for s in existing.samples)
                and all(_matches(existing.samples[i], existing.image_path(existing.samples[i]), seed, i, spec)
                        for i in {0, num_samples - 1})):  # same generator (spot check of the ends)
            return root
    if overwrite and (root / "images").exists():
        shutil.rmtree(root / "images")
    (root / "images").mkdir(parents=True, exist_ok=True)
    samples = []
    for i, example_id in enumerate(ids):
        family, question, answer, image = make_sample(seed, i, spec)
        (root / "images" / f"{example_id}.png").write_bytes(_png_bytes(image))
        samples.append(VqaSample(example_id=example_id, image_id=example_id, question=question,
                                 answers=(answer,) * NUM_ANSWERS, family=family))
    write_dataset(root, name, split, samples)
    return root
