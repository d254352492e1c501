"""The ctrl command through typer's CliRunner: exit codes, stdout and stderr apart."""

from __future__ import annotations

import csv
import io
import json

import pytest
from typer.testing import CliRunner

from cli import app
from conftest import CONFIGS, NUM_SAMPLES

runner = CliRunner()


def invoke(*args: str, env: dict | None = None):
    return runner.invoke(app, list(args), env=env, catch_exceptions=False)


def test_ingest_query_status(small_tree, tmp_path):
    ws = str(tmp_path / "ws")
    result = invoke("ingest", str(small_tree / "exp5"), str(small_tree / "exp6"), "--workspace", ws)
    assert result.exit_code == 0, result.output
    assert "ingested 9 files (9 ok)" in result.stdout
    again = invoke("ingest", str(small_tree), "--workspace", ws)
    assert again.exit_code == 0 and "nothing changed" in again.stdout

    q = invoke("query", "SELECT experiment, count(*) AS n FROM measurements GROUP BY 1 ORDER BY 1", "-w", ws,
               "--format", "csv")
    assert q.exit_code == 0
    assert list(csv.DictReader(io.StringIO(q.stdout))) == [{"experiment": "exp5", "n": str(NUM_SAMPLES * len(CONFIGS))},
                                                          {"experiment": "exp6", "n": str(NUM_SAMPLES * len(CONFIGS))}]
    j = invoke("query", "SELECT count(*) AS n FROM samples", "-w", ws, "--format", "json")
    assert json.loads(j.stdout) == [{"n": NUM_SAMPLES}]
    t = invoke("query", "SELECT sample_key FROM samples ORDER BY 1", "-w", ws)
    assert "ex:500004" in t.stdout

    s = invoke("status", "-w", ws, "--json")
    summary = json.loads(s.stdout)
    assert summary["datasets"] == [{"dataset": "coco_2014_vqa", "samples": NUM_SAMPLES,
                                    "measurements": 2 * NUM_SAMPLES * len(CONFIGS)}]
    assert summary["flags"]["flag_prefill_invalid"] == NUM_SAMPLES * len(CONFIGS)
    assert "coco_2014_vqa" in invoke("status", "-w", ws).stdout
    assert summary["missing_files"] == []
    gone = next(small_tree.rglob("exp5_accuracy_results.json"))
    gone.unlink()
    assert json.loads(invoke("status", "-w", ws, "--json").stdout)["missing_files"] == [str(gone)]
    assert "1 ingested file(s) no longer on disk" in invoke("status", "-w", ws).stdout


def test_workspace_from_environment(small_tree, tmp_path):
    ws = tmp_path / "from_env"
    assert invoke("ingest", str(small_tree), env={"CTRL_WORKSPACE": str(ws)}).exit_code == 0
    assert (ws / "ctrl.duckdb").exists()


def test_bad_file_exits_non_zero_with_summary_on_stderr(small_tree, tmp_path):
    (small_tree / "exp6" / "exp6_latency_crops2_topk4_blocks12_rank0.json").write_text("{")
    result = invoke("ingest", str(small_tree), "-w", str(tmp_path / "ws"))
    assert result.exit_code == 1
    assert "bad file: exp6_latency_crops2_topk4_blocks12_rank0.json: invalid JSON" in result.stderr
    assert "1 bad file(s)" in result.stderr and "ingested" in result.stdout


def test_errors_are_one_red_line_not_a_traceback(tmp_path):
    result = invoke("query", "SELECT 1", "-w", str(tmp_path / "empty"))
    assert result.exit_code == 1 and "has no tables yet" in result.stderr and "Traceback" not in result.stderr
    bad_sql = invoke("status", "-w", str(tmp_path / "empty"))
    assert bad_sql.exit_code == 1


def test_missing_input_path(tmp_path):
    result = runner.invoke(app, ["ingest", str(tmp_path / "nope")], env={"COLUMNS": "300"})
    # a usage error is a user error like any other: one line, exit 1
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: Invalid value for 'paths'") and "does not exist" in result.stderr


