"""JSON text byte-identical to ``json.dump(obj, f, indent=...)``, built from reusable pieces.

Per-sample records repeat across the rank, merged and final files at the same depth
(top object -> list -> record), so the generator encodes each record once and reuses the text;
the standard library's pure-Python indenting encoder would dominate generation time for large trees.
"""

from __future__ import annotations

import math
from json.encoder import encode_basestring_ascii


class Raw(str):
    """Already-encoded JSON text (placed verbatim by :class:`JsonText`)."""


class JsonText:
    """A minimal ``json.dumps`` that places :class:`Raw` fragments verbatim."""

    def __init__(self, indent: int | None) -> None:
        self.indent = indent
        self.sep = "," if indent is not None else ", "

    def nl(self, level: int) -> str:
        return "" if self.indent is None else "\n" + " " * (self.indent * level)

    def value(self, v: object, level: int = 0) -> str:
        if isinstance(v, Raw):
            return v
        if isinstance(v, str):
            return encode_basestring_ascii(v)
        if v is None or isinstance(v, bool):
            return {None: "null", True: "true", False: "false"}[v]
        if isinstance(v, int):
            return int.__repr__(v)
        if isinstance(v, float):
            if v != v:
                return "NaN"
            return float.__repr__(v) if math.isfinite(v) else ("Infinity" if v > 0 else "-Infinity")
        if isinstance(v, dict):
            if not v:
                return "{}"
            inner = self.nl(level + 1)
            body = (self.sep + inner).join(f"{encode_basestring_ascii(k)}: {self.value(x, level + 1)}"
                                           for k, x in v.items())
            return "{" + inner + body + self.nl(level) + "}"
        if isinstance(v, (list, tuple)):
            return self.array([self.value(x, level + 1) for x in v], level)
        msg = f"cannot encode {type(v).__name__}"
        raise TypeError(msg)

    def array(self, items: list[str], level: int) -> Raw:
        if not items:
            return Raw("[]")
        inner = self.nl(level + 1)
        return Raw("[" + inner + (self.sep + inner).join(items) + self.nl(level) + "]")

    def template(self, obj: dict, level: int = 2) -> list[str]:
        """Encode ``obj`` with ``Raw("\\x00")`` holes and split there (for fast filling)."""
        return self.value(obj, level).split("\x00")


HOLE = Raw("\x00")


def fill(parts: list[str], values: list[str]) -> str:
    """A :meth:`JsonText.template` with its holes filled by ``values`` (already encoded)."""
    out = [parts[0]]
    for v, p in zip(values, parts[1:]):
        out.append(v)
        out.append(p)
    return "".join(out)
