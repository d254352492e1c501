"""Pack a ``ctrl profile`` output tree into one small Parquet file, and unpack it file for file.

A profile tree is mostly the exp5/exp6 format's own redundancy: every per-sample record is
written three times (rank file, merged file, final aggregate), twice more inside exp6
(latencies and predictions), and each copy carries the sample's metadata. The archive keeps
what was measured once:

* one row per (dataset, configuration, rank, sample) with every field of the rank files'
  latency and prediction records except the sample metadata (columns ``lat:<field>`` and
  ``pred:<field>``);
* in the Parquet key-value metadata (``ctrl_profile_archive``, deflated JSON in base64): per rank
  file what is not per sample (configuration, active blocks, the ``ctrl_profile`` block, duration
  and start / end time), the records' field order, and each dataset's sample metadata by index.

:func:`unpack_profile` renders the rank files from that with profile's own
:class:`profiler.tree.TreeWriter`, then merges and aggregates with it, so the unpacked tree is
byte-identical to the packed one; :func:`pack_profile` renders every rank file once and refuses a
tree it would not reproduce. ``data/generate.py`` ships the sample data this way: a real profile of
the trained testbed in a few hundred kB.
"""

from __future__ import annotations

import base64
import json
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import CtrlError
from pipeline.knobs import Config
from pipeline.origin_format import EXP5_DIR_PREFIX, EXP6_CONFIG_RE, EXP6_DIR_PREFIX, exp5_name, exp6_name
from pipeline.workspace import write_bytes_atomic
from profiler.tree import BATCH_ONE, IDENTITY_KEYS, PROFILE_VERSION, TreeWriter, read_json, sampling_of

__all__ = ["ARCHIVE_VERSION", "UnpackReport", "pack_profile", "unpack_profile"]

ARCHIVE_VERSION = 1
METADATA_KEY = b"ctrl_profile_archive"
_WRITER_KEYS = ("split", "world_size", "max_new_tokens", "num_total_blocks", "sampling_strategy")


@dataclass
class UnpackReport:
    out_dir: Path
    datasets: list[str]
    files: int
    records: int


def _writer(out: Path, name: str, config: dict, combinations: tuple = ()) -> TreeWriter:
    """The TreeWriter of a dataset from one of its rank files' ``config`` (exp5's)."""
    return TreeWriter(out, name, config["split"], config["world_size"], config["max_new_tokens"],
                      config["num_total_blocks"], config["sampling_strategy"], combinations)


@dataclass
class _Packer:
    """What :func:`pack_profile` collects, rank file by rank file."""

    rows: list[dict] = field(default_factory=list)  # one per (rank file, sample)
    rank_files: list[dict] = field(default_factory=list)  # what is not per sample
    samples: dict[str, dict[int, dict]] = field(default_factory=dict)  # dataset -> index -> metadata
    fields: dict[str, list[str]] = field(default_factory=dict)  # the records' field order

    def add(self, path5: Path, path6: Path, knob: Config, rank: int, scratch: Path) -> None:
        """One rank's exp5 and exp6 files (checked to come back byte for byte from what is kept)."""
        d6, d5 = read_json(path6), read_json(path5)
        for path, doc in ((path6, d6), (path5, d5)):
            config = doc.get("config") if doc else None
            if not isinstance(config, dict) or config.get("ctrl_profile_version") != PROFILE_VERSION \
                    or not (config.get("ctrl_profile") or {}).get("complete"):
                msg = (f"{path}: missing, unreadable or not a complete ctrl profile rank file "
                       f"(version {PROFILE_VERSION})")
                raise CtrlError(msg)
        config5, summary5 = d5["config"], d5["summary"][0]
        if sampling_of(config5["ctrl_profile"]) != BATCH_ONE:
            msg = (f"{path5}: a profile generated in batches or timing a subset (--batch-size, --latency-samples) "
                   "keeps two sets of generations; the archive holds batch-1 profiles only")
            raise CtrlError(msg)
        name = config5["dataset_name"]
        lats, preds = d6["per_sample_latencies"], d6["per_sample_predictions"]
        self._add_records(path6, name, lats, preds)
        entry = {"dataset": name, "knob": list(knob), "rank": rank, "config_index": config5["config_index"],
                 "active": config5["active_block_indices"], "block": config5["ctrl_profile"],
                 "duration": summary5["duration_seconds"], "start_time": summary5["start_time"],
                 "end_time": summary5["end_time"], "writer": {key: config5[key] for key in _WRITER_KEYS}}
        # the archive keeps fields, not files: check that they give these very files back
        for original, rendered in zip((path5, path6), _render_rank(scratch, entry, lats, preds)):
            if original.read_bytes() != rendered.read_bytes():
                msg = (f"{original}: not reproducible from its fields (another ctrl profile "
                       "version, or edited); the archive would change it")
                raise CtrlError(msg)
        self.rank_files.append(entry)

    def _add_records(self, path6: Path, name: str, lats: list[dict], preds: list[dict]) -> None:
        known = self.samples.setdefault(name, {})
        for lat, pred in zip(lats, preds, strict=True):
            index = lat["dataset_index"]
            if known.setdefault(index, lat["metadata"]) != lat["metadata"]:
                msg = f"{path6}: dataset index {index} has other metadata than in another file"
                raise CtrlError(msg)
            self.fields.setdefault("lat", list(lat))
            self.fields.setdefault("pred", list(pred))
            if list(lat) != self.fields["lat"] or list(pred) != self.fields["pred"]:
                msg = f"{path6}: per-sample records with other fields than the first file's"
                raise CtrlError(msg)
            row = {"dataset": name, "file": len(self.rank_files)}
            row.update({f"lat:{f}": v for f, v in lat.items() if f != "metadata"})
            row.update({f"pred:{f}": v for f, v in pred.items() if f not in ("metadata", "answers")})
            self.rows.append(row)