@pytest.mark.parametrize(("args", "text"), [
    (["bogus"], "error: No such command 'bogus'."),
    (["--bogus"], "error: No such option: --bogus"),
    (["query", "SELECT 1", "--max-rows", "x"], "error: Invalid value for '--max-rows'"),
    (["export", "latest"], "error: Missing option '--out'."),
    (["testbed", "generate"], "error: Missing argument 'out_dir'."),
])
def test_a_usage_error_is_one_line_and_exit_1_for_every_command(args, text):
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith(text), \
        result.stderr


def test_a_command_group_alone_still_prints_its_help():
    result = runner.invoke(app, ["testbed"])
    assert "generate" in result.output and "error:" not in result.output


def test_ctrl_c_during_a_query_exits_130_with_one_line(small_tree, tmp_path, monkeypatch):
    ws = tmp_path / "ws"
    assert invoke("ingest", str(small_tree), "-w", str(ws)).exit_code == 0

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    import pipeline

    monkeypatch.setattr(pipeline, "run_query", interrupted)
    result = invoke("query", "SELECT 1", "-w", str(ws))
    assert result.exit_code == 130
    assert result.stderr == "interrupted: nothing was written\n" and result.stdout == ""


def test_a_query_that_would_write_is_refused_with_exit_1(small_tree, tmp_path):
    ws = tmp_path / "ws"
    assert invoke("ingest", str(small_tree), "-w", str(ws)).exit_code == 0
    target = tmp_path / "copy.parquet"
    result = invoke("query", f"COPY (SELECT * FROM measurements) TO '{target}'", "-w", str(ws))
    assert result.exit_code == 1 and not target.exists()
    assert result.stderr.startswith("error: query refused: `ctrl query` only reads the workspace's views")


def test_doctor_of_a_workspace_that_does_not_exist_is_an_error(tmp_path):
    result = invoke("doctor", "-w", str(tmp_path / "nowhere"))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: workspace {tmp_path / 'nowhere'} does not exist")
    assert not (tmp_path / "nowhere").exists()


def test_doctor_of_a_directory_that_holds_no_workspace_is_an_error_not_a_clean_bill(tmp_path):
    (tmp_path / "empty").mkdir()
    result = invoke("doctor", "-w", str(tmp_path / "empty"))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: workspace {tmp_path / 'empty'} holds nothing ctrl wrote (no tables yet)")
    assert list((tmp_path / "empty").iterdir()) == []


def test_csv_holds_list_columns_as_json(small_tree, tmp_path):
    ws = tmp_path / "ws"
    assert invoke("ingest", str(small_tree), "-w", str(ws)).exit_code == 0
    result = invoke("query", "SELECT [1, 2] AS blocks, {'a': 1} AS s, 'x' AS t", "-w", str(ws), "--format", "csv")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ['"blocks","s","t"', '"[1, 2]","{""a"": 1}","x"']


def test_a_full_disk_is_one_line_naming_the_file(small_tree, tmp_path, monkeypatch):
    import errno

    import pipeline

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ws" / "tables" / ".tmp-1"))

    monkeypatch.setattr(pipeline, "ingest", full)
    result = invoke("ingest", str(small_tree), "-w", str(tmp_path / "ws"))
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"error: {tmp_path / 'ws' / 'tables' / '.tmp-1'}: No space left on device"
    assert lines[1].startswith("Hint: free space")


def test_commands_over_a_damaged_table_give_one_line_and_point_to_doctor(small_tree, tmp_path):
    ws = tmp_path / "ws"
    assert invoke("ingest", str(small_tree), "-w", str(ws)).exit_code == 0
    gen = ws / "tables" / (ws / "CURRENT").read_text().strip()
    table = gen / "measurements.parquet"
    table.write_bytes(table.read_bytes()[:200] + b"\x00" * 64)
    for args in (("status",), ("query", "SELECT count(*) FROM measurements")):
        result = invoke(*args, "-w", str(ws))
        assert result.exit_code == 1 and "Traceback" not in result.stderr, args
        lines = result.stderr.strip().splitlines()
        assert lines[0].startswith("error: ") and lines[-1].startswith("Hint: `ctrl doctor`"), lines
    doctor = invoke("doctor", "-w", str(ws))
    assert doctor.exit_code == 1 and f"damaged: {table}: unreadable" in doctor.stderr


