"""The ``ctrl`` command: one module per command group, each thin (parse options, build a config,
call one library function, print).

An option is declared on the config field it sets (``pipeline.options``) and built into the
command by ``cli.options``. The stages run inside the commands: pipeline pulls in pyarrow, the
trainer and the runtime torch and transformers (seconds), and ``ctrl --help`` or ``ctrl query``
must not pay for what they do not run; the configs the options are read from import neither.
"""

from importlib import import_module

from cli.common import app

#: the command modules, in the order ``ctrl --help`` lists their commands (importing one registers them)
COMMAND_MODULES = ("dataset", "features", "train", "evaluate", "serve", "simulate", "profile", "testbed")
for _module in COMMAND_MODULES:
    import_module(f"cli.{_module}")

__all__ = ["app"]
