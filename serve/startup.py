"""The startup checks of ``ctrl serve`` that read the machine rather than the options: the host
resolves and can be bound, the port is free, the controller file is intact. Each refusal is one
line, raised before the model loads.

Imports nothing heavy: the CLI runs :func:`check_bind` before it imports the server (torch).
"""

from __future__ import annotations

import errno
import socket
import zipfile
import zlib
from pathlib import Path

from pipeline.errors import CtrlError


def bind_addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, tuple]]:
    """The addresses uvicorn binds for ``host``: asyncio's ``create_server`` binds every address
    ``getaddrinfo`` gives for a passive stream socket. A host that does not resolve is a ``ValueError``
    naming ``--host``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        msg = f"--host {host!r} does not resolve to an address ({reason})"
        raise ValueError(msg) from None
    return list(dict.fromkeys((family, address) for family, _, _, _, address in infos))


def check_bind(host: str, port: int) -> None:
    """Refuse (``ValueError``, one line) a host that does not resolve or is no address of this
    machine, and a port something already listens on. Binds each address as uvicorn will, then
    lets it go."""
    for family, address in bind_addresses(host, port):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
            if family == socket.AF_INET6:  # as asyncio binds: [::] does not also take 0.0.0.0
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                where = f"[{address[0]}]:{port}" if family == socket.AF_INET6 else f"{address[0]}:{port}"
                if exc.errno == errno.EADDRNOTAVAIL:
                    msg = f"--host {host!r}: cannot listen on {where} ({exc.strerror}): not an address of this machine"
                elif exc.errno == errno.EACCES:
                    msg = f"--port {port}: cannot listen on {where} ({exc.strerror}): choose a port this user may bind"
                else:
                    msg = (f"--port {port}: cannot listen on {where} ({exc.strerror}); another server may hold it: "
                           "stop it or choose another port (--port 0 picks a free one)")
                raise ValueError(msg) from None


def check_controller_file(path: Path) -> None:
    """Refuse (``CtrlError``, one line naming the file) a controller file whose zip members do not
    match their CRC-32. A checkpoint and an exported controller are zip files, and neither
    ``torch.load`` nor ``torch.jit.load`` checks the CRCs: a flipped byte in a weight would load
    and decide without a word. A file that is not a zip (a copy cut short loses the zip's directory,
    at its end) is no controller either."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        msg = (f"{path}: not a controller file: not the zip archive torch writes (a copy cut short, or another "
               "kind of file); copy, export or train the controller again")
        raise CtrlError(msg)
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every member: a controller is kilobytes to a few megabytes
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        msg = f"{path}: damaged: its zip structure cannot be read ({exc}); copy, export or train the controller again"
        raise CtrlError(msg) from None
    if bad is not None:
        msg = (f"{path}: damaged: its zip member {bad!r} fails its CRC check (changed since it was written); "
               "copy, export or train the controller again")
        raise CtrlError(msg)
