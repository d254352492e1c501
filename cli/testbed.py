"""``ctrl testbed``: the procedural VQA task and the embedded model trained on it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import Dtype, DtypeOption, app, err, handled, say

testbed_app = typer.Typer(help="The testbed: a procedural VQA task and the embedded model trained on it.",
                          no_args_is_help=True)
app.add_typer(testbed_app, name="testbed")


@testbed_app.command("generate")
def testbed_generate(
    out_dir: Annotated[Path, typer.Argument(help="Dataset directory to write (dataset.json + images/).",
                                            file_okay=False)],
    num_samples: Annotated[int, typer.Option("--num-samples", min=1, help="Samples (one question per image, families "
                                             "in turn).")] = 500,
    seed: Annotated[int, typer.Option("--seed", help="Seed: the same seed gives byte-identical files.")] = 0,
    split: Annotated[str, typer.Option("--split", help="Split name recorded in dataset.json (and in the sample "
                                       "ids).")] = "val",
    name: Annotated[str, typer.Option("--name", help="Dataset name (results and ingest use it).")] = "testbed",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Regenerate even when the same dataset is "
                                            "there.")] = False,
) -> None:
    """Write a seeded testbed VQA set (reused when the same set is already there)."""
    from testbed.task import generate_dataset

    with handled(also=(ValueError,)):
        root = generate_dataset(out_dir, num_samples, seed=seed, split=split, name=name, overwrite=overwrite)
    say(f"{num_samples} samples -> {root}")


@testbed_app.command("train")
def testbed_train(
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps.")] = 800,
    num_train_samples: Annotated[int, typer.Option("--num-train-samples", min=1, help="Size of the generated training "
                                                   "set.")] = 4000,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Samples per step (one knob setting per "
                                            "step).")] = 8,
    lr: Annotated[float, typer.Option("--lr", help="AdamW peak learning rate.")] = 3e-3,
    vision_lr: Annotated[float | None, typer.Option("--vision-lr", min=0.0, help="Peak learning rate of the ViT and "
                                                    "projector (default: the recipe's).", show_default=False)] = None,
    vision_pretrain_steps: Annotated[int | None, typer.Option("--vision-pretrain-steps", min=0, help="Steps training "
                                                              "the vision path alone first (default: the recipe's; "
                                                              "0 = none).", show_default=False)] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the training set, data order and knob draws.")] = 0,
    threads: Annotated[int, typer.Option("--threads", min=1, help="Torch threads (part of the recipe: results depend "
                                         "on it).")] = 1,
    cache_dir: Annotated[Path | None, typer.Option("--cache-dir", help="Model cache (default: $CTRL_CACHE_DIR or "
                                                   "~/.cache/ctrl).", show_default=False, file_okay=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Train even when this recipe is cached or shipped "
                                        "(minutes).")] = False,
    eval_samples: Annotated[int, typer.Option("--eval-samples", min=0, help="Held-out samples for the knob table (0 = "
                                              "no evaluation).")] = 250,
    eval_dir: Annotated[Path | None, typer.Option("--eval-dir", help="Held-out set directory (default: "
                                                  "<cache>/testbed-eval-seed<seed+1000>-n<N>).", show_default=False,
                                                  file_okay=False)] = None,
    dtype: Annotated[Dtype, typer.Option("--dtype", help="The knob table's model: " + DtypeOption.__metadata__[0].help
                                         + " Training itself is float32.")] = Dtype.auto,
) -> None:
    """Train the embedded model on the testbed task (cached per recipe) and print its knob trade-off table."""
    from runtime import TestbedRecipe
    from runtime.cache import default_cache_root
    from testbed.task import generate_dataset
    from testbed.train import evaluate_testbed, format_eval_table, marginal_table, train_testbed

    optional = {"vision_lr": vision_lr, "vision_pretrain_steps": vision_pretrain_steps}
    recipe = TestbedRecipe(seed=seed, num_train_samples=num_train_samples, steps=steps, batch_size=batch_size, lr=lr,
                           threads=threads, **{k: v for k, v in optional.items() if v is not None})

    def progress(step: int, loss: float) -> None:
        if step % 50 == 0 or step == steps:
            err.print(f"step {step}/{steps} loss {loss:.3f}", highlight=False, markup=False)

    def pretrain_progress(step: int, loss: float) -> None:
        if step % 250 == 0 or step == recipe.vision_pretrain_steps:
            err.print(f"vision pretraining step {step}/{recipe.vision_pretrain_steps} loss {loss:.3f}",
                      highlight=False, markup=False)

    with handled(also=(ValueError,)):
        report = train_testbed(recipe, cache_dir, force=force, progress=progress, pretrain_progress=pretrain_progress)
        if report.trained:
            say(f"trained in {report.train_seconds:.0f}s -> {report.model_dir}")
        elif report.from_shipped:
            say(f"unpacked the shipped weights of this recipe -> {report.model_dir} (--force trains it instead)")
        else:
            say(f"cached: {report.model_dir}")
        if eval_samples:
            root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
            eval_root = eval_dir or root / f"testbed-eval-seed{seed + 1000}-n{eval_samples}"
            generate_dataset(eval_root, eval_samples, seed=seed + 1000, split="val")
            rows = evaluate_testbed(report.model_dir, eval_root, dtype=dtype.value)
            for line in format_eval_table(rows) + [""] + marginal_table(rows):
                say(line)


