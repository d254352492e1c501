"""The real model run with knobs, hook-measured latency; lands with issue #5."""
