"""Loading a MolmoE checkpoint: streamed into place, sized up before, fingerprinted without a
second read, found by Hugging Face id; and on a GPU where there is one.

The peak-memory tests load a 127 M-parameter checkpoint (d_model 256, 64 experts, the real
vocabulary) in a fresh process and read the kernel's high-water mark of its resident memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from load_memory import measure_load
from safetensors import safe_open
from test_model_runtime import QUESTION, make_image
from typer.testing import CliRunner

from cli import app
from runtime import ModelLoadError, load_runtime, model_fingerprint
from runtime import fingerprint as fingerprints
from runtime.memory import check_fits, host_available_bytes
from runtime.molmoe import MolmoERuntime, checkpoint_fingerprint, known_checkpoint_fingerprint
from runtime.weights import WeightIndex
from synthetic.molmoe_checkpoint import write_random_checkpoint

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30

@pytest.fixture(scope="module")
def mid_size(tiny_molmoe_dir: Path, tmp_path_factory) -> dict[str, Path]:
    """The same 127 M-parameter model as one float32 file and as bfloat16 shards of 100 MB."""
    config = {**json.loads((tiny_molmoe_dir / "config.json").read_text()), "d_model": 256}
    root = tmp_path_factory.mktemp("mid")
    return {"float32": write_random_checkpoint(root / "f32", config, tiny_molmoe_dir, dtype=torch.float32),
            "bfloat16": write_random_checkpoint(root / "bf16", config, tiny_molmoe_dir, dtype=torch.bfloat16,
                                                max_shard_bytes=100_000_000)}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize(("stored", "held"), [("float32", "bfloat16"), ("bfloat16", "bfloat16"),
                                              ("float32", "float32"), ("bfloat16", "float32")])
def test_a_load_takes_little_more_than_its_weights(mid_size, stored, held):
    """Nothing is held twice: the peak is the weights in the held dtype plus two 16 MiB staging
    buffers and the tokenizer; a loader that builds the state dict first or stacks the experts
    with a copy holds 1.5x or more."""
    got = measure_load(mid_size[stored], held)
    values = sum(t.numel for t in WeightIndex(mid_size[stored]).tensors.values())
    assert values > 120_000_000
    assert got["weights"] == values * (2 if held == "bfloat16" else 4)
    assert got["peak"] <= 1.15 * got["weights"] + (64 << 20), got


def test_streamed_tensors_are_the_files_tensors_in_place(mid_size):
    """Every expert's gate/up/down and the split QKV land where the stacked layout puts them,
    converted to bfloat16 by rounding (what ``.to(torch.bfloat16)`` gives)."""
    runtime = MolmoERuntime(mid_size["float32"], dtype="bfloat16")
    layer = runtime.decoder.model.layers[5]
    d, inter = 256, 128
    with safe_open(str(mid_size["float32"] / "model.safetensors"), framework="pt") as f:
        for e in (0, 17, 63):
            src = f"model.transformer.blocks.5.mlp.experts.{e}."
            gate_up = layer.mlp.experts.gate_up_proj[e]
            assert torch.equal(gate_up[:inter], f.get_tensor(src + "gate_proj.weight").bfloat16())
            assert torch.equal(gate_up[inter:], f.get_tensor(src + "up_proj.weight").bfloat16())
            assert torch.equal(layer.mlp.experts.down_proj[e], f.get_tensor(src + "down_proj.weight").bfloat16())
        qkv = f.get_tensor("model.transformer.blocks.5.attn.att_proj.weight").bfloat16()
        assert torch.equal(layer.self_attn.k_proj.weight, qkv[d:2 * d])
        embed = runtime.decoder.model.embed_tokens.weight
        assert torch.equal(embed[-128:], f.get_tensor("model.transformer.wte.new_embedding").bfloat16())


def test_bf16_shards_and_a_float32_file_load_the_same_bf16_model(mid_size):
    a = MolmoERuntime(mid_size["float32"], dtype="bfloat16")
    b = MolmoERuntime(mid_size["bfloat16"], dtype="bfloat16")
    for (name, p), q in zip(a.decoder.named_parameters(), b.decoder.parameters()):
        assert torch.equal(p, q), name
    # the same model, the same precision: the same fingerprint is not required (other files), the
    # same dtype qualification is
    assert a.fingerprint != a.weights_fingerprint and b.fingerprint != b.weights_fingerprint


# -- sized up before loading --------------------------------------------------------------------------

def test_check_fits_names_the_need_the_free_memory_and_the_dtype_that_fits():
    def need(dtype):
        return (27 if dtype == torch.float32 else 13.5) * GIB

    with pytest.raises(ModelLoadError) as info:
        check_fits("ckpt", need, torch.float32, torch.device("cpu"), available=20 * GIB)
    message = str(info.value)
    assert "\n" not in message
    assert "need 27.0 GiB in float32" in message and "20.0 GiB of host memory is free" in message
    assert "--dtype bfloat16 (13.5 GiB) would fit" in message
    with pytest.raises(ModelLoadError, match=r"no --dtype fits \(bfloat16 needs 13\.5 GiB\)"):
        check_fits("ckpt", need, torch.bfloat16, torch.device("cpu"), available=10 * GIB)
    check_fits("ckpt", need, torch.bfloat16, torch.device("cpu"), available=15 * GIB)  # 13.5 + 1 GiB to run


def test_check_fits_counts_the_kv_cache_beside_the_weights():
    def need(dtype):
        return (27 if dtype == torch.float32 else 13.5) * GIB

    def cache(dtype):  # the fast path's cache at the trained context: 0.5 GiB in bfloat16, 1 GiB in float32
        return (1.0 if dtype == torch.float32 else 0.5) * GIB

    check_fits("ckpt", need, torch.bfloat16, torch.device("cpu"), available=15 * GIB, cache_bytes=cache)  # 15.0
    with pytest.raises(ModelLoadError, match=r"13\.5 GiB in bfloat16 \(\+0\.5 GiB of KV cache and 1 GiB to run\)"):
        check_fits("ckpt", need, torch.bfloat16, torch.device("cpu"), available=14.9 * GIB, cache_bytes=cache)
    # float32 weights and cache do not fit in 28.5 GiB, bfloat16's do
    with pytest.raises(ModelLoadError, match=r"--dtype bfloat16 \(13\.5 GiB\) would fit"):
        check_fits("ckpt", need, torch.float32, torch.device("cpu"), available=28.5 * GIB, cache_bytes=cache)


def test_molmoe_1bs_cache_at_the_trained_context_is_512_mib_in_bfloat16():
    from molmoe_origin import SKIP_REASON, reference_dir

    from runtime.molmoe_model import MolmoEArchitecture

    reference = reference_dir()
    if reference is None:
        pytest.skip(SKIP_REASON)
    arch = MolmoEArchitecture.from_config(json.loads((reference / "origin/configs/model/config.json").read_text()))
    assert (arch.max_sequence_length, arch.max_position_embeddings) == (4096, 32768)
    cuda = torch.device("cuda")
    # 2 (keys, values) x 16 blocks x 16 key-value heads x 4,096 positions x 128 dims
    assert arch.kv_cache_bytes(torch.bfloat16, cuda) == 2 * 16 * 16 * 4096 * 128 * 2 == 512 * 2**20
    assert arch.kv_cache_bytes(torch.bfloat16, cuda, float32_attention=True) == 2**30
    assert arch.kv_cache_bytes(torch.bfloat16, torch.device("cpu")) == 2**30  # a CPU attends in float32


def test_host_memory_is_read_from_the_system():
    available = host_available_bytes()
    total = int(next(line for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemTotal:")).split()[1]) * 1024
    assert available is not None and 0 < available <= total


def test_a_model_that_does_not_fit_is_refused_before_any_weight_is_read(tiny_molmoe_dir, tmp_path, monkeypatch):
    from testbed.task import generate_dataset

    monkeypatch.setattr("runtime.memory.host_available_bytes", lambda: 900 << 20)
    monkeypatch.setattr("runtime.molmoe.stream_weights", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ModelLoadError, match=r"need \d+\.\d GiB in float32 \(\+\d+\.\d GiB of KV cache and 1 GiB "
                                             r"to run\) and 0\.9 GiB of host memory is free; no --dtype fits"):
        MolmoERuntime(tiny_molmoe_dir)
    generate_dataset(tmp_path / "ds", num_samples=1, seed=1)
    result = CliRunner().invoke(app, ["profile", "--model", str(tiny_molmoe_dir), "--dataset", str(tmp_path / "ds"),
                                      "--out", str(tmp_path / "prof")])
    assert result.exit_code == 1
    assert "GiB of host memory is free" in result.output and "Traceback" not in result.output


# -- fingerprints ---------------------------------------------------------------------------------------

def test_the_first_load_fingerprints_from_the_bytes_it_reads(tiny_molmoe_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CTRL_CACHE_DIR", str(tmp_path / "cache"))
    copy = Path(shutil.copytree(tiny_molmoe_dir, tmp_path / "copy"))
    assert known_checkpoint_fingerprint(copy) is None  # never seen: only a load can tell
    assert model_fingerprint(str(copy)) is None
    reads = []
    real = fingerprints._sha256_file
    monkeypatch.setattr(fingerprints, "_sha256_file", lambda f: reads.append(f.name) or real(f))
    runtime = MolmoERuntime(copy)
    assert not [name for name in reads if name.endswith(".safetensors")]  # no second read of the weights
    assert runtime.fingerprint == checkpoint_fingerprint(tiny_molmoe_dir)
    assert known_checkpoint_fingerprint(copy) == runtime.fingerprint == model_fingerprint(str(copy))
    cached = json.loads(next((tmp_path / "cache" / "fingerprints").glob("*.json")).read_text())
    content = hashlib.sha256((copy / "model.safetensors").read_bytes()).hexdigest()
    assert cached["model.safetensors"][2] == content
    assert model_fingerprint(str(copy), dtype="bfloat16") == MolmoERuntime(copy, dtype="bfloat16").fingerprint


def test_a_rewritten_weight_file_is_hashed_again(tiny_molmoe_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CTRL_CACHE_DIR", str(tmp_path / "cache"))
    copy = Path(shutil.copytree(tiny_molmoe_dir, tmp_path / "copy"))
    before = MolmoERuntime(copy).fingerprint
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    (copy / "model.safetensors").write_bytes(bytes(data))
    assert known_checkpoint_fingerprint(copy) is None
    assert MolmoERuntime(copy).fingerprint != before


def hub_cache(root: Path, checkpoint: Path, repo: str = "allenai/MolmoE-tiny") -> tuple[Path, str]:
    """``checkpoint`` laid out as huggingface_hub caches a repository: blobs named by content,
    snapshot files linking to them, refs/main naming the snapshot. Returns (cache, commit)."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in sorted(checkpoint.iterdir()):
        data = file.read_bytes()
        large = file.suffix == ".safetensors"  # LFS files are named by sha256, others by a git sha1
        name = hashlib.sha256(data).hexdigest() if large else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo_dir / "blobs" / name).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("../../blobs") / name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return root, commit


