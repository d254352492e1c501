"""What a GPU run of gpu_check.py needs, staged here into one git-ignored folder that travels with the code.

    python benchmarks/gpu_check.py --prepare              # -> .gpu_check/ (needs the MolmoE reference
                                                          #    and the package index)

The folder (``.gpu_check/`` by default):

* ``molmoe/``: the released ``config.json``, generation config, tokenizer and processor configs
  (the full-size checkpoint's, 2.1 MB; its weights are drawn there);
* ``tiny/config.json``: the reference builder's tiny real-layout config (the parity check's model);
* ``wheels.tar.xz``: the packages the GPU image lacks (:data:`WHEELS`), each pinned to the version
  installed here, for CPython 3.12 on manylinux x86-64; repacked to travel small: the wheels
  stored uncompressed in one xz archive with the x86 filter, and shared libraries that carry a
  symbol table stripped of it (``strip --strip-unneeded``, their RECORD lines updated). Polars'
  runtime alone is a 51 MiB wheel, duckdb's 24 MiB: as they come, the two would not travel in the
  64 MiB a call may carry;
* ``manifest.json``: what was staged, with versions and sizes.

On the GPU machine :func:`install_wheels` unpacks the archive and installs the wheels with
``pip install --no-index --no-deps --no-compile --target SITE``; children then find them through
``PYTHONPATH``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path

from molmoe_common import ROOT, stage_reference_files

DEFAULT_STAGED = ROOT / ".gpu_check"
MIB = float(1 << 20)
#: what a call may carry to the device machine, the working tree included
TRAVEL_LIMIT_BYTES = 64 << 20
#: packages ctrl's GPU steps import that the GPU image lacks, or has in versions too old for the
#: others (anyio, idna, h11, typing-extensions, annotated-doc: a wheel here shadows the image's)
WHEELS = ("duckdb", "polars", "polars-runtime-32", "orjson", "fastapi", "starlette", "pydantic", "pydantic-core",
          "annotated-types", "annotated-doc", "typing-inspection", "typing-extensions", "opentelemetry-api",
          "uvicorn", "h11", "anyio", "idna", "sniffio", "openai", "httpx2", "httpcore2", "truststore", "jiter")
#: what the GPU image has that the staged wheels require (read off the image's package list)
IMAGE_PACKAGES = frozenset({"click", "numpy", "pillow", "pyarrow", "rich", "typer", "prometheus-client", "torch",
                            "transformers", "tokenizers", "safetensors", "huggingface-hub", "certifi", "uvloop",
                            "packaging", "pyyaml", "regex", "tqdm", "filelock", "fsspec", "jinja2", "requests",
                            "importlib-metadata", "zipp", "exceptiongroup"})
PIP_PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
                "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                "--platform", "manylinux1_x86_64"]
#: the environment the wheels' requirement markers are evaluated in (the GPU image's Python)
TARGET_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pinned_versions(names: Iterable[str]) -> dict[str, str]:
    """Each distribution's version as installed in this environment (a KeyError names one that is not)."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            msg = f"{name} is not installed here: install ctrl with its test extra first (pip install -e '.[test]')"
            raise KeyError(msg) from None
    return versions


def unmet_requirements(requires: Mapping[str, list[str]], staged: Iterable[str],
                       image: Iterable[str] = IMAGE_PACKAGES) -> list[str]:
    """``"A needs B"`` for every requirement of a staged wheel (``requires``: name -> its
    Requires-Dist lines) that applies on the GPU image's Python and is neither staged nor in the image."""
    from packaging.requirements import Requirement

    have = {canonical(n) for n in [*staged, *image]}
    unmet = []
    for name, lines in sorted(requires.items()):
        for line in lines:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(TARGET_MARKERS):
                continue
            if canonical(req.name) not in have:
                unmet.append(f"{name} needs {req.name}")
    return unmet


