"""The fast path (``runtime.fast_decoder``) against the eager reference, on the CPU.

The eager path is the one tested against the origin code (tests/test_molmoe_native.py); here the
fast path must give its greedy tokens for every knob setting, its prefill logits bit for bit on
MolmoE in float32, and decode steps that a CUDA graph can capture: no operation that waits for the
device, the same operations on the same shapes at every position, a bounded number of operations
per block, and the knobs still cutting work (top-K experts read, skipped blocks absent).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from test_model_runtime import QUESTION, make_image
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.cuda_graphs import GraphCache, RerunBackend
from runtime.fast_decoder import (
    CpuFormulation,
    CudaFormulation,
    FastSession,
    GraphedFunction,
    bucket_for,
    prefill_bucket_for,
)
from runtime.molmoe import MolmoERuntime
from runtime.timing import GenerateTimer

#: operations that read a device value on the host (a CUDA graph cannot contain them, and on a GPU
#: each one stalls the host until the device catches up)
HOST_SYNC_OPS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
                 "aten.nonzero_static.default", "aten.masked_select.default", "aten.unique_consecutive.default",
                 "aten._unique2.default", "aten.bincount.default", "aten.repeat_interleave.Tensor",
                 "aten.is_nonzero.default", "aten.equal.default", "aten.masked_scatter.default"}
#: tensor methods that hand a tensor's values to Python (on a CPU tensor ``tolist`` dispatches no aten
#: operation, so only the Python call shows it)
HOST_READ_METHODS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__bool__,
                     torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
#: aten operations (views included) a GPU's decode step may dispatch per active block: measured 86
#: (grouped experts) and 92 (gathered) on the tiny checkpoint; the eager path's step dispatched 238
#: (and read the expert counts once per block)
OPS_PER_BLOCK_MAX = 100


class HostReads(TorchFunctionMode):
    """The tensor methods inside the ``with`` block that read values into Python."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READ_METHODS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


class OpTrace(TorchDispatchMode):
    """Every aten operation dispatched inside the ``with`` block, with its output shapes, and the
    ones that read device values on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []
        self.syncs: list[str] = []
        self.grouped_offsets: list[torch.Tensor] = []
        self.topk: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        out = func(*args, **kwargs)
        if name in HOST_SYNC_OPS:
            self.syncs.append(name)
        # indexing with a boolean mask has a data-dependent shape (nonzero underneath)
        if name.startswith("aten.index.") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self.syncs.append(name + " (boolean mask)")
        if name == "aten._grouped_mm.default":
            self.grouped_offsets.append(kwargs.get("offs", args[2] if len(args) > 2 else None).clone())
        if name == "aten.topk.default":
            self.topk.append(int(args[1]))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        self.calls.append((name, tuple(tuple(o.shape) for o in outputs if isinstance(o, torch.Tensor))))
        return out


@pytest.fixture(scope="module")
def eager(tiny_molmoe_dir) -> MolmoERuntime:
    return MolmoERuntime(tiny_molmoe_dir, fast_path=False)


@pytest.fixture(scope="module")
def fast(tiny_molmoe_dir) -> MolmoERuntime:
    return MolmoERuntime(tiny_molmoe_dir, fast_path=True)


@contextmanager
def formulation(runtime: MolmoERuntime, make, graphs: GraphCache | None = None,
                prefill_graphs: GraphCache | None = None) -> Iterator[MolmoERuntime]:
    """The fast runtime computing with ``make(decoder)`` (and capturing decode steps into ``graphs``,
    prefill blocks into ``prefill_graphs``) inside the block, its own CPU formulation after."""
    decoder = runtime.fast
    decoder.use(make(decoder), graphs, prefill_graphs)
    try:
        yield runtime
    finally:
        decoder.use(CpuFormulation(decoder))


@pytest.fixture
def fused(fast) -> Iterator[MolmoERuntime]:
    """The fast runtime in a GPU's formulation, on the CPU: the sync-free step with fewer, larger
    kernels and the experts as grouped products."""
    with formulation(fast, lambda d: CudaFormulation(d, grouped=True)) as runtime:
        yield runtime


@pytest.fixture
def gathered(fast) -> Iterator[MolmoERuntime]:
    """The GPU's formulation where grouped_mm is not one kernel (an A100, L4, RTX 4090): a decode
    step gathers its K experts' weights, a prefill runs the experts module."""
    with formulation(fast, lambda d: CudaFormulation(d, grouped=False)) as runtime:
        yield runtime


