"""``ctrl testbed``: the procedural VQA task and the embedded model trained on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from cli.common import app, err, handled, say
from cli.options import config_parameters, with_parameters
from runtime.testbed_recipe import TestbedRecipe
from testbed.config import TestbedEvalOptions, TestbedGenerateConfig

testbed_app = typer.Typer(help="The testbed: a procedural VQA task and the embedded model trained on it.",
                          no_args_is_help=True)
app.add_typer(testbed_app, name="testbed")

#: the recipe's fields a command line sets, in the order ``--help`` lists them
RECIPE_OPTIONS = ("steps", "num_train_samples", "batch_size", "lr", "vision_lr", "vision_pretrain_steps", "seed",
                  "threads")


@testbed_app.command("generate")
@with_parameters(config_parameters(TestbedGenerateConfig))
def testbed_generate(**options: Any) -> None:
    """Write a seeded testbed VQA set (reused when the same set is already there)."""
    from testbed.task import generate_dataset

    config = TestbedGenerateConfig(**options)
    with handled(also=(ValueError,)):
        root = generate_dataset(config.out_dir, config.num_samples, seed=config.seed, split=config.split,
                                name=config.name, overwrite=config.overwrite)
    say(f"{config.num_samples} samples -> {root}")


@testbed_app.command("train")
@with_parameters(config_parameters(TestbedRecipe, RECIPE_OPTIONS), config_parameters(TestbedEvalOptions))
def testbed_train(**options: Any) -> None:
    """Train the embedded model on the testbed task (cached per recipe) and print its knob trade-off table."""
    from runtime.cache import default_cache_root
    from testbed.task import generate_dataset
    from testbed.train import evaluate_testbed, format_eval_table, marginal_table, train_testbed

    recipe = TestbedRecipe(**{name: options.pop(name) for name in RECIPE_OPTIONS})
    run = TestbedEvalOptions(**options)
    steps, seed, cache_dir = recipe.steps, recipe.seed, run.cache_dir

    def progress(step: int, loss: float) -> None:
        if step % 50 == 0 or step == steps:
            err.print(f"step {step}/{steps} loss {loss:.3f}", highlight=False, markup=False)

    def pretrain_progress(step: int, loss: float) -> None:
        if step % 250 == 0 or step == recipe.vision_pretrain_steps:
            err.print(f"vision pretraining step {step}/{recipe.vision_pretrain_steps} loss {loss:.3f}",
                      highlight=False, markup=False)

    with handled(also=(ValueError,)):
        report = train_testbed(recipe, cache_dir, force=run.force, progress=progress,
                               pretrain_progress=pretrain_progress)
        if report.trained:
            say(f"trained in {report.train_seconds:.0f}s -> {report.model_dir}")
        elif report.from_shipped:
            say(f"unpacked the shipped weights of this recipe -> {report.model_dir} (--force trains it instead)")
        else:
            say(f"cached: {report.model_dir}")
        if run.eval_samples:
            root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
            eval_root = run.eval_dir or root / f"testbed-eval-seed{seed + 1000}-n{run.eval_samples}"
            generate_dataset(eval_root, run.eval_samples, seed=seed + 1000, split="val")
            rows = evaluate_testbed(report.model_dir, eval_root, dtype=run.dtype)
            for line in format_eval_table(rows) + [""] + marginal_table(rows):
                say(line)


