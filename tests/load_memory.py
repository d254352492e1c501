"""A MolmoE load measured in a fresh process: its time and the resident memory it took.

Used by tests/test_molmoe_loading.py and benchmarks/bench_loading.py. The process imports
torch and transformers first, then resets the kernel's high-water mark of its resident memory
(``/proc/self/clear_refs``, Linux), loads, and reports the peak above that baseline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: argv: checkpoint, dtype ("-": a runtime without a dtype parameter, an older revision's)
_SCRIPT = r"""
import json, sys, time
from pathlib import Path
import safetensors, transformers  # loaded before the baseline: not the load's memory
from runtime.molmoe import MolmoERuntime
from runtime.molmoe_model import build_decoder, read_architecture

def status(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

arch, _ = read_architecture(Path(sys.argv[1]))
build_decoder(arch, 0, 1)  # transformers' lazy modules imported, on the meta device
Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
base = status("VmRSS")
started = time.perf_counter()
runtime = MolmoERuntime(sys.argv[1]) if sys.argv[2] == "-" else MolmoERuntime(sys.argv[1], dtype=sys.argv[2])
seconds = time.perf_counter() - started
weights = sum(p.numel() * p.element_size() for m in (runtime.vision_backbone, runtime.decoder) for p in m.parameters())
print(json.dumps({"seconds": seconds, "weights": weights, "peak": status("VmHWM") - base}))
"""


def measure_load(checkpoint: Path, dtype: str, tree: Path = REPO, env: dict[str, str] | None = None) -> dict:
    """{"seconds", "weights" (bytes held), "peak" (bytes above the baseline)} of loading ``checkpoint``
    in ``dtype`` with the code of ``tree``; raises RuntimeError with the child's stderr when it fails."""
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(checkpoint), dtype], capture_output=True, text=True,
                         env=full_env, cwd=tree, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])