@contextmanager
def execution(runtime, compile: bool) -> Iterator:
    """The runtime on one path for the block, its own path restored after."""
    saved = runtime.fast is not None
    runtime.set_execution(compile)
    try:
        yield runtime
    finally:
        runtime.set_execution(saved)


#: (image size or None, max_crops, knobs): the default, top-K 1, blocks skipped, both, text only
GENERATE_CASES = [((320, 240), 4, {}), ((640, 480), 12, {"top_k": 1}), ((50, 700), 6, {"num_active_blocks": 12}),
                  ((1000, 300), 9, {"top_k": 2, "active_blocks": [0, 3, 4, 7, 11, 15]}),
                  (None, 3, {"top_k": {0: 8, 4: 2, 15: 1}, "num_active_blocks": 10})]


def inputs_for(runtime, size, max_crops: int):
    return runtime.preprocess(None if size is None else make_image(*size, seed=max_crops), QUESTION, max_crops)


@pytest.mark.parametrize("variant", ["fast", "fused", "gathered"])
@pytest.mark.parametrize(("size", "max_crops", "knobs"), GENERATE_CASES)
def test_greedy_tokens_equal_the_eager_path(eager, request, variant, size, max_crops, knobs):
    """The CPU's own formulation (``fast``) and a GPU's, with and without grouped products (run on the CPU)."""
    runtime = request.getfixturevalue(variant)
    inputs = inputs_for(eager, size, max_crops)
    with eager.knobs(**knobs):
        expected = eager.generate(inputs, max_new_tokens=12).token_ids
    with runtime.knobs(**knobs):
        got = runtime.generate(inputs, max_new_tokens=12).token_ids
    assert len(expected) == 12 and got == expected


@pytest.mark.parametrize("knobs", [{}, {"top_k": 1, "num_active_blocks": 12}])
def test_embedded_greedy_tokens_equal_the_eager_path(embedded_runtime, knobs):
    inputs = inputs_for(embedded_runtime, (400, 300), 6)
    with execution(embedded_runtime, False), embedded_runtime.knobs(**knobs):
        expected = embedded_runtime.generate(inputs, max_new_tokens=10).token_ids
    with execution(embedded_runtime, True), embedded_runtime.knobs(**knobs):
        got = embedded_runtime.generate(inputs, max_new_tokens=10).token_ids
    assert got == expected


def two_stage(runtime, inputs, p: int, top_k: int, blocks: int, steps: int) -> list[torch.Tensor]:
    """The logits of the prefill and of ``steps`` greedy decode steps through the two-stage calls."""
    prefix = runtime.prefill_prefix(inputs, p)
    with runtime.knobs(top_k={i: top_k for i in range(p, runtime.num_layers)}):
        state = runtime.prefill_suffix(prefix, runtime.blocks_for(blocks, first_kept=max(p, 1)))
        logits = [state.logits.clone()]
        for _ in range(steps):
            runtime.decode_step(state, int(state.logits.argmax()))
            logits.append(state.logits.clone())
    return logits


