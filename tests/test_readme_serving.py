"""The README's front door, run as a new user would: its main job (after the install), then its
serving lines exactly as written against the server they start. Only the port changes (8000 may
be taken) and the workspace and model cache live in temporary directories."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the parts of the set-up command that make the environment this test already runs in
INSTALL_STEPS = ("python3 -m venv", ". .venv/bin/activate", "pip install")


def bash_blocks(after_heading: str) -> list[str]:
    """The fenced bash blocks of the README section under ``after_heading``."""
    text = README.read_text()
    section = text.split(f"\n## {after_heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def main_job_steps() -> list[str]:
    command = bash_blocks("Set up")[0].strip()
    return [step.strip() for step in command.split(" && ") if not step.strip().startswith(INSTALL_STEPS)]


def serving_lines() -> list[str]:
    return [line for line in bash_blocks("Serving")[0].splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_readme_names_a_main_job_and_three_serving_lines():
    steps = main_job_steps()
    assert steps[0] == "python data/generate.py" and any(s.startswith("ctrl train --online") for s in steps)
    lines = serving_lines()
    assert len(lines) == 3 and lines[0].startswith("ctrl serve ") and lines[1].startswith("curl ")


@pytest.fixture(scope="module")
def readme_env(tmp_path_factory) -> dict[str, str]:
    """The README's main job done in a temporary workspace and model cache (the sample data it
    generates goes where the README puts it, data/ of this checkout, as on a fresh clone)."""
    home = tmp_path_factory.mktemp("readme")
    env = {**os.environ, "CTRL_WORKSPACE": str(home / "workspace"), "CTRL_CACHE_DIR": str(home / "cache"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for step in main_job_steps():
        done = subprocess.run(["bash", "-c", step], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (f"{step!r} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                                      f"{done.stderr[-3000:]}")
    return env


@pytest.mark.skipif(shutil.which("curl") is None, reason="the README's request line uses curl")
def test_the_readmes_serving_lines_answer_right_within_budget(readme_env, tmp_path):
    port = free_port()
    serve_line, curl_line, openai_line = (line.replace("8000", str(port)) for line in serving_lines())
    serve_line = f"{serve_line.split('#')[0].strip()} --port {port}"  # the README's serves on the default 8000
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(["bash", "-c", f"exec {serve_line}"], cwd=ROOT, env=readme_env, stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"ctrl serve exited: {(tmp_path / 'serve.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "ctrl serve did not answer /health within 300 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as health:
                    if health.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        dataset = {s["image_id"]: s for s in json.loads((ROOT / "data" / "testbed" / "dataset.json").read_text())
                   ["samples"]}

        def expected(line: str) -> dict:
            image_id = re.search(r"images/([\w-]+)\.png", line).group(1)
            return dataset[image_id]

        curled = subprocess.run(["bash", "-c", curl_line], cwd=ROOT, env=readme_env, capture_output=True,
                                text=True, timeout=120)
        assert curled.returncode == 0, curled.stderr
        reply = json.loads(curled.stdout)
        sample = expected(curl_line)
        assert sample["question"] in curl_line
        choice = reply["choices"][0]
        assert choice["message"]["content"].strip() in sample["answers"], (choice, sample)
        assert choice["finish_reason"] == "stop" and reply["ctrl"]["met"] is True, reply["ctrl"]

        printed = subprocess.run(["bash", "-c", openai_line], cwd=ROOT, env=readme_env, capture_output=True,
                                 text=True, timeout=300)
        assert printed.returncode == 0, printed.stderr
        content, finish_reason, ctrl = re.fullmatch(r"('.*'|\".*\") (\w+) (\{.*\})\n", printed.stdout).groups()
        sample = expected(openai_line)
        assert ast.literal_eval(content).strip() in sample["answers"], (printed.stdout, sample)
        assert finish_reason == "stop" and ast.literal_eval(ctrl)["met"] is True, printed.stdout

        # the same server refuses the question without its image, naming what is missing
        text_only = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
            data=json.dumps({"model": "testbed", "messages": [{"role": "user", "content": sample["question"]}]
                             }).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(text_only, timeout=60)
        error = json.loads(refused.value.read())["error"]
        assert refused.value.code == 400 and error["code"] == "image_required"
        assert error["param"] == "messages[0].content" and "image" in error["message"]
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
