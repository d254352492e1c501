"""What every ``ctrl`` command shares: the app, its consoles, one-line errors, the progress bar,
and the options that several commands declare alike."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from typer.core import TyperGroup

from cli.options import choice_type
from pipeline.execution import DTYPE_CHOICES, EXECUTION_HELP
from pipeline.options import WORKSPACE_CLI, WORKSPACE_HELP


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


#: the base of Typer's usage errors: click's ClickException, or the copy of it Typer vendors (typer._click)
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _usage_error(error: Exception) -> Exception:
    """A usage error as one red line and exit 1 (:func:`fail`); a command given without its
    arguments (no_args_is_help) is left to print its help."""
    if type(error).__name__ == "NoArgsIsHelpError":
        return error
    errors = getattr(error.__cause__, "errors", None)
    if isinstance(error, typer.BadParameter) and callable(errors) and errors() and "input" in errors()[0]:
        error.message = f"{error.message} (got {errors()[0]['input']!r})"
    return fail(ValueError(" ".join(error.format_message().split())))


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
    typer.Option(*WORKSPACE_CLI["flags"], envvar=WORKSPACE_CLI["envvar"], help=WORKSPACE_HELP, show_default=False,
                 file_okay=False),
]
#: the values of ``--dtype`` as an option type
Dtype = choice_type(DTYPE_CHOICES, "dtype")
DtypeOption = Annotated[Dtype, typer.Option("--dtype", help=EXECUTION_HELP["dtype"])]


def say(text: str) -> None:
    """A result line on stdout, printed as is."""
    out.print(text, highlight=False, markup=False)


def fail(error: Exception) -> typer.Exit:
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
        raise fail(e) from None
    except OSError as e:  # a full or read-only disk, a permission: the file and the reason, not a traceback
        where = f"{e.filename}: " if e.filename else ""
        then = resume or "run the command again; what was finished is kept"
        raise fail(CtrlError(f"{where}{e.strerror or e}\nHint: free space or fix permissions, then: {then}.")) \
            from None
    except Exception as e:
        # a damaged file under a reader (Parquet, Arrow IPC, DuckDB): one line, and where to look
        if type(e).__module__.split(".")[0] not in ("pyarrow", "duckdb", "_duckdb", "polars"):
            raise
        raise fail(CtrlError(f"{describe(e, 1000)}\nHint: `ctrl doctor` checks the workspace's files "
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




def rate(samples: float, seconds: float) -> str:
    """Samples per second, or seconds per sample when a sample takes longer than a second (a
    full-size model on a CPU)."""
    if samples <= 0 or seconds <= 0:
        return "0 samples/s"
    per_second = samples / seconds
    return f"{per_second:.1f} samples/s" if per_second >= 1 else f"{seconds / samples:.1f} s/sample"