def wheel_requires(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def download_wheels(versions: Mapping[str, str], dest: Path) -> list[Path]:
    """``pip download`` of each pinned distribution for the GPU image's Python (no dependencies:
    they are listed in :data:`WHEELS` or in the image)."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_PLATFORM, "-d", str(dest),
                    *(f"{n}=={v}" for n, v in versions.items())], check=True)
    wanted = {canonical(n): v for n, v in versions.items()}
    found = [w for w in sorted(dest.glob("*.whl"))
             if wanted.get(canonical(w.name.split("-")[0])) == w.name.split("-")[1]]
    missing = set(wanted) - {canonical(w.name.split("-")[0]) for w in found}
    if missing:
        msg = f"pip download gave no wheel for {', '.join(sorted(missing))}"
        raise RuntimeError(msg)
    return found


def record_hash(data: bytes) -> str:
    """A RECORD file's hash field of ``data``."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def stripped(data: bytes) -> bytes:
    """A shared library without its symbol table (``strip --strip-unneeded``), or ``data`` itself
    where that saves less than 1 MiB or ``strip`` is not there."""
    if shutil.which("strip") is None:
        return data
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lib.so"
        path.write_bytes(data)
        done = subprocess.run(["strip", "--strip-unneeded", str(path)], capture_output=True)
        out = path.read_bytes()
    return out if done.returncode == 0 and len(out) < len(data) - (1 << 20) else data


def repack_wheel(wheel: Path, dest: Path, strip: bool = True) -> Path:
    """``wheel`` rewritten into ``dest`` uncompressed (the archive compresses it better), its
    shared libraries stripped (:func:`stripped`) and its RECORD updated to match."""
    out = dest / wheel.name
    with zipfile.ZipFile(wheel) as src:
        members = {info.filename: src.read(info) for info in src.infolist()}
    changed = {}
    for name, data in members.items():
        if strip and (name.endswith(".so") or ".so." in name):
            new = stripped(data)
            if new is not data:
                changed[name] = new
    members.update(changed)
    record = next(n for n in members if n.endswith(".dist-info/RECORD"))
    if changed:
        lines = []
        for line in members[record].decode().splitlines():
            path = line.rsplit(",", 2)[0]
            if path in changed:
                line = f"{path},{record_hash(changed[path])},{len(changed[path])}"
            lines.append(line)
        members[record] = ("\n".join(lines) + "\n").encode()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return out


def pack(files: Iterable[Path], archive: Path, preset: int = 9) -> Path:
    """One .tar.xz of ``files`` (flat), compressed with the x86 branch filter before LZMA2 with a
    192 MiB dictionary (a shared library is one long file: matches reach far back)."""
    filters = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": preset, "dict_size": 192 << 20}]
    tmp = archive.with_suffix(".tmp")
    with lzma.open(tmp, "wb", format=lzma.FORMAT_XZ, filters=filters) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for f in files:
            tar.add(f, arcname=f.name)
    tmp.replace(archive)
    return archive


def tree_bytes() -> int:
    """What the working tree itself takes in a call: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in listed if n and (ROOT / n.decode()).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def travel_line(tree: int, staged: int, limit: int = TRAVEL_LIMIT_BYTES) -> str:
    """One line: what a call carries against its limit."""
    total = tree + staged
    verdict = "fits" if total <= limit else f"OVER by {(total - limit) / MIB:.1f} MiB"
    return (f"a call carries {total / MIB:.1f} MiB of {limit / MIB:.0f} MiB ({verdict}): the working tree "
            f"{tree / MIB:.1f} MiB, the staged folder {staged / MIB:.1f} MiB")


def prepare(staged: Path, *, reference: Path | None, tiny_from: Path | None = None, wheels: bool = True,
            exclude: Iterable[str] = (), cache: Path | None = None, log=print) -> dict:
    """Stage everything into ``staged`` (see the module docstring); returns the manifest."""
    sys.path.insert(0, str(ROOT / "tests"))
    staged.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"files": {}}
    if reference is None:
        msg = "the MolmoE reference (../shared/molmoe_reference or $CTRL_MOLMOE_REFERENCE) is needed to prepare"
        raise FileNotFoundError(msg)
    shutil.rmtree(staged / "molmoe", ignore_errors=True)
    stage_reference_files(reference, staged / "molmoe")
    (staged / "tiny").mkdir(exist_ok=True)
    if tiny_from is None:
        from molmoe_origin import build_tiny

        with tempfile.TemporaryDirectory() as tmp:
            tiny_from = build_tiny(Path(tmp) / "tiny")
            shutil.copyfile(tiny_from / "config.json", staged / "tiny" / "config.json")
    else:
        shutil.copyfile(tiny_from / "config.json", staged / "tiny" / "config.json")
    archive = staged / "wheels.tar.xz"
    if wheels:
        names = [n for n in WHEELS if canonical(n) not in {canonical(e) for e in exclude}]
        versions = pinned_versions(names)
        cache = cache or ROOT / "benchmarks" / ".cache" / "gpu-check-wheels"
        downloaded = download_wheels(versions, cache / "download")
        unmet = unmet_requirements({w.name: wheel_requires(w) for w in downloaded}, names)
        if unmet:
            log("warning: requirements neither staged nor in the GPU image: " + "; ".join(unmet))
        key = hashlib.sha256(json.dumps(sorted(w.name for w in downloaded)).encode()).hexdigest()[:16]
        packed = cache / f"wheels-{key}.tar.xz"
        if not packed.is_file():
            log(f"repacking {len(downloaded)} wheels ({sum(w.stat().st_size for w in downloaded) / MIB:.1f} MiB) ...")
            with tempfile.TemporaryDirectory() as tmp:
                pack([repack_wheel(w, Path(tmp)) for w in downloaded], packed)
        shutil.copyfile(packed, archive)
        manifest["wheels"] = {w.name: w.stat().st_size for w in downloaded}
        manifest["excluded"] = sorted(exclude)
        manifest["unmet"] = unmet
    else:
        archive.unlink(missing_ok=True)
        manifest["wheels"] = {}
    for path in sorted(p for p in staged.rglob("*") if p.is_file() and p.name != "manifest.json"):
        manifest["files"][str(path.relative_to(staged))] = path.stat().st_size
    (staged / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if (ROOT / ".git").exists() and staged.resolve().is_relative_to(ROOT):  # what a call carries
        tree, size = tree_bytes(), folder_bytes(staged)
        manifest["travel"] = {"tree_bytes": tree, "staged_bytes": size, "fits": tree + size <= TRAVEL_LIMIT_BYTES,
                              "line": travel_line(tree, size)}
    return manifest


# -- on the GPU machine ------------------------------------------------------------------------

def install_wheels(staged: Path, site: Path, work: Path, timeout: float | None = None) -> dict:
    """Install the staged wheels into ``site`` (kept when the same archive was installed there
    before). Returns {"installed": [wheel names], "reused": bool} ({"installed": []} with none staged)."""
    archive, loose = staged / "wheels.tar.xz", sorted((staged / "wheels").glob("*.whl"))
    if not archive.is_file() and not loose:
        return {"installed": [], "reused": False}
    stamp_key = hashlib.sha256()
    for f in [archive] if archive.is_file() else loose:
        stamp_key.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    stamp = stamp_key.hexdigest()[:16]
    if (site / ".stamp").is_file() and (site / ".stamp").read_text() == stamp:
        return {"installed": sorted(json.loads((site / ".installed").read_text())), "reused": True}
    unpacked = work / "wheels"
    shutil.rmtree(unpacked, ignore_errors=True)
    unpacked.mkdir(parents=True)
    if archive.is_file():
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(unpacked, filter="data")
    for f in loose:
        shutil.copyfile(f, unpacked / f.name)
    wheels = sorted(unpacked.glob("*.whl"))
    shutil.rmtree(site, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--disable-pip-version-check", "--target", str(site), *map(str, wheels)], check=True,
                   capture_output=True, text=True, timeout=timeout)
    (site / ".installed").write_text(json.dumps([w.name for w in wheels]))
    (site / ".stamp").write_text(stamp)
    shutil.rmtree(unpacked, ignore_errors=True)
    return {"installed": [w.name for w in wheels], "reused": False}


def missing_line(missing: Mapping[str, str], needed_by: Mapping[str, Iterable[str]], staged: Path,
                 order: Sequence[str] = ()) -> str:
    """One line naming what cannot be imported, which steps that skips and how to stage it; "" when
    nothing is missing. ``missing``: module -> why (its import error); ``needed_by``: module -> the
    steps that import it; ``order``: the steps in the order they run."""
    if not missing:
        return ""
    names = sorted(missing)
    steps = sorted({s for m in names for s in needed_by.get(m, ())},
                   key=lambda s: (order.index(s) if s in order else len(order), s))
    why = "; ".join(f"{m}: {missing[m]}" for m in names)
    skipped = f"skipped: {', '.join(steps)}" if steps else "no step needs them"
    return (f"missing: {', '.join(names)} ({why}); {skipped}. Stage the wheels beside the code with "
            f"`python benchmarks/gpu_check.py --prepare {staged.name}` and carry {staged.name}")

