"""benchmarks/gpu_check.py: its CPU dry run (every step of the GPU check on the tiny checkpoint)
and the helpers it stands on (the wheel staging and install, the missing-module line, the clock
agreement, the parity rule)."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402  (beside the benchmarks, not a package)
import gpu_check_child  # noqa: E402
import gpu_check_prepare  # noqa: E402
from gpu_check_figures import agreement, budget_summary  # noqa: E402

from synthetic.molmoe_checkpoint import write_random_checkpoint  # noqa: E402

CORNERS = {"2/4/12", "2/8/16", "10/4/12", "10/8/16"}


# -- the CPU dry run ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dry_run(tiny_molmoe_dir: Path, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gpu-check")
    staged, out = root / "staged", root / "out"
    prepared = subprocess.run([sys.executable, BENCHMARKS / "gpu_check.py", "--prepare", staged, "--no-wheels",
                               "--tiny-from", tiny_molmoe_dir], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert prepared.returncode == 0, prepared.stderr
    done = subprocess.run([sys.executable, BENCHMARKS / "gpu_check.py", "--device", "cpu", "--tiny", "--staged", staged,
                           "--work", root / "work", "--out", out], capture_output=True, text=True, cwd=ROOT,
                          timeout=1500)
    result = json.loads((out / "gpu_check.json").read_text())
    return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr, "json": result,
            "log": (out / "gpu_check.log").read_text(), "staged": staged}


def test_every_step_of_the_dry_run_succeeds(dry_run):
    steps = dry_run["json"]["steps"]
    failed = {name: r.get("error") or r.get("reason") for name, r in steps.items() if r["status"] != "ok"}
    assert failed == {}, dry_run["stdout"][-3000:]
    assert list(steps) == [s.name for s in gpu_check.STEPS]
    assert dry_run["returncode"] == 0
    assert dry_run["json"]["summary"]["ok"] == list(steps)
    install = steps["install"]  # no wheels staged, every module importable here
    assert install["wheels"] == [] and install["missing_line"] is None and not any(install["imports"].values())
    # one line per step on stdout, every child's output in the log
    for name in steps:
        assert f"{name}: ok in " in dry_run["stdout"]
    for child in ("----- load -----", "----- parity -----", "----- ctrl profile", "----- ctrl serve -----",
                  "----- torchrun extract-features -----"):
        assert child in dry_run["log"]


def test_the_staged_folder_holds_the_released_and_the_tiny_config(dry_run):
    staged = dry_run["staged"]
    released = json.loads((staged / "molmoe" / "config.json").read_text())
    assert released["d_model"] == 2048 and released["n_layers"] == 16 and released["moe_num_experts"] == 64
    assert json.loads((staged / "tiny" / "config.json").read_text())["d_model"] == 64
    assert (staged / "molmoe" / "tokenizer.json").is_file()
    manifest = json.loads((staged / "manifest.json").read_text())
    assert manifest["wheels"] == {} and "molmoe/tokenizer.json" in manifest["files"]


def test_the_load_figures(dry_run):
    load = dry_run["json"]["steps"]["load"]
    assert load["param_devices"] == ["cpu"] and load["param_dtypes"] == ["bfloat16"]
    assert load["weights_bytes"] > 0 and load["peak_rss_bytes"] >= load["rss_before_bytes"] > 0
    assert "host memory is free" in load["memory_check_refusal"]
    assert load["generate"]["tokens"] >= 1 and load["generate"]["total_ms"] > 0
    assert not load["targets"]["gpu_peak_over_weights"]["applies"]  # a tiny model on a CPU


def test_the_speed_figures_cover_every_configuration_on_both_paths(dry_run):
    speed = dry_run["json"]["steps"]["speed"]
    assert [f"{r['max_crops']}/{r['top_k']}/{r['num_active_blocks']}" for r in speed["rows"]] == \
        gpu_check.SPEED_CONFIGS.split(",")
    for row in speed["rows"]:
        for path in ("eager", "fast"):
            figures = row[path]
            assert figures["total_ms"] > figures["prefill_ms"] > 0 and figures["vision_ms"] > 0
            assert figures["host_step_ms"] > 0 and figures["tokens"] >= 1
            assert figures["gpu_peak_over_weights_bytes"] is None  # no GPU
    # one request per image case of the parity check, the two paths' logits compared
    assert len(speed["fast_vs_eager"]) == len(gpu_check_child.PARITY_CASES)
    assert all(c["max_abs_diff"] < c["logit_scale"] for c in speed["fast_vs_eager"])
    assert speed["graphs"] == 0 and speed["fast_memory_bytes"]["kv_cache"] > 0  # a CPU captures nothing
    assert not any(t["applies"] for t in speed["targets"].values())  # a tiny model on a CPU
    assert set(speed["knob_costs"]) == {"eager", "fast"}


def test_the_parity_rule_holds_with_the_cpu_as_its_own_device(dry_run):
    parity = dry_run["json"]["steps"]["parity"]
    assert parity["holds"] and parity["broken"] == []
    assert len([c for c in parity["cases"] if c["case"].startswith("logits")]) == 4
    assert len([c for c in parity["cases"] if c["case"].startswith("image feature")]) == 3
    for case in parity["cases"]:
        # the rounding is real (W and A differ) and, on a dry run, N is A itself
        assert case["their_max"] > 0 and case["our_mean"] == case["their_mean"] and case["between_mean"] == 0
        assert case.get("same_greedy_tokens") is None  # compared on a GPU only


def test_the_profile_times_every_request_with_both_clocks(dry_run):
    profile = dry_run["json"]["steps"]["profile"]
    assert set(profile["configs"]) == CORNERS
    assert all(c["requests"] == gpu_check.NUM_SAMPLES for c in profile["configs"].values())
    compared = profile["agreement"]
    assert compared["requests"] == 4 * gpu_check.NUM_SAMPLES and compared["compared_with"] == "host_clock"
    assert profile["events_match_files"]  # the totals the wrapper saw are the ones in the exp6 files
    assert all(t["event_ms"] is None and t["wall_ms"] > 0 for t in profile["timed_requests"])
    assert profile["recorded_device"] == ["cpu"] and profile["recorded_dtype"] == ["bfloat16"]


def test_features_in_one_process_and_under_torchrun(dry_run):
    steps = dry_run["json"]["steps"]
    assert steps["features"]["summary"].startswith(f"features for {gpu_check.NUM_SAMPLES} samples")
    torchrun = steps["features_torchrun"]
    assert torchrun["backend"] == "gloo" and torchrun["ranks"] == 2
    assert f"{gpu_check.NUM_SAMPLES} computed" in torchrun["summary"]  # --force: every sample again


def test_online_training_ran_two_steps_of_timed_rollouts(dry_run):
    online = dry_run["json"]["steps"]["train_online"]
    assert len(online["steps"]) == 2 and online["rollouts"] >= 4  # 2 steps x a group of 2
    assert online["rollout_latency_ms_median"]["latency_total_ms"] > 0
    assert online["dtype"] == "bfloat16" and online["device"] == "cpu"
    low, high = online["budget_range_ms"]
    assert 0 < low < high


def test_the_server_answered_every_request_and_drained(dry_run):
    serve = dry_run["json"]["steps"]["serve"]
    assert serve["requests"] == gpu_check.NUM_REQUESTS and serve["exit_code_on_sigterm"] == 0
    budgets = dry_run["json"]["budgets_ms"]
    assert len(budgets) == 2 and budgets[0] < budgets[1]
    assert sorted(s["requests"] for s in serve["per_budget"].values()) == [25, 25]
    scale = serve["latency_scale"]
    assert scale["source"] == "measured" and scale["settled"] > 0  # an offline run records reference latencies
    assert serve["controller"] == gpu_check.OFFLINE_RUN
    assert any("ctrl_latency_scale" in line for line in serve["metrics"])


def test_a_missing_staged_folder_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, BENCHMARKS / "gpu_check.py", "--staged", tmp_path / "none", "--out",
                           tmp_path / "out"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--prepare" in done.stderr


# -- what a step needs -----------------------------------------------------------------------------

def check_with(modules: dict[str, str | None], tmp_path: Path) -> gpu_check.Check:
    args = argparse.Namespace(device="cpu", tiny=True, staged=tmp_path, out=tmp_path / "out", work=tmp_path / "w",
                              num_requests=1, draw_device=None, deadline_s=None, steps=None)
    check = gpu_check.Check(args)
    check.modules = modules
    return check


def test_a_step_whose_module_does_not_import_is_skipped_with_the_reason(tmp_path):
    check = check_with({"duckdb": "ModuleNotFoundError: No module named 'duckdb'", "polars": None}, tmp_path)
    steps = {s.name: s for s in gpu_check.STEPS}
    assert check.blocked(steps["ingest"]) == "cannot import duckdb (ModuleNotFoundError: No module named 'duckdb')"
    assert check.blocked(steps["write"]) is None and check.blocked(steps["parity"]) is None
    check.results["steps"]["ingest"] = {"status": "skipped"}
    assert check.blocked(steps["features"]) == "needs step ingest, which was skipped"
    check.results["steps"]["ingest"] = {"status": "ok"}
    check.modules = {}  # no install step ran: nothing is known to be missing
    assert check.blocked(steps["features"]) is None
    check.fatal = "CUDA is not available here"
    assert check.blocked(steps["write"]) == "CUDA is not available here"


def test_the_missing_line_names_the_modules_the_steps_and_the_fix():
    needed_by = {"duckdb": ["ingest", "features", "serve"], "polars": ["train_offline", "serve"]}
    order = [s.name for s in gpu_check.STEPS]
    line = gpu_check_prepare.missing_line({"polars": "ModuleNotFoundError: No module named 'polars'",
                                           "duckdb": "ImportError: bad"}, needed_by, Path("/x/.gpu_check"), order)
    assert line == ("missing: duckdb, polars (duckdb: ImportError: bad; polars: ModuleNotFoundError: No module named "
                    "'polars'); skipped: ingest, features, train_offline, serve. Stage the wheels beside the code "
                    "with `python benchmarks/gpu_check.py --prepare .gpu_check` and carry .gpu_check")
    assert "\n" not in line
    assert gpu_check_prepare.missing_line({}, needed_by, Path(".gpu_check"), order) == ""


# -- figures ---------------------------------------------------------------------------------------

def test_agreement_flags_requests_off_by_more_than_the_tolerance():
    timed = [{"hook_total_ms": 100.0, "event_ms": 100.5, "wall_ms": 101.0},
             {"hook_total_ms": 50.0, "event_ms": 40.0, "wall_ms": 50.2},  # 25 % over the events
             {"hook_total_ms": 20.0, "event_ms": 21.0, "wall_ms": 21.0}]
    got = agreement(timed)
    assert got["compared_with"] == "cuda_events" and got["flagged"] == [1] and not got["agree"]
    assert got["hook_over_event_max_deviation"] == pytest.approx(0.25)
    assert agreement(timed[::2])["agree"]
    host = agreement([{"hook_total_ms": 10.0, "event_ms": None, "wall_ms": 10.5}])
    assert host["compared_with"] == "host_clock" and host["agree"] and host["hook_over_event_median"] is None
    assert not agreement([])["agree"]


def test_budget_summary_counts_per_budget():
    def row(budget, met, total, knobs=(2, 4, 12), by="controller"):
        return {"budget_ms": budget, "met": met, "latency_ms": {"total": total, "model": total / 2},
                "knobs": dict(zip(("max_crops", "top_k", "num_active_blocks"), knobs)), "decided_by": by}

    got = budget_summary([row(100, True, 80), row(100, False, 120), row(300, True, 200, (10, 8, 16), "table")])
    assert got["100"]["requests"] == 2 and got["100"]["met_share"] == 0.5
    assert got["100"]["latency_total_ms_median"] == 100 and got["100"]["latency_total_ms_p90"] == 120
    assert got["300"]["knobs"] == {"10/8/16": 1} and got["300"]["decided_by"] == {"table": 1}


def stats(**change: float) -> dict:
    """Figures of one comparison, exactly representable: A's mean error 1, its largest 4, logits up to 100."""
    return {"their_mean": 1.0, "their_max": 4.0, "our_mean": 1.0, "our_max": 4.0, "between_mean": 1.0,
            "exact_max": 100.0, **change}


