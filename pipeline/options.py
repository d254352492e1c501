"""A command's option, declared once: on the config field it sets.

:func:`option` makes a dataclass field whose metadata holds what the command line needs besides
the field's own name, type and default: the help text and, where the rule below does not give
them, the flags and checks. ``cli/options.py`` builds each command's options from these fields,
and docs/cli.md is generated from the commands, so an option's name, default, type and help are
written nowhere else. Plain data, no Typer: configs stay importable without the CLI.

Flags by rule: ``--field-name``; a bool is ``--field-name/--no-field-name``. ``flags`` replaces
the rule (``("--allow-remote",)``: a switch with no off form; ``("--images",)``: another name).
"""

from __future__ import annotations

from dataclasses import MISSING, field, fields
from typing import Any

#: the metadata keys :func:`option` writes besides ``help`` and ``shown_default``
CLI_KEYS = ("flags", "panel", "min", "max", "envvar", "metavar", "choices", "is_dir", "exists", "argument", "cli")

#: the workspace option's command-line form, the same in every command
WORKSPACE_CLI: dict[str, Any] = {"flags": ("--workspace", "-w"), "envvar": "CTRL_WORKSPACE", "is_dir": True}
#: its help where a command says nothing more
WORKSPACE_HELP = "Workspace directory (default: ./workspace)."


def option(default: Any = MISSING, *, help: str, default_factory: Any = MISSING,
           shown_default: str | None = None, flags: tuple[str, ...] | None = None, panel: str | None = None,
           min: float | None = None, max: float | None = None,
           envvar: str | None = None, metavar: str | None = None, choices: tuple[str, ...] | None = None,
           is_dir: bool | None = None,
           exists: bool = False, argument: bool = False, cli: bool = True) -> Any:
    """A config field with its help text and command-line form.

    ``shown_default``: how the help names a default that is not a plain value; ``panel``: the
    ``--help`` section; ``min``/``max``, ``choices``: checked as the command line is read (the
    config checks its values again); ``is_dir``: a path that must be a directory (True) or a file
    (False); ``exists``: it must exist; ``argument``: a positional argument; ``cli``: False for
    a field that no command line sets."""
    metadata = {"help": help, "shown_default": shown_default, "flags": flags, "panel": panel, "min": min,
                "max": max, "envvar": envvar, "metavar": metavar, "choices": choices, "is_dir": is_dir,
                "exists": exists, "argument": argument, "cli": cli}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def option_field(cls: type, name: str) -> Any:
    """The field ``name`` of config class ``cls``, which must carry a help text."""
    for f in fields(cls):
        if f.name == name:
            if "help" not in f.metadata:
                msg = f"{cls.__name__}.{name} has no help text"
                raise KeyError(msg)
            return f
    msg = f"{cls.__name__} has no field {name!r}"
    raise KeyError(msg)


def option_help(cls: type, name: str) -> str:
    """The help text of field ``name`` of the config class ``cls``."""
    return option_field(cls, name).metadata["help"]


def option_default(cls: type, name: str) -> Any:
    """The default of field ``name`` as the user sees it (``shown_default``, else the value; None
    for a field without a default)."""
    f = option_field(cls, name)
    if f.metadata.get("shown_default") is not None:
        return f.metadata["shown_default"]
    if f.default is MISSING:
        return f.default_factory() if f.default_factory is not MISSING else None
    return f.default


def flags_by_rule(name: str, is_bool: bool) -> tuple[str, ...]:
    """``--name``, and ``--name/--no-name`` for a bool (the rule the module docstring states)."""
    flag = "--" + name.replace("_", "-")
    return (f"{flag}/--no-{flag[2:]}",) if is_bool else (flag,)


def option_flags(cls: type, name: str) -> tuple[str, ...]:
    """The flags of field ``name`` of ``cls``: its ``flags``, else :func:`flags_by_rule`."""
    f = option_field(cls, name)
    if f.metadata.get("flags"):
        return tuple(f.metadata["flags"])
    return flags_by_rule(name, f.type in ("bool", bool))


def auto_or_count(flag: str, value: object) -> str:
    """An option that is "auto" or a positive integer, as its canonical text; ValueError naming
    ``flag`` otherwise."""
    text = str(value).strip().lower()
    if not isinstance(value, bool) and (text == "auto" or (text.isdigit() and int(text) >= 1)):
        return text if text == "auto" else str(int(text))
    msg = f"{flag} must be 'auto' or a positive integer, got {value!r}"
    raise ValueError(msg)
