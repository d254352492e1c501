"""``ctrl serve``: MolmoE over HTTP with the controller on the request path."""

from __future__ import annotations

from typing import Any

import typer

from cli.common import app, err, handled
from cli.options import config_parameters, with_parameters
from serve.config import ServeConfig


@app.command()
@with_parameters(config_parameters(ServeConfig))
def serve(**options: Any) -> None:
    """Serve the model over HTTP (OpenAI chat completions) with the controller choosing each request's
    knobs within its latency budget; every request is recorded in the workspace (view `requests`).
    SIGTERM or Ctrl-C drains the requests in flight and exits 0; a second one stops at once and exits 1."""
    from serve.startup import check_bind

    with handled(also=(ValueError,)):
        config = ServeConfig(**options)
        check_bind(config.host, config.port)
        # imported once the options are checked: the server pulls in torch, seconds that a bad option need not wait
        from serve.server import serve as run_server

        drained = run_server(config, log=lambda line: err.print(line, markup=False, highlight=False))
    if not drained:
        raise typer.Exit(1)
