"""The parts of gpu_check.py that run in a child process of their own, one per call:

    python benchmarks/gpu_check_child.py NAME 'JSON ARGUMENTS'

prints a JSON object of figures on its last line. NAME is one of:

* ``imports``: which of the given modules import here ({module: null or the error}), torch's and
  CUDA's versions;
* ``write``: the random-weight checkpoint (``molmoe_common.write_checkpoint``);
* ``load``: the bfloat16 load onto the device with its memory (``molmoe_common.measure_load``),
  where the parameters ended up, the memory check's reading and refusal on that device, and one
  generation;
* ``speed``: the fast path against the eager one (``bench_speed.measure``) on the device, and how
  far the fast path's bfloat16 logits are from the eager path's;
* ``parity``: bf16 on the device against the CPU path, by the rule of tests/test_molmoe_precision.py;
* ``client``: requests through the openai client to a running ``ctrl serve``.

Each runs in its own process so that a model held by one never crowds the next out, and a hang
is ended with its process group.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from molmoe_common import ROOT, measure_load, write_checkpoint

sys.path.insert(0, str(ROOT))

QUESTION = "What is the dominant color of the object in the center of the picture?"
#: (image size or None, max_crops): a 3x4 tiling, a 2x2, a tall image, text only (the precision test's cases)
PARITY_CASES = [((640, 480), 12), ((320, 240), 4), ((50, 700), 6), (None, 6)]


def random_image(width: int, height: int, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def check_imports(args: dict) -> dict:
    errors = {}
    for module in args["modules"]:
        try:
            __import__(module)
            errors[module] = None
        except Exception as exc:  # a broken install raises more than ImportError
            errors[module] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}",
                    bf16=torch.cuda.is_bf16_supported(), cudnn=torch.backends.cudnn.version(),
                    nccl=str(torch.cuda.nccl.version()))
    return {"errors": errors, **info}


def write(args: dict) -> dict:
    config = json.loads(Path(args["config"]).read_text())
    return write_checkpoint(Path(args["out"]), config, Path(args["source"]), seed=args.get("seed", 0),
                            draw_device=args.get("draw_device", "cpu"), log=lambda line: print(line, flush=True))


def load(args: dict) -> dict:
    import torch

    from runtime import ModelLoadError
    from runtime.memory import check_fits, device_available_bytes
    from runtime.timing import GenerateTimer

    device = args["device"]
    runtime, figures = measure_load(Path(args["checkpoint"]), "bfloat16", device)
    if runtime is None:
        msg = f"the load was refused: {figures['refused']}"
        raise RuntimeError(msg)
    # the memory check on this device: what it reads as free, and a refusal of twice that
    dev = torch.device(device)
    free = device_available_bytes(dev)
    figures["memory_check_free_bytes"] = free
    try:
        check_fits("gpu-check", lambda dtype: 2 * (free or 1 << 40), runtime.dtype, dev)
        figures["memory_check_refusal"] = None
    except ModelLoadError as exc:
        figures["memory_check_refusal"] = str(exc)
    # one generation at 4 crops: the forward runs on the device, and its memory beside the weights
    inputs = runtime.preprocess(random_image(640, 480, 1), QUESTION, 4)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with GenerateTimer(runtime) as timer:
        runtime.generate(inputs, max_new_tokens=2)  # warm-up
        with timer.request() as marks:
            result = runtime.generate(inputs, max_new_tokens=8)
        t = timer.resolve(marks)
    figures["generate"] = {"tokens": len(result.token_ids), "total_ms": t.total_ms, "vision_ms": t.vision_ms,
                           "prefill_ms": t.prefill_ms, "decode_ms": t.decode_ms,
                           "prompt_tokens": int(inputs.input_ids.shape[1])}
    if dev.type == "cuda":
        figures["generate"]["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
    return figures


def _error_stats(ours, theirs, exact) -> dict:
    """The precision test's figures: ours (N) and theirs (A) against the exact (W) computation."""
    their, our = (theirs - exact).abs(), (ours - exact).abs()
    return {"their_mean": float(their.mean()), "their_max": float(their.max()), "our_mean": float(our.mean()),
            "our_max": float(our.max()), "between_mean": float((ours - theirs).abs().mean()),
            "exact_max": float(exact.abs().max())}


def parity_rule(stats: dict) -> list[str]:
    """What breaks tests/test_molmoe_precision.py's rule (empty: it holds): the rounding is real and
    small, N's mean error at most 1.25x A's, its largest at most 2x A's, and N and A differ on
    average by at most twice A's error."""
    broken = []
    if not 0 < stats["their_max"] < 0.05 * stats["exact_max"]:
        broken.append(f"the CPU bf16 error {stats['their_max']:.3g} is not in (0, 5% of {stats['exact_max']:.3g})")
    if stats["our_mean"] > 1.25 * stats["their_mean"]:
        broken.append(f"mean error {stats['our_mean']:.3g} > 1.25 x the CPU's {stats['their_mean']:.3g}")
    if stats["our_max"] > 2 * stats["their_max"]:
        broken.append(f"largest error {stats['our_max']:.3g} > 2 x the CPU's {stats['their_max']:.3g}")
    if stats["between_mean"] > 2 * stats["their_mean"]:
        broken.append(f"mean difference from the CPU {stats['between_mean']:.3g} > 2 x its error "
                      f"{stats['their_mean']:.3g}")
    return broken


