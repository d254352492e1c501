"""A checkpoint's weights read once, each tensor streamed from its file into its final place.

A loader describes every tensor it wants as a :class:`Target`: its shape and the source tensors
(or row ranges of them) that fill it in order, e.g. one expert-stacked tensor from 128 per-expert
tensors, or three projections from one fused QKV tensor. :func:`stream_weights` then

* allocates each target once, in the requested dtype, on the requested device (a GPU directly);
* reads every weight file **in file order, in one pass**, with ``readinto``: a span stored in
  the target dtype is read straight into its place in host memory, anything else passes through
  a 16 MiB staging buffer and is converted on the copy (float32 -> bfloat16, host -> GPU);
* never maps a whole file: a memory-mapped file's touched pages count as the process's resident
  memory until it is unmapped, which would double the peak of a 15 GB load;
* hashes the bytes it reads (sha256, on a second thread) for the files whose digest the caller
  does not know yet, so that fingerprinting costs no second read (``runtime.fingerprint``).

The peak is the targets plus the staging buffers. ``pytorch_model*.bin`` pickles cannot be read
this way: they are memory-mapped one file at a time and copied into the targets (the peak then
includes one file's pages), and their digests are computed by a separate read.

Safetensors layout: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data, offsets relative to its start.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from runtime.base import ModelLoadError

#: safetensors dtype names
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
#: bytes per staging buffer (two of them: one is read into while the other is hashed)
STAGING_BYTES = 16 << 20
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a weight file; ``begin``/``end`` are its absolute byte offsets in a
    safetensors file (0 for a ``.bin`` tensor, which is read through its memory map)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """Rows ``rows`` (all when None) of source tensor ``source``, whose shape must be ``shape``."""

    source: str
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        lo, hi = self.rows or (0, self.shape[0] if self.shape else 1)
        return (hi - lo) * math.prod(self.shape[1:])


@dataclass(frozen=True)
class Target:
    """A tensor to fill: its shape and the pieces that fill it, concatenated in order (flat)."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_safetensors_header(file: Path) -> tuple[bytes, dict[str, StoredTensor]]:
    """(the raw header bytes, the tensors by name) of a safetensors file; a damaged header is a
    ModelLoadError naming the file."""
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                msg = f"{size} bytes, shorter than the 8-byte header length"
                raise ValueError(msg)
            (length,) = struct.unpack("<Q", prefix)
            if not 2 <= length <= min(_MAX_HEADER_BYTES, size - 8):
                msg = f"header length {length} does not fit a {size}-byte file"
                raise ValueError(msg)
            raw = fh.read(length)
        header = json.loads(raw)
        if not isinstance(header, dict):
            msg = "the header is not a JSON object"
            raise ValueError(msg)
        data_start = 8 + length
        tensors: dict[str, StoredTensor] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(entry, dict):
                msg = f"tensor {name!r}: expected an object, got {entry!r}"
                raise ValueError(msg)
            dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
            if dtype is None:
                msg = f"tensor {name!r}: unknown or missing dtype {entry.get('dtype')!r}"
                raise ValueError(msg)
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
            nbytes = math.prod(shape) * dtype.itemsize
            if end - begin != nbytes or begin < 0 or data_start + end > size:
                msg = f"tensor {name!r}: data_offsets [{begin}, {end}] do not hold {shape} {entry['dtype']} in the file"
                raise ValueError(msg)
            tensors[name] = StoredTensor(name, file, dtype, shape, data_start + begin, data_start + end)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        msg = f"{file}: cannot read weights: {type(exc).__name__}: {exc}"
        raise ModelLoadError(msg) from exc
    return prefix + raw, tensors


