"""A command's options built from the config fields they set (``pipeline.options``).

:func:`config_parameters` reads a config class's fields (type, default, help, flags, checks) and
returns them as the parameters Typer reads; :func:`with_parameters` puts them on a command
function taking ``**options``, so that a command declares an option nowhere but on its field.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, fields
from enum import Enum
from typing import Annotated, Any, TypeVar

import typer

from pipeline.options import flags_by_rule

F = TypeVar("F", bound=Callable[..., Any])


def _cli_type(hint: Any) -> Any:
    """The type a command line gives a field: ``X | None`` stays; a sequence becomes a list
    (a repeatable option); of a union of several kinds, the first (``str | Sequence[Config]``:
    a string the config parses); a Literal a string."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin is typing.Literal:  # checked by the config, whose one-line message names the choices
        return str
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        inner = _cli_type(kinds[0])
        return inner | None if type(None) in args else inner
    if origin is not None and isinstance(origin, type) and issubclass(origin, Sequence) and origin is not str:
        return list[_cli_type(args[0])] if args else list[str]
    return hint


def config_parameters(cls: type, names: Iterable[str] | None = None, *, not_given: bool = False,
                      help_of: Callable[[str], str] | None = None,
                      field_of: dict[str, str] | None = None,
                      overrides: dict[str, dict[str, Any]] | None = None) -> list[inspect.Parameter]:
    """The command-line parameters of ``cls``'s fields (``names``: these, in this order; else
    every field a command line sets, in field order).

    ``not_given``: every default is None ("not given"; the config's own default applies later).
    ``field_of``: parameter name -> the field it sets, where they differ (the flag then follows
    the parameter's name); ``help_of``: the help per parameter instead of the field's;
    ``overrides``: per parameter, metadata replacing the field's (``pipeline.options.option``'s
    keys, and ``type``: the command-line type)."""
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in fields(cls)}
    field_of = field_of or {}
    if names is None:
        names = [f.name for f in fields(cls) if f.init and "help" in f.metadata and f.metadata.get("cli", True)]
    out: list[inspect.Parameter] = []
    for name in names:
        f = by_name[field_of.get(name, name)]
        meta = {**f.metadata, **(overrides or {}).get(name, {})}
        kind = meta.get("type") or _cli_type(hints[f.name])
        if meta.get("choices"):
            kind = choice_type(tuple(meta["choices"]), name)
        if not_given:
            default: Any = None
            kind = kind if typing.get_origin(kind) in (typing.Union, types.UnionType) else kind | None
        elif f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = inspect.Parameter.empty
        is_bool = kind is bool or set(typing.get_args(kind)) == {bool, type(None)}
        flags = tuple(meta["flags"]) if meta.get("flags") else flags_by_rule(name, is_bool)
        help_text = help_of(name) if help_of is not None else meta["help"]
        info = _option(meta, help_text=help_text, default=None if default is inspect.Parameter.empty else default,
                       flags=flags)
        out.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                     annotation=Annotated[kind, info]))
    return out


def _option(meta: dict[str, Any], *, help_text: str, default: Any, flags: tuple[str, ...]) -> Any:
    checks: dict[str, Any] = {k: meta[k] for k in ("min", "max", "envvar", "metavar") if meta.get(k) is not None}
    if meta.get("exists"):
        checks["exists"] = True
    if meta.get("is_dir") is not None:
        checks["file_okay"], checks["dir_okay"] = not meta["is_dir"], bool(meta["is_dir"])
    if meta.get("panel"):
        checks["rich_help_panel"] = meta["panel"]
    if meta.get("argument"):
        return typer.Argument(help=help_text, show_default=default is not None, **checks)
    return typer.Option(*flags, help=help_text, show_default=default is not None, **checks)


@functools.cache
def choice_type(choices: tuple[str, ...], name: str) -> type[Enum]:
    """The option type of a field with ``choices`` (Typer checks an Enum's values; the command
    function gets the value itself, see :func:`with_parameters`)."""
    return Enum(name.title().replace("_", ""), {c: c for c in choices}, type=str)  # type: ignore[return-value]


def with_parameters(*groups: Sequence[inspect.Parameter]) -> Callable[[F], F]:
    """Give a command function taking ``**options`` the parameters of ``groups`` after its own;
    a choice arrives as its value (a str), not as the Enum member Typer checked it with."""
    def wrap(func: F) -> F:
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(func, eval_str=True).parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD]
        extra = [p for group in groups for p in group]

        @functools.wraps(func)
        def command(**given: Any) -> Any:
            return func(**{k: v.value if isinstance(v, Enum) and k in generated else v for k, v in given.items()})

        generated = {p.name for p in extra}
        command.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
        return command  # type: ignore[return-value]

    return wrap

