"""Which image feature stage 2 reads: the global crop's, which a server has, against the all-crops reference.

    python benchmarks/bench_stage2_features.py                         # workspace /tmp/ctrl-bench-stage2
    python benchmarks/bench_stage2_features.py --reuse --baseline-seed 1  # + the spread of a second seed
    python benchmarks/bench_stage2_features.py --skip-training          # parts 2 and 3 only

1. Decisions and outcomes on the shipped sample data (README "Set up"): ``data/generate.py``,
   ``ctrl testbed train --eval-samples 0``, ``ctrl ingest data/exp5 data/exp6`` and ``ctrl
   extract-features --model testbed --images data/testbed/images`` into ``--workspace`` (steps
   already done there are skipped), then ``ctrl train --offline`` with its defaults (5-fold
   cross-fitting), which reads ``image_features.global_feature``, and the same configuration
   (its ``config.json``, the same seed) on the data loaded with the reference feature
   (``image_features.feature``: all tokens at max_crops 6). Reported:

   * the fraction of greedy decisions that differ, over every sample x every budget of the
     evaluation grid, each sample decided out of fold (by the fold network that did not train
     on it): the network alone (``policy``), and with the run's table fallback
     (``controller``, the deployed decision); split into a different crops value (stage 1, which
     reads no image feature: the two runs train it apart only through the shared trunk) and,
     at the same crops, a different top-K or block count (stage 2);
   * the cross-fitted accuracy and violation rate of ``controller`` and ``policy`` per budget for
     both runs (the runs' ``evaluation.parquet``), and the paired accuracy difference (global
     minus reference, the same samples) with its standard error;
   * with ``--baseline-seed S``: the same configuration on the global feature with seed S, and
     the fraction of decisions that differ between the two seeds: how far training noise alone
     moves the decisions.

   ``--reuse`` keeps runs of an earlier invocation that finished (their ``evaluation.parquet``);
   a second ``--seed`` needs its own ``--workspace`` (the run names do not carry the seed).

2. The claim itself: for the trained testbed and a tiny MolmoE checkpoint with the real layout
   (``../shared/molmoe_reference``; built once into ``benchmarks/.cache``), in float32 and
   bfloat16, the global-crop feature of a request at max_crops 1, 2, 6 and 12
   (``PrefixState.image_feature`` of ``prefill_prefix(inputs, 0)``) against the one extraction
   caches (``encode_images`` at max_crops 6, all images in one batch): the largest absolute
   difference and whether every vector is bit-identical, over 5 drawn images of different
   shapes and 5 sample images. For MolmoE also what the decoder's array-0 tokens would give (the
   origin's shifted padding row, without the global image's own mask).

3. The cost of the global-crop feature in a MolmoE request at full width: the vision backbone of
   the MolmoE-1B config (random weights, ``--dtype``) on a 640 x 480 image at max_crops 6
   (median of ``--rounds`` calls), and what the global image's own padding mask adds where the
   origin's shifted ``image_masks`` row differs: the padding embeddings, pooling and projector
   of that one array once more (median of at least 20 calls). Needs
   ``../shared/molmoe_reference`` (the real config).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

GLOBAL_RUN, REFERENCE_RUN = "stage2-global", "stage2-reference"


def ctrl(*args: str) -> None:
    """One ``ctrl`` command, as a user runs it (its output passes through)."""
    subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, check=True)


def prepare(ws: Path) -> None:
    """The README's set-up steps into ``ws``, each skipped when its output is there."""
    from pipeline import Workspace

    if not (ROOT / "data" / "exp5").is_dir():
        subprocess.run([sys.executable, "data/generate.py"], cwd=ROOT, check=True)
    ctrl("testbed", "train", "--eval-samples", "0")
    workspace = Workspace(ws)
    if workspace.current_generation() is None:
        ctrl("ingest", "data/exp5", "data/exp6", "-w", str(ws))
    ctrl("extract-features", "--model", "testbed", "--images", "data/testbed/images", "-w", str(ws))


def finished(ws: Path, run_id: str) -> bool:
    return (ws / "runs" / run_id / "evaluation.parquet").is_file()