def test_ctrl_c_during_ingest_exits_130_and_leaves_the_workspace(small_tree, tmp_path, monkeypatch):
    ws = tmp_path / "ws"
    assert invoke("ingest", str(small_tree / "exp5"), "-w", str(ws)).exit_code == 0
    before = invoke("query", "SELECT count(*) AS n FROM measurements", "-w", str(ws), "--format", "csv").stdout

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("pipeline.ingestion.build_tables", interrupted)  # Ctrl-C while the tables are built
    result = invoke("ingest", str(small_tree), "-w", str(ws))
    assert result.exit_code == 130 and result.stdout == ""
    assert result.stderr == ("interrupted: the workspace is unchanged; parsed files are cached and the next run "
                             "resumes\n")
    monkeypatch.undo()
    assert invoke("query", "SELECT count(*) AS n FROM measurements", "-w", str(ws), "--format", "csv").stdout == before
    assert before == f"\"n\"\n{NUM_SAMPLES * len(CONFIGS)}\n"  # exp5 only: 5 samples x 2 configurations


def test_every_model_command_takes_the_dtypes_of_the_runtime_with_their_defaults():
    """--dtype is written once in the CLI and once in runtime.precision; the configs default to auto."""
    from cli.common import Dtype
    from features import FeatureConfig
    from online import OnlineTrainConfig
    from profiler import ProfileConfig
    from runtime.precision import DTYPE_CHOICES

    assert tuple(d.value for d in Dtype) == DTYPE_CHOICES
    assert FeatureConfig.dtype == ProfileConfig.dtype == OnlineTrainConfig.dtype == "auto"
    import pytest

    from runtime import ModelLoadError

    for make in (lambda: FeatureConfig(dtype="int8"), lambda: OnlineTrainConfig(dtype="int8"),
                 lambda: ProfileConfig(datasets=["."], dtype="int8")):
        with pytest.raises(ModelLoadError, match=r"--dtype 'int8': expected one of auto, bfloat16, float16, float32"):
            make()
    for command in (["extract-features"], ["profile"], ["train", "--online"], ["testbed", "train"]):
        required = ["--dataset", "."] if command == ["profile"] else []
        result = runner.invoke(app, [*command, "--dtype", "int8", *required])
        assert result.exit_code == 1, command
        assert "'int8' is not one of" in result.output and all(f"'{c}'" in result.output for c in DTYPE_CHOICES)
        # train's options show each phase's default from its config field
        shown = "(online only; default: auto)" if command[0] == "train" else "[default: auto]"
        assert shown in runner.invoke(app, [*command, "--help"], env={"COLUMNS": "400"}).output


def test_throughput_reads_as_seconds_per_sample_when_a_sample_takes_longer_than_a_second():
    from cli.common import rate

    assert rate(10, 2.0) == "5.0 samples/s"
    assert rate(2, 71.0) == "35.5 s/sample"  # MolmoE-1B's features on a CPU
    assert rate(0, 3.0) == "0 samples/s"


@pytest.mark.parametrize("command", ["serve", "profile", "train"])
@pytest.mark.parametrize(("flag", "expected"), [("--eager", False), ("--no-compile", False), ("--fast-path", True),
                                                ("--compile", True)])
def test_the_fast_path_switch_keeps_its_old_names(command, flag, expected):
    import typer

    import cli

    group = typer.main.get_command(cli.app)
    args = ["--dataset", "."] if command == "profile" else []
    ctx = group.commands[command].make_context(command, [*args, flag])
    assert ctx.params["fast_path"] is expected