RESOLVE_SCRIPT = r"""
import json, sys
from runtime import model_fingerprint, resolve_model
from runtime.base import ModelLoadError
try:
    kind, path = resolve_model(sys.argv[1])
    print(json.dumps({"kind": kind, "path": str(path), "fingerprint": model_fingerprint(sys.argv[1])}))
except ModelLoadError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def resolve_in_subprocess(model: str, hub: Path, cache: Path) -> dict:
    """huggingface_hub reads its environment at import: a fresh process sees the test's cache."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1",
           "CTRL_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", RESOLVE_SCRIPT, model], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_hub_id_resolves_offline_to_its_snapshot_with_the_directorys_fingerprint(tiny_molmoe_dir, tmp_path):
    hub, commit = hub_cache(tmp_path / "hub", tiny_molmoe_dir)
    got = resolve_in_subprocess("allenai/MolmoE-tiny", hub, tmp_path / "ctrl-cache")
    assert got["kind"] == "molmoe" and Path(got["path"]).name == commit
    # known without reading the weights (their blob names are their digests), equal to the directory's
    assert got["fingerprint"] == checkpoint_fingerprint(tiny_molmoe_dir)
    assert resolve_in_subprocess(f"allenai/MolmoE-tiny@{commit}", hub, tmp_path / "ctrl-cache")["path"] == got["path"]
    missing = resolve_in_subprocess("allenai/MolmoE-1B-0924", hub, tmp_path / "ctrl-cache")["error"]
    first = missing.splitlines()[0]
    assert "allenai/MolmoE-1B-0924" in first and str(hub) in first and "not in the Hugging Face cache" in first
    revision = resolve_in_subprocess("allenai/MolmoE-tiny@v2", hub, tmp_path / "ctrl-cache")["error"]
    assert "revision 'v2' of allenai/MolmoE-tiny" in revision