@pytest.mark.parametrize(("change", "broken"), [
    ({}, None),
    ({"our_mean": 1.25, "our_max": 8.0, "between_mean": 2.0}, None),  # every bound reached, none passed
    ({"our_mean": 1.3}, "mean error 1.3 > 1.25 x the CPU's 1"),
    ({"our_max": 8.5}, "largest error 8.5 > 2 x the CPU's 4"),
    ({"between_mean": 2.5}, "mean difference from the CPU 2.5 > 2 x its error 1"),
    ({"their_max": 0.0, "our_max": 0.0}, "the CPU bf16 error 0 is not in"),  # no rounding: the comparison says nothing
    ({"their_max": 6.0}, "the CPU bf16 error 6 is not in"),  # above 5 % of the logits
])
def test_the_parity_rule(change, broken):
    got = gpu_check_child.parity_rule(stats(**change))
    if broken is None:
        assert got == []
    else:
        assert len(got) == 1 and got[0].startswith(broken), got


# -- staging and installing wheels --------------------------------------------------------------------

def test_unmet_requirements_read_markers_for_the_gpu_image():
    requires = {"openai.whl": ["httpx2<3,>=2.12.0", "anyio<5,>=4.10.0", "distro; python_version < '3.12'",
                               "pandas; extra == 'datalib'"],
                "httpx2.whl": ["httpx2-jsfetch; sys_platform == 'emscripten'", "idna>=3.18", "truststore>=0.10"],
                "uvicorn.whl": ["click>=7.0", "typing-extensions>=4.0; python_version < '3.11'"]}
    got = gpu_check_prepare.unmet_requirements(requires, staged=["openai", "httpx2", "anyio", "uvicorn"],
                                               image=["click"])
    assert got == ["httpx2.whl needs idna", "httpx2.whl needs truststore"]


