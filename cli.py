"""The ``ctrl`` command. Thin: parse options, build a config, call one library function, print.

The stages are imported inside the commands: pipeline pulls in pyarrow, the trainer and the
runtime torch and transformers (seconds), and ``ctrl --help`` or ``ctrl query`` must not pay
for what they do not run.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from typer.core import TyperGroup

from pipeline.execution import EXECUTION_HELP

if TYPE_CHECKING:
    import pyarrow as pa


class _Commands(TyperGroup):
    """ctrl's command group: a usage error (an option value that does not convert, a path of the wrong
    kind, an unknown option or command) is one red line naming the option and exit 1, as every other
    user error, not Typer's boxed usage text and exit 2; an option value that does not convert is
    named in it (Typer's own message, "Input should be a valid integer", does not say which value was
    given). ``ctrl`` or ``ctrl testbed`` alone still prints its help."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except _ClickException as e:
            raise _usage_error(e) from None

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except _ClickException as e:
            raise _usage_error(e) from None


#: the fast path's switch; --compile/--no-compile are its old names, accepted for one release (docs/cli.md)
FAST_PATH_FLAGS = ("--fast-path/--eager", "--compile/--no-compile")

#: the base of Typer's usage errors: click's ClickException, or the copy of it Typer vendors (typer._click)
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _usage_error(error: Exception) -> Exception:
    """A usage error as one red line and exit 1 (:func:`_fail`); a command given without its
    arguments (no_args_is_help) is left to print its help."""
    if type(error).__name__ == "NoArgsIsHelpError":
        return error
    errors = getattr(error.__cause__, "errors", None)
    if isinstance(error, typer.BadParameter) and callable(errors) and errors() and "input" in errors()[0]:
        error.message = f"{error.message} (got {errors()[0]['input']!r})"
    return _fail(ValueError(" ".join(error.format_message().split())))


app = typer.Typer(
    name="ctrl",
    cls=_Commands,
    help="Dataset pipeline and trainer for a latency-budget knob controller of MolmoE-1B.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
# results on stdout, diagnostics on stderr; a pipe gets wide tables, not rich's 80 columns
out = Console() if sys.stdout.isatty() else Console(width=240)
err = Console(stderr=True)

WorkspaceOption = Annotated[
    Path | None,
    typer.Option("--workspace", "-w", envvar="CTRL_WORKSPACE", help="Workspace directory (default: ./workspace).",
                 show_default=False, file_okay=False),
]
ModelOption = Annotated[str, typer.Option(
    "--model", help="'embedded' (built offline from a seed), 'testbed' (the trained testbed, see `ctrl testbed "
                    "train`), a local model directory or a Hugging Face id org/name[@revision] in the local HF cache.")]


class Dtype(str, Enum):
    """The values of ``--dtype`` (``runtime.precision.DTYPE_CHOICES``; tests/test_cli.py checks they agree)."""

    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


DtypeOption = Annotated[Dtype, typer.Option(
    "--dtype", help="Weights held in this dtype: auto (float32 on CPU, bfloat16 on CUDA), bfloat16, float16 or "
                    "float32; products round to it as bf16 autocast does. Part of the model's fingerprint: features "
                    "and profiles of two dtypes never mix.")]
REWARD, ONLINE = "Reward and loss", "Online"


class OutputFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"


class GroupBy(str, Enum):
    dataset = "dataset"
    family = "family"
    cluster = "cluster"


def _print(text: str) -> None:
    """A result line on stdout, printed as is."""
    out.print(text, highlight=False, markup=False)


def _fail(error: Exception) -> typer.Exit:
    """One red line on stderr (the Hint on the next), exit code 1."""
    lines = str(error).splitlines() or [type(error).__name__]
    # the message is text, not markup: "[@revision]" or a path with brackets must print as written
    err.print(f"[bold red]error:[/] {escape(lines[0])}", markup=True, highlight=False, soft_wrap=True)
    for line in lines[1:]:
        err.print(line, markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code=1)


class Bar:
    """The progress bar of a command, on stderr; invisible when stderr is not a terminal."""

    def __init__(self, progress: Progress, task: TaskID) -> None:
        self.progress, self.task = progress, task

    def total(self, n: int) -> None:
        self.progress.update(self.task, total=n)

    def advance(self, n: int = 1, info: str | None = None) -> None:
        self.progress.update(self.task, advance=n, **({} if info is None else {"info": info}))

    def update(self, *, completed: int | None = None, total: int | None = None, info: str | None = None) -> None:
        changes = {k: v for k, v in (("completed", completed), ("total", total), ("info", info)) if v is not None}
        self.progress.update(self.task, **changes)

    @property
    def completed(self) -> float:
        return next(t.completed for t in self.progress.tasks if t.id == self.task)


@contextmanager
def handled(*, interrupted: str | None = None, also: tuple[type[Exception], ...] = (),
            resume: str | None = None) -> Iterator[None]:
    """The frame of every command: a ctrl error (and the exceptions in ``also``) becomes one red
    line and exit 1; Ctrl-C prints ``interrupted`` (``: <interrupted>``, what happens to the
    work, when given) and exits 130. A disk error's hint says how to go on: ``resume``, else
    "run the command again"."""
    from pipeline.errors import CtrlError, describe

    try:
        yield
    except (CtrlError, *also) as e:
        raise _fail(e) from None
    except OSError as e:  # a full or read-only disk, a permission: the file and the reason, not a traceback
        where = f"{e.filename}: " if e.filename else ""
        then = resume or "run the command again; what was finished is kept"
        raise _fail(CtrlError(f"{where}{e.strerror or e}\nHint: free space or fix permissions, then: {then}.")) \
            from None
    except Exception as e:
        # a damaged file under a reader (Parquet, Arrow IPC, DuckDB): one line, and where to look
        if type(e).__module__.split(".")[0] not in ("pyarrow", "duckdb", "_duckdb", "polars"):
            raise
        raise _fail(CtrlError(f"{describe(e, 1000)}\nHint: `ctrl doctor` checks the workspace's files "
                              "and names the command that repairs them.")) from None
    except KeyboardInterrupt:
        err.print("interrupted" + (f": {interrupted}" if interrupted else ""), highlight=False, soft_wrap=True)
        raise typer.Exit(code=130) from None


@contextmanager
def running(label: str, *, interrupted: str | None = None, also: tuple[type[Exception], ...] = (),
            counts: bool = True, show: bool = True, resume: str | None = None) -> Iterator[Bar]:
    """:func:`handled` with a progress bar (``counts``: n/total; ``show``: False hides it)."""
    columns = [TextColumn(label), BarColumn(), *([MofNCompleteColumn()] if counts else []),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
    with handled(interrupted=interrupted, also=also, resume=resume), \
            Progress(*columns, console=err, transient=True, disable=not show or not err.is_terminal) as progress:
        yield Bar(progress, progress.add_task(label, total=None, info=""))


# -- the dataset -------------------------------------------------------------------------------

@app.command()
def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Result files or directories (searched recursively for *.json).",
                                                exists=True)],
    workspace: WorkspaceOption = None,
    strict: Annotated[bool, typer.Option("--strict", help="Stop at the first bad file and change nothing.")] = False,
    num_workers: Annotated[int, typer.Option("--num-workers", help="Parser processes; 0 = one per core (max 4).", min=0,
                                             rich_help_panel="Performance")] = 0,
) -> None:
    """Parse exp5/exp6/core_exp result trees into the workspace's Parquet tables."""
    from pipeline import IngestConfig
    from pipeline import ingest as run_ingest

    with running("ingest", interrupted="the workspace is unchanged; parsed files are cached and the next run resumes") \
            as bar:
        config = IngestConfig(paths=paths, workspace=workspace, strict=strict, num_workers=num_workers)
        report = run_ingest(config, progress=lambda name: bar.advance(info=name), on_total=bar.total)
    for line in report.repaired:
        err.print(f"[yellow]repaired:[/] {line}", highlight=False, soft_wrap=True)
    for f in report.errors:
        err.print(f"[red]bad file:[/] {f.error}", highlight=False, soft_wrap=True)
    parts = [f"{report.count(s)} {s}" for s in ("ok", "unchanged", "skipped", "error") if report.count(s)]
    summary = f"{len(report.files)} files ({', '.join(parts) or 'none'}) in {report.elapsed_s:.1f}s"
    if report.changed:
        rows = ", ".join(f"{n} {t}" for t, n in report.table_rows.items())
        _print(f"ingested {summary} -> {report.workspace} ({report.generation}): {rows}")
    else:
        out.print(f"nothing changed: {summary}; workspace {report.workspace}", highlight=False)
    if report.errors:
        err.print(f"[bold red]{len(report.errors)} bad file(s)[/] recorded with status 'error' (see `ctrl status`)")
        raise typer.Exit(code=1)


