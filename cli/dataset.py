"""The dataset commands: ``ctrl ingest``, ``query``, ``status``, ``doctor``, ``schema``."""

from __future__ import annotations

import json
import sys
import time
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from cli.common import WorkspaceOption, app, err, handled, out, running, say
from cli.options import config_parameters, with_parameters
from pipeline.ingest_config import IngestConfig

if TYPE_CHECKING:
    import pyarrow as pa


class OutputFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"


@app.command()
@with_parameters(config_parameters(IngestConfig))
def ingest(**options: Any) -> None:
    """Parse exp5/exp6/core_exp result trees into the workspace's Parquet tables."""
    from pipeline import ingest as run_ingest

    with running("ingest", interrupted="the workspace is unchanged; parsed files are cached and the next run resumes") \
            as bar:
        config = IngestConfig(**options)
        report = run_ingest(config, progress=lambda name: bar.advance(info=name), on_total=bar.total)
    for line in report.repaired:
        err.print(f"[yellow]repaired:[/] {line}", highlight=False, soft_wrap=True)
    for f in report.errors:
        err.print(f"[red]bad file:[/] {f.error}", highlight=False, soft_wrap=True)
    parts = [f"{report.count(s)} {s}" for s in ("ok", "unchanged", "skipped", "error") if report.count(s)]
    summary = f"{len(report.files)} files ({', '.join(parts) or 'none'}) in {report.elapsed_s:.1f}s"
    if report.changed:
        rows = ", ".join(f"{n} {t}" for t, n in report.table_rows.items())
        say(f"ingested {summary} -> {report.workspace} ({report.generation}): {rows}")
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
    say(f"workspace {summary['workspace']} ({summary['generation']})  catalog: {summary['catalog']}")
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
        say(f"{len(summary['missing_files'])} ingested file(s) no longer on disk (their rows are kept), "
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
    say(f"workspace {ws.root}: every table, cached parse, feature chunk, run file and the catalog check out, "
        f"their contents included (checked in {took})")


@app.command()
def schema() -> None:
    """Print the workspace tables' schemas (columns, types, units) as Markdown."""
    from pipeline.schema import schemas_markdown

    sys.stdout.write(schemas_markdown() + "\n")