def test_the_wheel_list_stages_what_ctrl_serve_and_the_client_need():
    names = {gpu_check_prepare.canonical(n) for n in gpu_check_prepare.WHEELS}
    assert {"duckdb", "polars", "polars-runtime-32", "orjson", "fastapi", "uvicorn", "openai", "pydantic",
            "pydantic-core"} <= names
    # every wheel's requirements installed here are staged or in the GPU image
    from importlib import metadata

    requires = {n: metadata.requires(n) or [] for n in gpu_check_prepare.WHEELS}
    assert gpu_check_prepare.unmet_requirements(requires, gpu_check_prepare.WHEELS) == []


def test_record_hash_is_the_wheel_format():
    assert gpu_check_prepare.record_hash(b"") == "sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU"


def make_wheel(folder: Path, name: str = "gpucheckdemo", version: str = "0.1") -> Path:
    """A minimal pure-Python wheel: one module and its dist-info."""
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files = {f"{name}/__init__.py": b"VALUE = 42\n", f"{name}-{version}.dist-info/METADATA": meta.encode(),
             f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  b"Tag: py3-none-any\n"}
    record = "".join(f"{path},{gpu_check_prepare.record_hash(data)},{len(data)}\n" for path, data in files.items())
    files[f"{name}-{version}.dist-info/RECORD"] = (record + f"{name}-{version}.dist-info/RECORD,,\n").encode()
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


