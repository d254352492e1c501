"""``ctrl profile``: measure a model's knob sweep into exp5/exp6 trees."""

from __future__ import annotations

from typing import Any

from cli.common import app, running, say
from cli.options import config_parameters, with_parameters
from profiler.config import ProfileConfig


@app.command()
@with_parameters(config_parameters(ProfileConfig))
def profile(**options: Any) -> None:
    """Measure the knob sweep of a model on VQA datasets and write exp5/exp6 result trees (read them with
    `ctrl ingest`)."""
    from profiler.sweep import format_report, profile_model
    from runtime.distributed import current_dist

    with running("profile", interrupted="finished configurations and rank files are kept; the same command resumes") \
            as bar:
        config = ProfileConfig(**options)
        bar.update(info="loading the model")
        report = profile_model(config, progress=lambda n, label: bar.advance(n, info=label), on_total=bar.total)
    if current_dist().rank != 0:  # under torchrun, rank 0 merged and reports
        return
    for line in format_report(report):
        say(line)
    say(f"{report.measured} generations measured in {report.measure_s:.1f}s "
        f"({report.per_minute:.1f} configuration x samples per minute), model {report.model_fingerprint[:16]}; "
        f"next: ctrl ingest {report.out_dir}")