class WeightIndex:
    """Every tensor of a checkpoint directory's weight files, from the headers alone:
    ``*.safetensors`` (sharded or not) or else ``pytorch_model*.bin``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
        if not self.files:
            msg = f"{path}: no weights (expected *.safetensors or pytorch_model*.bin)"
            raise ModelLoadError(msg)
        self.headers: dict[Path, bytes] = {}
        self.tensors: dict[str, StoredTensor] = {}
        for file in self.files:
            if file.suffix == ".safetensors":
                self.headers[file], found = read_safetensors_header(file)
            else:
                found = {name: StoredTensor(name, file, t.dtype, tuple(t.shape))
                         for name, t in _load_bin(file).items()}
            for name, tensor in found.items():
                self.tensors.setdefault(name, tensor)

    @property
    def safetensors(self) -> bool:
        return self.files[0].suffix == ".safetensors"


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # a damaged pickle fails in many ways: name the file
        msg = f"{file}: cannot read weights: {type(exc).__name__}: {exc}"
        raise ModelLoadError(msg) from exc
    if not isinstance(state, Mapping):
        msg = f"{file}: cannot read weights: not a state dict"
        raise ModelLoadError(msg)
    return dict(state)


def check_targets(index: WeightIndex, targets: Mapping[str, Target]) -> None:
    """Strict: every source present with its expected shape, every stored tensor used, every
    target filled exactly; else a ModelLoadError naming the first offenders."""
    path = index.path
    wanted = {p.source: p for t in targets.values() for p in t.pieces}
    missing = [name for name in wanted if name not in index.tensors]
    if missing:
        msg = f"{path}: checkpoint lacks {len(missing)} of {len(wanted)} MolmoE weights, e.g. {missing[:3]}"
        raise ModelLoadError(msg)
    unexpected = sorted(set(index.tensors) - set(wanted))
    if unexpected:
        msg = (f"{path}: checkpoint has {len(unexpected)} weights this MolmoE config does not use, "
               f"e.g. {unexpected[:3]} (config.json does not match the weights?)")
        raise ModelLoadError(msg)
    for name, piece in wanted.items():
        stored = index.tensors[name].shape
        if stored != piece.shape:
            msg = f"{path}: weight {name} has shape {stored}, config.json implies {piece.shape}"
            raise ModelLoadError(msg)
    for name, target in targets.items():
        if sum(p.numel for p in target.pieces) != target.numel:
            msg = f"{name}: its pieces hold {sum(p.numel for p in target.pieces)} values, not {target.numel}"
            raise ValueError(msg)


def target_bytes(targets: Mapping[str, Target], dtype: torch.dtype) -> int:
    """Bytes the targets take in ``dtype``."""
    return sum(t.numel for t in targets.values()) * dtype.itemsize


@dataclass(order=True)
class _Span:
    """Bytes [begin, end) of a file that go into ``dest`` (flat, target dtype) from element ``offset``."""

    begin: int
    end: int
    dtype: torch.dtype = field(compare=False)
    dest: torch.Tensor = field(compare=False)
    offset: int = field(compare=False)


def stream_weights(index: WeightIndex, targets: Mapping[str, Target], dtype: torch.dtype,
                   device: torch.device, hash_files: Iterable[Path] = ()) -> tuple[dict[str, torch.Tensor],
                                                                                  dict[Path, str]]:
    """Allocate every target in ``dtype`` on ``device`` and fill it from the files (module docstring).

    Returns (the filled targets by name, the sha256 of each safetensors file in ``hash_files``).
    Floating-point sources convert to ``dtype``; other dtypes must match exactly. The targets must
    have passed :func:`check_targets`.
    """
    out = {name: torch.empty(t.shape, dtype=dtype, device=device) for name, t in targets.items()}
    spans: dict[Path, list[_Span]] = {}
    for name, target in targets.items():
        flat, offset = out[name].view(-1), 0
        for piece in target.pieces:
            stored = index.tensors[piece.source]
            if not (stored.dtype.is_floating_point or stored.dtype == dtype):
                msg = f"{index.path}: weight {piece.source} is {stored.dtype}, not a floating-point tensor"
                raise ModelLoadError(msg)
            row_bytes = math.prod(stored.shape[1:]) * stored.dtype.itemsize
            lo, hi = piece.rows or (0, stored.shape[0] if stored.shape else 1)
            spans.setdefault(stored.file, []).append(
                _Span(stored.begin + lo * row_bytes, stored.begin + hi * row_bytes, stored.dtype, flat, offset))
            offset += piece.numel
    digests: dict[Path, str] = {}
    hash_files = set(hash_files)
    with _Stager(device) as stager:
        for file in index.files:
            if file.suffix != ".safetensors":
                _copy_bin(file, targets, index, out)
                continue
            header = index.headers[file]
            if file not in hash_files:
                _read_file(file, len(header), sorted(spans.get(file, [])), stager, None)
                continue
            with _Hasher(header) as hasher:
                _read_file(file, len(header), sorted(spans.get(file, [])), stager, hasher)
                digests[file] = hasher.hexdigest()
    return out, digests


def _copy_bin(file: Path, targets: Mapping[str, Target], index: WeightIndex, out: dict[str, torch.Tensor]) -> None:
    """The targets' pieces stored in one ``.bin`` file, copied from its memory map (dropped after)."""
    state = _load_bin(file)
    for name, target in targets.items():
        flat, offset = out[name].view(-1), 0
        for piece in target.pieces:
            if index.tensors[piece.source].file == file:
                source = state[piece.source]
                rows = source if piece.rows is None else source[piece.rows[0]:piece.rows[1]]
                flat[offset:offset + piece.numel].copy_(rows.reshape(-1))
            offset += piece.numel
    del state