@app.command()
def query(
    sql: Annotated[str, typer.Argument(help="SQL over the workspace views (samples, measurements, configs, files, "
                                            "groups; features and runs once written).")],
    workspace: WorkspaceOption = None,
    output_format: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
    max_rows: Annotated[int, typer.Option("--max-rows", help="Rows shown by --format table (0 = all).", min=0)] = 50,
) -> None:
    """Run SQL over the workspace with DuckDB."""
    from pipeline import Workspace, run_query
    from pipeline.catalog import csv_ready

    with handled(interrupted="nothing was written"):
        result = run_query(Workspace(workspace), sql)
        if output_format is OutputFormat.csv:
            import pyarrow.csv as pacsv

            pacsv.write_csv(csv_ready(result), sys.stdout.buffer)
        elif output_format is OutputFormat.json:
            sys.stdout.write(json.dumps(result.to_pylist(), default=str, indent=1) + "\n")
        else:
            _print_arrow(result, max_rows)


def _print_arrow(result: pa.Table, max_rows: int) -> None:
    table = Table(show_header=True, header_style="bold")
    for name in result.column_names:
        table.add_column(name, overflow="fold")
    shown = result if max_rows == 0 else result.slice(0, max_rows)
    for row in shown.to_pylist():
        table.add_row(*("" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v) for v in row.values()))
    out.print(table)
    if shown.num_rows < result.num_rows:
        err.print(f"{result.num_rows} rows, {shown.num_rows} shown (--max-rows 0 shows all, --format csv exports)")