@pytest.mark.parametrize(("p", "top_k", "blocks"), [(0, 8, 16), (2, 1, 16), (3, 4, 12)])
def test_two_stage_prefill_is_bit_identical_and_decoding_agrees(eager, fast, p, top_k, blocks):
    inputs = inputs_for(eager, (640, 480), 6)
    expected = two_stage(eager, inputs, p, top_k, blocks, steps=6)
    got = two_stage(fast, inputs, p, top_k, blocks, steps=6)
    # the prefill computes what the eager path computes, in the same order
    assert torch.equal(got[0], expected[0])
    # decode steps attend over a fixed window with a mask: the softmax sums in another order, and
    # the reference builder's gains amplify that rounding (measured: at most 1.5e-4 relative)
    for a, b in zip(got[1:], expected[1:]):
        assert float((a - b).norm() / b.norm()) <= 1e-3
        assert int(a.argmax()) == int(b.argmax())


def test_a_prefix_with_the_budget_token_keeps_the_prompt_only(eager, fast):
    inputs = inputs_for(eager, (320, 240), 4)
    token = torch.randn(eager.hidden_size, generator=torch.Generator().manual_seed(1))
    results = []
    for runtime in (eager, fast):
        prefix = runtime.prefill_prefix(inputs, 2, token)
        state = runtime.prefill_suffix(prefix, tuple(range(16)))
        results.append((prefix.hidden, state.logits))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-5)
    assert torch.equal(results[1][1], results[0][1])


def decode_trace(runtime, inputs, knobs: dict, steps: int = 2) -> tuple[list[OpTrace], FastSession]:
    """One op trace per decode step after a prefill (the first step outside any trace)."""
    prefix = runtime.prefill_prefix(inputs, 0)
    traces = []
    with runtime.knobs(**knobs):
        state = runtime.prefill_suffix(prefix, tuple(runtime.current_active_blocks()))
        runtime.decode_step(state, int(state.logits.argmax()))
        for _ in range(steps):
            token = int(state.logits.argmax())
            with torch.no_grad(), HostReads() as reads, OpTrace() as trace:
                runtime.decode_step(state, token)
            trace.syncs += reads.reads
            traces.append(trace)
    return traces, state.cache


def test_the_sync_detector_sees_host_reads():
    with HostReads() as reads, OpTrace() as trace:
        x = torch.tensor([0.0, 2.0, 3.0])
        x.sum().item()
        x.nonzero()
        x[x > 1]
        x.tolist()
    assert trace.syncs == ["aten._local_scalar_dense.default", "aten.nonzero.default",
                           "aten.index.Tensor (boolean mask)"]
    assert reads.reads == ["item", "tolist"]


@pytest.mark.parametrize("variant", ["fused", "gathered"])
@pytest.mark.parametrize("knobs", [{}, {"top_k": 1, "num_active_blocks": 12}])
def test_a_decode_step_never_reads_the_device_and_keeps_its_shapes(request, variant, knobs):
    runtime = request.getfixturevalue(variant)
    inputs = inputs_for(runtime, (320, 240), 4)
    (first, second), session = decode_trace(runtime, inputs, knobs)
    assert first.syncs == [] and second.syncs == []
    # the next position, same window: the same operations on the same shapes (what a graph replays)
    assert bucket_for(session.position - 1) == bucket_for(session.position)
    assert first.calls == second.calls
    blocks = len(session.blocks)
    assert len(first.calls) / blocks <= OPS_PER_BLOCK_MAX, f"{len(first.calls) / blocks:.1f} ops per block"


@pytest.mark.parametrize("variant", ["fused", "gathered"])
@pytest.mark.parametrize("knobs", [{}, {"top_k": 1, "num_active_blocks": 12}])
def test_a_gpus_decode_step_computes_what_the_cpus_does(fast, request, variant, knobs):
    """A CPU loops over the chosen experts (ids read on the host); a GPU's step, grouped or gathered,
    computes the same products in another rounding: the same greedy tokens, logits within 1e-3."""
    inputs = inputs_for(fast, (640, 480), 6)
    top_k, blocks = knobs.get("top_k", 8), knobs.get("num_active_blocks", 16)
    looped = two_stage(fast, inputs, 0, top_k, blocks, steps=4)
    runtime = request.getfixturevalue(variant)
    other = two_stage(runtime, inputs, 0, top_k, blocks, steps=4)
    for a, b in zip(other, looped):
        assert float((a - b).norm() / b.norm()) <= 1e-3 and int(a.argmax()) == int(b.argmax())


