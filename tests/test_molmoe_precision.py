"""MolmoE in reduced precision: the native runtime in bfloat16 against the origin code in bf16 autocast.

The checkpoint is tiny with the real layout, written in bfloat16 by ``synthetic.molmoe_checkpoint``
with the scales of a trained network. The reference builder's checkpoints cannot serve here:
their gains (chosen so that every knob visibly matters) amplify any rounding through the 16
blocks, and there the origin's own bf16 logits differ from its float32 ones by as much as the
logits themselves (measured: 5.8 at a logit scale of 6.0), so no bf16 implementation could be
compared with another on them.

Three computations of the same bf16 weights:

* W: the origin model in float32 (the exact computation of these weights);
* A: the origin model under ``torch.autocast("cpu", bfloat16)``, the way the origin profiled
  (``precision: amp_bf16``);
* N: the native runtime with ``dtype="bfloat16"``.

The tolerance comes from bf16 rounding itself. N must be as accurate as A: its mean distance to W
at most a quarter above A's (the order of sums differs), its largest at most twice A's largest
(the extreme of 10^5 roundings is noisy: measured 0.028 against 0.020 on the text-only prompt,
with equal means). N and A, two independent roundings of one computation, may differ on average
by at most twice what one of them differs from W.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from molmoe_origin import load_origin_model, origin_forward, origin_greedy
from test_model_runtime import QUESTION, make_image

from runtime.molmoe import MolmoERuntime, checkpoint_fingerprint
from runtime.precision import HalfStorageCompute, qualify_fingerprint
from synthetic.molmoe_checkpoint import write_random_checkpoint

pytestmark = [pytest.mark.filterwarnings("ignore:torch.is_autocast_cpu_enabled:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:torch.get_autocast_cpu_dtype:DeprecationWarning")]

# (image size or None, max_crops): a 3x4 tiling, a 2x2, a tall image, text only
CASES = [((640, 480), 12), ((320, 240), 4), ((50, 700), 6), (None, 6)]


@pytest.fixture(scope="module")
def checkpoint(tiny_molmoe_dir: Path, tmp_path_factory) -> Path:
    config = json.loads((tiny_molmoe_dir / "config.json").read_text())
    return write_random_checkpoint(tmp_path_factory.mktemp("bf16") / "ckpt", config, tiny_molmoe_dir,
                                   dtype=torch.bfloat16, seed=0)


@pytest.fixture(scope="module")
def origin(checkpoint: Path):
    return load_origin_model(checkpoint)


@pytest.fixture(scope="module")
def native(checkpoint: Path) -> MolmoERuntime:
    return MolmoERuntime(checkpoint, dtype="bfloat16")


def inputs_for(native: MolmoERuntime, size, max_crops: int):
    image = None if size is None else make_image(*size, seed=3)
    return native.preprocess(image, QUESTION, max_crops)


def autocast_bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_weights_are_held_in_bfloat16_and_the_fingerprint_says_so(native, checkpoint):
    params = [p for m in (native.vision_backbone, native.decoder) for p in m.parameters()]
    assert {p.dtype for p in params} == {torch.bfloat16}
    # rotary frequencies are not weights: they stay float32
    assert {b.dtype for b in native.decoder.buffers()} == {torch.float32}
    assert native.fingerprint != native.weights_fingerprint == checkpoint_fingerprint(checkpoint)
    assert MolmoERuntime(checkpoint, dtype="float32").fingerprint == checkpoint_fingerprint(checkpoint)


@pytest.mark.parametrize(("size", "max_crops"), CASES)
def test_logits_agree_with_the_origin_in_bf16_autocast(native, origin, size, max_crops):
    inputs = inputs_for(native, size, max_crops)
    exact = origin_forward(origin, inputs).logits[0]
    with autocast_bf16():
        theirs = origin_forward(origin, inputs).logits[0].float()
    ours = native.forward_logits(inputs)
    their_error = (theirs - exact).abs()
    our_error = (ours - exact).abs()
    assert 0 < their_error.max() < 0.05 * exact.abs().max()  # the rounding is real and small here
    assert our_error.mean() <= 1.25 * their_error.mean()
    assert our_error.max() <= 2 * their_error.max()
    assert (ours - theirs).abs().mean() <= 2 * their_error.mean()


def bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


@pytest.mark.parametrize(("size", "max_crops"), CASES)
def test_greedy_tokens_equal_the_origin_or_split_at_a_bf16_tie(native, origin, size, max_crops):
    """Equal tokens, or a first divergence where the two candidates' exact logits are closer than
    two bf16 steps (both computations round the head's output to bf16: a coin flip there)."""
    inputs = inputs_for(native, size, max_crops)
    with autocast_bf16():
        theirs = origin_greedy(origin, inputs, 8, native.eos_id)
    ours = native.generate(inputs, max_new_tokens=8).token_ids
    if ours == theirs:
        return
    step = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    ids = torch.cat([inputs.input_ids, torch.tensor([theirs[:step]], dtype=torch.long)], dim=1)
    exact = origin_forward(origin, dataclasses.replace(inputs, input_ids=ids, attention_mask=torch.ones_like(ids)))
    logits = exact.logits[0, -1]
    margin = abs(float(logits[ours[step]] - logits[theirs[step]]))
    assert margin < 2 * bf16_ulp(float(logits[theirs[step]])), (step, margin)


def test_image_features_agree_with_the_origin_vision_backbone(native, origin):
    for size, max_crops in CASES[:3]:
        item = inputs_for(native, size, max_crops)
        with torch.no_grad():
            exact, _ = origin.model.vision_backbone(item.images[None], item.image_masks[None])
            with autocast_bf16():
                theirs, _ = origin.model.vision_backbone(item.images[None], item.image_masks[None])
        valid = item.image_input_idx >= 0
        exact_mean, their_mean = exact[0][valid].mean(0), theirs[0].float()[valid].mean(0)
        ours = native.image_features([item])[0]
        our_error, their_error = (ours - exact_mean).abs(), (their_mean - exact_mean).abs()
        assert 0 < their_error.max() < 0.05 * exact_mean.abs().max()
        assert our_error.mean() <= 1.25 * their_error.mean()
        assert our_error.max() <= 2 * their_error.max()


def test_float32_of_a_bf16_file_is_the_origin_in_float32(checkpoint, origin):
    native32 = MolmoERuntime(checkpoint, dtype="float32")
    inputs = inputs_for(native32, (640, 480), 12)
    torch.testing.assert_close(native32.forward_logits(inputs), origin_forward(origin, inputs).logits[0],
                               rtol=0, atol=1e-4)


# -- the compute rule --------------------------------------------------------------------------------

def test_the_cpu_kernels_for_few_and_many_rows_compute_the_same_rounding():
    """Up to 8 rows run the half kernel, more convert the weight: both are 'round the inputs, sum in
    float32, round the output', so a row gets the same value either way (up to summation order)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 200, generator=generator).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16()
    x = torch.randn(40, 200, generator=generator)
    with HalfStorageCompute(torch.bfloat16):
        many = torch.nn.functional.linear(x, weight, bias)
        few = torch.cat([torch.nn.functional.linear(x[i:i + 4], weight, bias) for i in range(0, 40, 4)])
    assert many.dtype == few.dtype == torch.float32
    # rounded outputs: every value is a bfloat16 value
    assert torch.equal(many, many.bfloat16().float()) and torch.equal(few, few.bfloat16().float())
    expected = (x.bfloat16().double() @ weight.double().T + bias.double()).bfloat16().float()
    # each value is the bf16 rounding of the exact sum: at most one bf16 step from the expectation
    step = expected.abs().clamp_min(1e-3) * 2 ** -7
    assert ((many - expected).abs() <= step).all()
    assert ((few - expected).abs() <= step).all()


def test_the_fingerprint_of_float32_is_the_weights_own_and_others_differ():
    assert qualify_fingerprint("abc", torch.float32) == "abc"
    assert len({"abc", qualify_fingerprint("abc", torch.bfloat16), qualify_fingerprint("abc", torch.float16)}) == 3


def test_gradients_through_converted_weights_are_those_of_each_weight():
    """Inference reuses one scratch buffer for converted weights; under autograd (the online
    latency token trains through the decoder) each product keeps its own, or the first layer's
    backward would read the second layer's weight."""
    generator = torch.Generator().manual_seed(1)
    w1, w2 = (torch.randn(64, 64, generator=generator).bfloat16() for _ in range(2))
    x = torch.randn(32, 64, generator=generator, requires_grad=True)
    with torch.enable_grad(), HalfStorageCompute(torch.bfloat16):
        torch.nn.functional.linear(torch.nn.functional.linear(x, w1), w2).pow(2).sum().backward()
    got = x.grad.clone()
    x.grad = None

    def rounded_linear(v, w):  # the same rounding, spelled out
        return torch.nn.functional.linear(v.bfloat16().float(), w.float()).bfloat16().float()

    rounded_linear(rounded_linear(x, w1), w2).pow(2).sum().backward()
    torch.testing.assert_close(got, x.grad, rtol=0, atol=0)


def test_the_scratch_buffer_serves_inference_mode_and_no_grad_forwards_alike():
    """The buffer made in an inference_mode forward (features, generation) is written again by a
    no_grad one (the online prefill); an inference tensor could not be."""
    import threading

    weight = torch.randn(64, 48).bfloat16()
    x = torch.randn(20, 48)
    out: dict[str, object] = {}

    def forwards() -> None:  # a new thread: its scratch buffer does not exist yet
        try:
            with torch.inference_mode(), HalfStorageCompute(torch.bfloat16):
                out["first"] = torch.nn.functional.linear(x, weight)
            with torch.no_grad(), HalfStorageCompute(torch.bfloat16):
                out["second"] = torch.nn.functional.linear(x, weight * 2)
        except RuntimeError as exc:
            out["error"] = exc

    thread = threading.Thread(target=forwards)
    thread.start()
    thread.join()
    assert "error" not in out, out.get("error")
    assert torch.equal(out["second"], 2 * out["first"])
