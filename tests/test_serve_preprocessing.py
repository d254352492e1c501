"""Requests preprocessed off the model's thread (``serve.preprocessing``): the same inputs, made
while the request waits, at each crops choice once per distinct tiling."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest
import torch
from PIL import Image
from test_serve import RecordingDecider

from serve.config import ServeConfig
from serve.engine import Engine, new_job
from serve.preprocessing import Preprocessor
from serve.protocol import ChatRequest


@pytest.fixture
def spied(embedded_runtime, monkeypatch):
    """The runtime, its preprocess calls recorded as (thread name, max_crops, with an image)."""
    calls: list[tuple[str, int, bool]] = []
    real = embedded_runtime.preprocess

    def preprocess(image, question, max_crops):
        calls.append((threading.current_thread().name, int(max_crops), image is not None))
        return real(image, question, max_crops)

    monkeypatch.setattr(embedded_runtime, "preprocess", preprocess)
    return embedded_runtime, calls


def _pool_done(prepared) -> None:
    """Wait until the pool has made everything it was asked for."""
    deadline = time.monotonic() + 60
    while not all(f.done() for f in [*prepared._by_key.values(), prepared._text]):
        assert time.monotonic() < deadline, "the pool did not finish in 60 s"
        time.sleep(0.01)


def _served(runtime, workers: int, image, knobs=None):
    engine = Engine(runtime, RecordingDecider(), model_name="embedded", max_queue=4, default_budget_ms=None,
                    threads=1, request_log=None, preprocess_workers=workers)
    job = new_job(ChatRequest("embedded", "What color is it?", image, 4, 500.0, knobs=knobs), engine, 0.0,
                  datetime.now(UTC), 0.0)
    try:
        engine.submit(job)
        if job.prepared is not None:  # the pool done first: a choice it has not started is computed on the worker
            _pool_done(job.prepared)
        result = engine.execute(job, record=False)  # on this thread, as the worker would
    finally:
        engine.stop()
    return job, result


def test_a_request_is_preprocessed_in_the_pool_and_answers_as_on_the_worker(spied):
    runtime, calls = spied
    image = Image.new("RGB", (640, 320), (200, 20, 20))
    _, alone = _served(runtime, 0, image)
    assert [(t, m) for t, m, has_image in calls if has_image] == [(threading.current_thread().name, 2)]
    calls.clear()
    job, pooled = _served(runtime, 1, image)
    assert pooled.text == alone.text and pooled.usage() == alone.usage()
    with_image = [(t, m) for t, m, has_image in calls if has_image]
    # both crops choices of the decider (1 and 2 give different tilings here), none on the model's thread
    assert sorted(m for _, m in with_image) == [1, 2]
    assert all(t.startswith("ctrl-preprocess") for t, _ in with_image)
    assert job.prepared is not None


def test_crops_choices_of_one_tiling_are_prepared_once(spied):
    runtime, calls = spied
    small = Image.new("RGB", (100, 100), (1, 2, 3))
    assert runtime.tiling(100, 100, 1) == runtime.tiling(100, 100, 2)  # a small image is one crop either way
    pool = Preprocessor(runtime, 1)
    try:
        prepared = pool.prepare(small, "What is it?", (1, 2))
        _pool_done(prepared)
        at_two = prepared.inputs(2)
        assert torch.equal(prepared.inputs(1).images, at_two.images)
        assert prepared.text_tokens() == runtime.preprocess(None, "What is it?", 1).num_text_tokens
        assert sorted(m for t, m, has_image in calls if has_image and t.startswith("ctrl-preprocess")) == [1]
        expected = runtime.preprocess(small, "What is it?", 2)
        assert torch.equal(at_two.images, expected.images) and torch.equal(at_two.input_ids, expected.input_ids)
        prepared.release()  # the request has left: a late call computes again rather than fail
        calls.clear()
        assert torch.equal(prepared.inputs(2).images, expected.images)
        assert calls == [(threading.current_thread().name, 2, True)]
    finally:
        pool.close()


def test_a_fixed_knobs_request_is_prepared_at_its_own_crops_and_a_bad_one_fails_on_its_path(spied):
    runtime, calls = spied
    image = Image.new("RGB", (640, 320), (200, 20, 20))
    _served(runtime, 1, image, knobs={"max_crops": 1, "top_k": 2, "num_active_blocks": 3})
    assert sorted(m for t, m, has_image in calls if has_image and t.startswith("ctrl-preprocess")) == [1]
    pool = Preprocessor(runtime, 1)
    try:
        prepared = pool.prepare(Image.new("RGB", (20, 20)), "q", (0,))  # max_crops 0: refused when used
        with pytest.raises(Exception, match="max_crops must be an integer >= 1"):
            prepared.inputs(0)
    finally:
        pool.close()


def test_preprocess_workers_default_to_half_the_cpus_and_refuse_negatives(monkeypatch):
    monkeypatch.setattr("serve.config.available_cpus", lambda: 16)
    assert ServeConfig(controller="x").preprocess_threads == 4
    monkeypatch.setattr("serve.config.available_cpus", lambda: 2)
    assert ServeConfig(controller="x").preprocess_threads == 1
    assert ServeConfig(controller="x", preprocess_workers=0).preprocess_threads == 0
    with pytest.raises(ValueError, match="--preprocess-workers must be an integer >= 0"):
        ServeConfig(controller="x", preprocess_workers=-1)


def test_the_token_count_comes_first_and_a_choice_the_pool_has_not_started_is_computed_on_the_worker(spied):
    runtime, calls = spied
    image = Image.new("RGB", (640, 320), (200, 20, 20))
    pool = Preprocessor(runtime, 1)
    gate, busy = threading.Event(), threading.Event()
    try:
        pool._pool.submit(lambda: (busy.set(), gate.wait(60)))  # the pool's one thread busy with another request
        assert busy.wait(60)
        prepared = pool.prepare(image, "What color is it?", (1, 2))
        # the pool has started neither choice: the worker makes the one stage 1 chose now, not after both
        at_two = prepared.inputs(2)
        assert calls == [(threading.current_thread().name, 2, True)]
        expected = runtime.preprocess(image, "What color is it?", 2)
        assert torch.equal(at_two.images, expected.images) and torch.equal(at_two.input_ids, expected.input_ids)
        calls.clear()
        gate.set()
        # once free, the pool counts the prompt's tokens before any image, and skips the choice taken
        assert prepared.text_tokens() == runtime.preprocess(None, "What color is it?", 1).num_text_tokens
        prepared.inputs(1)
        pooled = [(m, has_image) for t, m, has_image in calls if t.startswith("ctrl-preprocess")]
        assert pooled == [(1, False), (1, True)]
    finally:
        gate.set()
        pool.close()
