"""A real full disk for fault tests: a small tmpfs mounted over one directory, in a private
mount namespace (``unshare``: no root needed where user namespaces are allowed), so nothing
outside the test's own process tree ever sees it."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_UNSHARE = ["unshare", "--user", "--map-root-user", "--mount"]


@cache
def small_disk_available() -> bool:
    """Whether this machine lets an unprivileged process mount a tmpfs in its own namespace."""
    if shutil.which("unshare") is None or sys.platform != "linux":
        return False
    with tempfile.TemporaryDirectory() as probe:
        done = subprocess.run([*_UNSHARE, "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {shlex.quote(probe)}"],
                              capture_output=True, check=False)
    return done.returncode == 0


def on_small_disk(mount_point: Path, size: str, steps: list[str], timeout: float = 600) -> list[str]:
    """Mount a ``size`` tmpfs over ``mount_point`` and run the shell ``steps`` in order under it
    (``$CTRL`` runs the ctrl command; ``grow SIZE`` enlarges the disk). Returns, per step, what it
    printed on stdout and stderr followed by its exit code as a last line ``exit N``."""
    mount_point.mkdir(parents=True, exist_ok=True)
    quoted = shlex.quote(str(mount_point))
    lines = [
        "set -u",
        f"mount -t tmpfs -o size={size} tmpfs {quoted} || exit 99",
        f"grow() {{ mount -o remount,size=$1 {quoted}; }}",
        f"CTRL={shlex.quote(sys.executable + ' -m cli')}",
    ]
    for i, step in enumerate(steps):
        lines += [f"echo '--- step {i}'", f"{{ {step}\n}} 2>&1", "echo \"exit $?\""]
    done = subprocess.run([*_UNSHARE, "sh", "-c", "\n".join(lines)], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return [part.split("\n", 1)[1].strip() for part in done.stdout.split("--- step ")[1:]]