@app.command()
def status(
    workspace: WorkspaceOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Summarize a workspace: datasets, configurations per experiment, flags, bad files."""
    from pipeline import Workspace, workspace_status

    with handled():
        summary = workspace_status(Workspace(workspace))
    if as_json:
        sys.stdout.write(json.dumps(summary, default=str, indent=1) + "\n")
        return
    _print(f"workspace {summary['workspace']} ({summary['generation']})  catalog: {summary['catalog']}")
    sections = [("datasets", summary["datasets"]), ("configurations", summary["experiments"]),
                ("files", summary["files"])]
    if summary["features"]:
        sections.append(("features (ctrl extract-features)", summary["features"]))
    for title, rows in sections:
        table = Table(title=title, title_justify="left")
        for name in (rows[0].keys() if rows else ["(none)"]):
            table.add_column(name)
        for row in rows:
            table.add_row(*(str(v) for v in row.values()))
        out.print(table)
    flags = ", ".join(f"{k} {v}" for k, v in summary["flags"].items() if v)
    out.print(f"flagged measurements: {flags or 'none'}", highlight=False)
    for bad in summary["bad_files"]:
        out.print(f"[red]{bad['status']}:[/] {bad['error']}", highlight=False, soft_wrap=True)
    if summary["missing_files"]:
        _print(f"{len(summary['missing_files'])} ingested file(s) no longer on disk (their rows are kept), "
               f"e.g. {summary['missing_files'][0]}")


@app.command()
def doctor(workspace: WorkspaceOption = None) -> None:
    """Check every workspace file against what its writer recorded; one line per problem with the
    command that repairs it (exit 1 if any)."""
    from pipeline import Workspace
    from pipeline.errors import WorkspaceError
    from pipeline.health import check_workspace

    with handled():
        ws = Workspace(workspace)
        if not ws.root.is_dir():
            msg = (f"workspace {ws.root} does not exist\n"
                   "Hint: pass the workspace with -w (or CTRL_WORKSPACE); `ctrl ingest` creates one.")
            raise WorkspaceError(msg)
        if not any((ws.root / name).exists() for name in ("CURRENT", "tables", "fragments", "features", "runs")):
            msg = (f"workspace {ws.root} holds nothing ctrl wrote (no tables yet): nothing to check\n"
                   "Hint: pass the workspace with -w (or CTRL_WORKSPACE); `ctrl ingest` fills one.")
            raise WorkspaceError(msg)
        started = time.perf_counter()
        problems = check_workspace(ws)
        took = f"{time.perf_counter() - started:.1f} s"
    for problem in problems:
        err.print(f"[red]damaged:[/] {problem.line()}", highlight=False, soft_wrap=True)
    if problems:
        err.print(f"[bold red]{len(problems)} problem(s)[/] in {ws.root} (checked in {took})")
        raise typer.Exit(code=1)
    _print(f"workspace {ws.root}: every table, cached parse, feature chunk, run file and the catalog check out, "
           f"their contents included (checked in {took})")


@app.command()
def schema() -> None:
    """Print the workspace tables' schemas (columns, types, units) as Markdown."""
    from pipeline.schema import schemas_markdown

    sys.stdout.write(schemas_markdown() + "\n")


# -- features ----------------------------------------------------------------------------------

@app.command("extract-features")
def extract_features(
    workspace: WorkspaceOption = None,
    images: Annotated[Path | None, typer.Option("--images", help="Directory searched (recursively) for images by "
                                                "image_id.", exists=True, file_okay=False)] = None,
    image_pattern: Annotated[str | None, typer.Option("--image-pattern", help="Extra file name pattern, e.g. "
                                                      "'{dataset}/{image_id}.jpg'.")] = None,
    model: ModelOption = "embedded",
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    dtype: DtypeOption = Dtype.auto,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Requests per forward pass.")] = 16,
    force: Annotated[bool, typer.Option("--force", help="Recompute features already cached for this model.")] = False,
) -> None:
    """Compute image and language features per sample once and cache them in the workspace.

    Several GPUs: torchrun --nproc-per-node N -m cli extract-features ... (the same cache as one process)."""
    import os
    import time

    from features import FeatureConfig
    from features import extract_features as run_extract
    from runtime.distributed import current_dist

    # under torchrun, rank 0 shows the progress and reports
    with running("features", interrupted="finished chunks are kept; the next run resumes",
                 resume="the same command again resumes (finished chunks are kept)",
                 show=os.environ.get("RANK", "0") == "0") as bar:
        config = FeatureConfig(workspace=workspace, images_dir=images, image_pattern=image_pattern, model=model,
                               device=device, dtype=dtype.value, batch_size=batch_size, force=force)
        started: list[float] = []

        def advance(n: int) -> None:
            started[:] = started or [time.perf_counter()]
            elapsed = time.perf_counter() - started[0]
            bar.advance(n, info=_rate(bar.completed + n, elapsed) if elapsed > 0 else "")

        report = run_extract(config, progress=advance, on_total=bar.total)
    if current_dist().rank != 0:
        return
    _print(f"features for {report.num_samples} samples (model {report.fingerprint[:16]}): {report.computed} computed, "
           f"{report.cached} already cached; {_rate(report.computed, report.elapsed_s)}")
    for label, ids in (("missing", report.missing_images), ("unreadable", report.unreadable_images)):
        unique = list(dict.fromkeys(ids))
        if unique:
            err.print(f"{len(unique)} {label} image(s), e.g. {', '.join(unique[:5])}: their image features are null",
                      highlight=False, markup=False)


def _rate(samples: float, seconds: float) -> str:
    """Samples per second, or seconds per sample when a sample takes longer than a second (a
    full-size model on a CPU)."""
    if samples <= 0 or seconds <= 0:
        return "0 samples/s"
    rate = samples / seconds
    return f"{rate:.1f} samples/s" if rate >= 1 else f"{seconds / samples:.1f} s/sample"


# -- training ----------------------------------------------------------------------------------

def _train_opt(name: str, *flags: str, **kwargs: Any) -> Any:
    """A ``ctrl train`` option: help and default from its config field (online.train_options); the
    CLI's default is None, "not given", so that each phase's own default applies."""
    from online.train_options import train_option_help

    return typer.Option(*(flags or ("--" + name.replace("_", "-"),)), help=train_option_help(name),
                        show_default=False, **kwargs)


@app.command()
def train(
    offline: Annotated[bool, typer.Option("--offline/--online", help="Offline GRPO on the recorded configurations, "
                                          "or online GRPO running the model.")] = True,
    workspace: WorkspaceOption = None,
    model_fingerprint: Annotated[str | None, _train_opt("model_fingerprint")] = None,
    num_epochs: Annotated[int | None, _train_opt("num_epochs", min=1)] = None,
    group_size: Annotated[int | None, _train_opt("group_size", min=2)] = None,
    batch_size: Annotated[int | None, _train_opt("batch_size", min=1)] = None,
    lr: Annotated[float | None, _train_opt("lr")] = None,
    seed: Annotated[int | None, _train_opt("seed")] = None,
    budget_min_ms: Annotated[float | None, _train_opt("budget_min_ms")] = None,
    budget_max_ms: Annotated[float | None, _train_opt("budget_max_ms")] = None,
    report_to: Annotated[str | None, _train_opt("report_to")] = None,
    calibration_samples: Annotated[int | None, _train_opt("calibration_samples", min=1, rich_help_panel=ONLINE)] = None,
    guard_samples: Annotated[int | None, _train_opt("guard_samples", min=0, rich_help_panel=ONLINE)] = None,
    reward_mode: Annotated[str | None, _train_opt("reward_mode", rich_help_panel=REWARD)] = None,
    score_target: Annotated[str | None, _train_opt("score_target", rich_help_panel=REWARD)] = None,
    warm_start_steps: Annotated[int | None, _train_opt("warm_start_steps", min=0, rich_help_panel=REWARD)] = None,
    warm_start_target: Annotated[str | None, _train_opt("warm_start_target", rich_help_panel=REWARD)] = None,
    loss_type: Annotated[str | None, _train_opt("loss_type", rich_help_panel=REWARD)] = None,
    scale_rewards: Annotated[str | None, _train_opt("scale_rewards", rich_help_panel=REWARD)] = None,
    clip_epsilon: Annotated[float | None, _train_opt("clip_epsilon", rich_help_panel=REWARD)] = None,
    kl_beta: Annotated[float | None, _train_opt("kl_beta", rich_help_panel=REWARD)] = None,
    violation_target: Annotated[float | None, _train_opt("violation_target", min=0.0, max=0.99,
                                                         rich_help_panel=REWARD)] = None,
    no_table_fallback: Annotated[bool | None, _train_opt("no_table_fallback", "--no-table-fallback/--table-fallback",
                                                         rich_help_panel=REWARD)] = None,
    fallback_confidence: Annotated[float | None, _train_opt("fallback_confidence", min=0.5, max=0.999,
                                                            rich_help_panel=REWARD)] = None,
    fallback_prefers: Annotated[str | None, _train_opt("fallback_prefers", rich_help_panel=REWARD)] = None,
    fallback_table: Annotated[str | None, _train_opt("fallback_table", rich_help_panel=REWARD)] = None,
    ignore_family_labels: Annotated[bool | None, _train_opt("ignore_family_labels", "--ignore-family-labels",
                                                            rich_help_panel=REWARD)] = None,
    latency_jitter: Annotated[float | None, _train_opt("latency_jitter", min=0.0, rich_help_panel=REWARD)] = None,
    cross_fit_folds: Annotated[int | None, _train_opt("cross_fit_folds", min=0, rich_help_panel=REWARD)] = None,
    holdout_dataset: Annotated[str | None, _train_opt("holdout_dataset")] = None,
    use_tilings: Annotated[bool | None, _train_opt("use_tilings", "--use-tilings/--no-tilings")] = None,
    hidden_dim: Annotated[int | None, _train_opt("hidden_dim", min=8)] = None,
    run_id: Annotated[str | None, _train_opt("run_id")] = None,
    resume: Annotated[str | None, _train_opt("resume")] = None,
    from_run: Annotated[str | None, _train_opt("from_run", "--from", rich_help_panel=ONLINE)] = None,
    fresh: Annotated[bool | None, _train_opt("fresh", "--fresh", rich_help_panel=ONLINE)] = None,
    model: Annotated[str | None, _train_opt("model", rich_help_panel=ONLINE)] = None,
    images: Annotated[Path | None, _train_opt("images", rich_help_panel=ONLINE)] = None,
    steps: Annotated[int | None, _train_opt("steps", min=1, rich_help_panel=ONLINE)] = None,
    samples_per_step: Annotated[int | None, _train_opt("samples_per_step", min=1, rich_help_panel=ONLINE)] = None,
    max_new_tokens: Annotated[int | None, _train_opt("max_new_tokens", min=1, rich_help_panel=ONLINE)] = None,
    device: Annotated[str | None, _train_opt("device", rich_help_panel=ONLINE)] = None,
    dtype: Annotated[Dtype | None, _train_opt("dtype", rich_help_panel=ONLINE)] = None,
    checkpoint_every: Annotated[int | None, _train_opt("checkpoint_every", min=1, rich_help_panel=ONLINE)] = None,
    online_evaluate: Annotated[bool | None, _train_opt("online_evaluate", "--evaluate/--no-evaluate",
                                                       rich_help_panel=ONLINE)] = None,
    eval_max_samples: Annotated[int | None, _train_opt("eval_max_samples", min=1, rich_help_panel=ONLINE)] = None,
    check_every: Annotated[int | None, _train_opt("check_every", min=0, rich_help_panel=ONLINE)] = None,
    check_samples: Annotated[int | None, _train_opt("check_samples", min=1, rich_help_panel=ONLINE)] = None,
    check_budgets: Annotated[int | None, _train_opt("check_budgets", min=1, rich_help_panel=ONLINE)] = None,
    patience: Annotated[int | None, _train_opt("patience", min=0, rich_help_panel=ONLINE)] = None,
    threads: Annotated[int | None, _train_opt("threads", min=0, rich_help_panel=ONLINE)] = None,
    fast_path: Annotated[bool | None, _train_opt("fast_path", *FAST_PATH_FLAGS, rich_help_panel=ONLINE)] = None,
    float32_attention: Annotated[bool | None, _train_opt("float32_attention",
                                                         "--float32-attention/--no-float32-attention",
                                                         rich_help_panel=ONLINE)] = None,
) -> None:
    """Train the knob controller with GRPO: --offline on the recorded configuration groups (then
    evaluate), or --online with the model in the loop (hook-measured latency, scored answers).
    Options of the other phase are refused; with --resume only the options a resumed run may
    change are accepted (docs/cli.md)."""
    options = {k: v for k, v in locals().items() if k != "offline"}
    import os

    from online.train_options import train_config

    phase = "offline" if offline else "online"
    with handled(also=(ValueError,)):
        config = train_config(phase, options)
    if config.resume is None and config.run_id is None and os.environ.get("WORLD_SIZE", "1") == "1":
        from dataclasses import replace

        from trainer.runs import new_run_id

        config = replace(config, run_id=new_run_id())  # named now, so that messages can say how to resume it
    if offline:
        _train_offline(config)
    else:
        _train_online(config)


def _train_offline(config: Any) -> None:
    from trainer import evaluation_title, read_fallback, train_offline

    run = config.resume or config.run_id or "RUN"
    with running("train", interrupted=f"resume with --resume {run} (the last finished epoch is checkpointed)",
                 resume=f"ctrl train --offline --resume {run} (the last finished epoch is checkpointed)",
                 also=(ValueError,), counts=False) as bar:

        def show(event: dict) -> None:
            if event.get("phase") == "train":
                val = event.get("val_expected_reward")
                bar.update(completed=event.get("step", 0), total=event.get("total_steps"),
                           info=f"epoch {event.get('epoch')} loss {event.get('loss', float('nan')):.4f} "
                                f"reward {event.get('reward', float('nan')):.3f} val E[r] "
                                + (f"{val:.3f}" if val is not None else "-"))
            elif event.get("phase") == "fold":
                bar.update(info=f"cross-fitting: fold {event['fold']} of {event['num_folds']}, "
                                f"epoch {event.get('epoch', 0)}")
            elif event.get("phase") == "evaluate":
                bar.update(info="evaluating")

        result = train_offline(config, progress=show)
    _print(f"run {result.run_id}: best epoch {result.best_epoch}, validation expected reward "
           f"{result.initial_val_expected_reward:.4f} -> {result.best_val_expected_reward:.4f}; {result.run_dir}")
    fallback = read_fallback(result.best_checkpoint)
    if fallback is not None:
        _print(fallback.describe())
    if result.evaluation is not None:
        from trainer.evaluate import format_summary_table, summarize_evaluation

        title = evaluation_title(result.run_dir).replace("evaluation", "summary", 1)
        out.print(format_summary_table(summarize_evaluation(result.evaluation, fallback), title))
        _print(f"every decider: `ctrl evaluate {result.run_id}`; plot: {result.run_dir / 'evaluation.png'}")
    _print(f"next: `ctrl predict --run {result.run_id} --budget-ms 200 --out decisions.parquet`, or "
           f"`ctrl query \"FROM evaluations WHERE run_id = '{result.run_id}'\"`")


def _train_online(config: Any) -> None:
    import os

    from online import train_online
    from runtime.distributed import current_dist
    from trainer import format_evaluation_table

    # under torchrun, rank 0 shows the progress and reports
    run = config.resume or config.run_id or "RUN"
    with running("online", interrupted=f"continue with --online --resume {run} (from its last checkpoint)",
                 resume=f"ctrl train --online --resume {run} (from its last checkpoint)",
                 also=(ValueError,), show=os.environ.get("RANK", "0") == "0") as bar:
        bar.update(total=config.steps, info="starting")

        def show(event: dict) -> None:
            if event.get("phase") == "calibrate":
                bar.update(info=f"calibrating the budget range on {event.get('samples')} samples")
            elif event.get("phase") == "guard_progress":
                bar.update(info=f"latency guard: configuration {event['done']} of {event['total']}")
            elif event.get("phase") == "guarded":
                ratios = ", ".join(f"{stage} x{ratio:.2f}" for stage, ratio in event["stage_ratios"].items())
                err.print(f"latency guard: {ratios} against the profile, slack x{event['slack']:.2f} "
                          f"({event['requests']} requests)", highlight=False, markup=False, soft_wrap=True)
            elif event.get("phase") == "evaluate":
                bar.update(info="evaluating on the test split with the model")
            elif event.get("phase") == "step":
                bar.update(completed=event["step"], total=event["steps"],
                           info=f"reward {event['reward/mean']:.3f} acc {event['accuracy']:.3f} "
                                f"latency {event['latency_ms_mean']:.0f} ms viol {event['violation_rate']:.0%}")
            elif event.get("phase") == "checking":
                bar.update(info=f"held-out check after step {event['step']}: {event['pairs']} paired requests")
            elif event.get("phase") == "check":
                kept = "the start" if event["kept_step"] == 0 else f"step {event['kept_step']}"
                err.print(f"step {event['step']}: held-out gain over the start {event['gain']:+.3f} "
                          f"[{event['gain_low']:+.3f}, {event['gain_high']:+.3f}] on {event['requests']} paired "
                          "requests, "
                          f"late {event['late_share']:.0%} (start {event['start_late_share']:.0%}); kept: {kept}"
                          + (f" ({event['since']} of {event['patience']} checks without a better one)"
                             if event["since"] and event["patience"] else ""), highlight=False, markup=False,
                          soft_wrap=True)
            elif event.get("phase") == "stop":
                err.print(f"stopping after step {event['step']} of {event['steps']}: {event['patience']} held-out "
                          "checks in a row found nothing better (--patience 0 runs every step)", highlight=False,
                          markup=False, soft_wrap=True)
            elif event.get("phase") == "no_checks":
                err.print(f"no held-out checks: {event['reason']}; the run's controller is its last step",
                          highlight=False, markup=False,
                          soft_wrap=True)

        result = train_online(config, progress=show)
    if current_dist().rank != 0:
        return
    if result.evaluation is not None:
        out.print(format_evaluation_table(result.evaluation))
    frame = result.steps
    lo, hi = result.budget_range_ms
    if len(frame):
        first, last = frame.head(max(1, len(frame) // 4)), frame.tail(max(1, len(frame) // 4))

        def change(column: str, fmt: str) -> str:
            return f"{first[column].mean():{fmt}} -> {last[column].mean():{fmt}}"

        _print(f"online run {result.run_id}: {len(frame)} steps, budget range {lo:.1f}-{hi:.1f} ms; "
               f"first/last quarter: reward {change('reward/mean', '.3f')}, accuracy {change('accuracy', '.3f')}, "
               f"violations {change('violation_rate', '.0%')}, latency {change('latency_ms_mean', '.0f')} ms; "
               f"{result.run_dir}")
        if result.kept is not None:
            k = result.kept
            _print(f"kept: the start (no check found a better controller); {result.checkpoint}" if k.step == 0 else
                   f"kept: step {k.step}, held-out gain over the start {k.gain:+.3f} [{k.gain_low:+.3f}, "
                   f"{k.gain_high:+.3f}]; {result.checkpoint}")
        _print(f"next: `ctrl evaluate {result.run_id}` (measured, paired with its offline start), the steps in "
               f"`ctrl query \"FROM online_steps WHERE run_id = '{result.run_id}'\"`, every rollout in view rollouts")


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

            raise _fail(CtrlError(f"{written[2]}: no per-group evaluation (online runs have none)"))
        import polars as pl

        out.print(format_group_table(pl.read_parquet(written[2]), by.value))
    _print("written: " + ", ".join(str(p) for p in written if p.is_file()))


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
        raise _fail(CtrlError("give exactly one of --run RUN and --checkpoint PATH"))
    with handled(also=(ValueError,)):
        frame = run_predict(workspace, run if run is not None else checkpoint, list(budget_ms), out_path)
    _print(f"{frame.height} decisions for {frame['sample_key'].n_unique()} samples x {len(budget_ms)} budgets "
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
    tiling = f", tiling_crops [B, {len(report.max_crops_values)}]" if report.uses_tilings else ""
    lang, image = f"lang [B, {report.lang_feature_dim}]", f"image [B, {report.image_feature_dim}]"
    _print(f"{report.path} ({report.size_bytes / 1024:.0f} KiB) from {report.checkpoint}")
    if report.compiled:
        _print(f"call: torch._inductor.aoti_load_package(FILE)({lang}, {image}, image_present [B] bool, budget_ms [B]"
               f"{tiling}) -> (max_crops, top_k, num_active_blocks), int64 [B] each")
    else:
        _print(f"stage 1, before the vision tower: torch.jit.load(FILE).stage1({lang}, budget_ms [B]{tiling}) "
               f"-> max_crops [B] int64, in {list(report.max_crops_values)}")
        _print(f"stage 2, after it: .stage2({lang}, {image} (the global crop's feature), image_present [B] bool, "
               f"budget_ms [B], max_crops [B]{tiling}) -> (top_k, num_active_blocks), int64 [B] each; "
               f"or .decide(...) for both")
    _print(f"features of model {report.model_fingerprint[:16]}")


# -- serving -----------------------------------------------------------------------------------

def _serve_help(name: str) -> str:
    from serve.config import option_help  # deferred like every stage; the help text is written once, there

    return option_help(name)


def _serve_default(name: str) -> Any:
    from serve.config import option_default

    return option_default(name)


@app.command()
def serve(
    model: Annotated[str, typer.Option("--model", help=_serve_help("model"))] = _serve_default("model"),
    controller: Annotated[str, typer.Option("--controller", help=_serve_help("controller"))] = _serve_default(
        "controller"),
    host: Annotated[str, typer.Option("--host", help=_serve_help("host"))] = _serve_default("host"),
    port: Annotated[int, typer.Option("--port", help=_serve_help("port"))] = _serve_default("port"),
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help=_serve_help("allow_remote"))] = False,
    auth_by_proxy: Annotated[bool, typer.Option("--auth-by-proxy", help=_serve_help("auth_by_proxy"))] = False,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="CTRL_API_KEY", help=_serve_help("api_key"),
                                                show_default=False)] = None,
    device: Annotated[str, typer.Option("--device", help=_serve_help("device"))] = _serve_default("device"),
    # a plain string, checked by ServeConfig: a bad value is one line and exit 1, as for --device
    dtype: Annotated[str, typer.Option("--dtype", metavar="<auto|bfloat16|float16|float32>", help=_serve_help(
        "dtype"))] = _serve_default("dtype"),
    threads: Annotated[int, typer.Option("--threads", help=_serve_help("threads"))] = _serve_default("threads"),
    max_queue: Annotated[int, typer.Option("--max-queue", help=_serve_help("max_queue"))] = _serve_default(
        "max_queue"),
    default_budget_ms: Annotated[float | None, typer.Option("--default-budget-ms", help=_serve_help(
        "default_budget_ms"), show_default=False)] = None,
    latency_scale: Annotated[float | None, typer.Option("--latency-scale", help=_serve_help("latency_scale"),
                                                        show_default=False)] = None,
    latency_scale_quantile: Annotated[float, typer.Option("--latency-scale-quantile", help=_serve_help(
        "latency_scale_quantile"))] = _serve_default("latency_scale_quantile"),
    queue_aware: Annotated[bool, typer.Option("--queue-aware/--no-queue-aware", help=_serve_help(
        "queue_aware"))] = _serve_default("queue_aware"),
    load_aware: Annotated[bool, typer.Option("--load-aware/--no-load-aware", help=_serve_help(
        "load_aware"))] = _serve_default("load_aware"),
    burst_aware: Annotated[bool, typer.Option("--burst-aware/--no-burst-aware", help=_serve_help(
        "burst_aware"))] = _serve_default("burst_aware"),
    refuse_unreachable: Annotated[bool, typer.Option("--refuse-unreachable/--no-refuse-unreachable",
                                                     help=_serve_help("refuse_unreachable"))] = _serve_default(
        "refuse_unreachable"),
    cheapest_floor: Annotated[bool, typer.Option("--cheapest-floor/--no-cheapest-floor", help=_serve_help(
        "cheapest_floor"))] = _serve_default("cheapest_floor"),
    config_guard: Annotated[bool, typer.Option("--config-guard/--no-config-guard", help=_serve_help(
        "config_guard"))] = _serve_default("config_guard"),
    met_target: Annotated[float, typer.Option("--met-target", help=_serve_help("met_target"))] = _serve_default(
        "met_target"),
    default_max_tokens: Annotated[int, typer.Option("--default-max-tokens", help=_serve_help(
        "default_max_tokens"))] = _serve_default("default_max_tokens"),
    max_tokens_limit: Annotated[int, typer.Option("--max-tokens-limit", help=_serve_help(
        "max_tokens_limit"))] = _serve_default("max_tokens_limit"),
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", help=_serve_help(
        "max_body_bytes"))] = _serve_default("max_body_bytes"),
    max_prompt_chars: Annotated[int, typer.Option("--max-prompt-chars", help=_serve_help(
        "max_prompt_chars"))] = _serve_default("max_prompt_chars"),
    max_prompt_tokens: Annotated[int | None, typer.Option("--max-prompt-tokens", help=_serve_help(
        "max_prompt_tokens"), show_default=False)] = None,
    queue_deadline: Annotated[float, typer.Option("--queue-deadline", help=_serve_help(
        "queue_deadline"))] = _serve_default("queue_deadline"),
    max_image_pixels: Annotated[int, typer.Option("--max-image-pixels", help=_serve_help(
        "max_image_pixels"))] = _serve_default("max_image_pixels"),
    max_image_aspect: Annotated[float, typer.Option("--max-image-aspect", help=_serve_help(
        "max_image_aspect"))] = _serve_default("max_image_aspect"),
    max_connections: Annotated[int, typer.Option("--max-connections", help=_serve_help(
        "max_connections"))] = _serve_default("max_connections"),
    header_timeout_s: Annotated[float, typer.Option("--header-timeout-s", help=_serve_help(
        "header_timeout_s"))] = _serve_default("header_timeout_s"),
    body_timeout_s: Annotated[float, typer.Option("--body-timeout-s", help=_serve_help(
        "body_timeout_s"))] = _serve_default("body_timeout_s"),
    write_timeout_s: Annotated[float, typer.Option("--write-timeout-s", help=_serve_help(
        "write_timeout_s"))] = _serve_default("write_timeout_s"),
    max_pipelined: Annotated[int, typer.Option("--max-pipelined", help=_serve_help(
        "max_pipelined"))] = _serve_default("max_pipelined"),
    max_uploads: Annotated[int | None, typer.Option("--max-uploads", help=_serve_help("max_uploads"),
                                                    show_default=False)] = None,
    allowed_hosts: Annotated[str | None, typer.Option("--allowed-hosts", help=_serve_help("allowed_hosts"),
                                                      show_default=False)] = None,
    allowed_origins: Annotated[str | None, typer.Option("--allowed-origins", help=_serve_help("allowed_origins"),
                                                        show_default=False)] = None,
    local_images: Annotated[Path | None, typer.Option("--local-images", help=_serve_help("local_images"),
                                                      file_okay=False, show_default=False)] = None,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name", help=_serve_help(
        "served_model_name"), show_default=False)] = None,
    fast_path: Annotated[bool, typer.Option(*FAST_PATH_FLAGS, help=_serve_help("fast_path"))] = _serve_default(
        "fast_path"),
    float32_attention: Annotated[bool, typer.Option("--float32-attention/--no-float32-attention", help=_serve_help(
        "float32_attention"))] = _serve_default("float32_attention"),
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help=_serve_help("warmup"))] = _serve_default(
        "warmup"),
    workspace: WorkspaceOption = None,
) -> None:
    """Serve the model over HTTP (OpenAI chat completions) with the controller choosing each request's
    knobs within its latency budget; every request is recorded in the workspace (view `requests`).
    SIGTERM or Ctrl-C drains the requests in flight and exits 0; a second one stops at once and exits 1."""
    from serve.config import ServeConfig
    from serve.startup import check_bind

    with handled(also=(ValueError,)):
        config = ServeConfig(model=model, controller=controller, workspace=workspace, host=host, port=port,
                             allow_remote=allow_remote, auth_by_proxy=auth_by_proxy,
                             api_key=api_key, device=device, dtype=dtype,
                             threads=threads, max_queue=max_queue, default_budget_ms=default_budget_ms,
                             latency_scale=latency_scale, latency_scale_quantile=latency_scale_quantile,
                             queue_aware=queue_aware, load_aware=load_aware, config_guard=config_guard,
                             burst_aware=burst_aware, refuse_unreachable=refuse_unreachable,
                             cheapest_floor=cheapest_floor,
                             met_target=met_target,
                             default_max_tokens=default_max_tokens,
                             max_tokens_limit=max_tokens_limit,
                             max_body_bytes=max_body_bytes, max_prompt_chars=max_prompt_chars,
                             max_prompt_tokens=max_prompt_tokens, queue_deadline=queue_deadline,
                             max_image_pixels=max_image_pixels, max_image_aspect=max_image_aspect,
                             max_connections=max_connections, header_timeout_s=header_timeout_s,
                             body_timeout_s=body_timeout_s, write_timeout_s=write_timeout_s,
                             max_pipelined=max_pipelined, max_uploads=max_uploads, allowed_hosts=allowed_hosts,
                             allowed_origins=allowed_origins,
                             local_images=local_images, served_model_name=served_model_name, warmup=warmup,
                             fast_path=fast_path, float32_attention=float32_attention)
        check_bind(config.host, config.port)
        # imported once the options are checked: the server pulls in torch, seconds that a bad option need not wait
        from serve.server import serve as run_server

        drained = run_server(config, log=lambda line: err.print(line, markup=False, highlight=False))
    if not drained:
        raise typer.Exit(1)


