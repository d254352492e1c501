"""``--model org/name[@revision]``: a Hugging Face Hub id, resolved in the local Hugging Face cache.

The id resolves through huggingface_hub's own cache lookup (``snapshot_download`` with
``local_files_only``), so its environment variables apply as they do for transformers: the cache
is ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``. ``@revision`` is a
branch, tag or commit hash (default ``main``). ctrl never downloads: a snapshot missing from the
cache is one error naming the id and the cache searched, with the command that fetches it.

The snapshot directory is the checkpoint directory, so a model given by id and by that path is
the same model with the same fingerprint.
"""

from __future__ import annotations

import re
from pathlib import Path

from runtime.base import ModelLoadError

#: ``org/name`` or ``org/name@revision`` as the Hub spells repository ids
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")


def is_hub_id(model: str) -> bool:
    """True for ``org/name[@revision]`` (a path that exists is a directory, not an id: see registry)."""
    return HUB_ID.match(model) is not None and not model.startswith(("./", "../"))


def hub_cache_dir() -> Path:
    """The cache huggingface_hub searches (its ``HF_HUB_CACHE`` constant, read from the environment)."""
    from huggingface_hub import constants  # deferred: the id path only

    return Path(constants.HF_HUB_CACHE)


def resolve_hub_id(model: str) -> Path:
    """The local snapshot directory of a Hub id; ModelLoadError when it is not in the cache."""
    match = HUB_ID.match(model)
    if match is None:
        msg = f"{model!r} is not a Hub id (expected org/name or org/name@revision)"
        raise ModelLoadError(msg)
    repo, revision = match["repo"], match["revision"]
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(repo, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        snapshot = None
    except (OSError, ValueError) as exc:
        msg = f"{model}: cannot read the Hugging Face cache {hub_cache_dir()}: {exc}"
        raise ModelLoadError(msg) from exc
    if snapshot is None or not Path(snapshot).is_dir():
        where = f"revision {revision!r} of " if revision else ""
        msg = (f"{model}: no such directory, and {where}{repo} is not in the Hugging Face cache {hub_cache_dir()} "
               f"(ctrl does not download)\nHint: fetch it with `hf download {repo}"
               + (f" --revision {revision}" if revision else "") + "`, or point HF_HUB_CACHE / HF_HOME at the "
               "cache that holds it, or pass the checkpoint directory")
        raise ModelLoadError(msg)
    return Path(snapshot)
