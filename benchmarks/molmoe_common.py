"""What the MolmoE-1B benchmarks share (molmoe_full_size.py, gpu_check.py).

* the released config and tokenizer staged into one directory (:func:`stage_reference_files`);
* the random-weight checkpoint with that config, written once per stamp (:func:`write_checkpoint`);
* a load measured in a fresh process (:func:`measure_load`, run as
  ``python benchmarks/molmoe_common.py load CHECKPOINT DTYPE [DEVICE]``): time, the kernel's
  high-water mark of resident memory and, on a GPU, the allocator's peak;
* ``ctrl ARGS`` in a child process with its peak resident memory (:func:`ctrl_measured`), and any
  child with a time limit that takes its whole process group down when it runs over
  (:func:`run_child`).

Children import the repository's packages through ``PYTHONPATH`` (no ``pip install -e .``
needed), after any site directories of wheels installed with ``pip install --target``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = float(1 << 30)
#: where the released files sit in the reference folder (tests/molmoe_origin.py finds the folder)
REFERENCE_SUBDIRS = ("origin/configs/tokenizer", "origin/configs/model")


def child_env(site_dirs: Sequence[Path | str] = (), **extra: str) -> dict[str, str]:
    """The environment of a child that imports ctrl from this checkout (and ``site_dirs`` first)."""
    paths = [str(p) for p in site_dirs] + [str(ROOT)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **extra}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo): what every timing is quoted beside."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def stage_reference_files(reference: Path, dest: Path) -> Path:
    """Copy the released config.json, generation config, tokenizer and processor configs of the
    reference folder into ``dest`` (a checkpoint directory without weights)."""
    dest.mkdir(parents=True, exist_ok=True)
    for sub in REFERENCE_SUBDIRS:
        for source in sorted((reference / sub).iterdir()):
            shutil.copyfile(source, dest / source.name)
    return dest


def checkpoint_stamp(config: dict, seed: int, draw_device: str, max_shard_bytes: int = 5_000_000_000) -> str:
    """What identifies a written checkpoint: the config, the seed, where the values were drawn."""
    key = [config, seed, "bf16", max_shard_bytes] + ([] if draw_device == "cpu" else [draw_device])
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def write_checkpoint(out: Path, config: dict, source: Path, *, seed: int = 0, draw_device: str = "cpu",
                     log: Callable[[str], None] = print) -> dict:
    """A bfloat16 random-weight checkpoint of ``config`` at ``out`` (tokenizer and configs from
    ``source``), written unless the same one is there. Returns {"reused", "seconds", "files", "bytes"}."""
    import torch

    from synthetic.molmoe_checkpoint import write_random_checkpoint

    stamp = checkpoint_stamp(config, seed, draw_device)
    started = time.perf_counter()
    reused = (out / ".stamp").is_file() and (out / ".stamp").read_text() == stamp
    if not reused:
        last = [0.0]

        def progress(done: int, total: int) -> None:
            if time.perf_counter() - last[0] > 10 or done == total:
                last[0] = time.perf_counter()
                log(f"  wrote {done / 1e9:.1f} of {total / 1e9:.1f} GB")

        write_random_checkpoint(out, config, source, dtype=torch.bfloat16, seed=seed, progress=progress,
                                draw_device=draw_device)
        (out / ".stamp").write_text(stamp)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    return {"reused": reused, "seconds": time.perf_counter() - started, "files": files, "draw_device": draw_device,
            "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors"))}


def proc_status(key: str) -> int:
    """A byte count of this process from /proc/self/status (``VmRSS``, ``VmHWM``)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def measure_load(checkpoint: Path, dtype: str, device: str = "cpu"):
    """Load ``checkpoint`` in this (fresh) process; returns (runtime, figures) or (None, {"refused": ...}).

    Imports and, on a GPU, the CUDA context come before the timer: they are not the load's cost.
    Figures: seconds, weights_bytes, rss_before_bytes, peak_rss_bytes (the process's high-water
    mark), rss_after_bytes, fingerprint; on a GPU also the allocator's peak and what is free."""
    import safetensors  # noqa: F401  (imported before the timer)
    import torch
    import transformers  # noqa: F401

    from runtime import ModelLoadError
    from runtime.molmoe import MolmoERuntime

    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.zeros(1, device=device)
        torch.cuda.reset_peak_memory_stats(device)
    before = proc_status("VmRSS")
    started = time.perf_counter()
    try:
        runtime = MolmoERuntime(checkpoint, device=device, dtype=dtype)
    except ModelLoadError as exc:
        return None, {"refused": str(exc), "seconds": time.perf_counter() - started}
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    params = [p for m in (runtime.vision_backbone, runtime.decoder) for p in m.parameters()]
    figures = {"seconds": seconds, "weights_bytes": sum(p.numel() * p.element_size() for p in params),
               "rss_before_bytes": before, "peak_rss_bytes": proc_status("VmHWM"),
               "rss_after_bytes": proc_status("VmRSS"), "fingerprint": runtime.fingerprint,
               "device": str(runtime.device), "dtype": str(runtime.dtype).removeprefix("torch."),
               "param_devices": sorted({str(p.device.type) for p in params}),
               "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params})}
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        figures.update(gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
                       gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
                       gpu_allocated_bytes=torch.cuda.memory_allocated(device), gpu_free_bytes=free,
                       gpu_total_bytes=total)
    return runtime, figures


class ChildFailed(RuntimeError):
    """A child process exited non-zero or ran over its time limit; the message ends with its output's tail."""

    def __init__(self, what: str, returncode: int | None, output: str, timed_out: bool = False) -> None:
        self.returncode, self.output, self.timed_out = returncode, output, timed_out
        head = f"{what}: timed out" if timed_out else f"{what}: exit code {returncode}"
        super().__init__(f"{head}\n{tail_lines(output)}")


def tail_lines(text: str, lines: int = 15, chars: int = 3000) -> str:
    """The last ``lines`` lines of ``text`` (at most ``chars`` characters)."""
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


@dataclass
class ChildResult:
    output: str  # stdout and stderr, interleaved as written
    seconds: float


def run_child(argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float | None = None,
              what: str | None = None, cwd: Path = ROOT) -> ChildResult:
    """Run ``argv`` in its own process group; raise :class:`ChildFailed` when it fails or runs past
    ``timeout`` seconds (then the whole group is killed: torchrun's ranks, a server's workers)."""
    what = what or " ".join(str(a) for a in argv[:3])
    started = time.perf_counter()
    process = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env, cwd=cwd, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)
        output, _ = process.communicate()
        raise ChildFailed(what, None, output or "", timed_out=True) from None
    if process.returncode != 0:
        raise ChildFailed(what, process.returncode, output)
    return ChildResult(output, time.perf_counter() - started)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process group ``process`` leads (started with ``start_new_session``)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def last_json(output: str) -> dict:
    """The JSON object a child printed on its last line that parses as one."""
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    msg = f"no JSON result line in the output:\n{tail_lines(output)}"
    raise ValueError(msg)


