"""The ``ctrl`` command. Thin: parse options, build a config, call one library function, print.

Heavy imports (pyarrow, duckdb, polars, later torch) happen inside the commands so that
``ctrl --help`` stays instant.
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    name="ctrl",
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
    typer.Option("--workspace", "-w", envvar="CTRL_WORKSPACE", help="Workspace directory [default: ./workspace].",
                 show_default=False, file_okay=False),
]


class OutputFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"


def _fail(error: Exception) -> typer.Exit:
    lines = str(error).splitlines() or [type(error).__name__]
    err.print(f"[bold red]error:[/] {lines[0]}", markup=True, highlight=False, soft_wrap=True)
    for line in lines[1:]:
        err.print(line, markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code=1)


@app.command()
def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Result files or directories (searched recursively for *.json).", exists=True)],
    workspace: WorkspaceOption = None,
    strict: Annotated[bool, typer.Option("--strict", help="Stop at the first bad file and change nothing.")] = False,
    num_workers: Annotated[int, typer.Option("--num-workers", help="Parser processes; 0 = one per core (max 4).", min=0,
                                             rich_help_panel="Performance")] = 0,
) -> None:
    """Parse exp5/exp6/core_exp result trees into the workspace's Parquet tables."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pipeline import CtrlError, IngestConfig
    from pipeline import ingest as run_ingest

    try:
        config = IngestConfig(paths=paths, workspace=workspace, strict=strict, num_workers=num_workers)
        with Progress(TextColumn("ingest"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[name]}"),
                      TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal) as bar:
            task = bar.add_task("ingest", total=None, name="")
            report = run_ingest(config, progress=lambda name: bar.update(task, advance=1, name=name),
                                on_total=lambda n: bar.update(task, total=n))
    except CtrlError as e:
        raise _fail(e) from None
    except KeyboardInterrupt:
        err.print("interrupted: the workspace is unchanged; parsed files are cached and the next run resumes")
        raise typer.Exit(code=130) from None
    for f in report.errors:
        err.print(f"[red]bad file:[/] {f.error}", highlight=False, soft_wrap=True)
    parts = [f"{report.count(s)} {s}" for s in ("ok", "unchanged", "skipped", "error") if report.count(s)]
    summary = f"{len(report.files)} files ({', '.join(parts) or 'none'}) in {report.elapsed_s:.1f}s"
    if report.changed:
        rows = ", ".join(f"{n} {t}" for t, n in report.table_rows.items())
        out.print(f"ingested {summary} -> {report.workspace} ({report.generation}): {rows}", highlight=False, markup=False)
    else:
        out.print(f"nothing changed: {summary}; workspace {report.workspace}", highlight=False)
    if report.errors:
        err.print(f"[bold red]{len(report.errors)} bad file(s)[/] recorded with status 'error' (see `ctrl status`)")
        raise typer.Exit(code=1)


@app.command()
def query(
    sql: Annotated[str, typer.Argument(help="SQL over the views samples, measurements, configs, files, groups.")],
    workspace: WorkspaceOption = None,
    output_format: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
    max_rows: Annotated[int, typer.Option("--max-rows", help="Rows shown by --format table (0 = all).", min=0)] = 50,
) -> None:
    """Run SQL over the workspace with DuckDB."""
    from pipeline import CtrlError, Workspace, run_query

    try:
        result = run_query(Workspace(workspace), sql)
    except CtrlError as e:
        raise _fail(e) from None
    if output_format is OutputFormat.csv:
        import pyarrow.csv as pacsv

        pacsv.write_csv(result, sys.stdout.buffer)
    elif output_format is OutputFormat.json:
        sys.stdout.write(json.dumps(result.to_pylist(), default=str, indent=1) + "\n")
    else:
        _print_arrow(result, max_rows)


def _print_arrow(result: Any, max_rows: int) -> None:
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
    from pipeline import CtrlError, Workspace, workspace_status

    try:
        summary = workspace_status(Workspace(workspace))
    except CtrlError as e:
        raise _fail(e) from None
    if as_json:
        sys.stdout.write(json.dumps(summary, default=str, indent=1) + "\n")
        return
    out.print(f"workspace {summary['workspace']} ({summary['generation']})  catalog: {summary['catalog']}", highlight=False, markup=False)
    sections = [("datasets", summary["datasets"]), ("configurations", summary["experiments"]), ("files", summary["files"])]
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
        out.print(f"{len(summary['missing_files'])} ingested file(s) no longer on disk (their rows are kept), "
                  f"e.g. {summary['missing_files'][0]}", highlight=False, markup=False)


@app.command("extract-features")
def extract_features(
    workspace: WorkspaceOption = None,
    images: Annotated[Path | None, typer.Option("--images", help="Directory searched (recursively) for images by image_id.",
                                                exists=True, file_okay=False)] = None,
    image_pattern: Annotated[str | None, typer.Option("--image-pattern", help="Extra file name pattern, e.g. '{dataset}/{image_id}.jpg'.")] = None,
    model: Annotated[str, typer.Option("--model", help="'embedded' (built offline from a seed) or a local checkpoint directory.")] = "embedded",
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Requests per forward pass.")] = 16,
    force: Annotated[bool, typer.Option("--force", help="Recompute features already cached for this model.")] = False,
) -> None:
    """Compute image and language features per sample once and cache them in the workspace."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from features import FeatureConfig
    from features import extract_features as run_extract
    from pipeline import CtrlError

    try:
        config = FeatureConfig(workspace=workspace, images_dir=images, image_pattern=image_pattern, model=model,
                               device=device, batch_size=batch_size, force=force)
        with Progress(TextColumn("features"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                      console=err, transient=True, disable=not err.is_terminal) as bar:
            task = bar.add_task("features", total=None, rate="")
            started = [0.0]

            def advance(n: int) -> None:
                import time

                started[0] = started[0] or time.perf_counter()
                bar.update(task, advance=n)
                done = bar.tasks[0].completed
                elapsed = time.perf_counter() - started[0]
                bar.update(task, rate=f"{done / elapsed:.1f} samples/s" if elapsed > 0 else "")

            report = run_extract(config, progress=advance, on_total=lambda n: bar.update(task, total=n))
    except CtrlError as e:
        raise _fail(e) from None
    except KeyboardInterrupt:
        err.print("interrupted: finished chunks are kept; the next run resumes")
        raise typer.Exit(code=130) from None
    out.print(f"features for {report.num_samples} samples (model {report.fingerprint[:16]}): {report.computed} computed, "
              f"{report.cached} already cached; {report.computed / max(report.elapsed_s, 1e-9):.1f} samples/s",
              highlight=False, markup=False)
    for label, ids in (("missing", report.missing_images), ("unreadable", report.unreadable_images)):
        unique = list(dict.fromkeys(ids))
        if unique:
            err.print(f"{len(unique)} {label} image(s), e.g. {', '.join(unique[:5])}: their image features are null",
                      highlight=False, markup=False)


@app.command()
def schema() -> None:
    """Print the workspace tables' schemas (columns, types, units) as Markdown."""
    from pipeline.schema import schemas_markdown

    sys.stdout.write(schemas_markdown() + "\n")


if __name__ == "__main__":
    app()