def test_the_eager_decode_step_reads_the_device(eager):
    """The contrast the fast path exists for: the eager step's experts read the expert counts."""
    inputs = inputs_for(eager, (320, 240), 4)
    (trace,), _ = decode_trace(eager, inputs, {}, steps=1)
    assert sum(name == "aten.bincount.default" for name in trace.syncs) == 16  # once per block
    assert len(trace.calls) / 16 > OPS_PER_BLOCK_MAX


@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_top_k_reads_only_k_experts_and_skipped_blocks_do_no_work(fused, top_k):
    inputs = inputs_for(fused, (320, 240), 4)
    for blocks in (16, 8):
        (trace,), _ = decode_trace(fused, inputs, {"top_k": top_k, "num_active_blocks": blocks}, steps=1)
        assert trace.topk == [top_k] * blocks
        # per block: the gate and up product and the down product, over the experts chosen
        assert len(trace.grouped_offsets) == 2 * blocks
        for offsets in trace.grouped_offsets:
            rows = torch.diff(offsets, prepend=offsets.new_zeros(1))
            assert int((rows > 0).sum()) == top_k and int(offsets[-1]) == top_k
        # the attention products (q, k and v as one, o), the router per active block, and the output head
        assert sum(name == "aten.mm.default" for name, _ in trace.calls) == 3 * blocks + 1


def test_prefill_calls_every_active_blocks_hooks_and_a_step_calls_them_once(fast):
    inputs = inputs_for(fast, (320, 240), 4)
    active = (0, 2, 5, 15)
    seen: list[int] = []
    with fast.knobs(active_blocks=list(active)), fast.between_blocks(seen.append):
        result = fast.generate(inputs, max_new_tokens=5)
    assert len(result.token_ids) == 5
    # the prefill: before each active block; each of the 4 decode steps: every active block's, before it
    assert seen == list(active) * 5
    with GenerateTimer(fast) as timer, timer.request() as marks:
        result = fast.generate(inputs, max_new_tokens=6)
    timing = timer.resolve(marks)
    assert timing.num_passes == len(result.token_ids) == 6 and len(timing.decode_steps_ms) == 5
    assert timing.prefill_ms > 0 and all(step > 0 for step in timing.decode_steps_ms)


def test_a_check_that_raises_stops_the_prefill_at_that_block(fast):
    inputs = inputs_for(fast, (320, 240), 4)
    ran: Counter = Counter()
    handles = [layer.register_forward_hook(lambda *_, i=i: ran.update([i]))
               for i, layer in enumerate(fast.decoder_layers)]

    def check(block: int) -> None:
        if block == 3:
            msg = "stop here"
            raise RuntimeError(msg)

    try:
        with pytest.raises(RuntimeError, match="stop here"), fast.between_blocks(check):
            fast.generate(inputs, max_new_tokens=4)
    finally:
        for handle in handles:
            handle.remove()
    assert sorted(ran) == [0, 1, 2]


def test_a_decode_state_of_an_earlier_request_is_refused(fast):
    inputs = inputs_for(fast, (320, 240), 4)
    state = fast.prefill_suffix(fast.prefill_prefix(inputs, 0), tuple(range(16)))
    fast.generate(inputs, max_new_tokens=2)  # another request takes the cache
    with pytest.raises(RuntimeError, match="no longer valid"):
        fast.decode_step(state, int(state.logits.argmax()))


