"""``ctrl simulate``: a run's controller and the static configurations on simulated servers."""

from __future__ import annotations

from typing import Any

from cli.common import app, out, running, say
from cli.options import config_parameters, with_parameters
from simulate.config import SimulateConfig, SimulateOptionError


@app.command()
@with_parameters(config_parameters(SimulateConfig))
def simulate(**options: Any) -> None:
    """Simulate `ctrl serve` replicas under a workload, without the model: the server's own admission, queue,
    budget planner and controller on a virtual clock, each request's model time and score the profile's
    for an unseen sample at the configuration chosen. Prints the answer and a table per cell; writes the
    `simulations` view's rows (runs/<run>/simulations/)."""
    with running("simulate", also=(SimulateOptionError, ValueError)) as bar:
        config = SimulateConfig(**options)
        from simulate.report import answer_lines, cell_tables, plot_attainment
        from simulate.run import simulate as run_simulation

        result = run_simulation(config, progress=lambda done, total: bar.update(completed=done, total=total))
        plot = plot_attainment(result, config.plot) if config.plot is not None else None
    for line in answer_lines(result):
        say(line)
    for table in cell_tables(result):
        out.print(table)
    over = result.overheads
    say(f"run {result.run_id}: {len(result.profile)} unseen samples ({result.profile.split}); one replica's capacity "
        f"{result.capacity_rps:.3g} requests/s; latency scale {over.latency_scale:.2f}; service noise "
        f"{over.noise_sigma:.2f}; fixed costs from {over.source}"
        + (f" ({over.paired:,} of its {over.requests:,} requests paired with their profiled samples)"
           if over.paired else ""))
    say(f"written: {result.path}" + (f", {plot}" if plot is not None else ""))
