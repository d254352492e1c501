"""What ``ctrl serve`` refuses at startup, on the real CLI: each refusal is one line on stderr naming
the option (or the file) and the reason, exit 1, before the model loads; and the spellings it
accepts (an API key read with its newline, an IPv6 literal in brackets).

The servers that run serve the embedded model with the offline run of test_serve's workspace.
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import test_serve
from test_serve import STARTUP_S, request, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
#: the workspace with the trained controllers (test_serve's module fixture, taken here under this name)
trained_ws = test_serve.serve_ws
#: a refusal comes before the model loads; a run that got that far would have logged this
LOADING = "loading model"


def cores() -> int:
    """The CPUs this process may run on, read here apart from the code under test."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ctrl_serve(*args: str, timeout: float = 90.0) -> subprocess.CompletedProcess:
    """``ctrl serve ARGS`` in a fresh process, without the API key or workspace of the caller's environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("CTRL_API_KEY", "CTRL_WORKSPACE")}
    return subprocess.run([sys.executable, "-m", "cli", "serve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def refused(done: subprocess.CompletedProcess, *words: str) -> str:
    """The one line of a refusal before the model loaded, holding every one of ``words``."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1, done.stderr
    assert LOADING not in done.stderr and "Traceback" not in done.stderr and "╭" not in done.stderr
    assert lines[0].startswith("error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def embedded(tmp_path: Path, *args: str) -> list[str]:
    """The embedded model with an empty workspace: a run that got past startup would fail later, at 'latest'."""
    return ["--model", "embedded", "-w", str(tmp_path / "ws"), "--no-warmup", "--port", "0", *args]


# -- --threads ----------------------------------------------------------------------------------

def test_more_threads_than_cores_is_refused_before_the_model_loads(tmp_path):
    line = refused(ctrl_serve(*embedded(tmp_path, "--threads", "100000")), "--threads", "100000",
                   f"{cores()} CPU")
    assert line.endswith("(0 = torch's default, one per core)"), line


def test_the_thread_limit_is_the_cores_this_process_may_use():
    from serve.config import ServeConfig

    assert ServeConfig(threads=cores()).threads == cores()
    assert ServeConfig(threads=0).threads == 0
    with pytest.raises(ValueError, match=rf"^--threads {cores() + 1}: more than the {cores()} CPU"):
        ServeConfig(threads=cores() + 1)


# -- --api-key ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("key", "reason"), [
    ("sec ret", "' ' at position 4"),
    ("secret\x07", "'\\x07' at position 7"),
    ("clé", "'é' at position 3"),
])
def test_an_api_key_with_a_character_no_client_sends_is_refused(tmp_path, key, reason):
    line = refused(ctrl_serve(*embedded(tmp_path, "--api-key", key)), "--api-key", "visible ASCII", reason)
    assert key not in line  # the key itself is never printed


def test_the_api_key_loses_its_surrounding_whitespace_once_for_the_key_and_the_token():
    from serve.config import ServeConfig, normalize_api_key

    for written in (" secret\n", "secret\r\n", "\tsecret "):
        assert ServeConfig(api_key=written).api_key == "secret"
    assert normalize_api_key("  Bearer-token \n") == "Bearer-token"