def test_the_cache_grows_mid_generation_and_keeps_what_it_holds(embedded_runtime):
    inputs = embedded_runtime.preprocess(make_image(200, 200), QUESTION, 1)
    prompt = int(inputs.input_ids.shape[1])
    new = 130 - prompt  # the decode crosses the 64- and 128-position windows
    with execution(embedded_runtime, False):
        expected = embedded_runtime.generate(inputs, max_new_tokens=new).token_ids
    with execution(embedded_runtime, True):
        embedded_runtime.fast.release()  # earlier tests' requests grew it
        embedded_runtime.fast.ensure_capacity(prompt)
        assert embedded_runtime.fast.capacity == bucket_for(prompt) < 130
        got = embedded_runtime.generate(inputs, max_new_tokens=new).token_ids
        assert embedded_runtime.fast.capacity >= 130
    assert got == expected


class FailingCapture(RerunBackend):
    """A capture that fails as a kernel that cannot be captured does: after its two warm-up runs of
    the step (which move the step's token and position), at the graph itself."""

    def capture(self, body):
        for _ in range(2):
            body()
        msg = "operation not permitted when stream is capturing"
        raise RuntimeError(msg)


def test_a_capture_that_fails_mid_request_leaves_its_tokens_as_eager_gives_them(eager, fast):
    inputs = inputs_for(eager, (320, 240), 4)
    expected = eager.generate(inputs, max_new_tokens=8).token_ids
    graphs = GraphCache(FailingCapture(), label="decode step")
    with formulation(fast, lambda d: CudaFormulation(d, grouped=True), graphs) as runtime:
        with pytest.warns(RuntimeWarning, match="capture failed"):
            got = runtime.generate(inputs, max_new_tokens=8).token_ids
        decoder = runtime.fast
        assert decoder.use_graphs is False and "not permitted" in decoder.graph_error
    # the first step's capture failed after its warm-up had moved the step's token and position; the
    # uncaptured step that follows reads the request's own again
    assert len(expected) == 8 and got == expected


def test_replayed_decode_steps_give_the_uncaptured_steps_tokens(fast, fused):
    """Graphs with a CPU's stand-in for a replay (the step runs again, its logits copied into the
    captured ones): a step reads only its fixed-address inputs, and the caller only the captured outputs."""
    inputs = inputs_for(fast, None, 1)
    prompt = int(inputs.input_ids.shape[1])
    new = 72 - prompt  # crosses the 64-position window: two graphs for one configuration
    expected = fused.generate(inputs, max_new_tokens=new).token_ids
    graphs = GraphCache(RerunBackend(), label="decode step")
    with formulation(fast, lambda d: CudaFormulation(d, grouped=True), graphs) as runtime:
        got = runtime.generate(inputs, max_new_tokens=new).token_ids
        windows = {bucket_for(n) for n in range(prompt + 1, prompt + new)}
        assert graphs.stats.captures == len(windows) == 2 and len(graphs) == 2
        again = runtime.generate(inputs, max_new_tokens=new).token_ids  # replays only
        assert graphs.stats.captures == 2 and runtime.graph_captures == 2
    assert got == expected and again == expected


@pytest.mark.parametrize(("size", "max_crops", "knobs"), [((320, 240), 4, {}), ((640, 480), 6, {"top_k": 2}),
                                                      (None, 3, {"num_active_blocks": 10})])
def test_captured_prefill_blocks_give_the_uncaptured_tokens(eager, fast, size, max_crops, knobs):
    """A prefill as one replayed graph per block, the prompt padded to its token bucket: the eager
    path's tokens; a second request of another length in the same bucket captures nothing."""
    inputs = inputs_for(eager, size, max_crops)
    with eager.knobs(**knobs):
        expected = eager.generate(inputs, max_new_tokens=8).token_ids
    prefill_graphs = GraphCache(RerunBackend(), label="prefill block")
    with formulation(fast, lambda d: CudaFormulation(d, grouped=True), None, prefill_graphs) as runtime, \
            runtime.knobs(**knobs):
        blocks = len(runtime.current_active_blocks())
        tokens = int(inputs.input_ids.shape[1])
        assert prefill_bucket_for(tokens) % 64 == 0 and prefill_bucket_for(tokens) > tokens - 64
        got = runtime.generate(inputs, max_new_tokens=8).token_ids
        assert prefill_graphs.stats.captures == blocks == len(prefill_graphs)
        shorter = runtime.preprocess(None if size is None else make_image(*size, seed=max_crops),
                                     "Why?", max_crops)
        same_bucket = prefill_bucket_for(int(shorter.input_ids.shape[1])) == prefill_bucket_for(tokens)
        runtime.generate(shorter, max_new_tokens=2)
        assert prefill_graphs.stats.captures == blocks * (1 if same_bucket else 2)
    assert len(expected) == 8 and got == expected