def train_runs(ws: Path, seed: int | None, baseline_seed: int | None, reuse: bool) -> None:
    """``ctrl train --offline`` (global feature), then its configuration on the reference feature
    (and on the global feature with ``baseline_seed``)."""
    from trainer import train_offline
    from trainer.config import OfflineTrainConfig
    from trainer.data import GLOBAL_IMAGE_FEATURE, REFERENCE_IMAGE_FEATURE, load_offline_data
    from trainer.runs import RunDir

    if not (reuse and finished(ws, GLOBAL_RUN)):
        shutil.rmtree(ws / "runs" / GLOBAL_RUN, ignore_errors=True)
        seed_option = () if seed is None else ("--seed", str(seed))
        ctrl("train", "--offline", "-w", str(ws), "--run-id", GLOBAL_RUN, *seed_option)
    saved = RunDir(ws / "runs" / GLOBAL_RUN).read_config()
    others = [(REFERENCE_RUN, REFERENCE_IMAGE_FEATURE, saved["seed"])]
    if baseline_seed is not None:
        others.append((seed_run(baseline_seed), GLOBAL_IMAGE_FEATURE, baseline_seed))
    for run_id, feature, run_seed in others:
        if reuse and finished(ws, run_id):
            continue
        shutil.rmtree(ws / "runs" / run_id, ignore_errors=True)
        config = OfflineTrainConfig.from_json({**saved, "run_id": run_id, "resume": None, "seed": run_seed})
        data = load_offline_data(ws, config.model_fingerprint, image_feature=feature)
        started = time.perf_counter()
        train_offline(config, data=data)
        print(f"trained {run_id} in {time.perf_counter() - started:.0f} s")


def seed_run(seed: int) -> str:
    return f"{GLOBAL_RUN}-seed{seed}"


def out_of_fold_decisions(ws: Path, run_id: str, data) -> tuple[dict[str, object], list[float]]:
    """Per decider (``policy``, ``controller``) the (budgets, N) action indices, every sample decided
    by its fold's network (and fold table where the fallback answers), and the evaluation grid."""
    import torch

    from trainer.baselines import LookupTableDecider
    from trainer.config import OfflineTrainConfig
    from trainer.crossfit import load_folds
    from trainer.fallback import PolicyDecider, read_fallback
    from trainer.runs import RunDir

    run = RunDir(ws / "runs" / run_id)
    config = OfflineTrainConfig.from_json(run.read_config())
    models = load_folds(run.path, data, config.cross_fit_folds)
    fallback = read_fallback(run.best_checkpoint)

    def controller(k: int) -> PolicyDecider:
        own = None if fallback is None else replace(fallback, table=LookupTableDecider(models.train[k]).state())
        return PolicyDecider(models.policies[k], own)

    deciders = {"policy": models.out_of_fold("policy", lambda k: PolicyDecider(models.policies[k], name="policy")),
                "controller": models.out_of_fold("controller", controller)}
    budgets = [float(b) for b in config.eval_budgets]
    return {name: torch.stack([d.decide(data, b) for b in budgets]) for name, d in deciders.items()}, budgets


def differences(a, b, crops, score) -> dict:
    """How two (budgets, N) decision tensors differ, and the paired accuracy difference a - b per budget."""
    differ, crops_differ = a != b, crops[a] != crops[b]
    rows = score.shape[0]
    paired = score[range(rows), a] - score[range(rows), b]  # (budgets, N): the same samples
    return {
        "all": float(differ.float().mean()),
        "crops": float(crops_differ.float().mean()),
        "same_crops_other_stage2": float((differ & ~crops_differ).float().mean()),
        "per_budget": [float(x) for x in differ.float().mean(1)],
        "accuracy_difference": [float(x) for x in paired.mean(1)],
        "accuracy_difference_se": [float(x) for x in paired.std(1) / rows ** 0.5],
    }


def compare(ws: Path, baseline_seed: int | None) -> dict:
    """The decision differences and the per-budget outcomes of the runs."""
    import polars as pl

    from trainer.data import GLOBAL_IMAGE_FEATURE, REFERENCE_IMAGE_FEATURE, load_offline_data

    data = {name: load_offline_data(ws, image_feature=name) for name in (GLOBAL_IMAGE_FEATURE, REFERENCE_IMAGE_FEATURE)}
    runs = {GLOBAL_RUN: GLOBAL_IMAGE_FEATURE, REFERENCE_RUN: REFERENCE_IMAGE_FEATURE}
    if baseline_seed is not None:
        runs[seed_run(baseline_seed)] = GLOBAL_IMAGE_FEATURE
    decisions, budgets = {}, None
    for run, feature in runs.items():
        decisions[run], run_budgets = out_of_fold_decisions(ws, run, data[feature])
        assert budgets in (None, run_budgets)
        budgets = run_budgets
    crops = data[GLOBAL_IMAGE_FEATURE].action_space.knob_indices()[:, 0]
    score = data[GLOBAL_IMAGE_FEATURE].score.nan_to_num(0.0)  # decisions stay inside the mask: never NaN there
    out: dict = {"budgets_ms": budgets, "num_samples": len(data[GLOBAL_IMAGE_FEATURE]), "differ": {}}
    for name in ("policy", "controller"):
        out["differ"][name] = differences(decisions[GLOBAL_RUN][name], decisions[REFERENCE_RUN][name], crops, score)
        if baseline_seed is not None:
            out["differ"][f"{name} (seed {baseline_seed})"] = differences(
                decisions[GLOBAL_RUN][name], decisions[seed_run(baseline_seed)][name], crops, score)
    frames = {run: pl.read_parquet(ws / "runs" / run / "evaluation.parquet") for run in (GLOBAL_RUN, REFERENCE_RUN)}
    out["outcomes"] = {
        run: frame.filter(pl.col("decider").is_in(["controller", "policy", "lut_p95", "oracle"]))
        .select("decider", "budget_ms", "accuracy", "violation_rate", "accuracy_se", "reward_mean").to_dicts()
        for run, frame in frames.items()}
    return out