class _Hasher:
    """sha256 of a file's bytes fed in order, updated on a second thread (hashlib releases the GIL)."""

    def __init__(self, header: bytes) -> None:
        self._sha = hashlib.sha256(header)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctrl-hash")
        self._last: Future | None = None

    def __enter__(self) -> _Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)

    def update(self, data: memoryview) -> Future:
        """Queue ``data`` (which must stay unchanged until the returned future is done)."""
        self._last = self._pool.submit(self._sha.update, data)
        return self._last

    def hexdigest(self) -> str:
        self._pool.shutdown(wait=True)
        if self._last is not None:
            self._last.result()
        return self._sha.hexdigest()


class _Stager:
    """Two staging buffers (pinned for a GPU target) used in turn."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._pending: list[Future | None] = [None, None]
        self._turn = 0

    def __enter__(self) -> _Stager:
        return self

    def __exit__(self, *exc: object) -> None:
        for pending in self._pending:
            if pending is not None:
                pending.result()
        self._buffers.clear()

    def next(self) -> tuple[int, torch.Tensor]:
        """(slot, buffer) free for reading into: waits until its last hash is done."""
        if not self._buffers:
            pin = self.device.type == "cuda"
            self._buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        slot, self._turn = self._turn, 1 - self._turn
        if self._pending[slot] is not None:
            self._pending[slot].result()
            self._pending[slot] = None
        return slot, self._buffers[slot]

    def hashing(self, slot: int, future: Future) -> None:
        self._pending[slot] = future


def _readinto(fh: BinaryIO, view: memoryview, file: Path) -> None:
    done = 0
    while done < len(view):
        n = fh.readinto(view[done:])
        if not n:
            msg = f"{file}: cannot read weights: the file ended early (truncated?)"
            raise ModelLoadError(msg)
        done += n


def _read_file(file: Path, data_start: int, spans: Sequence[_Span], stager: _Stager, hasher: _Hasher | None) -> None:
    """One sequential pass over ``file`` from ``data_start`` (the header is hashed already): each
    span into its destination, every other byte (gaps, unused tensors) only through the hash."""
    try:
        fh = file.open("rb", buffering=0)
    except OSError as exc:
        msg = f"{file}: cannot read weights: {exc.strerror or exc}"
        raise ModelLoadError(msg) from exc
    with fh:
        size = file.stat().st_size
        position = data_start
        fh.seek(position)
        for span in spans:
            if span.begin < position:
                msg = f"{file}: cannot read weights: overlapping tensors at byte {span.begin}"
                raise ModelLoadError(msg)
            if span.begin > position:
                _skip(fh, file, position, span.begin, stager, hasher)
            _fill(fh, file, span, stager, hasher)
            position = span.end
        if hasher is not None and position < size:
            _skip(fh, file, position, size, stager, hasher)


def _skip(fh: BinaryIO, file: Path, begin: int, end: int, stager: _Stager, hasher: _Hasher | None) -> None:
    """Bytes that fill nothing: hashed when hashing, else passed over."""
    if hasher is None:
        fh.seek(end)
        return
    while begin < end:
        n = min(STAGING_BYTES, end - begin)
        slot, buffer = stager.next()
        view = memoryview(buffer.numpy())[:n]
        _readinto(fh, view, file)
        stager.hashing(slot, hasher.update(view))
        begin += n


def _fill(fh: BinaryIO, file: Path, span: _Span, stager: _Stager, hasher: _Hasher | None) -> None:
    count = (span.end - span.begin) // span.dtype.itemsize
    dest = span.dest[span.offset:span.offset + count]
    if span.dtype == dest.dtype and dest.device.type == "cpu":
        # stored as wanted: straight into place
        view = memoryview(dest.view(torch.uint8).numpy())
        _readinto(fh, view, file)
        if hasher is not None:
            hasher.update(view)
        return
    step = STAGING_BYTES // span.dtype.itemsize
    for first in range(0, count, step):
        n = min(step, count - first)
        slot, buffer = stager.next()
        view = memoryview(buffer.numpy())[:n * span.dtype.itemsize]
        _readinto(fh, view, file)
        if hasher is not None:
            stager.hashing(slot, hasher.update(view))
        dest[first:first + n].copy_(buffer[:n * span.dtype.itemsize].view(span.dtype))