# -- profiling ---------------------------------------------------------------------------------

@app.command()
def profile(
    dataset: Annotated[list[Path], typer.Option("--dataset", help="Dataset directory (dataset.json + images/); "
                                                "repeatable.", show_default=False)],
    model: ModelOption = "embedded",
    configs: Annotated[str, typer.Option("--configs", help="'balanced' (27), 'full' (75) or a list C/K/B,C/K/B "
                                         "(max_crops/top_k/num_active_blocks).")] = "balanced",
    num_samples: Annotated[int | None, typer.Option("--num-samples", min=1, help="The first N samples of each dataset "
                                                    "(default: all).", show_default=False)] = None,
    world_size: Annotated[int, typer.Option("--world-size", min=1, help="Ranks simulated in this process, one after "
                                            "the other (each writes its own rank file, then a deterministic merge); "
                                            "under torchrun every process is one rank.")] = 1,
    out_dir: Annotated[Path, typer.Option("--out", help="Results directory (exp5_accuracy_<dataset>/, "
                                          "exp6_latency_<dataset>/).", file_okay=False)] = Path("results/profile"),
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Generation cap per request.")] = 16,
    device: Annotated[str, typer.Option("--device", help=EXECUTION_HELP["device"])] = "cpu",
    dtype: DtypeOption = Dtype.auto,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Unmeasured generations before each configuration "
                                        "(per rank).")] = 1,
    threads: Annotated[int, typer.Option("--threads", min=0, help=EXECUTION_HELP["threads"])] = 1,
    fast_path: Annotated[bool, typer.Option(*FAST_PATH_FLAGS, help=EXECUTION_HELP["fast_path"] + " Profiles of the "
                                            "two paths never mix.")] = True,
    float32_attention: Annotated[bool, typer.Option("--float32-attention/--no-float32-attention",
                                                    help=EXECUTION_HELP["float32_attention"])] = False,
) -> None:
    """Measure the knob sweep of a model on VQA datasets and write exp5/exp6 result trees (read them with
    `ctrl ingest`)."""
    from profiler import ProfileConfig, format_report, profile_model
    from runtime.distributed import current_dist

    with running("profile", interrupted="finished configurations and rank files are kept; the same command resumes") \
            as bar:
        config = ProfileConfig(datasets=dataset, model=model, configs=configs, num_samples=num_samples,
                               world_size=world_size, out_dir=out_dir, max_new_tokens=max_new_tokens, device=device,
                               dtype=dtype.value, warmup=warmup, threads=threads, fast_path=fast_path,
                               float32_attention=float32_attention)
        bar.update(info="loading the model")
        report = profile_model(config, progress=lambda n, label: bar.advance(n, info=label), on_total=bar.total)
    if current_dist().rank != 0:  # under torchrun, rank 0 merged and reports
        return
    for line in format_report(report):
        _print(line)
    _print(f"{report.measured} generations measured in {report.measure_s:.1f}s "
           f"({report.per_minute:.1f} configuration x samples per minute), model {report.model_fingerprint[:16]}; "
           f"next: ctrl ingest {report.out_dir}")


# -- ctrl testbed: the procedural VQA task and the trained embedded testbed ------------------------

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
    _print(f"{num_samples} samples -> {root}")


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
            _print(f"trained in {report.train_seconds:.0f}s -> {report.model_dir}")
        elif report.from_shipped:
            _print(f"unpacked the shipped weights of this recipe -> {report.model_dir} (--force trains it instead)")
        else:
            _print(f"cached: {report.model_dir}")
        if eval_samples:
            root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
            eval_root = eval_dir or root / f"testbed-eval-seed{seed + 1000}-n{eval_samples}"
            generate_dataset(eval_root, eval_samples, seed=seed + 1000, split="val")
            rows = evaluate_testbed(report.model_dir, eval_root, dtype=dtype.value)
            for line in format_eval_table(rows) + [""] + marginal_table(rows):
                _print(line)


if __name__ == "__main__":
    app()