def print_comparison(result: dict) -> None:
    print(f"\n{result['num_samples']} samples x {len(result['budgets_ms'])} budgets, each decided out of fold")
    for name, d in result["differ"].items():
        against = "a second seed" if "seed" in name else "the reference feature"
        print(f"{name}, global against {against}: {100 * d['all']:.1f} % of the greedy decisions differ "
              f"({100 * d['crops']:.1f} % in crops, {100 * d['same_crops_other_stage2']:.1f} % in top-K/blocks "
              "at the same crops); per budget " + " ".join(f"{100 * x:.0f}" for x in d["per_budget"]))
        print("    paired accuracy difference per budget: " + ", ".join(
            f"{x:+.3f} ± {se:.3f}" for x, se in zip(d["accuracy_difference"], d["accuracy_difference_se"])))
    rows = {run: {(r["decider"], r["budget_ms"]): r for r in rows} for run, rows in result["outcomes"].items()}
    for decider in ("controller", "policy"):
        print(f"\n{decider}: budget | accuracy global / reference | violation rate global / reference")
        for budget in result["budgets_ms"]:
            g, r = rows[GLOBAL_RUN].get((decider, budget)), rows[REFERENCE_RUN].get((decider, budget))
            if g and r:
                print(f"  {budget:7.1f} ms | {g['accuracy']:.3f} / {r['accuracy']:.3f} (se {g['accuracy_se']:.3f}) | "
                      f"{100 * g['violation_rate']:.1f} % / {100 * r['violation_rate']:.1f} %")


def tiny_molmoe() -> Path | None:
    """The tiny MolmoE checkpoint of ``benchmarks/bench_molmoe.py`` (built once), None without the reference."""
    from molmoe_origin import reference_dir

    ref = reference_dir()
    if ref is None:
        return None
    out = ROOT / "benchmarks" / ".cache" / "tiny-molmoe-d64"
    if not (out / "model.safetensors").is_file():
        subprocess.run([sys.executable, str(ref / "build_tiny_molmoe.py"), str(out), "--force", "--v5-fixes",
                        "--d-model", "64"], check=True, capture_output=True)
    return out


def equality() -> list[dict]:
    """Per model and dtype: the request's global-crop feature at several crop counts against the cached one."""
    import torch
    from PIL import Image
    from test_model_runtime import make_image

    from runtime import ExecutionOptions, load_runtime

    drawn = [make_image(w, h, seed=i) for i, (w, h) in enumerate([(640, 480), (1000, 300), (200, 900),
                                                                  (1500, 1500), (320, 240)])]
    shipped = [Image.open(p).convert("RGB") for p in sorted((ROOT / "data" / "testbed" / "images").iterdir())[:5]]
    images = drawn + shipped
    models = [("testbed", "testbed")]
    tiny = tiny_molmoe()
    if tiny is not None:
        models.append(("molmoe-tiny", str(tiny)))
    rows = []
    for name, model in models:
        for dtype in ("float32", "bfloat16"):
            rt = load_runtime(model, ExecutionOptions(dtype=dtype))
            cached = rt.encode_images([rt.preprocess(image, "", 6) for image in images]).global_crop
            worst, identical, shifted = 0.0, True, 0.0
            for max_crops in (1, 2, 6, 12):
                for i, image in enumerate(images):
                    inputs = rt.preprocess(image, "What is shown?", max_crops)
                    live = rt.prefill_prefix(inputs, 0).image_feature
                    worst = max(worst, float((live - cached[i]).abs().max()))
                    identical &= bool(torch.equal(live, cached[i]))
                    if rt.kind == "molmoe":
                        with torch.inference_mode(), rt.precision_context():
                            tokens, _ = rt.vision_module(inputs.images[None], inputs.image_masks[None])
                        shifted = max(shifted, float((tokens[0, 0].float().mean(0) - cached[i]).abs().max()))
            rows.append({"model": name, "dtype": dtype, "largest_difference": worst, "bit_identical": identical,
                         "largest_value": float(cached.abs().max()),
                         "shifted_mask_difference": shifted if rt.kind == "molmoe" else None})
            print(f"{name} {dtype}: request vs cached global-crop feature, max_crops 1/2/6/12, {len(images)} images: "
                  f"largest difference {worst:.3g}, bit-identical {identical}"
                  + (f"; the decoder's array 0 (shifted mask) would differ by up to {shifted:.3g}"
                     if rt.kind == "molmoe" else "") + f" (largest value {float(cached.abs().max()):.3g})")
    return rows