def test_a_prefill_capture_that_fails_finishes_the_prefill_uncaptured(eager, fast):
    inputs = inputs_for(eager, (320, 240), 4)
    expected = eager.generate(inputs, max_new_tokens=6).token_ids
    prefill_graphs = GraphCache(FailingCapture(), label="prefill block")
    with formulation(fast, lambda d: CudaFormulation(d, grouped=True), None, prefill_graphs) as runtime:
        with pytest.warns(RuntimeWarning, match="the prefill block runs uncaptured"):
            got = runtime.generate(inputs, max_new_tokens=6).token_ids
        assert not prefill_graphs.enabled
    assert got == expected


def test_prefill_blocks_captured_ahead_serve_the_first_request_of_that_length(fast):
    inputs = inputs_for(fast, (320, 240), 4)
    tokens = int(inputs.input_ids.shape[1])
    prefill_graphs = GraphCache(RerunBackend(), label="prefill block")
    with formulation(fast, lambda d: CudaFormulation(d, grouped=True), None, prefill_graphs) as runtime:
        active = tuple(runtime.current_active_blocks())
        assert runtime.capture_prefill(active, tokens) == len(active)
        assert runtime.capture_prefill(active, tokens) == 0  # held
        runtime.generate(inputs, max_new_tokens=2)
        assert prefill_graphs.stats.captures == len(active)
        # a graph's inputs and the hooks: every active block's hooks still run around it
        seen: list[int] = []
        with runtime.between_blocks(seen.append):
            runtime.generate(inputs, max_new_tokens=1)
        assert seen == list(active)


def test_a_captured_steps_cache_spans_the_trained_context_not_the_rope_table(fast):
    decoder = fast.fast
    assert decoder.context_length == 4096  # max_sequence_length; max_position_embeddings is 32,768
    with formulation(fast, CpuFormulation, GraphCache(RerunBackend())):  # graphs size it at once
        decoder.ensure_capacity(100)
        assert decoder.capacity == 4096
        per_position = 2 * decoder.keys[:, :, 0].numel() * decoder.keys.element_size()
        assert decoder.memory_bytes()["kv_cache"] == 4096 * per_position
        decoder.ensure_capacity(5000)  # a longer request grows it (its graphs are captured again)
        assert decoder.capacity == 8192


def test_the_fused_qkv_product_reads_the_checkpoints_tensor_without_a_copy(eager, fused):
    attn = fused.decoder.model.layers[0].self_attn
    fused_weight = attn.fused_qkv_weight  # the checkpoint's att_proj, loaded once
    d = attn.q_proj.weight.shape[0]
    kv = attn.k_proj.weight.shape[0]
    assert fused_weight.shape == (d + 2 * kv, attn.q_proj.weight.shape[1])
    # the three projections are its rows, not copies
    assert attn.q_proj.weight.data_ptr() == fused_weight.data_ptr()
    assert attn.v_proj.weight.data_ptr() == fused_weight[d + kv:].data_ptr()
    assert torch.equal(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), fused_weight)
    fused.fast.release()
    inputs = inputs_for(eager, (320, 240), 4)
    assert fused.generate(inputs, max_new_tokens=4).token_ids == eager.generate(inputs, max_new_tokens=4).token_ids
    assert fused.fast.memory_bytes()["fused_weights"] == 0


