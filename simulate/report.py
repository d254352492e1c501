"""What ``ctrl simulate`` prints (the answer in three lines, then a table per cell) and its plot."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from pipeline.workspace import atomic_path
from simulate.run import CellResult, SimulationResult, paired_difference


def _pct(value: float) -> str:
    return f"{100 * value:.1f} %"


def best_static(cells: list[CellResult]) -> CellResult | None:
    """The static decider with the most right answers within budget (its pick in hindsight: a ceiling for
    any one static configuration); with a target, the one needing the fewest replicas first."""
    statics = [c for c in cells if c.decider.static is not None]
    if not statics:
        return None
    return max(statics, key=lambda c: (bool(c.meets_target), -c.replicas if c.meets_target else 0,
                                       c.figures["right_within_budget"]))


def answer_lines(result: SimulationResult) -> list[str]:
    """The answer first: at the most loaded cell (the first budget mix there), the controller, the best
    static configuration, and the paired difference in right answers within budget (or, with a target,
    the replicas each needs)."""
    rate = max(c.rate_rps for c in result.cells)
    mix = next(c.budget_mix for c in result.cells if c.rate_rps == rate)
    cells = [c for c in result.cells if c.rate_rps == rate and c.budget_mix == mix]
    controller = next((c for c in cells if c.decider.static is None), None)
    static = best_static(cells)
    where = f"{rate:.3g} requests/s (load {cells[0].load:.2f}), budget {mix} ms"
    lines = []

    def line(cell: CellResult, label: str) -> str:
        f = cell.figures
        replicas = f"{cell.replicas} replica{'s' if cell.replicas != 1 else ''}"
        if result.target is not None:
            verb = "meet" if cell.meets_target else "do not meet"
            replicas = f"{replicas} {verb} {_pct(result.target)}"
        return (f"{label}: {_pct(f['within_budget'])} within budget [{_pct(f['within_budget_low'])}, "
                f"{_pct(f['within_budget_high'])}], accuracy {f['accuracy']:.3f}, {f['goodput_rps']:.3g} right "
                f"answers/s within budget ({replicas})")

    if controller is not None:
        lines.append(line(controller, f"At {where}, the controller"))
    if static is not None:
        lines.append(line(static, f"The best static, {static.decider.name.removeprefix('static:')}"))
    if controller is not None and static is not None and controller.replicas == static.replicas:
        mean, low, high = paired_difference(controller.requests, static.requests)
        lines.append(f"Controller minus best static, same requests: {100 * mean:+.1f} right answers within budget "
                     f"per 100 requests [{100 * low:+.1f}, {100 * high:+.1f}]")
    elif controller is not None and static is not None:
        lines.append(f"Replicas to meet {_pct(result.target)}: controller {controller.replicas}"
                     f"{'' if controller.meets_target else '+'}, best static {static.replicas}"
                     f"{'' if static.meets_target else '+'}")
    return lines


def cell_table(result: SimulationResult, rate: float, mix: str) -> Table:
    cells = [c for c in result.cells if c.rate_rps == rate and c.budget_mix == mix]
    table = Table(title=f"{rate:.3g} requests/s (load {cells[0].load:.2f}), budget {mix} ms, "
                        f"{len(cells[0].requests)} requests", title_justify="left")
    for name in ("decider", "replicas", "within budget", "accuracy", "right/s", "p50 ms", "p95 ms", "p99 ms",
                 "503", "504", "cheapest"):
        table.add_column(name, justify="left" if name == "decider" else "right")
    for c in sorted(cells, key=lambda c: -c.figures["right_within_budget"]):
        f = c.figures
        table.add_row(c.decider.name, f"{c.replicas}{'' if c.meets_target in (None, True) else '+'}",
                      _pct(f["within_budget"]), f"{f['accuracy']:.3f}", f"{f['goodput_rps']:.3g}",
                      f"{f['latency_p50_ms']:.0f}", f"{f['latency_p95_ms']:.0f}", f"{f['latency_p99_ms']:.0f}",
                      _pct(f["rejected_503"]), _pct(f["dropped_504"]), _pct(f["cheapest_share"]))
    return table


def cell_tables(result: SimulationResult) -> list[Table]:
    keys = list(dict.fromkeys((c.rate_rps, c.budget_mix) for c in result.cells))
    return [cell_table(result, rate, mix) for rate, mix in keys]


def plot_attainment(result: SimulationResult, path: Path) -> Path:
    """The within-budget share against the arrival rate, one line per decider (per budget mix), with the
    Wilson intervals as bands; written atomically."""
    import matplotlib  # the plot is the only user: not imported for a table

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    mixes = list(dict.fromkeys(c.budget_mix for c in result.cells))
    for mix in mixes:
        for name in dict.fromkeys(c.decider.name for c in result.cells):
            cells = sorted((c for c in result.cells if c.decider.name == name and c.budget_mix == mix),
                           key=lambda c: c.rate_rps)
            if not cells:
                continue
            x = [c.rate_rps for c in cells]
            label = name if len(mixes) == 1 else f"{name}, {mix} ms"
            width = 2.0 if name == "controller" else 1.0
            ax.plot(x, [c.figures["within_budget"] for c in cells], marker="o", markersize=3, linewidth=width,
                    label=label)
            ax.fill_between(x, [c.figures["within_budget_low"] for c in cells],
                            [c.figures["within_budget_high"] for c in cells], alpha=0.15)
    if result.target is not None:
        ax.axhline(result.target, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("share within budget")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"ctrl simulate: run {result.run_id}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return path
