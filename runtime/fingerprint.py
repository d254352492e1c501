"""What identifies a checkpoint directory's outputs: digests of its files, known without a second read.

A checkpoint's fingerprint is a sha256 over a version string and, for every file that determines
what the model computes (config, generation and preprocessor configs, tokenizer, weights; never
the checkpoint's own Python files), its name and the sha256 of its contents. Copies of a
checkpoint share it; any change to a weight changes it.

A weight file is read only to load it. Its digest is known without reading it when

* it lives in a Hugging Face cache: snapshot files link to ``blobs/<sha256 of the contents>``
  (the content address huggingface_hub names large files by), or
* it was computed before: digests are kept in ``<cache root>/fingerprints/<directory key>.json``
  with each file's size and mtime and reused while both are unchanged (an edited file gets a new
  mtime, so a changed weight is hashed again).

Otherwise the loader hashes the bytes it reads anyway (``runtime.weights.stream_weights``) and
hands the digests to :func:`checkpoint_fingerprint`; :func:`known_fingerprint` answers None
until then, and a caller that needs the fingerprint first loads the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from runtime.cache import default_cache_root

#: the files that determine what a checkpoint computes besides its weights
CONFIG_FILES = ("config.json", "generation_config.json", "preprocessor_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json")
#: weight files too large to read for a fingerprint alone
LARGE_SUFFIXES = (".safetensors", ".bin")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def fingerprint_files(path: Path) -> list[Path]:
    """The files of ``path`` that enter its fingerprint, sorted."""
    files = {path / name for name in CONFIG_FILES if (path / name).is_file()}
    files |= {p for pattern in WEIGHT_PATTERNS for p in path.glob(pattern) if p.is_file()}
    return sorted(files)


def hub_blob_digest(file: Path) -> str | None:
    """The sha256 of ``file``'s contents when it is a Hugging Face cache entry named by it
    (``.../blobs/<sha256>``, where snapshot files of large files point), else None."""
    target = file.resolve()
    return target.name if target.parent.name == "blobs" and _SHA256.fullmatch(target.name) else None


def _sha256_file(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


class DigestCache:
    """Digests of one directory's files computed earlier, valid while size and mtime are unchanged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()
        self.file = default_cache_root() / "fingerprints" / f"{key}.json"
        try:
            loaded = json.loads(self.file.read_text())
        except (OSError, ValueError):
            loaded = {}
        self._entries: dict[str, list] = loaded if isinstance(loaded, dict) else {}
        self._fresh: dict[str, list] = {}

    def _rel(self, file: Path) -> str:
        return file.relative_to(self.path).as_posix()

    def known(self, file: Path) -> str | None:
        """The digest of ``file`` without reading it (hub blob name or an unchanged cached entry)."""
        digest = hub_blob_digest(file)
        if digest is not None:
            return digest
        stat = file.stat()
        entry = self._entries.get(self._rel(file))
        if isinstance(entry, list) and len(entry) == 3 and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
            return str(entry[2])
        return None

    def digest(self, file: Path, computed: Mapping[Path, str]) -> str:
        """The digest of ``file``: given, known, or read now; remembered for :meth:`save`."""
        digest = computed.get(file) or self.known(file) or _sha256_file(file)
        stat = file.stat()
        self._fresh[self._rel(file)] = [stat.st_size, stat.st_mtime_ns, digest]
        return digest

    def save(self) -> None:
        if self._fresh == self._entries:
            return
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self._fresh))
            os.replace(tmp, self.file)
        except OSError:
            pass  # the cache only saves time


def unknown_weight_files(path: Path) -> list[Path]:
    """The large weight files of ``path`` whose digest would have to be read to be known."""
    cache = DigestCache(path)
    return [f for f in fingerprint_files(path) if f.suffix in LARGE_SUFFIXES and cache.known(f) is None]


def checkpoint_fingerprint(path: Path, version: str, computed: Mapping[Path, str] | None = None) -> str:
    """The fingerprint of ``path`` (module docstring); digests in ``computed`` (file -> sha256, e.g.
    from the loader) are used as given, unknown ones are read. Records every digest for later."""
    cache = DigestCache(path)
    h = hashlib.sha256(f"{version}\n".encode())
    for file in fingerprint_files(path):
        rel = file.relative_to(path).as_posix()
        h.update(rel.encode() + b"\0" + cache.digest(file, computed or {}).encode() + b"\n")
    cache.save()
    return h.hexdigest()


def known_fingerprint(path: Path, version: str) -> str | None:
    """:func:`checkpoint_fingerprint` when no large weight file has to be read for it, else None."""
    if unknown_weight_files(path):
        return None
    return checkpoint_fingerprint(path, version)