def test_placing_the_image_tokens_reads_nothing_from_the_device(fast):
    inputs = inputs_for(fast, (640, 480), 6)
    assert int((inputs.image_input_idx < 0).sum()) > 0  # padding positions the placement skips
    with torch.inference_mode(), fast.precision_context(), OpTrace() as trace:
        embeds, _ = fast._embed(inputs)
    # the positions are found on the host from the preprocessor's, so the vision pass need not finish first
    assert trace.syncs == []
    with torch.inference_mode(), fast.precision_context():  # the same embeddings as the mask gave
        text = fast.text_embeddings(inputs.input_ids)
        feats, _ = fast._image_tokens(inputs, global_crop=False)
        idx = inputs.image_input_idx.reshape(-1)
        valid = (idx >= 0) & (idx < text.shape[1])
        text[0].index_add_(0, idx[valid], feats.reshape(idx.shape[0], -1)[valid].to(text.dtype))
    assert torch.equal(embeds, text)


def test_windows_are_powers_of_two():
    assert [bucket_for(n) for n in (1, 64, 65, 600, 1024, 1025, 4000)] == [64, 64, 128, 1024, 1024, 2048, 4096]


def test_bfloat16_prefill_is_bit_identical_on_the_cpu(tiny_molmoe_dir):
    """On a CPU the fast path keeps the precision rule's products (float32 attention, the
    block's own experts for a prefill), so bfloat16 weights give the eager path's prefill too."""
    eager_bf16 = MolmoERuntime(tiny_molmoe_dir, dtype="bfloat16", fast_path=False)
    fast_bf16 = MolmoERuntime(tiny_molmoe_dir, dtype="bfloat16", fast_path=True)
    assert fast_bf16.fast.attention_dtype == torch.float32
    inputs = inputs_for(eager_bf16, (320, 240), 4)
    expected = two_stage(eager_bf16, inputs, 0, 4, 12, steps=3)
    got = two_stage(fast_bf16, inputs, 0, 4, 12, steps=3)
    assert torch.equal(got[0], expected[0])
    for a, b in zip(got[1:], expected[1:]):
        assert int(a.argmax()) == int(b.argmax())


def test_switching_paths_keeps_the_fast_paths_state(tiny_molmoe_dir):
    runtime = MolmoERuntime(tiny_molmoe_dir, fast_path=True)
    fast = runtime.fast
    inputs = inputs_for(runtime, (320, 240), 4)
    runtime.generate(inputs, max_new_tokens=2)
    capacity = fast.capacity
    runtime.set_execution(False)
    assert runtime.fast is None and runtime.execution["compiled"] is False
    runtime.set_execution(True)
    assert runtime.fast is fast and fast.capacity == capacity  # the same cache (and graphs, on a GPU)
    runtime.set_execution(True, float32_attention=True)
    assert runtime.fast is not fast and runtime.fast.float32_attention
    # a CPU captures nothing: the ViT runs as it is, and a graphed function just calls through
    assert runtime.vision_backbone.runner is None
    calls = []
    graphed = GraphedFunction(lambda x: calls.append(x) or x * 2, GraphCache(RerunBackend(), enabled=False))
    assert torch.equal(graphed(torch.ones(3)), torch.full((3,), 2.0)) and len(calls) == 1 and graphed.graphs == 0


def test_a_gpus_fused_decode_step_reads_nothing_and_launches_less(eager, fused):
    inputs = inputs_for(fused, (320, 240), 4)
    expected = two_stage(eager, inputs, 0, 4, 12, steps=4)
    got = two_stage(fused, inputs, 0, 4, 12, steps=4)
    for a, b in zip(got, expected):
        assert float((a - b).norm() / b.norm()) <= 1e-3 and int(a.argmax()) == int(b.argmax())
    (first, second), session = decode_trace(fused, inputs, {})
    assert first.syncs == [] and first.calls == second.calls
    names = [name for name, _ in first.calls]
    # per block one product for q, k and v, the output projection and the router; the head once
    assert names.count("aten.mm.default") == 3 * len(session.blocks) + 1
    # per block the gate and up products as one, then the down product
    assert names.count("aten._grouped_mm.default") == 2 * len(session.blocks)
    assert "aten.index_add_.default" not in names and "aten.sort.stable" not in names  # no scatter, one sort


