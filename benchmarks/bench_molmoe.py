"""The native MolmoE runtime against the origin model code, on the same tiny checkpoint, in one run.

    python benchmarks/bench_molmoe.py            # 15 rounds, 1 thread; --d-model 256 for a wider model

Builds (once, cached in benchmarks/.cache) a tiny random-weight checkpoint with the real layout
(``../shared/molmoe_reference/build_tiny_molmoe.py``; the reference must be present), loads it
with the native runtime and with the origin ``MolmoForCausalLM`` (in-process, as the tests do),
and times, alternating native and origin in every round so that both see the same machine:

* ``forward``: one uncached forward of a prompt with an image (vision tower + prefill, logits);
* ``generate``: greedy decoding of 16 tokens with the KV cache (prefill + 15 cached steps).

Both get the native preprocessing's inputs (the origin processor needs torchvision); the
outputs are checked equal before timing. Reported: median, p95 per path, and native/origin.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
CACHE = ROOT / "benchmarks" / ".cache"


def tiny_checkpoint(d_model: int) -> Path:
    from molmoe_origin import reference_dir

    ref = reference_dir()
    if ref is None:
        sys.exit("the MolmoE reference (../shared/molmoe_reference or $CTRL_MOLMOE_REFERENCE) is needed")
    out = CACHE / f"tiny-molmoe-d{d_model}"
    if not (out / "model.safetensors").is_file():
        subprocess.run([sys.executable, str(ref / "build_tiny_molmoe.py"), str(out), "--force", "--v5-fixes",
                        "--d-model", str(d_model)], check=True, capture_output=True)
    return out


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--max-crops", type=int, default=6)
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    import torch
    from molmoe_origin import load_origin_model, origin_forward, origin_greedy
    from PIL import Image

    from runtime.molmoe import MolmoERuntime

    torch.set_num_threads(args.threads)
    ckpt = tiny_checkpoint(args.d_model)
    native = MolmoERuntime(ckpt)
    origin = load_origin_model(ckpt)
    rng = torch.Generator().manual_seed(0)
    pixels = (torch.rand(480, 640, 3, generator=rng) * 255).byte().numpy()
    inputs = native.preprocess(Image.fromarray(pixels), "What is the color of the cat on the table?", args.max_crops)
    torch.testing.assert_close(native.forward_logits(inputs), origin_forward(origin, inputs).logits[0],
                               rtol=0, atol=1e-4)
    assert native.generate(inputs, 16).token_ids == origin_greedy(origin, inputs, 16, native.eos_id)

    tasks = {
        "forward": (lambda: native.forward_logits(inputs), lambda: origin_forward(origin, inputs)),
        "generate": (lambda: native.generate(inputs, 16), lambda: origin_greedy(origin, inputs, 16, -1)),
    }
    times: dict[tuple[str, str], list[float]] = {(t, w): [] for t in tasks for w in ("native", "origin")}
    for _ in range(args.rounds):
        for task, (run_native, run_origin) in tasks.items():
            for which, run in (("native", run_native), ("origin", run_origin)):
                start = time.perf_counter()
                run()
                times[(task, which)].append((time.perf_counter() - start) * 1000)
    print(f"torch {torch.__version__}, {args.threads} thread(s); tiny MolmoE d_model {args.d_model}, "
          f"{inputs.num_crops} crops + global image, {inputs.input_ids.shape[1]} prompt tokens; "
          f"{args.rounds} alternating rounds (outputs checked equal first)")
    print(f"{'task':10s} {'native median':>14s} {'p95':>8s} {'origin median':>14s} {'p95':>8s} {'native/origin':>14s}")
    for task in tasks:
        n, o = times[(task, "native")], times[(task, "origin")]
        print(f"{task:10s} {statistics.median(n):11.1f} ms {p95(n):6.1f} ms {statistics.median(o):11.1f} ms "
              f"{p95(o):6.1f} ms {statistics.median(n) / statistics.median(o):14.2f}")


if __name__ == "__main__":
    main()
