"""Batched generation with per-request knobs (``runtime.batched_decoder``) against batch 1.

Every row of a batch must answer what the same request answers alone at its knobs (greedy tokens;
a difference is allowed only where batch 1's two candidate tokens are a near-tie), its first
logits must equal batch 1's within rounding, and its knobs must be real inside the batch: its
tokens run exactly its top-K experts per block and only its own blocks.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from test_model_runtime import QUESTION, make_image

from pipeline.errors import CtrlError
from runtime import load_runtime
from runtime.base import BatchRequest, GenerationResult, PrefixRequest
from runtime.molmoe import MolmoERuntime

#: rows of mixed knobs: (image size or None, max_crops, top_k, active blocks as a count, new tokens)
MIXED = [((320, 240), 1, 8, 16, 6), ((640, 480), 4, 1, 12, 5), (None, 1, 12, 14, 7), ((300, 300), 6, 4, 16, 4),
         ((1000, 250), 2, 2, 13, 6), ((150, 150), 3, 6, 15, 3)]
#: float32 logits of a row in a batch against the same request alone (products summed in another order).
#: The tiny MolmoE's random router has near-ties: one of its requests alone moves by up to 9e-4 when its
#: input embeddings get 1e-6 relative noise, so its bound is set by that sensitivity, not by the batch.
LOGIT_ATOL_FLOAT32 = {"embedded_runtime": 2e-4, "tiny_molmoe": 1e-3}
#: a batched token may differ from batch 1's only where batch 1's logits of the two are this close
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


def requests_for(runtime, rows=MIXED) -> list[BatchRequest]:
    out = []
    for j, (size, crops, k, blocks, n) in enumerate(rows):
        image = None if size is None else make_image(*size, seed=j)
        if image is None and not runtime.answers_without_image:
            image = make_image(200, 200, seed=j)
        inputs = runtime.preprocess(image, f"{QUESTION} {j}", crops)
        out.append(BatchRequest(inputs, n, top_k=k, num_active_blocks=blocks))
    return out


def alone(runtime, request: BatchRequest) -> GenerationResult:
    return runtime.generate(request.inputs, request.max_new_tokens, top_k=request.top_k,
                            num_active_blocks=request.num_active_blocks, active_blocks=request.active_blocks)


def assert_same_or_near_tie(runtime, request: BatchRequest, batched: list[int], single: list[int]) -> int:
    """Equal tokens, or the first difference a near-tie of batch 1's logits (returns 1 then, else 0)."""
    if batched == single:
        return 0
    differ = [i for i, (a, b) in enumerate(zip(batched, single)) if a != b]
    assert differ, f"one answer is a prefix of the other: {batched} vs {single}"
    t = differ[0]
    with runtime.knobs(top_k=request.top_k, num_active_blocks=request.num_active_blocks):
        logits = runtime.forward_logits(request.inputs, single[:t])[-1]
    gap = float(logits[single[t]] - logits[batched[t]])
    assert 0 <= gap < NEAR_TIE[runtime.dtype], f"token {t}: {batched[t]} instead of {single[t]}, logit gap {gap}"
    return 1


@pytest.fixture(scope="module")
def testbed(tmp_path_factory):
    from runtime.registry import TestbedRecipe
    from testbed.train import train_testbed

    report = train_testbed(TestbedRecipe(), cache_dir=tmp_path_factory.mktemp("testbed-cache"))
    return load_runtime(str(report.model_dir))


@pytest.fixture(scope="module")
def tiny_molmoe(tiny_molmoe_dir) -> MolmoERuntime:
    return MolmoERuntime(tiny_molmoe_dir)


@pytest.mark.parametrize("model", ["embedded_runtime", "testbed", "tiny_molmoe"])
@pytest.mark.parametrize("fast_path", [True, False])
def test_a_mixed_batch_answers_what_each_request_answers_alone(request, model, fast_path):
    runtime = request.getfixturevalue(model)
    runtime.set_execution(fast_path)
    try:
        reqs = requests_for(runtime)
        batched = runtime.generate_batch(reqs)
        ties = sum(assert_same_or_near_tie(runtime, r, b.token_ids, alone(runtime, r).token_ids)
                   for r, b in zip(reqs, batched, strict=True))
        assert ties <= 1
        assert all(isinstance(b, GenerationResult) and b.text == runtime.decode_text(b.token_ids) for b in batched)
    finally:
        runtime.set_execution(None)