def pack_profile(profile_dir: str | Path, dest: str | Path) -> int:
    """Write the archive of the ``ctrl profile`` tree under ``profile_dir`` to ``dest`` (atomic);
    returns the number of per-sample rows. Refuses trees not written by ``ctrl profile`` and
    rank files the archive could not reproduce byte for byte."""
    root = Path(profile_dir)
    exp6_dirs = sorted(p for p in root.glob(EXP6_DIR_PREFIX + "*") if p.is_dir())
    if not exp6_dirs:
        msg = f"{root}: no exp6_latency_* directories (not a ctrl profile output directory)"
        raise CtrlError(msg)
    packer = _Packer()
    with tempfile.TemporaryDirectory() as scratch:
        for exp6_dir in exp6_dirs:
            exp5_dir = root / exp6_dir.name.replace(EXP6_DIR_PREFIX, EXP5_DIR_PREFIX, 1)
            for path6 in sorted(exp6_dir.iterdir(), key=lambda p: p.name):
                m = EXP6_CONFIG_RE.match(path6.name)
                if m is None or m.group(4) is None:  # rank files only: the rest is rendered from them
                    continue
                c, k, b, rank = (int(g) for g in m.groups())
                packer.add(exp5_dir / exp5_name(c, k, b, rank), path6, (c, k, b), rank, Path(scratch))
    if not packer.rank_files:
        msg = f"{root}: no rank files (exp6_latency_crops*_rank*.json) found"
        raise CtrlError(msg)
    meta = {"version": ARCHIVE_VERSION, "fields": packer.fields, "rank_files": packer.rank_files,
            "samples": {name: [[i, md] for i, md in sorted(by_index.items())]
                        for name, by_index in packer.samples.items()}}
    table = pa.Table.from_pylist(packer.rows)
    # Parquet does not compress its footer, where key-value metadata lives: deflate it ourselves
    packed = base64.b64encode(zlib.compress(json.dumps(meta, allow_nan=False).encode(), 9))
    sink = pa.BufferOutputStream()
    floats = [n for n, t in zip(table.column_names, table.schema.types) if pa.types.is_floating(t)]
    # store_schema=False: the Arrow schema blob would hold a second copy of the metadata
    with pq.ParquetWriter(sink, table.schema, compression="zstd", compression_level=19, store_schema=False,
                          use_byte_stream_split=floats) as writer:
        writer.write_table(table)
        writer.add_key_value_metadata({METADATA_KEY: packed})
    write_bytes_atomic(Path(dest), sink.getvalue().to_pybytes())
    return len(packer.rows)