def test_a_hub_id_loads_the_model(tiny_molmoe_dir, tmp_path):
    hub, _ = hub_cache(tmp_path / "hub", tiny_molmoe_dir)
    script = ("import sys; from runtime import ExecutionOptions, load_runtime; "
              "print(load_runtime('allenai/MolmoE-tiny', ExecutionOptions(dtype='bfloat16')).fingerprint)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1",
           "CTRL_CACHE_DIR": str(tmp_path / "ctrl-cache")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == MolmoERuntime(tiny_molmoe_dir, dtype="bfloat16").fingerprint


def test_a_path_that_is_neither_a_directory_nor_an_id_says_what_model_takes(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model directory .*Hugging Face id org/name"):
        load_runtime(str(tmp_path / "absent"))


# -- on a GPU -------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_bf16_loads_straight_to_the_gpu_and_computes_like_the_cpu(tiny_molmoe_dir):
    torch.cuda.reset_peak_memory_stats()
    gpu = MolmoERuntime(tiny_molmoe_dir, device="cuda", dtype="bfloat16")
    params = [p for m in (gpu.vision_backbone, gpu.decoder) for p in m.parameters()]
    assert {p.device.type for p in params} == {"cuda"} and {p.dtype for p in params} == {torch.bfloat16}
    weights = sum(p.numel() * 2 for p in params)
    assert torch.cuda.max_memory_allocated() <= weights + (64 << 20)  # no float32 copy went through the GPU
    cpu = MolmoERuntime(tiny_molmoe_dir, dtype="bfloat16")
    assert gpu.fingerprint == cpu.fingerprint
    inputs = cpu.preprocess(make_image(320, 240), QUESTION, 4)
    agree = (gpu.forward_logits(inputs).argmax(-1) == cpu.forward_logits(inputs).argmax(-1)).float().mean()
    assert agree > 0.9


@needs_cuda
def test_a_gpu_profile_record_names_its_dtype(tiny_molmoe_dir, tmp_path):
    from profiler import ProfileConfig, profile_model
    from testbed.task import generate_dataset

    dataset = tmp_path / "ds"
    generate_dataset(dataset, num_samples=1, seed=2)
    config = ProfileConfig(datasets=[dataset], model=str(tiny_molmoe_dir), configs="2/8/16", num_samples=1,
                           out_dir=tmp_path / "prof", max_new_tokens=2, device="cuda", dtype="auto")
    report = profile_model(config)
    rank_file = next((tmp_path / "prof").rglob("exp6_latency_*_rank0.json"))
    block = json.loads(rank_file.read_text())["config"]["ctrl_profile"]
    assert block["device"] == "cuda" and block["dtype"] in ("bfloat16", "float16")
    assert block["model_fingerprint"] == report.model_fingerprint


@pytest.mark.parametrize(("field", "value", "message"), [
    ("n_layers", 1_000_000, "the weights need"),  # refused by the memory check, before any module is built
    ("moe_num_experts", 1_000_000, "the weights need"),
    ("d_model", 1_000_000_000, "the weights need"),
    ("d_model", -32, "MolmoE sizes must be positive: d_model=-32"),
    ("d_model", "32", "d_model must be an integer, got '32'"),
    ("n_layers", 32.5, "n_layers must be an integer, got 32.5"),
])
def test_a_config_with_impossible_sizes_is_refused_before_the_model_is_built(tiny_molmoe_dir, tmp_path, field,
                                                                               value, message):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_molmoe_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
        MolmoERuntime(broken)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_among_the_weights_is_refused_without_reading_it(tiny_molmoe_dir, tmp_path):
    broken = tmp_path / "fifo"
    shutil.copytree(tiny_molmoe_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    os.mkfifo(broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.safetensors: not a regular file"):
        MolmoERuntime(broken)


def test_the_early_size_estimate_never_exceeds_what_the_checkpoint_holds(tiny_molmoe_dir):
    """The estimate refuses a config before any module exists, so it must be a lower bound: for the
    released MolmoE-1B config (7.22 B parameters in its weight layout) and for a tiny checkpoint."""
    from molmoe_origin import SKIP_REASON, reference_dir

    from runtime.molmoe_model import MolmoEArchitecture, weight_targets

    reference = reference_dir()
    if reference is None:
        pytest.skip(SKIP_REASON)
    released = json.loads((reference / "origin/configs/model/config.json").read_text())
    for config, tight in ((released, 0.95), (json.loads((tiny_molmoe_dir / "config.json").read_text()), 0.5)):
        arch = MolmoEArchitecture.from_config(config)
        held = sum(t.numel for t in weight_targets(arch).values())
        assert tight * held <= arch.parameters_at_least() <= held  # the experts dominate at full size
    assert 7.2e9 < sum(t.numel for t in weight_targets(MolmoEArchitecture.from_config(released)).values()) < 7.3e9
