"""What the machine can still give a process: read before a large allocation, so that what
cannot fit is refused with one line instead of ending in the kernel's OOM killer."""

from __future__ import annotations

from pathlib import Path

__all__ = ["host_available_bytes"]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_available_bytes() -> int | None:
    """Host memory a process can still take: ``MemAvailable`` of /proc/meminfo, lowered to the
    room left under the process's cgroup (v2) limit when there is one; None where unknown."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        entry = Path("/proc/self/cgroup").read_text().splitlines()
        group = next(line.split(":", 2)[2] for line in entry if line.startswith("0::"))
    except (OSError, StopIteration, IndexError):
        return available
    root = Path("/sys/fs/cgroup") / group.lstrip("/")
    limit, current = _read_int(root / "memory.max"), _read_int(root / "memory.current")
    if limit is not None and current is not None:
        room = max(limit - current, 0)
        available = room if available is None else min(available, room)
    return available