#: ``ctrl ARGS`` with the process's own peak resident memory written to $PEAK_FILE at exit;
#: $CTRL_PRELUDE (Python source) runs first, e.g. to wrap a timer
CTRL_SCRIPT = r"""
import atexit, os, sys
from pathlib import Path

def peak():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
    Path(os.environ["PEAK_FILE"]).write_text(str(int(line.split()[1]) * 1024))

atexit.register(peak)
exec(os.environ.get("CTRL_PRELUDE", ""))
sys.argv = ["ctrl", *sys.argv[1:]]
from cli import app
app()
"""


def ctrl_measured(*args: str, env: dict[str, str] | None = None, timeout: float | None = None,
                  peak_dir: Path | None = None) -> dict:
    """``ctrl ARGS`` in a child process: wall time, its peak resident memory, its output (last lines
    in ``stdout``). Raises :class:`ChildFailed`."""
    peak_dir = peak_dir or ROOT / "benchmarks" / ".cache"
    peak_dir.mkdir(parents=True, exist_ok=True)
    peak_file = peak_dir / f"peak-{os.getpid()}-{time.monotonic_ns()}"
    done = run_child([sys.executable, "-c", CTRL_SCRIPT, *args], env={**(env or child_env()),
                     "PEAK_FILE": str(peak_file)}, timeout=timeout, what=f"ctrl {args[0]}")
    peak = int(peak_file.read_text()) if peak_file.is_file() else None
    peak_file.unlink(missing_ok=True)
    return {"seconds": done.seconds, "peak_rss_bytes": peak, "stdout": done.output.strip().splitlines()[-3:],
            "output": done.output}


def _main() -> None:
    if len(sys.argv) < 4 or sys.argv[1] != "load":
        sys.exit("usage: molmoe_common.py load CHECKPOINT DTYPE [DEVICE]")
    _, figures = measure_load(Path(sys.argv[2]), sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "cpu")
    print(json.dumps(figures))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _main()
