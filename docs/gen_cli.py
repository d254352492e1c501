"""Write docs/cli.md from the ``ctrl`` command itself: every command, its description and its options.

    python docs/gen_cli.py           # rewrite docs/cli.md
    python docs/gen_cli.py --check   # exit 1 when docs/cli.md differs from the CLI

The page is read off the Typer app in cli/ (``typer.main.get_command``), so an option's flag,
default and help are written once, where the option is declared; tests/test_docs.py fails when the
committed page is stale. Nothing here is imported by the package: cli/ stays the top of the flow.
"""

from __future__ import annotations

import re
import sys
from enum import Enum
from pathlib import Path
from typing import Any

import typer
import typer.main

DOC = Path(__file__).resolve().parent / "cli.md"
NO_PANEL = "Options"

HEADER = """\
# Command reference: `ctrl`

<!-- Generated from cli/ by `python docs/gen_cli.py`; do not edit by hand. -->

Every command and option of `ctrl`, generated from the command's own definitions in `cli/`.
After changing a command or an option, regenerate this page with `python docs/gen_cli.py` and
commit it; `tests/test_docs.py` fails while it is stale. `ctrl COMMAND --help` prints the same.

Exit codes: 0 success; 1 a user error (one red line on stderr, with a `Hint:` where there is a
fix), a bad command line included (an unknown option, a value that does not convert, a file where
a directory is expected), or, for `ingest`, at least one bad file; 2 `ctrl` or `ctrl testbed` given
no command (it prints its help); 130 interrupted (what is kept is said on stderr).
`--workspace/-w` defaults to `$CTRL_WORKSPACE`, else `./workspace`.
"""


def _cell(text: Any) -> str:
    """One Markdown table cell: a single line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _paragraphs(text: str | None) -> list[str]:
    return [" ".join(p.split()) for p in (text or "").split("\n\n") if p.strip()]


def _default(param: Any) -> str:
    """The default as a user types it, or '' where there is none to show."""
    value = param.default
    if getattr(param, "show_default", None) is False or value is None or callable(value):
        return ""
    if getattr(param, "is_flag", False):
        if param.secondary_opts:  # --x/--no-x: name the side that is on by default
            return f"`{param.opts[0] if value else param.secondary_opts[0]}`"
        return "on" if value else ""
    if isinstance(value, (list, tuple)):
        return ", ".join(f"`{v.value if isinstance(v, Enum) else v}`" for v in value)
    return f"`{value.value if isinstance(value, Enum) else value}`"


def _flag(param: Any, ctx: typer.Context) -> str:
    """Flags and value as ``ctrl COMMAND --help`` shows them."""
    record = param.get_help_record(ctx)
    if not record:
        return ""
    flags = re.sub(r"<list\[(\w+)\]>", lambda m: f"<{m.group(1).lower()}>", record[0]).replace(" range>", ">")
    return f"`{_cell(flags)}`"


def _help(param: Any) -> str:
    text = param.help or ""
    parts = [text]
    if getattr(param, "multiple", False) and param.param_type_name == "option" and "repeatable" not in text.lower():
        parts.append("Repeatable.")
    if param.required:
        parts.append("Required.")
    if param.envvar and param.envvar not in text:
        parts.append(f"Env: `{param.envvar}`.")
    return _cell(" ".join(p for p in parts if p))


def _usage(path: list[str], command: Any) -> str:
    pieces = [*path, "[OPTIONS]"]
    for param in command.params:
        if param.param_type_name == "argument" and not param.hidden:
            name = param.name.upper() + ("..." if param.nargs == -1 else "")
            pieces.append(name if param.required else f"[{name}]")
    return " ".join(pieces)


def _command_markdown(path: list[str], command: Any, ctx: typer.Context) -> list[str]:
    lines = [f"## {' '.join(path)}", "", f"`{_usage(path, command)}`", ""]
    lines += [p for paragraph in _paragraphs(command.help) for p in (paragraph, "")]
    arguments = [p for p in command.params if p.param_type_name == "argument" and not p.hidden]
    if arguments:
        lines += ["| argument | help |", "|---|---|"]
        lines += [f"| `{p.name.upper()}` | {_help(p)} |" for p in arguments]
        lines.append("")
    panels: dict[str, list[Any]] = {}
    for p in command.params:
        if p.param_type_name == "option" and not p.hidden:
            panels.setdefault(getattr(p, "rich_help_panel", None) or NO_PANEL, []).append(p)
    for panel in sorted(panels, key=lambda name: name != NO_PANEL):  # stable: the rest in declaration order
        if len(panels) > 1:
            lines += [f"*{panel}*", ""]
        lines += ["| flag | default | help |", "|---|---|---|"]
        lines += [f"| {_flag(p, ctx)} | {_default(p)} | {_help(p)} |" for p in panels[panel]]
        lines.append("")
    return lines


def _walk(command: Any, path: list[str], ctx: typer.Context) -> list[str]:
    if not hasattr(command, "list_commands"):
        return _command_markdown(path, command, ctx)
    lines: list[str] = []
    for name in command.list_commands(ctx):
        sub = command.get_command(ctx, name)
        if sub is None or sub.hidden:
            continue
        sub_ctx = typer.Context(sub, info_name=name, parent=ctx)
        if hasattr(sub, "list_commands"):
            lines += [f"## {' '.join([*path, name])}", ""]
            lines += [p for paragraph in _paragraphs(sub.help) for p in (paragraph, "")]
            lines.append("Subcommands: " + ", ".join(f"`{' '.join([*path, name, n])}`"
                                                     for n in sub.list_commands(sub_ctx)) + ".")
            lines.append("")
        lines += _walk(sub, [*path, name], sub_ctx)
    return lines


def cli_markdown() -> str:
    """The text of docs/cli.md, generated from the Typer app in cli/."""
    import cli  # the top of the flow; imported here so that importing this file stays cheap

    group = typer.main.get_command(cli.app)
    ctx = typer.Context(group, info_name="ctrl")
    names = [n for n in group.list_commands(ctx) if not group.get_command(ctx, n).hidden]
    index = ["| command | what it does |", "|---|---|"]
    for name in names:
        sub = group.get_command(ctx, name)
        summary = (_paragraphs(sub.help) or [""])[0]
        index.append(f"| [`ctrl {name}`](#ctrl-{name}) | {_cell(summary)} |")
    body = _walk(group, ["ctrl"], ctx)
    return "\n".join([HEADER, *index, "", *body]).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    text = cli_markdown()
    if "--check" in argv:
        if DOC.read_text() != text:
            print(f"{DOC} is stale: run `python docs/gen_cli.py`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