def test_the_vit_captured_ahead_serves_the_request_with_that_many_arrays(tiny_molmoe_dir):
    """``capture_vision`` captures the vision path (ViT, pooling, projector) for an array count before
    a request has it; the request then replays it (no capture) and gets the uncaptured tokens and
    global-crop feature bit for bit."""
    runtime = MolmoERuntime(tiny_molmoe_dir, fast_path=True)
    inputs = inputs_for(runtime, (640, 480), 6)
    arrays = int(inputs.images.shape[0])
    # the global image's own padding differs from the first crop's here: its tokens are pooled again
    assert not torch.equal(inputs.global_image_mask, inputs.image_masks[0])
    with torch.inference_mode(), runtime.precision_context():
        expected, expected_global = runtime._image_tokens(inputs, global_crop=True)
    runtime.vision_backbone.runner = GraphedFunction(runtime.vision_backbone.encode, GraphCache(RerunBackend()))
    runtime._vit_graphs[runtime.vision_attends_float32()] = runtime.vision_backbone.runner
    assert runtime.capture_vision(arrays) is True and runtime.capture_vision(arrays) is False
    assert runtime.graph_captures == 1
    with torch.inference_mode(), runtime.precision_context(), OpTrace() as trace:
        got, got_global = runtime._image_tokens(inputs, global_crop=True)
    assert runtime.graph_captures == 1 and torch.equal(got, expected) and torch.equal(got_global, expected_global)
    # the global image's placed rows are found on the host, not by a boolean mask on the device
    assert [name for name in trace.syncs if "boolean" in name] == []


def test_the_vision_tower_attends_as_the_fast_paths_decoder_and_the_fingerprint_says_so(tiny_molmoe_dir):
    """In bfloat16 with the GPU's formulation (attention in the weights' dtype) the vision tower attends in
    bfloat16 too (its tokens: tests/test_molmoe_native.py), and the fingerprint (the feature cache's key,
    what a controller is matched to) is another; the fingerprint predicted from the config for a GPU is
    that one. The CPU's formulation attends in float32 as the origin does, under the dtype's own."""
    from pipeline.execution import ExecutionOptions
    from runtime.precision import qualify_fingerprint
    from runtime.registry import model_fingerprint

    runtime = MolmoERuntime(tiny_molmoe_dir, dtype="bfloat16", fast_path=True)
    items = [inputs_for(runtime, (640, 480), 6), inputs_for(runtime, (320, 240), 2)]
    origin_fingerprint = runtime.fingerprint
    assert runtime.vision_attends_float32() is True
    assert origin_fingerprint == qualify_fingerprint(runtime.weights_fingerprint, torch.bfloat16)
    assert model_fingerprint(str(tiny_molmoe_dir), dtype="bfloat16") == origin_fingerprint
    expected = runtime.encode_images(items)
    with formulation(runtime, lambda d: CudaFormulation(d, grouped=False)):
        assert runtime.fast.attention_dtype == torch.bfloat16 and runtime.vision_attends_float32() is False
        runtime.encode_images(items)
        assert runtime.vision_backbone.float32_attention is False
        assert runtime.fingerprint != origin_fingerprint
        assert runtime.fingerprint == model_fingerprint(
            str(tiny_molmoe_dir), execution=ExecutionOptions(device="cuda", dtype="bfloat16"))
    assert model_fingerprint(str(tiny_molmoe_dir), execution=ExecutionOptions(
        device="cuda", dtype="bfloat16", float32_attention=True)) == origin_fingerprint
    again = runtime.encode_images(items)  # the CPU's formulation again: the origin's attention
    assert runtime.vision_backbone.float32_attention is True and runtime.fingerprint == origin_fingerprint
    assert torch.equal(again.all_tokens, expected.all_tokens)
