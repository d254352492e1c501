"""The commands on a trained run: ``ctrl evaluate``, ``predict``, ``export``."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from cli.common import WorkspaceOption, app, fail, handled, out, running, say


class GroupBy(str, Enum):
    dataset = "dataset"
    family = "family"
    cluster = "cluster"


@app.command()
def evaluate(
    run: Annotated[str, typer.Argument(help="A run id of the workspace (offline or online), a run directory, or "
                                       "'latest': the most recently started run with a checkpoint.")],
    workspace: WorkspaceOption = None,
    budget_ms: Annotated[list[float] | None, typer.Option("--budget-ms", help="Budgets to evaluate (repeatable; "
                                                          "default: the run's grid).")] = None,
    max_samples: Annotated[int | None, typer.Option("--max-samples", min=1, help="Online runs: test samples to run "
                                                    "(default: all).")] = None,
    by: Annotated[GroupBy | None, typer.Option("--by", help="Offline runs: also print the accuracy per dataset, "
                                               "per labelled question family, or per question cluster (the group "
                                               "the deployed table reads; all in evaluation_groups.parquet).")
                  ] = None,
) -> None:
    """Evaluate a run's controller on the test split (table, Parquet, PNG): an offline run against
    the baselines on the recorded outcomes, an online run against its offline start with the model.
    An offline run's evaluation at other budgets (--budget-ms) goes beside its own, under
    evaluations/."""
    from pipeline import Workspace
    from trainer import RunDir, evaluate_run, evaluation_title, format_evaluation_table
    from trainer.evaluate import GROUPS_FILE, evaluation_dir, format_group_table

    with handled(also=(ValueError,)):
        run_dir = RunDir.resolve(Workspace(workspace), run, ("offline", "online"))
    if run_dir.phase == "online":
        from online import evaluate_online_run

        with running("evaluate", also=(ValueError,)) as bar:
            frame = evaluate_online_run(workspace, run_dir.path, budget_ms or None, max_samples=max_samples,
                                        progress=lambda done, total: bar.update(completed=done, total=total))
    else:
        with handled(also=(ValueError,)):
            frame = evaluate_run(workspace, run_dir.path, budget_ms or None)
    out.print(format_evaluation_table(frame, evaluation_title(run_dir.path)))
    target = run_dir.path if run_dir.phase == "online" else evaluation_dir(run_dir.path, budget_ms or None)
    written = [target / name for name in ("evaluation.parquet", "evaluation.png", GROUPS_FILE)]
    if by is not None:
        if not written[2].is_file():
            from pipeline.errors import CtrlError

            raise fail(CtrlError(f"{written[2]}: no per-group evaluation (online runs have none)"))
        import polars as pl

        out.print(format_group_table(pl.read_parquet(written[2]), by.value))
    say("written: " + ", ".join(str(p) for p in written if p.is_file()))


@app.command()
def predict(
    budget_ms: Annotated[list[float], typer.Option("--budget-ms", help="Latency budget in ms (repeatable).")],
    out_path: Annotated[Path, typer.Option("--out", help="Output file, .parquet or .csv.", dir_okay=False)],
    run: Annotated[str | None, typer.Option("--run", help="An offline run id of the workspace, a run directory, or "
                                            "'latest': the most recently started offline run with a "
                                            "checkpoint.")] = None,
    checkpoint: Annotated[Path | None, typer.Option("--checkpoint", help="A checkpoint file.", exists=True,
                                                    dir_okay=False)] = None,
    workspace: WorkspaceOption = None,
) -> None:
    """One knob decision per (sample, budget) for the workspace's samples."""
    from controller.predict import predict as run_predict
    from pipeline import CtrlError

    if (run is None) == (checkpoint is None):
        raise fail(CtrlError("give exactly one of --run RUN and --checkpoint PATH"))
    with handled(also=(ValueError,)):
        frame = run_predict(workspace, run if run is not None else checkpoint, list(budget_ms), out_path)
    say(f"{frame.height} decisions for {frame['sample_key'].n_unique()} samples x {len(budget_ms)} budgets "
        f"-> {out_path}")


@app.command("export")
def export(
    run: Annotated[str, typer.Argument(help="An offline run id of the workspace, a run directory, a checkpoint "
                                       "file, or 'latest': the most recently started offline run with a "
                                       "checkpoint.")],
    out_path: Annotated[Path, typer.Option("--out", help="The file to write (TorchScript; with --compiled an "
                                           "AOTInductor .pt2 package).", dir_okay=False)],
    compiled: Annotated[bool, typer.Option("--compiled", help="Compile ahead of time for this kind of CPU "
                                           "(AOTInductor): several times faster per decision; needs a C++ "
                                           "compiler and a minute or two to write, torch alone to load.")] = False,
    device: Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N: the device a --compiled package is "
                                        "built for (a TorchScript file loads on any device).")] = "cpu",
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
    workspace: WorkspaceOption = None,
) -> None:
    """Write a run's deployed controller (network, budget encoding, action space, table fallback) as one
    file that a serving process loads with torch alone: torch.jit.load(FILE), or with --compiled
    torch._inductor.aoti_load_package(FILE)."""
    from controller.deploy import export_controller

    with handled():
        report = export_controller(workspace, run, out_path, compiled=compiled, device=device, force=force)
    tiling = (f", tiling_crops [B, {len(report.max_crops_values)}]"
              if report.uses_tilings or report.uses_prompt_tokens else "")
    # the per-request table also reads each prompt's text-token count (NaN: unknown)
    tiling += ", prompt_tokens [B]" if report.uses_prompt_tokens else ""
    lang, image = f"lang [B, {report.lang_feature_dim}]", f"image [B, {report.image_feature_dim}]"
    say(f"{report.path} ({report.size_bytes / 1024:.0f} KiB) from {report.checkpoint}")
    if report.compiled:
        say(f"call: torch._inductor.aoti_load_package(FILE)({lang}, {image}, image_present [B] bool, budget_ms [B]"
            f"{tiling}) -> (max_crops, top_k, num_active_blocks), int64 [B] each")
    else:
        say(f"stage 1, before the vision tower: torch.jit.load(FILE).stage1({lang}, budget_ms [B]{tiling}) "
            f"-> max_crops [B] int64, in {list(report.max_crops_values)}")
        say(f"stage 2, after it: .stage2({lang}, {image} (the global crop's feature), image_present [B] bool, "
            f"budget_ms [B], max_crops [B]{tiling}) -> (top_k, num_active_blocks), int64 [B] each; "
            f"or .decide(...) for both")
    if report.has_cost_model:
        say(f"each request's own cost: .expected_latency({lang}, tiling_crops, prompt_tokens) -> (median ms, "
            "quantile ms, own cost) [B, A], per row of .actions")
    say(f"features of model {report.model_fingerprint[:16]}")
