"""The model cache: where built and trained models live (``$CTRL_CACHE_DIR`` or ``~/.cache/ctrl``).

Models are written to a temporary sibling of their final directory and renamed into place, so
the cache never holds half a model.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def default_cache_root() -> Path:
    """``$CTRL_CACHE_DIR`` if set, else ``~/.cache/ctrl``."""
    env = os.environ.get("CTRL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ctrl"


def cache_tmp_dir(target: Path) -> Path:
    """A temporary sibling of ``target`` (same filesystem, so the final rename is atomic), with
    ordinary permissions (mkdtemp makes it private; the cache is an ordinary directory)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp
