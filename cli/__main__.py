"""``python -m cli``: the ``ctrl`` command (what torchrun runs: ``torchrun ... -m cli extract-features``)."""

from cli import app

app()