def test_wheels_repack_pack_and_install_into_a_site(tmp_path):
    src, repacked, staged, work = (tmp_path / d for d in ("src", "repacked", "staged", "work"))
    for d in (src, repacked, staged, work):
        d.mkdir()
    wheel = make_wheel(src)
    again = gpu_check_prepare.repack_wheel(wheel, repacked)
    with zipfile.ZipFile(wheel) as a, zipfile.ZipFile(again) as b:
        assert {i.filename: a.read(i) for i in a.infolist()} == {i.filename: b.read(i) for i in b.infolist()}
        assert {i.compress_type for i in b.infolist()} == {zipfile.ZIP_STORED}
    gpu_check_prepare.pack([again], staged / "wheels.tar.xz")
    site = tmp_path / "site"
    first = gpu_check_prepare.install_wheels(staged, site, work)
    assert first == {"installed": [wheel.name], "reused": False}
    assert (site / "gpucheckdemo" / "__init__.py").read_text() == "VALUE = 42\n"
    done = subprocess.run([sys.executable, "-c", "import gpucheckdemo; print(gpucheckdemo.VALUE)"],
                          env={"PYTHONPATH": str(site)}, capture_output=True, text=True)
    assert done.stdout.strip() == "42"
    assert gpu_check_prepare.install_wheels(staged, site, work)["reused"]  # the same archive: kept


def test_no_staged_wheels_installs_nothing(tmp_path):
    assert gpu_check_prepare.install_wheels(tmp_path, tmp_path / "site", tmp_path) == {"installed": [],
                                                                                        "reused": False}


def test_travel_line_says_whether_a_call_fits():
    mib = 1 << 20
    assert gpu_check_prepare.travel_line(7 * mib, 50 * mib).startswith("a call carries 57.0 MiB of 64 MiB (fits)")
    assert "OVER by 6.0 MiB" in gpu_check_prepare.travel_line(10 * mib, 60 * mib)