def molmoe_vision_cost(dtype: str, rounds: int, threads: int) -> dict | None:
    """Median ms of the full-width MolmoE vision backbone with and without the global crop's own mask."""
    import torch
    from molmoe_origin import reference_dir
    from test_model_runtime import make_image

    from runtime.molmoe_model import MolmoVisionBackbone, read_architecture
    from runtime.molmoe_processor import MolmoImageConfig, MolmoProcessor, load_molmo_tokenizer
    from runtime.precision import compute_context, resolve_dtype

    ref = reference_dir()
    if ref is None:
        print("skipping the MolmoE cost: the reference (../shared/molmoe_reference) is absent")
        return None
    config_dir = ref / "origin" / "configs"
    model_dir = Path("/tmp") / "ctrl-bench-stage2-molmoe-config"
    model_dir.mkdir(exist_ok=True)
    shutil.copy(config_dir / "model" / "config.json", model_dir / "config.json")
    for file in (config_dir / "tokenizer").iterdir():
        shutil.copy(file, model_dir / file.name)
    arch, _ = read_architecture(model_dir)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    weights = resolve_dtype(dtype, torch.device("cpu"))
    backbone = MolmoVisionBackbone(arch).to(weights).eval().requires_grad_(False)
    with torch.no_grad():
        backbone.pad_embed.normal_()
    processor = MolmoProcessor(load_molmo_tokenizer(model_dir), MolmoImageConfig.from_dir(model_dir))
    out = processor.process(make_image(640, 480), "What is it?", 6)
    images, masks, own = out.images[None], out.image_masks[None], out.global_image_mask[None]
    assert not torch.equal(masks[0, 0], own[0])  # the shifted row differs: the extra pooling runs

    # what the global crop's own mask adds: padding, pooling and projector of one array (its cost
    # does not depend on the values, so ViT-width noise stands in for the ViT states)
    vit_states = torch.randn(1, 1, images.shape[2], arch.pooled_width, dtype=weights)

    def timed(call) -> float:
        started = time.perf_counter()
        with torch.inference_mode(), compute_context(weights):
            call()
        return 1000 * (time.perf_counter() - started)

    def whole() -> None:
        backbone(images, masks)

    def extra() -> None:
        backbone.pool_and_project(vit_states, own[:, None])

    timed(whole), timed(extra)  # warm-up
    vision = [timed(whole) for _ in range(rounds)]
    tail = [timed(extra) for _ in range(max(rounds, 20))]
    a, b = statistics.median(vision), statistics.median(tail)
    return {"dtype": str(weights), "threads": threads, "arrays": int(images.shape[1]), "tiling": list(out.tiling),
            "vision_ms": a, "extra_ms": b, "extra_fraction": b / a}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", type=Path, default=Path("/tmp/ctrl-bench-stage2"))
    parser.add_argument("--seed", type=int, help="training seed of both runs (default: ctrl train's)")
    parser.add_argument("--baseline-seed", type=int, help="also train the global feature with this seed")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs of an earlier invocation")
    parser.add_argument("--skip-training", action="store_true", help="only parts 2 and 3")
    parser.add_argument("--skip-runtime", action="store_true", help="only the training comparison (part 1)")
    parser.add_argument("--dtype", default="float32", help="MolmoE weights (float32, a CPU's fast path; bfloat16)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    results: dict = {}
    if not args.skip_training:
        prepare(args.workspace)
        train_runs(args.workspace, args.seed, args.baseline_seed, args.reuse)
        results["training"] = compare(args.workspace, args.baseline_seed)
        print_comparison(results["training"])
    if not args.skip_runtime:
        results["equality"] = equality()
        cost = molmoe_vision_cost(args.dtype, args.rounds, args.threads)
        if cost is not None:
            results["molmoe"] = cost
            print(f"\nMolmoE-1B vision backbone ({cost['dtype']}, {cost['threads']} threads, {cost['arrays']} arrays, "
                  f"tiling {cost['tiling']}): {cost['vision_ms']:.0f} ms; the global crop's own mask adds "
                  f"{cost['extra_ms']:.1f} ms ({100 * cost['extra_fraction']:.2f} %)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
