"""``ctrl extract-features``: the image and language features of every sample, cached."""

from __future__ import annotations

from typing import Any

from cli.common import app, err, rate, running, say
from cli.options import config_parameters, with_parameters
from features import config as feature_config


@app.command("extract-features")
@with_parameters(config_parameters(feature_config.FeatureConfig))
def extract_features(**options: Any) -> None:
    """Compute image and language features per sample once and cache them in the workspace.

    Several GPUs: torchrun --nproc-per-node N -m cli extract-features ... (the same cache as one process)."""
    import os
    import time

    from features import FeatureConfig
    from features import extract_features as run_extract
    from runtime.distributed import current_dist

    # under torchrun, rank 0 shows the progress and reports
    with running("features", interrupted="finished chunks are kept; the next run resumes",
                 resume="the same command again resumes (finished chunks are kept)",
                 show=os.environ.get("RANK", "0") == "0") as bar:
        config = FeatureConfig(**options)
        started: list[float] = []

        def advance(n: int) -> None:
            started[:] = started or [time.perf_counter()]
            elapsed = time.perf_counter() - started[0]
            bar.advance(n, info=rate(bar.completed + n, elapsed) if elapsed > 0 else "")

        report = run_extract(config, progress=advance, on_total=bar.total)
    if current_dist().rank != 0:
        return
    say(f"features for {report.num_samples} samples (model {report.fingerprint[:16]}): {report.computed} computed, "
        f"{report.cached} already cached; {rate(report.computed, report.elapsed_s)}")
    for label, ids in (("missing", report.missing_images), ("unreadable", report.unreadable_images)):
        unique = list(dict.fromkeys(ids))
        if unique:
            err.print(f"{len(unique)} {label} image(s), e.g. {', '.join(unique[:5])}: their image features are null",
                      highlight=False, markup=False)