# -- the random weights, drawn on a GPU ----------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_weights_drawn_on_a_gpu_are_deterministic_and_of_the_same_layout(tiny_molmoe_dir, tmp_path):
    config = json.loads((tiny_molmoe_dir / "config.json").read_text())

    def digest(path: Path) -> str:
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    cpu = write_random_checkpoint(tmp_path / "cpu", config, tiny_molmoe_dir)
    gpu = write_random_checkpoint(tmp_path / "gpu", config, tiny_molmoe_dir, draw_device="cuda")
    again = write_random_checkpoint(tmp_path / "again", config, tiny_molmoe_dir, draw_device="cuda")
    assert digest(gpu) == digest(again) != digest(cpu)
    with (cpu / "model.safetensors").open("rb") as a, (gpu / "model.safetensors").open("rb") as b:
        assert a.read(8) == b.read(8)  # the same header: names, shapes, offsets


def test_the_speed_step_times_seven_fast_rounds_and_prints_the_knob_table(dry_run):
    speed = dry_run["json"]["steps"]["speed"]
    assert speed["rounds"] == gpu_check.SPEED_ROUNDS == 7 and speed["eager_rounds"] == 1
    for row in speed["rows"]:
        assert row["fast"]["rounds"] == 7 and row["eager"]["rounds"] == 1 and row["captures_in_timing"] == 0
        # every request ran to the asked tokens: the end of sequence does not stop a timed request
        assert row["fast"]["tokens"] == row["eager"]["tokens"] == speed["max_new_tokens"] == 8
    table = speed["knob_costs"]["fast"]["table"]
    assert len(table) == speed["knob_costs"]["fast"]["pairs"] > 0
    assert "----- the fast path's knob table (median totals) -----" in dry_run["log"]


def _speed_figures(**row_changes) -> dict:
    fast = {"rounds": 7, "tokens": 8}
    row = {"max_crops": 4, "top_k": 8, "num_active_blocks": 16, "fast": fast, "eager": {"rounds": 1, "tokens": 8},
           "captures_in_timing": 0}
    for key, value in row_changes.items():
        if key.startswith("fast_"):
            fast[key[5:]] = value
        else:
            row[key] = value
    return {"rows": [row], "paths": ["eager", "fast"], "max_new_tokens": 8, "graph_error": None,
            "vision_graphs": {"graphs": 3, "error": None}}


def test_the_speed_step_fails_on_figures_that_are_not_the_fast_paths_speed():
    assert gpu_check.speed_problems(_speed_figures()) == []
    assert gpu_check.speed_problems(_speed_figures(fast_rounds=3)) == [
        "4/8/16: 3 timed rounds of the fast path, not 7"]
    assert gpu_check.speed_problems(_speed_figures(fast_tokens=5)) == ["4/8/16: fast generated fewer than 8 tokens"]
    assert gpu_check.speed_problems(_speed_figures(captures_in_timing=2)) == [
        "4/8/16: 2 CUDA graph(s) captured during timed rounds"]
    figures = _speed_figures()
    figures["vision_graphs"]["error"] = "RuntimeError: capture failed"
    assert gpu_check.speed_problems(figures) == ["the ViT's CUDA graphs failed: RuntimeError: capture failed"]


def test_the_knob_rule_reads_a_difference_within_the_rounds_spread_as_flat():
    from bench_speed import knob_costs

    def row(top_k: int, totals: list[float]) -> dict:
        return {"max_crops": 4, "top_k": top_k, "num_active_blocks": 16,
                "fast": {"totals_ms": totals, "total_ms": sorted(totals)[len(totals) // 2]}}

    # top-K 8 is 1 ms faster by the median, within the rounds' 4 ms spread: flat, not a violation
    flat = knob_costs([row(4, [60, 62, 64, 66, 68]), row(8, [59, 61, 63, 65, 67])], "fast")
    assert flat["violations"] == [] and len(flat["flat"]) == 1 and flat["table"][0]["tolerance_ms"] == 4.0
    # 10 ms faster with a 1 ms spread: a violation
    faster = knob_costs([row(4, [70, 70.5, 71, 71.5, 72]), row(8, [60, 60.5, 61, 61.5, 62])], "fast")
    assert len(faster["violations"]) == 1 and faster["table"][0]["cost_ms"] == -10.0
    # a clear cost: neither
    costs = knob_costs([row(4, [60, 60.5, 61, 61.5, 62]), row(8, [70, 70.5, 71, 71.5, 72])], "fast")
    assert costs["violations"] == [] and costs["flat"] == []
