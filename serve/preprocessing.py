"""A request's preprocessing off the model thread, while it waits and while stage 1 decides.

Stage 1 picks a request's crops (max_crops) before the image is cut into them: done on the worker
thread between stage 1 and the vision tower, the resize, normalisation and tiling would be on the
request's budget and the model's time. A pool of threads (``--preprocess-workers``) prepares
every request as it is admitted: its inputs at each crops choice its decider can make, one per
distinct tiling (a runtime's inputs depend on max_crops only through the tiling its image gets
there: ``ModelRuntime.tiling``), and its prompt's token count. The worker then takes the inputs
stage 1's choice needs (waiting only for what is still being computed: the request's
``preprocess`` segment is that wait) and the others are dropped.

The inputs are the runtime's own ``preprocess`` output, so a request's crops are what the worker
would have computed (the same function on the same image). Memory: a waiting request holds up
to one set of inputs per distinct tiling of its crops choices (MolmoE-1B at 12 crops: 13 arrays
of 336 x 336 x 3 float32, 17.6 MB), released when it leaves.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from PIL import Image

from pipeline.errors import CtrlError
from runtime import ModelRuntime
from runtime.base import ModelInputs


class PreparedInputs:
    """One request's inputs being prepared in the pool: :meth:`inputs` at a crops choice,
    :meth:`text_tokens` its prompt's tokens; :meth:`release` drops what it holds."""

    def __init__(self, runtime: ModelRuntime, image: Image.Image | None, question: str,
                 by_key: dict[object, Future[ModelInputs]], key_of: dict[int, object],
                 text: Future[int]) -> None:
        self._runtime, self._image, self._question = runtime, image, question
        self._by_key, self._key_of, self._text = by_key, key_of, text
        self._lock = threading.Lock()

    def inputs(self, max_crops: int) -> ModelInputs:
        """The inputs at ``max_crops``: prepared in the pool, or computed here for a choice the pool was
        not asked for or has not started yet (it may be busy with the other choices: waiting for them
        would put their preprocessing on this request's path); a preprocessing error is raised here,
        on the request's path."""
        with self._lock:
            future = self._by_key.get(self._key_of.get(int(max_crops)))
        if future is None or future.cancel():
            return self._runtime.preprocess(self._image, self._question, int(max_crops))
        return future.result()

    def text_tokens(self) -> int:
        """The prompt's token count, as ``runtime.preprocess(None, question, 1).num_text_tokens``."""
        return self._text.result()

    def release(self) -> None:
        """Cancel what has not started and drop the prepared inputs (the request has left; the image
        is its request's)."""
        with self._lock:
            futures, self._by_key = list(self._by_key.values()), {}
        for future in [*futures, self._text]:
            future.cancel()


class Preprocessor:
    """The pool that prepares admitted requests (``workers`` threads; 0: none, everything on the
    worker thread)."""

    def __init__(self, runtime: ModelRuntime, workers: int) -> None:
        if isinstance(workers, bool) or int(workers) < 0:
            msg = f"preprocess workers must be a non-negative integer, got {workers!r}"
            raise ValueError(msg)
        self.runtime, self.workers = runtime, int(workers)
        self._pool = (ThreadPoolExecutor(self.workers, thread_name_prefix="ctrl-preprocess")
                      if self.workers else None)

    def prepare(self, image: Image.Image | None, question: str,
                max_crops_values: Sequence[int]) -> PreparedInputs | None:
        """Start preparing a request at each crops choice (None without a pool)."""
        if self._pool is None:
            return None
        runtime = self.runtime
        key_of: dict[int, object] = {}
        for m in dict.fromkeys(max_crops_values):
            try:
                key_of[int(m)] = None if image is None else runtime.tiling(image.width, image.height, int(m))
            except (CtrlError, TypeError, ValueError):  # refused where the worker reaches it
                continue
        # the token count first: stage 1 reads it, and it should not wait behind every crops choice's image
        text = self._pool.submit(lambda: int(runtime.preprocess(None, question, 1).num_text_tokens))
        by_key: dict[object, Future[ModelInputs]] = {}
        for m, key in key_of.items():
            if key not in by_key:
                by_key[key] = self._pool.submit(runtime.preprocess, image, question, m)
        return PreparedInputs(runtime, image, question, by_key, key_of, text)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