def parity(args: dict) -> dict:
    """W: float32 on the CPU (the exact computation of the bf16 weights); A: bfloat16 on the CPU; N:
    bfloat16 on the device (on a CPU dry run N is A: the rule then holds trivially)."""
    from runtime.molmoe import MolmoERuntime

    config = json.loads(Path(args["config"]).read_text())
    checkpoint = Path(args["checkpoint"])
    write_checkpoint(checkpoint, config, Path(args["source"]), seed=0, log=lambda line: None)
    exact = MolmoERuntime(checkpoint, "cpu", dtype="float32")
    cpu = MolmoERuntime(checkpoint, "cpu", dtype="bfloat16")
    device = args["device"]
    ours = cpu if device == "cpu" else MolmoERuntime(checkpoint, device, dtype="bfloat16")
    cases, broken = [], []
    for size, max_crops in PARITY_CASES:
        image = None if size is None else random_image(*size, seed=3)
        inputs = cpu.preprocess(image, QUESTION, max_crops)
        label = f"logits {'text only' if size is None else f'{size[0]}x{size[1]}'} crops {max_crops}"

        def both(compute):  # (N, A): computed once when N is A
            theirs = compute(cpu)
            return (theirs if ours is cpu else compute(ours)), theirs

        stats = _error_stats(*both(lambda rt: rt.forward_logits(inputs)), exact.forward_logits(inputs))
        if image is not None:
            feats = both(lambda rt: rt.image_features([inputs])[0])
            cases.append({"case": label.replace("logits", "image feature"),
                          **_error_stats(*feats, exact.image_features([inputs])[0])})
        same = None
        if ours is not cpu:  # greedy tokens on the device against the CPU's (a near tie may split them)
            same = list(ours.generate(inputs, max_new_tokens=8).token_ids) == list(
                cpu.generate(inputs, max_new_tokens=8).token_ids)
        cases.append({"case": label, **stats, "same_greedy_tokens": same})
    for case in cases:
        case["broken"] = parity_rule(case)
        broken += [f"{case['case']}: {b}" for b in case["broken"]]
    return {"device": device, "cases": cases, "broken": broken, "holds": not broken}


def speed(args: dict) -> dict:
    """``bench_speed.measure`` of the checkpoint in bfloat16 on the device, then per parity case the
    fast path's first-token logits against the eager path's (largest and mean difference, relative
    to the largest logit) and whether their 8 greedy tokens agree."""
    import torch
    from bench_speed import measure, parse_configs

    from runtime.molmoe import MolmoERuntime

    runtime = MolmoERuntime(Path(args["checkpoint"]), args["device"], dtype="bfloat16", fast_path=True)
    result = measure(runtime, parse_configs(args["configs"]), rounds=args.get("rounds", 7), warmup=2,
                     max_new_tokens=8, eager_rounds=args.get("eager_rounds"), log=lambda line: print(line, flush=True))
    compared = []
    for size, max_crops in PARITY_CASES:
        image = None if size is None else random_image(*size, seed=3)
        inputs = runtime.preprocess(image, QUESTION, max_crops)
        outputs = {}
        for path in ("eager", "fast"):
            runtime.set_execution(path == "fast")
            with torch.inference_mode():
                state = runtime.prefill_suffix(runtime.prefill_prefix(inputs, 0), tuple(range(runtime.num_layers)))
                logits = state.logits.float().cpu()
            outputs[path] = (logits, runtime.generate(inputs, max_new_tokens=8).token_ids)
        (eager_logits, eager_tokens), (fast_logits, fast_tokens) = outputs["eager"], outputs["fast"]
        scale = float(eager_logits.abs().max())
        compared.append({"case": f"{'text only' if size is None else f'{size[0]}x{size[1]}'} crops {max_crops}",
                         "max_abs_diff": float((fast_logits - eager_logits).abs().max()),
                         "mean_abs_diff": float((fast_logits - eager_logits).abs().mean()), "logit_scale": scale,
                         "same_first_token": int(fast_logits.argmax()) == int(eager_logits.argmax()),
                         "same_greedy_tokens": list(fast_tokens) == list(eager_tokens)})
    result["fast_vs_eager"] = compared
    return result


def client(args: dict) -> dict:
    """``num_requests`` requests one after another, the budgets in turn, the dataset's samples in turn."""
    import openai

    samples = json.loads(Path(args["dataset"], "dataset.json").read_text())["samples"]
    images = Path(args["dataset"]) / "images"
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{args['port']}/v1", api_key="-", max_retries=0,
                        timeout=args.get("timeout_s", 120))
    rows = []
    for i in range(args["num_requests"]):
        sample = samples[i % len(samples)]
        budget = args["budgets_ms"][i % len(args["budgets_ms"])]
        image = next(images.glob(f"{sample['image_id']}.*"))
        started = time.perf_counter()
        reply = api.chat.completions.create(
            model=args["model"], max_tokens=args.get("max_tokens", 8), extra_body={"latency_budget_ms": budget},
            messages=[{"role": "user", "content": [{"type": "text", "text": sample["question"]},
                                                   {"type": "image_url", "image_url": {"url": str(image)}}]}])
        ctrl = reply.model_extra["ctrl"]
        rows.append({"budget_ms": budget, "client_ms": (time.perf_counter() - started) * 1000.0,
                     "met": ctrl["met"], "knobs": ctrl["knobs"], "decided_by": ctrl["decided_by"],
                     "latency_scale": ctrl["latency_scale"], "latency_ms": ctrl["latency_ms"],
                     "finish_reason": reply.choices[0].finish_reason,
                     "completion_tokens": reply.usage.completion_tokens})
    return {"requests": rows}


def main() -> None:
    name, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    steps = {"imports": check_imports, "write": write, "load": load, "speed": speed, "parity": parity,
             "client": client}
    result = steps[name](args)
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