def _render_rank(out: Path, entry: dict, lats: list[dict], preds: list[dict]) -> tuple[Path, Path]:
    """Write one rank's exp5 and exp6 files under ``out`` with profile's own writer; their paths."""
    c, k, b = entry["knob"]
    writer = _writer(out, entry["dataset"], entry["writer"])
    exp5_dir, exp6_dir = writer.dirs
    exp5_dir.mkdir(parents=True, exist_ok=True)
    exp6_dir.mkdir(parents=True, exist_ok=True)
    files = (exp5_dir / exp5_name(c, k, b, entry["rank"]), exp6_dir / exp6_name(c, k, b, entry["rank"]))
    writer.write_rank(files, (c, k, b), entry["rank"], entry["active"], entry["config_index"], entry["block"],
                      lats, preds, entry["duration"], entry["start_time"], entry["end_time"])
    return files


def _read_archive(path: Path) -> tuple[pa.Table, dict]:
    try:
        table = pq.read_table(path)
        raw = (pq.read_metadata(path).metadata or {}).get(METADATA_KEY)
    except (OSError, pa.ArrowInvalid) as exc:
        msg = f"{path}: not a readable Parquet file ({exc})"
        raise CtrlError(msg) from None
    if raw is None:
        msg = f"{path}: not a ctrl profile archive (no {METADATA_KEY.decode()} metadata)"
        raise CtrlError(msg)
    try:
        meta = json.loads(zlib.decompress(base64.b64decode(raw)))
    except (ValueError, zlib.error) as exc:
        msg = f"{path}: damaged profile archive metadata ({exc})"
        raise CtrlError(msg) from None
    if meta.get("version") != ARCHIVE_VERSION:
        msg = f"{path}: profile archive version {meta.get('version')!r}, this ctrl reads {ARCHIVE_VERSION}"
        raise CtrlError(msg)
    for entry in meta.get("rank_files", []):
        if isinstance(entry.get("block"), dict):
            # a block without a dtype was profiled with float32 weights (it has no other precision)
            entry["block"].setdefault("dtype", "float32")
    return table, meta


def unpack_profile(archive: str | Path, out_dir: str | Path,
                   progress: Callable[[int, str], None] | None = None) -> UnpackReport:
    """Write the tree packed in ``archive`` under ``out_dir``: rank files, merged files, final aggregates."""
    archive, out = Path(archive), Path(out_dir)
    table, meta = _read_archive(archive)
    lat_fields, pred_fields = meta["fields"]["lat"], meta["fields"]["pred"]
    samples = {name: {int(i): md for i, md in items} for name, items in meta["samples"].items()}
    by_file: dict[int, list[dict]] = {}
    for row in table.to_pylist():
        by_file.setdefault(row["file"], []).append(row)
    sweeps: dict[str, list[dict]] = {}
    for number, entry in enumerate(meta["rank_files"]):
        name = entry["dataset"]
        lats, preds = [], []
        for row in by_file.get(number, []):
            md = samples[name][row["lat:dataset_index"]]
            lats.append({f: (md if f == "metadata" else row[f"lat:{f}"]) for f in lat_fields})
            preds.append({f: (md if f == "metadata" else list(md["answers"]) if f == "answers" else row[f"pred:{f}"])
                          for f in pred_fields})
        _render_rank(out, entry, lats, preds)
        sweeps.setdefault(name, []).append(entry)
        if progress is not None:
            progress(1, f"{name} crops{entry['knob'][0]}_topk{entry['knob'][1]}_blocks{entry['knob'][2]} "
                        f"rank {entry['rank']}")
    files = 2 * len(meta["rank_files"])
    for name, entries in sweeps.items():
        by_index = {e["config_index"]: e for e in entries}  # sweep order = config_index
        ordered = [by_index[i] for i in sorted(by_index)]
        writer = _writer(out, name, entries[0]["writer"], tuple(tuple(e["knob"]) for e in ordered))
        identity = {key: entries[0]["block"][key] for key in IDENTITY_KEYS}
        if "execution" in entries[0]["block"]:
            identity["execution"] = entries[0]["block"]["execution"]
        for e in ordered:
            writer.merge(identity, tuple(e["knob"]), e["active"])
        writer.final(identity)
        files += 2 * len(ordered) + 2
    return UnpackReport(out, sorted(sweeps), files, table.num_rows)