def test_a_key_read_with_its_newline_accepts_the_key_and_refuses_another(trained_ws, tmp_path):
    _, ws, _ = trained_ws
    server = start_server(ws.root, tmp_path / "log.txt", "--controller", "offline-run", "--api-key", " secret\n")
    try:
        assert request(server, "GET", "/v1/models", headers={"Authorization": "Bearer secret"})[0] == 200
        assert request(server, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert request(server, "GET", "/v1/models")[0] == 401
        assert request(server, "GET", "/health")[0] == 200
    finally:
        stop_server(server)


# -- --host -------------------------------------------------------------------------------------

def ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_loopback_literal_serves_health(trained_ws, tmp_path, host):
    _, ws, _ = trained_ws
    log_path = tmp_path / "log.txt"
    args = [sys.executable, "-m", "cli", "serve", "--model", "embedded", "-w", str(ws.root), "--controller",
            "offline-run", "--host", host, "--port", "0", "--threads", "1", "--no-warmup"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, port = time.monotonic() + STARTUP_S, None
        while port is None:
            assert process.poll() is None, f"ctrl serve exited with {process.returncode}:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, log_path.read_text()
            # the printed URL puts the address in brackets, as a browser or curl takes it
            found = re.search(r"Uvicorn running on http://\[::1\]:(\d+)", log_path.read_text())
            port = int(found.group(1)) if found else None
            time.sleep(0.2)
        conn = http.client.HTTPConnection("::1", port, timeout=30)
        try:
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
        finally:
            conn.close()
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0, log_path.read_text()


def test_brackets_around_anything_but_an_ipv6_address_are_refused(tmp_path):
    refused(ctrl_serve(*embedded(tmp_path, "--host", "[127.0.0.1]")), "--host '[127.0.0.1]'", "IPv6")


def test_a_host_that_does_not_resolve_is_blamed_not_the_port(tmp_path):
    line = refused(ctrl_serve(*embedded(tmp_path, "--host", "no-such-host.invalid", "--allow-remote",
                                        "--api-key", "k", "--port", "8123")),
                   "--host 'no-such-host.invalid'", "does not resolve")
    assert "--port" not in line and "8123" not in line


# -- values the command line cannot convert -------------------------------------------------------

def test_a_port_that_is_not_a_number_is_one_line_and_exit_1(tmp_path):
    refused(ctrl_serve(*embedded(tmp_path), "--port", "abc"), "'--port'", "'abc'", "integer")


def test_local_images_that_is_a_file_is_one_line_and_exit_1(tmp_path):
    image = tmp_path / "image.png"
    image.write_bytes(b"not a directory")
    refused(ctrl_serve(*embedded(tmp_path, "--local-images", str(image))), "'--local-images'", str(image),
            "is a file")


def test_a_workspace_that_is_a_file_is_one_line_and_exit_1(tmp_path):
    ws_file = tmp_path / "ws-file"
    ws_file.write_text("")
    refused(ctrl_serve("--model", "embedded", "--no-warmup", "-w", str(ws_file)), "'--workspace'", str(ws_file),
            "is a file")


# -- the controller file --------------------------------------------------------------------------

def flip_a_tensor_byte(path: Path) -> str:
    """Flip one byte inside the largest stored tensor of a torch zip file; the member's name."""
    with zipfile.ZipFile(path) as archive:
        stored = [i for i in archive.infolist() if "/data/" in i.filename and i.compress_type == zipfile.ZIP_STORED]
    member = max(stored, key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[member.header_offset + 26:member.header_offset + 30])
    start = member.header_offset + 30 + name_len + extra_len
    data[start + member.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return member.filename


def damaged_controllers(ws, online_file: Path, tmp_path: Path) -> dict[str, tuple[str, Path]]:
    """kind -> (--controller value, the damaged file): a run directory's checkpoint, a checkpoint file,
    an online controller file and a file written by ``ctrl export``."""
    from controller.deploy import export_controller

    run_dir = tmp_path / "offline-run"
    shutil.copytree(ws.runs_dir / "offline-run", run_dir)
    exported = export_controller(ws, "offline-run", tmp_path / "exported.pt").path
    online = tmp_path / "online.pt"
    shutil.copy(online_file, online)
    best = run_dir / "checkpoints" / "best.pt"
    checkpoint = tmp_path / "best-copy.pt"
    shutil.copy(best, checkpoint)
    return {"run directory": (str(run_dir), best), "checkpoint": (str(checkpoint), checkpoint),
            "online file": (str(online), online), "exported": (str(exported), exported)}


def test_a_controller_file_that_fails_its_crc_is_refused_before_the_model_loads(trained_ws, tmp_path):
    _, ws, online_file = trained_ws
    for kind, (spec, path) in damaged_controllers(ws, online_file, tmp_path).items():
        member = flip_a_tensor_byte(path)
        done = ctrl_serve("--model", "embedded", "-w", str(ws.root), "--no-warmup", "--port", "0",
                          "--controller", spec, timeout=120)
        line = refused(done, str(path), member, "CRC")
        assert line.startswith(f"error: {path}: damaged"), (kind, line)


def test_an_intact_controller_file_passes_the_check(trained_ws, tmp_path):
    from serve.startup import check_controller_file

    _, ws, online_file = trained_ws
    for _, path in damaged_controllers(ws, online_file, tmp_path).values():
        check_controller_file(path)


def test_a_controller_file_cut_short_or_of_another_kind_is_refused_before_the_model_loads(trained_ws, tmp_path):
    _, ws, online_file = trained_ws
    cut = tmp_path / "cut.pt"
    whole = online_file.read_bytes()
    cut.write_bytes(whole[: len(whole) // 2])  # a copy interrupted halfway: the zip's directory is at its end
    other = tmp_path / "notes.pt"
    other.write_text("not a controller\n")
    for path in (cut, other):
        done = ctrl_serve("--model", "embedded", "-w", str(ws.root), "--no-warmup", "--port", "0",
                          "--controller", str(path), timeout=120)
        refused(done, str(path), "not a controller file")