@pytest.mark.parametrize("model", ["embedded_runtime", "tiny_molmoe"])
def test_a_rows_first_logits_equal_its_logits_alone(request, model):
    runtime = request.getfixturevalue(model)
    reqs = requests_for(runtime)
    batch = runtime.batch_decoder()
    with runtime.batch_context():
        rows = batch.join([runtime.decoder_inputs(r.inputs) for r in reqs],
                          [runtime.row_knobs(top_k=r.top_k, num_active_blocks=r.num_active_blocks) for r in reqs],
                          [r.max_new_tokens for r in reqs])
    for r, row in zip(reqs, rows, strict=True):
        with runtime.knobs(top_k=r.top_k, num_active_blocks=r.num_active_blocks):
            expected = runtime.forward_logits(r.inputs)[-1]
        torch.testing.assert_close(row.logits.cpu(), expected, atol=LOGIT_ATOL_FLOAT32[model], rtol=0)


def test_bfloat16_batches_answer_as_bfloat16_alone(tiny_molmoe_dir):
    runtime = MolmoERuntime(tiny_molmoe_dir, dtype="bfloat16")
    reqs = requests_for(runtime)
    batched = runtime.generate_batch(reqs)
    ties = sum(assert_same_or_near_tie(runtime, r, b.token_ids, alone(runtime, r).token_ids)
               for r, b in zip(reqs, batched, strict=True))
    assert ties <= 2


def test_rows_join_and_leave_between_steps(embedded_runtime):
    runtime = embedded_runtime
    reqs = requests_for(runtime)
    expected = [alone(runtime, r).token_ids for r in reqs]
    knobs = [runtime.row_knobs(top_k=r.top_k, num_active_blocks=r.num_active_blocks) for r in reqs]
    batch = runtime.batch_decoder()
    with runtime.batch_context():
        first = batch.join([runtime.decoder_inputs(r.inputs) for r in reqs[:2]], knobs[:2],
                           [r.max_new_tokens for r in reqs[:2]])
        batch.step()
        batch.step()
        later = batch.join([runtime.decoder_inputs(r.inputs) for r in reqs[2:]], knobs[2:],
                           [r.max_new_tokens for r in reqs[2:]])
        assert len(batch.live) == 6
        while batch.live:
            batch.step()
    rows = first + later
    assert [row.tokens for row in rows] == expected
    assert [row.finish_reason for row in rows] == [
        "eos" if expected[i][-1] == runtime.eos_id else "length" for i in range(len(reqs))]
    # a row that left gave its slot to a later one: the cache never held more rows than were live
    assert batch.slots <= 8


def test_each_row_multiplies_its_own_top_k_in_its_own_blocks_only(embedded_runtime):
    runtime = embedded_runtime
    reqs = requests_for(runtime)
    blocks_run: list[int] = []
    handles = [layer.register_forward_pre_hook(lambda *_, i=i: blocks_run.append(i))
               for i, layer in enumerate(runtime.decoder_layers)]
    batch = runtime.batch_decoder()
    batch.count_products = True
    try:
        with runtime.batch_context():
            rows = batch.join([runtime.decoder_inputs(r.inputs) for r in reqs],
                              [runtime.row_knobs(top_k=r.top_k, num_active_blocks=r.num_active_blocks) for r in reqs],
                              [r.max_new_tokens for r in reqs])
            while batch.live:
                batch.step()
    finally:
        for h in handles:
            h.remove()
    for r, row in zip(reqs, rows, strict=True):
        # every token the row ran (its prompt, then each token it fed back) through its blocks, top_k experts each
        fed = row.prompt_tokens + len(row.tokens) - 1
        assert row.expert_products == r.top_k * r.num_active_blocks * fed
    # every block some row runs is entered once per pass (the prefill and each step with such a row)
    assert blocks_run.count(0) == 1 + max(len(row.tokens) for row in rows) - 1
    only_full = [b for b in range(16) if b not in runtime.blocks_for(12)]
    assert blocks_run.count(only_full[0]) > 0

    # a block no row runs is never entered
    one = reqs[1]
    blocks_run.clear()
    handles = [layer.register_forward_pre_hook(lambda *_, i=i: blocks_run.append(i))
               for i, layer in enumerate(runtime.decoder_layers)]
    try:
        runtime.generate_batch([one, dataclasses.replace(one, top_k=3)])
    finally:
        for h in handles:
            h.remove()
    assert set(blocks_run) == set(runtime.blocks_for(12))


