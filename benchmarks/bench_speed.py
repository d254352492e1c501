"""The fast path against the eager path, per configuration, in one run on one loaded model.

    python benchmarks/bench_speed.py --model testbed                      # the CPU, 1 thread
    python benchmarks/bench_speed.py --model /path/to/molmoe --dtype bfloat16 --device cuda --json out.json

One model is loaded and switched between the two paths (``runtime.set_execution``), so both read
the same weights and the full-size model fits once. Per configuration (max_crops/top_k/blocks;
a 640x480 image, which MolmoE tiles into ``max_crops`` crops: 4 crops = about 600 prompt tokens)
each path generates ``--warmup`` times unmeasured (a CUDA graph is captured there), then the
paths alternate for ``--rounds`` rounds (the eager path for only ``--eager-rounds`` of them, where
it is asked for parity alone), each generating exactly ``--max-new-tokens`` tokens (the
end-of-sequence token does not stop a timed request), each round timed with the hooks ``ctrl profile`` uses
(``runtime.timing.GenerateTimer``): vision, prefill, the median decode step, the whole request.
Besides: the preprocessing of the request (crops and tokens, on the host; median of at least 5),
the host-side time of a decode step (the call alone, no synchronisation after it: what
the host spends before it may launch the next step), the GPU's peak memory above the weights
while the path ran, the fast path's KV cache and graph pool, and whether the greedy tokens agree.

``--decoder-only`` times the decoder alone, where the two paths differ (the vision tower is the
same code on both): per path one prefix (vision and embeddings) per configuration, then per
round the prefill (every active block, the first token's logits) and ``--max-new-tokens - 1``
greedy decode steps. On a CPU at MolmoE-1B's size a whole request takes 10-20 s, most of it
vision, so this is how enough rounds fit.

``--profile DIR`` runs each configuration once more on the fast path under ``torch.profiler`` (after
two unmeasured runs) and writes, per configuration, its operators by host time and by device time
(``ops-C-K-B.txt``), a Chrome trace (``trace-C-K-B.json.gz``) and, in ``profile.json``, the request's
wall time, how many kernels it launched and how long the GPU was busy, the same for the prefill
alone and for one decode step (a replayed graph's kernels are counted as launched): a GPU busy for a
small part of the wall time is waiting for the host to launch its kernels.

The knob table checks the trade-off: of every pair of configurations that differ in one knob only,
the higher setting must not be faster by the median total beyond the larger of the two's round
spreads (interquartile range), on each path; it prints each pair's cost, so that each knob's
price on the card is visible. Graphs captured during timed rounds are counted per configuration.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTION = "What is the dominant color of the object in the center of the picture?"
#: the default configurations: the profile's corners and the default knobs at 4 crops (~600 tokens on MolmoE)
DEFAULT_CONFIGS = "2/4/12,2/8/16,10/4/12,10/8/16,4/8/16"


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in item.split("/")) for item in text.split(",") if item.strip()]  # type: ignore[misc]


def test_image(width: int = 640, height: int = 480):
    """A smooth deterministic image with a few blocks (what the runtime tests use)."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(0)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    arr = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    for _ in range(4):
        x0, y0 = rng.randint(0, width // 2), rng.randint(0, height // 2)
        arr[y0:y0 + height // 3, x0:x0 + width // 3] = rng.randint(0, 255, size=3)
    return Image.fromarray(arr.clip(0, 255).astype(np.uint8))


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Milliseconds covered by the union of (start, end) intervals in microseconds."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1000.0


def profile_requests(runtime, configs: list[tuple[int, int, int]], out_dir: Path, *, max_new_tokens: int = 8,
                     log=print) -> list[dict]:
    """One fast-path request per configuration under ``torch.profiler`` (see ``--profile``)."""
    import gzip

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = runtime.device.type == "cuda"
    out_dir.mkdir(parents=True, exist_ok=True)
    image = test_image()

    def kernels(prof) -> tuple[int, float | None]:  # kernels launched, ms the GPU was busy with them
        found = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        return len(found), _busy_ms([(e.time_range.start, e.time_range.end) for e in found]) if cuda else None

    runtime.set_execution(True)
    rows = []
    for max_crops, top_k, blocks in configs:
        name = f"{max_crops}-{top_k}-{blocks}"
        inputs = runtime.preprocess(image, QUESTION, max_crops)
        with runtime.knobs(top_k=top_k, num_active_blocks=blocks):
            for _ in range(2):
                runtime.generate(inputs, max_new_tokens)
            if cuda:
                torch.cuda.synchronize(runtime.device)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                started = time.perf_counter()
                result = runtime.generate(inputs, max_new_tokens)
                if cuda:
                    torch.cuda.synchronize(runtime.device)
                wall_ms = (time.perf_counter() - started) * 1000.0
            # the prefill alone (every active block over the prompt's embeddings), profiled the same way
            with torch.inference_mode(), runtime.precision_context():
                embeds = runtime._embed(inputs)[0][0]
                active = runtime._active or tuple(range(runtime.num_layers))
                if cuda:
                    torch.cuda.synchronize(runtime.device)
                with profile(activities=activities) as prefill_prof:
                    started = time.perf_counter()
                    runtime.fast.prefill(embeds, active, reserve=max_new_tokens)
                    if cuda:
                        torch.cuda.synchronize(runtime.device)
                    prefill_ms = (time.perf_counter() - started) * 1000.0
                # one decode step alone (the request's first window), profiled the same way
                session = runtime.fast.session(active, embeds.shape[0])
                token = int(runtime.fast.logits(embeds[-1:]).argmax())
                runtime.fast.step(session, token)  # a first step outside the profile (its capture, if any)
                if cuda:
                    torch.cuda.synchronize(runtime.device)
                with profile(activities=activities) as step_prof:
                    runtime.fast.step(session, token)
                    if cuda:
                        torch.cuda.synchronize(runtime.device)
        averages = prof.key_averages()
        tables = [f"{name}: wall {wall_ms:.1f} ms under the profiler, {len(result.token_ids)} tokens",
                  "by host time", averages.table(sort_by="self_cpu_time_total", row_limit=25)]
        if cuda:
            tables += ["by device time", averages.table(sort_by="self_cuda_time_total", row_limit=25)]
        tables += [f"the prefill alone: wall {prefill_ms:.1f} ms under the profiler", "by host time",
                   prefill_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)]
        (out_dir / f"ops-{name}.txt").write_text("\n".join(tables) + "\n")
        trace = out_dir / f"trace-{name}.json"
        prof.export_chrome_trace(str(trace))
        with trace.open("rb") as raw, gzip.open(out_dir / f"trace-{name}.json.gz", "wb") as packed:
            packed.write(raw.read())
        trace.unlink()
        launched, busy = kernels(prof)
        prefill_launched, prefill_busy = kernels(prefill_prof)
        step_launched, step_busy = kernels(step_prof)
        row = {"config": name, "prompt_tokens": int(inputs.input_ids.shape[1]), "wall_ms": wall_ms,
               "tokens": len(result.token_ids), "kernels": launched, "gpu_busy_ms": busy,
               "host_ops": sum(1 for e in prof.events()
                               if e.device_type == DeviceType.CPU and e.name.startswith("aten::")),
               "prefill_wall_ms": prefill_ms, "prefill_kernels": prefill_launched, "prefill_gpu_busy_ms": prefill_busy,
               "step_kernels": step_launched, "step_gpu_busy_ms": step_busy,
               "step_host_ops": sum(1 for e in step_prof.events()
                                    if e.device_type == DeviceType.CPU and e.name.startswith("aten::"))}
        rows.append(row)
        log(f"{name}: wall {wall_ms:.1f} ms under the profiler, {row['kernels']} kernels, GPU busy "
            f"{row['gpu_busy_ms'] or 0:.1f} ms, {row['host_ops']} aten ops; the prefill alone {prefill_ms:.1f} ms, "
            f"{row['prefill_kernels']} kernels, GPU busy {row['prefill_gpu_busy_ms'] or 0:.1f} ms; a decode step "
            f"{row['step_kernels']} kernels ({row['step_host_ops']} aten ops), GPU busy "
            f"{row['step_gpu_busy_ms'] or 0:.2f} ms")
    (out_dir / "profile.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _host_step_ms(runtime, inputs, steps: int) -> list[float]:
    """Wall time of each decode-step call alone (the host's share: no synchronisation after it)."""
    import torch

    with torch.inference_mode():
        state = runtime.prefill_suffix(runtime.prefill_prefix(inputs, 0), tuple(runtime.current_active_blocks()))
        token = int(state.logits.argmax())
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            runtime.decode_step(state, token)
            times.append((time.perf_counter() - started) * 1000.0)
            token = int(state.logits.argmax())
    return times


@contextmanager
def every_token(runtime) -> Iterator[None]:
    """Generation that runs to ``max_new_tokens`` inside the block: the end-of-sequence token does not
    stop it (a request that stopped early would be timed over fewer steps than the others)."""
    saved = runtime.eos_id
    runtime.eos_id = -1  # no token id
    try:
        yield
    finally:
        runtime.eos_id = saved


def measure(runtime, configs: list[tuple[int, int, int]], *, rounds: int = 5, warmup: int = 2,
            max_new_tokens: int = 8, paths: tuple[str, ...] = ("eager", "fast"), eager_rounds: int | None = None,
            log=print) -> dict:
    """Every figure of the module docstring for ``runtime`` (both paths), as one JSON-able dict.

    ``rounds`` timed rounds per path; ``eager_rounds`` (None: ``rounds``) for every path but the
    fast one, which alternate with the fast path's first rounds (the eager path for parity only,
    the fast path's medians over all of its rounds). ``captures_in_timing`` counts the CUDA graphs
    captured during a configuration's timed rounds (a timed round that captured is not its speed)."""
    import torch

    from runtime.timing import GenerateTimer

    cuda = runtime.device.type == "cuda"
    image = test_image()
    weights = sum(p.numel() * p.element_size() for p in runtime.decoder.parameters()) + sum(
        p.numel() * p.element_size() for p in runtime.vision_module.parameters())
    rows: list[dict] = []
    saved = runtime.fast is not None
    attention32 = bool(runtime.fast is not None and runtime.fast.float32_attention)

    def use(path: str) -> None:  # the runtime keeps each path's state (graphs, cache) across switches
        runtime.set_execution(path == "fast", float32_attention=attention32)

    others = rounds if eager_rounds is None else int(eager_rounds)
    try:
        for max_crops, top_k, blocks in configs:
            preprocess_ms = []
            for _ in range(max(5, rounds)):  # the host's part of a served request before the model
                started = time.perf_counter()
                inputs = runtime.preprocess(image, QUESTION, max_crops)
                preprocess_ms.append((time.perf_counter() - started) * 1000.0)
            tokens: dict[str, list[int]] = {}
            timed: dict[str, list] = {p: [] for p in paths}
            host: dict[str, list[float]] = {}
            peak: dict[str, int | None] = {}
            with runtime.knobs(top_k=top_k, num_active_blocks=blocks), GenerateTimer(runtime) as timer, \
                    every_token(runtime):
                for path in paths:  # warm-up (graphs captured), the tokens, the host time of a step
                    use(path)
                    for _ in range(warmup):
                        tokens[path] = runtime.generate(inputs, max_new_tokens).token_ids
                    host[path] = _host_step_ms(runtime, inputs, max(4, max_new_tokens))
                captures = runtime.graph_captures
                for i in range(max(rounds, others)):
                    for path in paths:
                        if i >= (rounds if path == "fast" else others):
                            continue
                        use(path)
                        if cuda:
                            torch.cuda.synchronize(runtime.device)
                            torch.cuda.reset_peak_memory_stats(runtime.device)
                        with timer.request() as marks:
                            runtime.generate(inputs, max_new_tokens)
                        timed[path].append(timer.resolve(marks))
                        if cuda:
                            peak[path] = max(peak.get(path) or 0, torch.cuda.max_memory_allocated(runtime.device))
            row = {"max_crops": max_crops, "top_k": top_k, "num_active_blocks": blocks,
                   "prompt_tokens": int(inputs.input_ids.shape[1]), "crops": inputs.num_crops,
                   "same_tokens": len({tuple(t) for t in tokens.values()}) == 1,
                   "captures_in_timing": runtime.graph_captures - captures,
                   "preprocess_ms": _median(preprocess_ms)}
            for path in paths:
                runs = timed[path]
                row[path] = {
                    "rounds": len(runs), "totals_ms": [t.total_ms for t in runs],
                    "total_ms": _median([t.total_ms for t in runs]),
                    "vision_ms": _median([t.vision_ms for t in runs if t.vision_ms is not None]),
                    "prefill_ms": _median([t.prefill_ms for t in runs]),
                    "decode_step_ms": _median([s for t in runs for s in t.decode_steps_ms]),
                    "host_step_ms": _median(host[path]),
                    "tokens": len(tokens[path]),
                    "gpu_peak_over_weights_bytes": None if not cuda else peak[path] - weights}
            rows.append(row)
            log(format_row(row, paths))
        use("fast")
        fast_path = runtime.fast
    finally:
        runtime.set_execution(saved, float32_attention=attention32)
    memory = fast_path.memory_bytes()
    result = {"rows": rows, "paths": list(paths), "rounds": rounds, "eager_rounds": others,
              "max_new_tokens": max_new_tokens,
              "device": str(runtime.device), "dtype": str(runtime.dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "weights_bytes": weights, "fast_memory_bytes": memory,
              "graphs": fast_path.stats.graphs, "graph_capture_s": fast_path.stats.capture_s,
              "graph_error": fast_path.graph_error, "vision_graphs": vision_graphs(runtime),
              "prefill_graphs": None if fast_path.prefill_graphs is None else {
                  "graphs": len(fast_path.prefill_graphs), "capture_s": fast_path.prefill_graphs.stats.capture_s,
                  "error": fast_path.prefill_graphs.error},
              "knob_costs": {path: knob_costs(rows, path) for path in paths}}
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(runtime.device)
    return result


def measure_decoder(runtime, configs: list[tuple[int, int, int]], *, rounds: int = 5, max_new_tokens: int = 8,
                    log=print) -> dict:
    """The decoder alone per configuration and path (``--decoder-only`` in the module docstring)."""
    import torch

    from runtime.timing import Clock

    clock = Clock(runtime.device)
    image = test_image()
    saved = runtime.fast is not None
    rows = []
    try:
        for max_crops, top_k, blocks in configs:
            inputs = runtime.preprocess(image, QUESTION, max_crops)
            times: dict[str, dict[str, list[float]]] = {p: {"prefill": [], "step": []} for p in ("eager", "fast")}
            tokens: dict[str, list[int]] = {}
            with torch.inference_mode(), runtime.knobs(top_k=top_k, num_active_blocks=blocks):
                active = tuple(runtime.current_active_blocks())
                prefixes = {}
                for path in ("eager", "fast"):
                    runtime.set_execution(path == "fast")
                    prefixes[path] = runtime.prefill_prefix(inputs, 0)
                for _ in range(rounds):
                    for path in ("eager", "fast"):
                        runtime.set_execution(path == "fast")
                        clock.synchronize()
                        start = clock.mark()
                        state = runtime.prefill_suffix(prefixes[path], active)
                        token = int(state.logits.argmax())
                        marks, generated = [clock.mark()], [token]
                        for _ in range(max_new_tokens - 1):
                            runtime.decode_step(state, token)
                            token = int(state.logits.argmax())
                            marks.append(clock.mark())
                            generated.append(token)
                        clock.synchronize()
                        times[path]["prefill"].append(clock.ms(start, marks[0]))
                        times[path]["step"] += [clock.ms(a, b) for a, b in zip(marks, marks[1:])]
                        tokens[path] = generated
            row = {"max_crops": max_crops, "top_k": top_k, "num_active_blocks": blocks,
                   "prompt_tokens": int(inputs.input_ids.shape[1]), "same_tokens": tokens["eager"] == tokens["fast"]}
            for path in ("eager", "fast"):
                row[path] = {"prefill_ms": _median(times[path]["prefill"]),
                             "decode_step_ms": _median(times[path]["step"])}
            rows.append(row)
            log(f"{max_crops}/{top_k}/{blocks} ({row['prompt_tokens']} tokens) " + " | ".join(
                f"{p}: prefill {row[p]['prefill_ms']:.1f} step {row[p]['decode_step_ms']:.2f} ms"
                for p in ("eager", "fast")) + ("" if row["same_tokens"] else "  (tokens differ)"))
    finally:
        runtime.set_execution(saved)
    return {"rows": rows, "rounds": rounds, "max_new_tokens": max_new_tokens, "device": str(runtime.device),
            "dtype": str(runtime.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "decoder_only": True}


def vision_graphs(runtime) -> dict | None:
    """The vision tower's captured shapes and any capture error (MolmoE on a GPU's fast path), else None."""
    runner = getattr(getattr(runtime, "vision_backbone", None), "runner", None)
    return None if runner is None else {"graphs": runner.graphs, "error": runner.error}


def spread_ms(totals: list[float]) -> float:
    """The noise of one configuration's timed rounds: their interquartile range (0 for one round)."""
    if len(totals) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(totals, n=4, method="inclusive")
    return q3 - q1


def knob_costs(rows: list[dict], path: str) -> dict:
    """Pairs of configurations differing in one knob, the higher setting's median total against the
    lower one's, with a tolerance: the larger of the two configurations' round spreads
    (:func:`spread_ms`). A violation is a higher setting faster by more than the tolerance; a
    difference within it is ``flat`` (the knob's cost is below what the rounds resolve)."""
    keys = ("max_crops", "top_k", "num_active_blocks")
    pairs, violations, flat, table = 0, [], [], []
    for a in rows:
        for b in rows:
            differ = [k for k in keys if a[k] != b[k]]
            if len(differ) != 1 or a[differ[0]] >= b[differ[0]]:
                continue
            pairs += 1
            knob = differ[0]
            cheap, dear = a[path]["total_ms"], b[path]["total_ms"]
            tolerance = max(spread_ms(a[path].get("totals_ms") or []), spread_ms(b[path].get("totals_ms") or []))
            line = (f"{knob} {a[knob]} -> {b[knob]}: {cheap:.1f} -> {dear:.1f} ms ({dear - cheap:+.1f}, "
                    f"tolerance {tolerance:.1f})")
            table.append({"knob": knob, "low": a[knob], "high": b[knob], "low_ms": cheap, "high_ms": dear,
                          "cost_ms": dear - cheap, "tolerance_ms": tolerance})
            if dear < cheap - tolerance or (tolerance == 0 and not dear > cheap):
                violations.append(line)
            elif dear <= cheap + tolerance:
                flat.append(line)
    return {"pairs": pairs, "violations": violations, "flat": flat, "table": table}


def format_row(row: dict, paths: tuple[str, ...]) -> str:
    head = f"{row['max_crops']}/{row['top_k']}/{row['num_active_blocks']} ({row['prompt_tokens']} tokens)"
    parts = []
    for path in paths:
        r = row[path]
        parts.append(f"{path}: total {r['total_ms']:.1f} vision {r['vision_ms'] or 0:.1f} prefill "
                     f"{r['prefill_ms']:.1f} step {r['decode_step_ms'] or 0:.2f} host {r['host_step_ms']:.2f} ms")
    return (f"{head:28s} preprocess {row['preprocess_ms']:.1f} ms | " + " | ".join(parts)
            + ("" if row["same_tokens"] else "  (tokens differ)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="testbed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="max_crops/top_k/blocks, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--eager-rounds", type=int,
                        help="timed rounds of the paths other than fast (default: --rounds)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU (0: torch's default)")
    parser.add_argument("--paths", default="eager,fast")
    parser.add_argument("--float32-attention", action="store_true")
    parser.add_argument("--decoder-only", action="store_true", help="time the decoder alone (see the docstring)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--profile", type=Path, metavar="DIR", help="profile one fast-path request per configuration "
                        "into DIR instead (see the docstring)")
    args = parser.parse_args()
    import torch

    from runtime import ExecutionOptions, load_runtime

    if args.threads and args.device == "cpu":
        torch.set_num_threads(args.threads)
    runtime = load_runtime(args.model, ExecutionOptions(device=args.device, dtype=args.dtype,
                                                        float32_attention=args.float32_attention))
    if args.profile:
        profile_requests(runtime, parse_configs(args.configs), args.profile, max_new_tokens=args.max_new_tokens)
        return
    if args.decoder_only:
        result = measure_decoder(runtime, parse_configs(args.configs), rounds=args.rounds,
                                 max_new_tokens=args.max_new_tokens)
        print(f"{result['device']} ({result['cpu']}), {result['dtype']}, {result['threads']} thread(s), torch "
              f"{torch.__version__}; decoder only, medians of {args.rounds} alternating rounds")
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return
    result = measure(runtime, parse_configs(args.configs), rounds=args.rounds, warmup=args.warmup,
                     max_new_tokens=args.max_new_tokens, paths=tuple(args.paths.split(",")),
                     eager_rounds=args.eager_rounds)
    print(f"{result['device']} ({result.get('gpu') or result['cpu']}), {result['dtype']}, {result['threads']} "
          f"thread(s), torch {torch.__version__}; medians of {args.rounds} alternating rounds; "
          f"graphs {result['graphs']} ({result['graph_capture_s']:.1f}s to capture); fast-path memory "
          f"{ {k: round(v / 2**20, 1) for k, v in result['fast_memory_bytes'].items()} } MiB")
    for path, costs in result["knob_costs"].items():
        print(f"knob table, {path}: {costs['pairs']} one-knob pairs, "
              + ("no higher setting is faster" if not costs["violations"] else "; ".join(costs["violations"])))
        for entry in costs["table"]:
            within = abs(entry["cost_ms"]) <= entry["tolerance_ms"]
            print(f"  {entry['knob']} {entry['low']} -> {entry['high']}: {entry['cost_ms']:+.1f} ms "
                  f"(tolerance {entry['tolerance_ms']:.1f}{'; within it' if within else ''})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