def test_a_cancelled_row_leaves_and_the_others_finish(embedded_runtime):
    runtime = embedded_runtime
    reqs = [dataclasses.replace(r, max_new_tokens=8) for r in requests_for(runtime)[:3]]
    expected = [alone(runtime, r).token_ids for r in reqs]
    batch = runtime.batch_decoder()
    with runtime.batch_context():
        rows = batch.join([runtime.decoder_inputs(r.inputs) for r in reqs],
                          [runtime.row_knobs(top_k=r.top_k, num_active_blocks=r.num_active_blocks) for r in reqs],
                          [r.max_new_tokens for r in reqs])
        batch.step()
        # cancelled from another thread while the batch waits between steps
        worker = threading.Thread(target=rows[1].cancel)
        worker.start()
        worker.join()
        while batch.live:
            batch.step()
    assert rows[1].finish_reason == "cancelled" and rows[1].tokens == expected[1][:2]
    assert [rows[0].tokens, rows[2].tokens] == [expected[0], expected[2]]


def test_a_malformed_request_is_refused_and_the_others_run(embedded_runtime):
    runtime = embedded_runtime
    reqs = requests_for(runtime)[:3]
    bad_knob = dataclasses.replace(reqs[0], top_k=0)
    bad_ids = dataclasses.replace(reqs[1], inputs=dataclasses.replace(reqs[1].inputs, input_ids=torch.zeros(3)))
    bad_image = dataclasses.replace(reqs[2], inputs=dataclasses.replace(reqs[2].inputs,
                                                                         images=torch.zeros(2, 3, 5, 5)))
    too_long = dataclasses.replace(reqs[0], max_new_tokens=runtime.context_length)
    results = runtime.generate_batch([bad_knob, reqs[0], bad_ids, reqs[1], bad_image, too_long, reqs[2]])
    assert [type(r).__name__ for r in results] == [
        "CtrlError", "GenerationResult", "CtrlError", "GenerationResult", "CtrlError", "CtrlError", "GenerationResult"]
    assert str(results[0]).startswith("request 0: top_k must be an integer in 1..64, got 0")
    assert str(results[2]).startswith("request 2: input_ids must be a (1, tokens) tensor")
    assert str(results[4]).startswith("request 4: its inputs could not be embedded")
    assert "exceed the model's 2048 positions" in str(results[5])
    assert [results[i].token_ids for i in (1, 3, 6)] == [
        alone(runtime, r).token_ids for r in reqs]
    assert runtime.generate_batch([dataclasses.replace(reqs[0], max_new_tokens=0)])[0].token_ids == []


def test_more_requests_than_rows_run_as_rows_leave(embedded_runtime):
    runtime = embedded_runtime
    reqs = requests_for(runtime)
    expected = [alone(runtime, r).token_ids for r in reqs]
    assert [r.token_ids for r in runtime.generate_batch(reqs, max_rows=2)] == expected
    with pytest.raises(ValueError, match="max_rows must be a positive integer, got 0"):
        runtime.generate_batch(reqs, max_rows=0)


def test_a_batch_larger_than_memory_names_the_size_that_fits(embedded_runtime, monkeypatch):
    runtime = embedded_runtime
    reqs = requests_for(runtime)[:2]
    monkeypatch.setattr(type(runtime), "batch_rows_that_fit", lambda self, tokens, available=None: 1)
    with pytest.raises(CtrlError, match=r"a batch of 2 rows of up to \d+ positions does not fit .*: at most 1 rows do"):
        runtime.generate_batch(reqs, max_rows=2)
    assert [r.token_ids for r in runtime.generate_batch(reqs)] == [alone(runtime, r).token_ids for r in reqs]


def test_rows_that_fit_count_the_cache_at_twice_its_size(embedded_runtime):
    from runtime.decoder_runtime import BATCH_HEADROOM_BYTES

    # the embedded decoder: 16 blocks, 4 KV heads of 16 values, float32 K and V
    per_position = 2 * 16 * 4 * 16 * 4
    available = BATCH_HEADROOM_BYTES + 10 * 2 * 100 * per_position
    assert embedded_runtime.batch_rows_that_fit(100, available=available) == 10
    assert embedded_runtime.batch_rows_that_fit(100, available=available - 1) == 9


#: rows continued from a prefix: (image size or None, max_crops, insertion position p, top_k, block count, new tokens)
FROM_PREFIX = [((320, 240), 1, 1, 8, 16, 6), ((640, 480), 4, 3, 1, 12, 5), (None, 1, 2, 12, 14, 7),
               ((300, 300), 6, 4, 4, 16, 4), ((1000, 250), 2, 2, 2, 2, 6)]


@pytest.mark.parametrize("model", ["embedded_runtime", "tiny_molmoe"])
@pytest.mark.parametrize("fast_path", [True, False])
def test_rows_from_prefixes_answer_what_each_prefix_answers_alone(request, model, fast_path):
    """Rows joining after blocks 0..p-1 (mixed p, a budget token appended to each prefix) give the
    tokens and first logits of the same prefix continued alone (prefill_suffix, decode_step)."""
    from runtime.request import RequestExecutor
    from runtime.timing import RequestTiming, StageTimer

    runtime = request.getfixturevalue(model)
    runtime.set_execution(fast_path)
    timer = StageTimer(runtime.vision_module, list(runtime.decoder_layers), runtime.device)
    try:
        executor = RequestExecutor(runtime, timer)
        gen = torch.Generator().manual_seed(5)
        rows, expected = [], []
        for j, (size, crops, p, k, blocks, n) in enumerate(FROM_PREFIX):
            text_only = size is None and runtime.answers_without_image
            image = None if text_only else make_image(*(size or (200, 200)), seed=j)
            inputs = runtime.preprocess(image, f"{QUESTION} {j}", crops)
            budget_token = torch.randn(runtime.hidden_size, generator=gen) * runtime.embedding_rms()
            prefix = runtime.prefill_prefix(inputs, p, budget_token)
            answer = executor.answer(prefix, k, blocks, RequestTiming(), max_tokens=n)
            with runtime.knobs(top_k={i: k for i in range(p, runtime.num_layers)}):
                first = runtime.prefill_suffix(prefix, answer.active_blocks).logits.float().cpu()
            knobs = runtime.knobs_after_prefix(p, k, blocks)
            assert knobs.blocks == answer.active_blocks
            rows.append(PrefixRequest(prefix, knobs, n))
            expected.append((answer.tokens, first))
        batched = runtime.answer_prefixes(rows)
        batch = runtime.batch_decoder()
        inputs = [runtime.row_prefix(r.prefix) for r in rows]
        with runtime.batch_context():
            joined = batch.join([hidden for hidden, _ in inputs], [r.knobs for r in rows],
                                [r.max_new_tokens for r in rows], prefixes=[kv for _, kv in inputs])
    finally:
        timer.close()
        runtime.set_execution(None)
    for (tokens, first), result, row in zip(expected, batched, joined, strict=True):
        torch.testing.assert_close(row.logits.cpu(), first, atol=LOGIT_ATOL_FLOAT32[model], rtol=0)
        assert result.token_ids == tokens
