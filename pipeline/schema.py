"""Table contracts of the workspace: one entry per table, the only place columns are defined.

Writers cast to these schemas and check primary keys, readers check ``schema_version``,
the DuckDB views and docs/schema.md are generated from here. The flags cite the origin's defects
(D1, D2, D10: docs/origin_format.md §9).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

SCHEMA_VERSION = "1"
SCHEMA_VERSION_KEY = b"ctrl.schema_version"
TABLE_NAME_KEY = b"ctrl.table"


@dataclass(frozen=True)
class Column:
    name: str
    dtype: pa.DataType
    description: str
    unit: str | None = None
    nullable: bool = True


@dataclass(frozen=True)
class TableSchema:
    name: str
    description: str
    columns: tuple[Column, ...]
    primary_key: tuple[str, ...]

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def arrow_schema(self) -> pa.Schema:
        fields = [pa.field(c.name, c.dtype, nullable=c.nullable) for c in self.columns]
        meta = {SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode(), TABLE_NAME_KEY: self.name.encode()}
        return pa.schema(fields, metadata=meta)

    def duckdb_select_list(self, source_alias: str | None = None) -> str:
        """``CAST(col AS TYPE) AS col, ...`` in schema order, for writers that go through DuckDB."""
        prefix = f"{source_alias}." if source_alias else ""
        return ",\n  ".join(
            f"CAST({prefix}{quote_ident(c.name)} AS {duckdb_type(c.dtype)}) AS {quote_ident(c.name)}"
            for c in self.columns
        )


def quote_ident(name: str) -> str:
    """Quote a SQL identifier for DuckDB; the only place identifiers are quoted."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str | Path) -> str:
    """Quote a SQL string literal (a path, usually) for DuckDB: a workspace may live under a
    directory whose name holds a quote."""
    return "'" + str(value).replace("'", "''") + "'"


def duckdb_type(dtype: pa.DataType) -> str:
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return "VARCHAR"
    if pa.types.is_boolean(dtype):
        return "BOOLEAN"
    if pa.types.is_int32(dtype):
        return "INTEGER"
    if pa.types.is_int64(dtype):
        return "BIGINT"
    if pa.types.is_float64(dtype):
        return "DOUBLE"
    if pa.types.is_float32(dtype):
        return "FLOAT"
    if pa.types.is_timestamp(dtype):
        return "TIMESTAMPTZ" if dtype.tz else "TIMESTAMP"
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        return duckdb_type(dtype.value_type) + "[]"
    msg = f"no DuckDB type for arrow type {dtype!r}"
    raise TypeError(msg)


_S, _I, _F, _B = pa.string(), pa.int32(), pa.float64(), pa.bool_()
_KEY = dict(nullable=False)

EXPERIMENTS = ("exp5", "exp6", "core_exp", "online")
#: the terms of a reward, logged as ``reward/<term>`` next to ``reward/mean``
#: (``trainer.reward``: reward = acc_term - lat_pen - viol_pen - complexity + bonus)
REWARD_TERMS = ("acc_term", "lat_pen", "viol_pen", "complexity", "bonus")

SAMPLES = TableSchema(
    name="samples",
    description="One row per (dataset, sample_key): the sample's identity and question/answers.",
    primary_key=("dataset", "sample_key"),
    columns=(
        Column("dataset", _S, "dataset name from the file's config.dataset_name", **_KEY),
        Column("sample_key", _S, "stable sample id built from metadata (see 'Sample keys')", **_KEY),
        Column("key_source", _S, "rule that built the key: example_id | question_id | image_caption | image | "
                                 "image_question | question_hash", **_KEY),
        Column("split", _S, "dataset split, e.g. validation"),
        Column("example_id", _S, "metadata example_id (the dataset's question id for VQA-style sets), as text"),
        Column("question_id", _S, "metadata question_id, as text"),
        Column("image_id", _S, "metadata image_id, as text"),
        Column("question", _S, "question text"),
        Column("answers", pa.list_(_S), "reference answers "
                                        "(VQA answers, the correct option for multiple choice, captions)"),
        Column("metadata_json", _S, "the remaining metadata fields as a JSON object"),
        Column("source_file", _S, "file whose copy of the metadata was kept"),
    ),
)

MEASUREMENTS = TableSchema(
    name="measurements",
    description="One row per (experiment, dataset, sample_key, max_crops, top_k, num_active_blocks).",
    primary_key=("experiment", "dataset", "sample_key", "max_crops", "top_k", "num_active_blocks"),
    columns=(
        Column("experiment", _S, "exp5 | exp6 | core_exp | online", **_KEY),
        Column("dataset", _S, "dataset name", **_KEY),
        Column("split", _S, "dataset split"),
        Column("sample_key", _S, "see samples.sample_key", **_KEY),
        Column("max_crops", _I, "crop limit passed to the preprocessor "
                                "(core_exp: the tier's upper bound)", "crops", **_KEY),
        Column("top_k", _I, "MoE experts per token", "experts", **_KEY),
        Column("num_active_blocks", _I, "decoder blocks that ran", "blocks", **_KEY),
        Column("tier", _S, "core_exp vision tier (low | medium | high); null for exp5/exp6"),
        Column("num_crops", _I, "crops actually used by the tiling (core_exp, ctrl profile and online rows)", "crops"),
        Column("num_total_blocks", _I, "decoder blocks of the model", "blocks"),
        Column("active_block_indices", pa.list_(_I), "indices of the blocks that ran, sorted; each in "
               "0..num_total_blocks-1, none twice (a file recording otherwise is refused)"),
        Column("score", _F, "the sample's score under the dataset metric, 0..1 (CIDEr for captioning "
               "datasets: >= 0; a file recording a score outside is refused)"),
        Column("pred", _S, "the cleaned prediction"),
        Column("latency_total_ms", _F, "whole generate call; every recorded time is finite, >= 0 and at most "
               "one hour (a file recording otherwise is refused)", "ms"),
        Column("latency_prefill_ms", _F, "prefill pass; null where the recorded value is not a prefill time", "ms"),
        Column("latency_decode_ms", _F, "decode steps; null where the recorded 0 cannot be a time", "ms"),
        Column("latency_vision_ms", _F, "vision tower (core_exp, ctrl profile and online rows)", "ms"),
        Column("latency_prefill_raw_ms", _F, "the prefill figure exactly as recorded", "ms"),
        Column("num_vision_tokens", _I, "image_input_idx >= 0 count", "tokens"),
        Column("num_text_tokens", _I, "sequence length minus vision tokens", "tokens"),
        Column("num_output_tokens", _I, "generated tokens incl. EOS", "tokens"),
        Column("world_size", _I, "GPUs of the run that wrote the kept copy"),
        Column("source_file", _S, "file of the kept copy", **_KEY),
        Column("source_kind", _S, "kind of that file (see 'File kinds')", **_KEY),
        Column("num_copies", _I, "copies seen across files and sampler padding (1 = unique)", **_KEY),
        Column("flag_prefill_invalid", _B, "exp6 T_prefill_ms is the last decode step (D1): "
                                           "latency_prefill_ms is null", **_KEY),
        Column("flag_prefill_partial", _B, "core_exp T_LLM_prefill covers blocks 1..15 only (D2)", **_KEY),
        Column("flag_text_tokens_derived", _B, "exp6 num_language_tokens counted image placeholders (D10): "
                                               "num_text_tokens = language - vision", **_KEY),
        Column("flag_decode_missing", _B, "decode time recorded as 0 with more than one output token: "
                                          "latency_decode_ms is null", **_KEY),
        Column("flag_partial_config", _B, "kept copy is from a rank-0 file of a multi-GPU run whose merge was lost "
                                          "(~1/world_size of the samples)", **_KEY),
        Column("flag_copies_disagree", _B, "copies of this measurement have different score or pred", **_KEY),
    ),
)

_LAT_STATS = ("latency_total_ms_mean", "latency_total_ms_p50", "latency_total_ms_p95",
              "latency_prefill_ms_mean", "latency_decode_ms_mean", "latency_vision_ms_mean")

CONFIGS = TableSchema(
    name="configs",
    description="One row per (experiment, dataset, max_crops, top_k, num_active_blocks): "
                "the recorded summary next to the same figures recomputed from measurements.",
    primary_key=("experiment", "dataset", "max_crops", "top_k", "num_active_blocks"),
    columns=(
        Column("experiment", _S, "exp5 | exp6 | core_exp | online", **_KEY),
        Column("dataset", _S, "dataset name", **_KEY),
        Column("split", _S, "dataset split"),
        Column("max_crops", _I, "see measurements", "crops", **_KEY),
        Column("top_k", _I, "see measurements", "experts", **_KEY),
        Column("num_active_blocks", _I, "see measurements", "blocks", **_KEY),
        Column("tier", _S, "core_exp tier"),
        Column("num_total_blocks", _I, "decoder blocks of the model", "blocks"),
        Column("active_block_indices", pa.list_(_I), "blocks that ran"),
        Column("world_size", _I, "GPUs of the run whose summary was kept"),
        Column("summary_source_file", _S, "file whose summary was kept (merged > final > rank file)"),
        Column("recorded_accuracy", _F, "summary accuracy as recorded (NaN summaries become null)"),
        Column("recorded_accuracy_std", _F, "summary std as recorded"),
        Column("recorded_num_samples", _I, "summary num_samples as recorded (includes sampler padding)"),
        *(Column("recorded_" + n, _F, "summary latency statistic as recorded (origin exp6 prefill: see D1; "
                                      "ctrl profile files are exempt)", "ms") for n in _LAT_STATS),
        Column("accuracy", _F, "mean score over measurements"),
        Column("accuracy_std", _F, "population std of score over measurements"),
        Column("num_samples", _I, "distinct samples in measurements", "samples", **_KEY),
        *(Column(n, _F, "recomputed from measurements (quantiles: linear interpolation)", "ms") for n in _LAT_STATS),
        Column("flag_summary_nan", _B, "recorded summary is NaN or empty "
                                       "(a configuration that processed no samples)", **_KEY),
        Column("flag_partial_config", _B, "measurements come from a rank-0 file only (lost merge)", **_KEY),
    ),
)

FILES = TableSchema(
    name="files",
    description="The manifest: one row per ingested path.",
    primary_key=("path",),
    columns=(
        Column("path", _S, "absolute path of the file", **_KEY),
        Column("sha256", _S, "content hash of the file as last seen", **_KEY),
        Column("size_bytes", pa.int64(), "file size", "bytes", **_KEY),
        Column("mtime_ns", pa.int64(), "modification time when hashed (fast unchanged check)", "ns", **_KEY),
        Column("kind", _S, "detected file kind (see 'File kinds'); null when unknown"),
        Column("experiment", _S, "exp5 | exp6 | core_exp"),
        Column("dataset", _S, "config.dataset_name"),
        Column("status", _S, "ok | skipped | error", **_KEY),
        Column("error", _S, "one-line reason for skipped / error"),
        Column("note", _S, "non-fatal remarks, e.g. why a final aggregate's samples were not used"),
        Column("rows", _I, "measurement rows parsed from the file, before dedupe", **_KEY),
        Column("duplicate_rows", _I, "rows repeating an earlier row of the same file (sampler padding)", **_KEY),
        Column("fragment_sha256", _S, "content whose rows are in the tables "
                                      "(an older version when the file turned bad)"),
        Column("ingested_at", pa.timestamp("us", tz="UTC"), "when this version was ingested", **_KEY),
    ),
)

TABLES: dict[str, TableSchema] = {t.name: t for t in (SAMPLES, MEASUREMENTS, CONFIGS, FILES)}

# -- feature tables, written by `ctrl extract-features` under workspace/features/<fingerprint>/
_FEATURE_KEY = (
    Column("dataset", _S, "see samples", **_KEY),
    Column("sample_key", _S, "see samples", **_KEY),
    Column("model_fingerprint", _S, "hash of the model's config, tokenizer and weights", **_KEY),
)
_VECTOR = pa.list_(pa.float32())

IMAGE_FEATURES = TableSchema(
    name="image_features",
    description="One row per (dataset, sample_key, model_fingerprint): "
                "the pooled vision-backbone output of the global crop (what stage 2 reads) "
                "and over all crops at the reference crop setting.",
    primary_key=("dataset", "sample_key", "model_fingerprint"),
    columns=_FEATURE_KEY + (
        Column("image_id", _S, "samples.image_id"),
        Column("image_status", _S, "ok | missing | unreadable | no_image_id", **_KEY),
        Column("image_path", _S, "file the image was read from"),
        Column("image_width", _I, "original image width", "px"),
        Column("image_height", _I, "original image height", "px"),
        Column("reference_max_crops", _I, "max_crops of the vision pass both features come from", "crops", **_KEY),
        Column("num_crops", _I, "crops of that tiling (plus one global image)", "crops"),
        Column("feature", _VECTOR, "float32[image_feature_dim]: mean of every image token at reference_max_crops "
                                   "(analysis only: a server never runs that crop count); null when the image is "
                                   "missing or unreadable"),
        Column("global_feature", _VECTOR, "float32[image_feature_dim]: mean of the global crop's image tokens (the "
                                          "whole image resized to one crop), the same at every max_crops; what the "
                                          "controller's stage 2 reads; null when the image is missing or unreadable"),
    ),
)

LANG_FEATURES = TableSchema(
    name="lang_features",
    description="One row per (dataset, sample_key, model_fingerprint): "
                "mean input embedding (wte) of the prompt's text tokens.",
    primary_key=("dataset", "sample_key", "model_fingerprint"),
    columns=_FEATURE_KEY + (
        Column("num_prompt_tokens", _I, "text tokens of the formatted prompt", "tokens", **_KEY),
        Column("feature", _VECTOR, "float32[lang_feature_dim]", **_KEY),
    ),
)

IMAGE_TILINGS = TableSchema(
    name="image_tilings",
    description="One row per (dataset, sample_key, model_fingerprint, max_crops): "
                "the tiling the model's preprocessor picks.",
    primary_key=("dataset", "sample_key", "model_fingerprint", "max_crops"),
    columns=_FEATURE_KEY + (
        Column("max_crops", _I, "crop limit", "crops", **_KEY),
        Column("rows", _I, "tiling rows", **_KEY),
        Column("cols", _I, "tiling columns", **_KEY),
        Column("num_crops", _I, "rows * cols (the vision tower sees num_crops + 1 image arrays)", "crops", **_KEY),
    ),
)

FEATURE_TABLES: dict[str, TableSchema] = {t.name: t for t in (IMAGE_FEATURES, LANG_FEATURES, IMAGE_TILINGS)}

# -- run tables, written by `ctrl train` / `ctrl evaluate` under workspace/runs/<run_id>/
_L, _TS = pa.int64(), pa.timestamp("us", tz="UTC")
_RUN_ID = Column("run_id", _S, "the run directory's name", **_KEY)

RUNS = TableSchema(
    name="runs",
    description="One row per training run (runs/<run_id>/run.parquet); "
                "epoch and validation columns are null for online runs.",
    primary_key=("run_id",),
    columns=(
        _RUN_ID,
        Column("created_at", _TS, "start of the run"),
        Column("finished_at", _TS, "end of the run (null while running)"),
        Column("status", _S, "running | interrupted | failed | completed"),
        Column("num_epochs", _L, "epochs asked for"),
        Column("epochs_done", _L, "epochs finished"),
        Column("steps", _L, "optimizer steps taken"),
        Column("best_epoch", _L, "epoch with the best validation expected reward (0 = initial policy)"),
        Column("best_val_expected_reward", _F, "its exact expected reward on the val split"),
        Column("initial_val_expected_reward", _F, "the same for the untrained policy"),
        Column("loss_type", _S, "grpo | pairwise"),
        Column("seed", _L, "seed of the run"),
        Column("model_fingerprint", _S, "feature model the run trained on"),
        Column("workspace", _S, "workspace directory"),
        Column("num_train_samples", _L, "samples in the train split"),
        Column("num_val_samples", _L, "samples in the val split"),
        Column("num_test_samples", _L, "samples in the test split"),
        Column("num_actions", _L, "configurations in the action space"),
        Column("budget_min_ms", _F, "training budget range, low end", "ms"),
        Column("budget_max_ms", _F, "training budget range, high end", "ms"),
        Column("wall_time_s", _F, "duration", "s"),
        Column("phase", _S, "offline | online"),
        Column("parent_run_id", _S, "online runs: the run the controller was continued from (null: fresh)"),
    ),
)

METRICS = TableSchema(
    name="metrics",
    description="One row per optimizer step (kind='step') and per epoch (kind='epoch'; epoch 0 = initial policy).",
    primary_key=("run_id", "kind", "step", "epoch"),
    columns=(
        _RUN_ID,
        Column("kind", _S, "step | epoch"),
        Column("step", _L, "optimizer step (epoch rows: the last step of the epoch)"),
        Column("epoch", _L, "epoch, from 1 (0 = the initial policy)"),
        Column("loss", _F, "policy loss"),
        *(Column(f"reward/{part}", _F, f"mean {part} over the sampled configurations") for part in
          ("mean", *REWARD_TERMS)),
        Column("reward_std", _F, "step rows: standard deviation of the sampled configurations' rewards"),
        Column("violation_rate", _F, "step rows: share of the sampled configurations over budget"),
        Column("learning_rate", _F, "step rows: the optimizer's learning rate"),
        Column("groups", _L, "(sample, budget) groups used"),
        Column("zero_variance_groups", _L, "groups dropped: all rewards equal, no signal"),
        Column("kl", _F, "exact KL to the initial policy (0 when off)"),
        Column("clip_ratio", _F, "share of clipped ratio terms"),
        Column("grad_norm", _F, "gradient norm before clipping"),
        Column("val/expected_reward", _F, "epoch rows: exact sum_a pi(a|x) r(x,a) "
                                          "on the val split over the budget grid"),
        Column("val/expected_accuracy", _F, "epoch rows: expected score on the val split"),
        Column("val/expected_violation_rate", _F, "epoch rows: expected share of latency > budget"),
        Column("wall_time_s", _F, "since the run started", "s"),
    ),
)

EVALUATIONS = TableSchema(
    name="evaluations",
    description="One row per (run, decider, budget): on every sample out of fold for a cross-fitted offline run, "
                "else on the test split (runs/<run_id>/evaluation.parquet).",
    primary_key=("run_id", "decider", "budget_ms"),
    columns=(
        _RUN_ID,
        Column("decider", _S, "controller | policy | outcome | oracle | clairvoyant | best_static | lut_p95 | "
                              "lut_by_family | lut_by_question | lut_by_cluster | lut_mean5 | largest | random "
                              "(offline); controller | offline_start (online)"),
        Column("budget_ms", _F, "latency budget", "ms"),
        Column("num_samples", _L, "test samples"),
        Column("accuracy", _F, "mean recorded score of the chosen configurations"),
        Column("latency_ms_mean", _F, "mean latency of the chosen configurations", "ms"),
        Column("latency_ms_p95", _F, "p95 latency of the chosen configurations", "ms"),
        Column("violation_rate", _F, "share of samples with latency > budget"),
        Column("accuracy_within_budget", _F, "mean score counting answers over budget as 0 "
                                             "(what a service with this deadline delivers)"),
        Column("reward_mean", _F, "mean reward of the decisions"),
        Column("expected_reward", _F, "exact expected reward of the decider's distribution "
                                      "(= reward_mean when deterministic)"),
        Column("config_histogram", _S, "JSON {\"C/K/B\": count} of the chosen configurations"),
        Column("accuracy_se", _F, "standard error of accuracy over the samples"),
        Column("accuracy_vs_table", _F, "mean per-sample score difference to lut_p95's choice (paired); "
                                        "null without a lut_p95 row"),
        Column("accuracy_vs_table_se", _F, "standard error of accuracy_vs_table"),
    ),
)

EVALUATION_GROUPS = TableSchema(
    name="evaluation_groups",
    description="An offline evaluation broken down per dataset, per question family and per question cluster: one "
                "row per (run, decider, "
                "budget, group), on the samples of evaluation.parquet (runs/<run_id>/evaluation_groups.parquet).",
    primary_key=("run_id", "decider", "budget_ms", "group_by", "group"),
    columns=(
        _RUN_ID,
        Column("decider", _S, "as in evaluations"),
        Column("budget_ms", _F, "latency budget", "ms"),
        Column("group_by", _S, "dataset | family | cluster"),
        Column("group", _S, "the dataset's name, the labelled question family ((none): samples without one), or the "
                            "family or cluster the question reads as under the deployed table"),
        Column("num_samples", _L, "samples of the group"),
        Column("accuracy", _F, "mean recorded score of the chosen configurations"),
        Column("accuracy_se", _F, "standard error of accuracy over the group's samples"),
        Column("violation_rate", _F, "share of the group's samples with latency > budget"),
        Column("accuracy_within_budget", _F, "mean score counting answers over budget as 0"),
        Column("config_histogram", _S, "JSON {\"C/K/B\": count} of the chosen configurations"),
    ),
)

_ONLINE_EXTRA = (
    _RUN_ID,
    Column("step", _L, "optimizer step of the online run (from 1)", **_KEY),
    Column("group_index", _L, "(sample, budget) group within the run, from 0", **_KEY),
    Column("member", _I, "member within its group, 0..G-1", **_KEY),
    Column("rank", _I, "torch.distributed rank that ran it", **_KEY),
    Column("insertion_position", _I, "stage 2 ran after blocks 0..p-1 (p in 1..5)", "blocks", **_KEY),
    Column("budget_ms", _F, "latency budget of the group", "ms", **_KEY),
    Column("latency_controller_ms", _F, "both controller stages (inside latency_total_ms)", "ms", **_KEY),
    Column("latency_stage1_ms", _F, "stage 1: crops, insertion position, budget token", "ms", **_KEY),
    Column("latency_stage2_ms", _F, "stage 2 on the latency token: top-K, block count", "ms", **_KEY),
    Column("latency_decode_step_ms", pa.list_(_F), "each decode step (num_output_tokens - 1 entries)", "ms", **_KEY),
    Column("reward", _F, "reward of the rollout (the run's reward config)", **_KEY),
    Column("violated", _B, "latency_total_ms > budget_ms", **_KEY),
    Column("log_prob", _F, "log pi of the configuration when it was sampled", **_KEY),
    Column("generated_text", _S, "the decoded answer before cleaning", **_KEY),
    Column("latency_modeled", _B, "a batched rollout: its suffix and decode-step latencies are the latency "
                                  "model's, the rest measured (--rollout-batch); false: every latency timed alone; "
                                  "null in runs written before the column"),
)

ROLLOUTS = TableSchema(
    name="rollouts",
    description=("One row per online rollout (runs/<run_id>/rollouts/step-NNNNNN.parquet): the measurements columns "
                 "(experiment 'online'; latencies measured with hooks on this machine, latency_total_ms includes the "
                 "controller) plus the online columns. The `measurements` view includes these rows, with the online "
                 "columns null for ingested rows."),
    primary_key=("run_id", "step", "group_index", "member"),
    columns=MEASUREMENTS.columns + _ONLINE_EXTRA,
)

ONLINE_STEPS = TableSchema(
    name="online_steps",
    description="One row per online optimizer step (runs/<run_id>/online_steps.parquet).",
    primary_key=("run_id", "step"),
    columns=(
        _RUN_ID,
        Column("step", _L, "optimizer step, from 1", **_KEY),
        Column("loss", _F, "policy loss"),
        *(Column(f"reward/{part}", _F, f"mean {part} over the step's rollouts") for part in
          ("mean", *REWARD_TERMS)),
        Column("reward_std", _F, "standard deviation of the step's rollout rewards"),
        Column("learning_rate", _F, "the optimizer's learning rate"),
        Column("accuracy", _F, "mean score of the rollouts"),
        Column("latency_ms_mean", _F, "mean latency_total_ms", "ms"),
        Column("violation_rate", _F, "share of rollouts over budget"),
        Column("controller_ms_mean", _F, "mean controller time per rollout", "ms"),
        Column("groups", _L, "(sample, budget) groups of the step"),
        Column("zero_variance_groups", _L, "groups dropped: all rewards equal"),
        Column("rollouts", _L, "rollouts of the step (all ranks)"),
        Column("prefixes", _L, "shared prefixes run (all ranks): "
                               "fewer than rollouts when members share a stage-1 choice"),
        Column("grad_norm", _F, "gradient norm before clipping"),
        Column("time_model_s", _F, "rollout execution: vision, prefill, decode (rank 0)", "s"),
        Column("time_controller_s", _F, "controller decisions and sampling during rollouts (rank 0)", "s"),
        Column("time_update_s", _F, "loss with the latency-token recompute, backward, optimizer (rank 0)", "s"),
        Column("time_bookkeeping_s", _F, "rewards, gathering across ranks, metrics, Parquet, "
                                         "checkpoints (rank 0)", "s"),
        Column("wall_time_s", _F, "since the run started", "s"),
        Column("check_gain", _F, "held-out check after this step (null on steps without one): accuracy within "
                                 "budget of the latest controller minus the run's start, paired on validation "
                                 "requests"),
        Column("check_gain_low", _F, "lower end of check_gain's 95% bootstrap interval (over samples)"),
        Column("check_gain_high", _F, "upper end of check_gain's 95% bootstrap interval"),
        Column("check_late_share", _F, "share of the latest controller's check answers over budget"),
        Column("check_start_late_share", _F, "share of the start's check answers over budget"),
        Column("check_requests", _L, "(sample, budget) pairs of the check"),
        Column("check_same_choice", _L, "pairs where the latest controller chose the start's configuration: its one "
                                        "run stood for both (the other pairs ran both, back to back)"),
        Column("time_check_s", _F, "wall time of the check (rank 0)", "s"),
        Column("rollouts_modeled", _L, "rollouts of the step that ran batched, their suffix and decode latencies "
                                       "modeled (all ranks; 0 with --rollout-batch 1)"),
        Column("latency_model_error", _F, "median relative error of the latency model's suffix + decode on the "
                                          "step's rollouts timed alone that it could predict (rank 0; null: none)"),
        Column("kept_step", _L, "the step whose controller the run keeps after this step (0: its start; null: "
                                "the run has no checks)"),
    ),
)

SIMULATIONS = TableSchema(
    name="simulations",
    description="One row per (simulation, decider, arrival rate, budget mix) of `ctrl simulate`: the server's "
                "own admission, queue, planner and controller on a virtual clock, each request's model time and "
                "score the profile's for its sample at the configuration chosen "
                "(runs/<run_id>/simulations/<simulation_id>.parquet; docs/simulate.md).",
    primary_key=("simulation_id", "decider", "rate_rps", "budget_ms"),
    columns=(
        Column("simulation_id", _S, "one `ctrl simulate` call (UTC time and a random suffix)", **_KEY),
        _RUN_ID,
        Column("decider", _S, "controller, or static:C/K/B (crops/top-K/blocks fixed per request; cheapest and "
                              "front expand to these)", **_KEY),
        Column("arrivals", _S, "poisson, or trace:<file name> (its mean rate rescaled to rate_rps)"),
        Column("rate_rps", _F, "mean arrival rate, all replicas together", "1/s", nullable=False),
        Column("load", _F, "rate_rps over one replica's capacity_rps"),
        Column("budget_ms", _S, "the budget (ms), or the mix of budgets with their shares (150:0.6,300:0.4)",
               nullable=False),
        Column("replicas", _L, "servers behind the balancer (with a target: the fewest found to meet it)"),
        Column("balancer", _S, "round-robin | least-loaded | power-of-two"),
        Column("seed", _L, "seeds the arrivals, the samples drawn and the budgets of a mix"),
        Column("sample_split", _S, "the unseen samples drawn from: dataset:<name>, val or test"),
        Column("samples", _L, "unseen samples recorded at every configuration, drawn with replacement"),
        Column("latency_scale", _F, "the machine's model time over the profile's"),
        Column("overheads", _S, "where the fixed per-request costs came from: profile (none), or the request log"),
        Column("capacity_rps", _F, "one replica's capacity: 1 / the mean worker time at the full configuration",
               "1/s"),
        Column("target", _F, "--target: the within-budget share the fewest replicas were sought for (null: none)"),
        Column("meets_target", _B, "whether this row's replicas meet the target (null without one)"),
        Column("requests", _L, "requests simulated in the cell"),
        Column("within_budget", _F, "share answered within budget on the client's clock (503, 504: missed)"),
        Column("within_budget_low", _F, "95 % Wilson interval of within_budget, lower end"),
        Column("within_budget_high", _F, "95 % Wilson interval of within_budget, upper end"),
        Column("accuracy", _F, "mean score of the answered requests"),
        Column("right_within_budget", _F, "mean over all requests of the score where answered within budget, else 0"),
        Column("goodput_rps", _F, "right answers within budget per second of arrivals", "1/s"),
        Column("latency_p50_ms", _F, "median client latency of the answered requests", "ms"),
        Column("latency_p95_ms", _F, "95th percentile client latency of the answered requests", "ms"),
        Column("latency_p99_ms", _F, "99th percentile client latency of the answered requests", "ms"),
        Column("rejected_503", _F, "share refused on arrival: queue full, or budget unreachable behind the queue"),
        Column("dropped_504", _F, "share dropped from the queue (budget left behind, or past the queue deadline)"),
        Column("cheapest_share", _F, "share the server's cheapest rule decided (the controller not asked)"),
    ),
)

RUN_TABLES: dict[str, TableSchema] = {t.name: t for t in (RUNS, METRICS, EVALUATIONS, EVALUATION_GROUPS, ONLINE_STEPS,
                                                           ROLLOUTS, SIMULATIONS)}

# -- the request log, written by `ctrl serve` under workspace/requests/ (one JSON line per request)
_D = pa.float64()
REQUESTS = TableSchema(
    name="requests",
    description="One row per request `ctrl serve` handled (workspace/requests/*.jsonl, one file per server "
                "process, append-only). Latencies are null for requests that did not finish.",
    primary_key=("request_id",),
    columns=(
        Column("request_id", _S, "the response's id (chatcmpl-...)", **_KEY),
        Column("time", _TS, "when the request arrived"),
        Column("status", _S, "ok | cancelled (the client disconnected, or the server was stopped at once) | "
                              "error | dropped (its budget had long passed in the queue: --queue-deadline; or "
                              "what was left of it was less than the cheapest configuration takes: "
                              "--refuse-unreachable) | "
                              "refused (503 on arrival: the requests ahead left too little of its budget for the "
                              "cheapest configuration, --refuse-unreachable)"),
        Column("model", _S, "the served model's name"),
        Column("model_fingerprint", _S, "fingerprint of the model that answered"),
        Column("controller_run", _S, "run id or file of the controller; `request` when the request fixed its knobs"),
        Column("controller_phase", _S, "offline | online | request"),
        Column("budget_ms", _D, "the request's latency budget", "ms"),
        Column("budget_source", _S, "request (its latency_budget_ms, or its x-slo-ttft-ms / x-slo-tpot-ms "
                                    "headers) | default (it stated no budget)"),
        Column("queue_length", _L, "requests waiting or running when it arrived"),
        Column("unreachable", _B, "on arrival, the requests ahead left too little of its budget for the cheapest "
                                  "configuration, and it asked to be run anyway (when_unreachable: run): it ran at "
                                  "the cheapest configuration (docs/serving.md#overload)"),
        Column("waited_ms", _D, "arrival to stage 1 (parsing, image decoding, queue): what stage 1 subtracts "
                                "from the budget", "ms"),
        Column("reserve_ms", _D, "reserve for what the request costs outside the model's profiled path after stage 1 "
                                 "(preprocessing, stage 2, detokenisation) and after its text (the reply's "
                                 "serialisation and write): p90 of recent requests each (docs/serving.md#budget-terms)",
               "ms"),
        Column("reply_reserve_ms", _D, "the reply's part of reserve_ms", "ms"),
        Column("budget_left_ms", _D, "budget_ms less the time spent before stage 1 and the reserve", "ms"),
        Column("queue_cap_ms", _D, "the most this request could take so that the requests waiting behind it could "
                                   "still meet their budgets at the cheapest configuration (docs/serving.md#"
                                   "queue-aware-budgets); null when nothing capped it", "ms"),
        Column("arrival_rate_rps", _D, "requests per second whose cost the controller chooses, over the last "
                                       "arrivals (docs/serving.md#load-aware-budgets); null before five", "1/s"),
        Column("arrival_cap_ms", _D, "the most a request could take so that the requests still to come, at that "
                                     "arrival rate, would on average meet a budget like this one (an M/G/1 queue's "
                                     "mean waiting time, Kingman's G/G/1 one under --burst-aware); null without an "
                                     "arrival rate", "ms"),
        Column("arrival_scv", _D, "the arrivals' variability the wait model read: the index of dispersion of the "
                                  "arrival counts over windows of the budget, kept within [1, 16] (1: Poisson, "
                                  "and always 1 under --no-burst-aware); null without an arrival rate"),
        Column("latency_scale", _D, "this machine's model time per ms of the controller's training latencies "
                                    "(docs/serving.md#latency-calibration)"),
        Column("budget_class", _S, "the budget over the cheapest configuration's expected time: <1x, 1-1.5x, "
                                   "1.5-2x, 2-3x, 3-5x, >=5x; each class keeps its own margin"),
        Column("budget_margin", _D, "the share of the budget left the controller read, kept per budget class so "
                                    "that met_target of its requests meet their budget (docs/serving.md#met-target); "
                                    "1 for fixed knobs and class <1x"),
        Column("met_target", _D, "the share of requests the class's margin aims at: --met-target, or feasible_rate "
                                 "where that is less; null for fixed knobs, class <1x and --met-target 0"),
        Column("feasible_rate", _D, "the share of the recently served requests' latencies at which the cheapest "
                                    "configuration would have met this budget, averaged over the class's recent "
                                    "requests; null for fixed knobs"),
        Column("floor", _B, "the cheapest configuration's floor decided the request: its budget class's "
                            "controller requests had recently met their budgets less often than a replay of the "
                            "same arrivals at the cheapest configuration (docs/serving.md#the-cheapest-floor); "
                            "null for requests that did not reach stage 1"),
        Column("controller_budget_ms", _D, "what both stages read, in the profile's ms: min(budget_left_ms, "
                                           "queue_cap_ms - after-stage-1 reserve, arrival_cap_ms - after-stage-1 "
                                           "reserve) x budget_margin / latency_scale / batch_factor", "ms"),
        Column("batch_factor", _D, "--max-batch > 1: how much longer than alone the request was expected to take "
                                   "beside the rows of the batch it joined, at the knobs of the request started "
                                   "before it (docs/serving.md#the-batch-factor); 1 alone, for fixed knobs and "
                                   "--max-batch 1"),
        Column("batch_rows_expected", _L, "--max-batch > 1: the rows of the batch it joined as stage 1 found them, "
                                          "itself included (1: alone); null for fixed knobs and --max-batch 1"),
        Column("occupancy", _D, "the share of a request's time on the worker that it holds the worker alone, as "
                                "the queue and arrival caps read it (1 one request at a time; the recent requests' "
                                "mean under --max-batch > 1); null for fixed knobs"),
        Column("decided_by", _S, "controller | table (the run's table fallback) | cheapest (the budget read was "
                                 "below every configuration's reference latency) | request (fixed knobs)"),
        Column("question_group", _S, "the question family or cluster the question reads as under the controller's "
                                     "fallback table (a family's label, a cluster's leading words); null without one"),
        Column("guarded_from", _S, "the configuration the controller chose (max_crops/top_k/num_active_blocks) where "
                                   "the per-configuration guard replaced it: its median on this machine exceeded the "
                                   "budget read (docs/serving.md#budget-terms); null otherwise"),
        Column("expected_latency_ms", _D, "the deployed cost model's predicted median latency of this request at the "
                                          "configuration it ran, in the profile's ms (x latency_scale on this "
                                          "machine); null for fixed knobs and controllers exported without one", "ms"),
        Column("latency_quantile_ms", _D, "the same prediction's quantile (the cost model's, p95 by default), the "
                                          "bound a per-request table held the budget to", "ms"),
        Column("cost_basis", _S, "what the prediction rests on: request (this request's tiling, prompt length and "
                                 "question) | extrapolated (its own, with crops or a prompt beyond what the cost "
                                 "model was fitted on: read along the fitted line) | configuration (the "
                                 "configuration's spread over the profile: no tiling, or no cost model deployed)"),
        Column("max_crops", _L, "knob: crops choice", "crops"),
        Column("insertion_position", _L, "decoder blocks run before stage 2 (0: stage 2 before block 0)", "blocks"),
        Column("top_k", _L, "knob: experts per token (of the blocks after the insertion position)"),
        Column("num_active_blocks", _L, "knob: decoder blocks run", "blocks"),
        Column("num_crops", _L, "crops of the image's tiling at max_crops", "crops"),
        Column("num_prompt_tokens", _L, "prompt tokens, image tokens included", "tokens"),
        Column("num_output_tokens", _L, "generated tokens", "tokens"),
        Column("finish_reason", _S, "stop (end of sequence, or a stop sequence: stop_hit) | length (max_tokens); "
                                    "null for a request not answered"),
        Column("stop_hit", _S, "the request's stop sequence that ended the answer (the answer is cut before it); "
                               "null otherwise"),
        Column("stream", _B, "the answer was streamed as server-sent events (`stream: true`); null in logs written "
                             "before streaming existed"),
        Column("temperature", _D, "sampling temperature; 0: greedy decoding (the controller was trained on greedy "
                                  "answers); null in logs written before sampling existed"),
        Column("top_p", _D, "nucleus sampling's probability mass (1: the whole vocabulary)"),
        Column("seed", _L, "the sampling seed: the request's `seed`, or one drawn for it, so that the answer can be "
                           "reproduced with the same knobs; null for greedy decoding"),
        Column("metadata", _S, "the request's `metadata` (the client's own labels: up to 16 string pairs, "
                               "OpenAI's field) as a JSON object's text, e.g. `metadata->>'example_id'`; null "
                               "without one. `ctrl simulate --calibrate-from` pairs a request whose "
                               "`example_id` names a simulated sample with that sample's profiled latency"),
        *(Column(f"latency_{stage}_ms", _D, what, "ms") for stage, what in (
            ("parse", "arrival to the queue: body, JSON, image decoding"),
            ("queue", "waiting for the model"),
            ("stage1", "language feature, tiling and the controller's stage 1"),
            ("preprocess", "crops and tokens at the chosen max_crops"),
            ("vision", "the vision tower"),
            ("prefill", "decoder blocks of the prefill (both parts)"),
            ("stage2", "the controller's stage 2"),
            ("decode", "decode steps after the first token"),
            ("model", "the vision pass, the prefill and the decode steps: what ctrl profile times as one generate "
                      "(the latency scale compares it with the profile)"),
            ("total", "arrival to the answer's text, as the client waits for it"))),
        Column("met", _B, "latency_total_ms <= budget_ms"),
        Column("captured", _B, "a CUDA graph (a decode step's window, the ViT's array count) was captured while the "
                               "request ran, a one-time cost the warm-up did not take off it "
                               "(docs/serving.md#warm-up); false without CUDA graphs, null in logs written before "
                               "it was recorded or for requests that never reached the model"),
        Column("answer", _S, "the generated text"),
        Column("error", _S, "what failed, for status error"),
        Column("batch_rows_prefill", _L, "--max-batch > 1: the requests prefilled together in the pass its "
                                         "prefill ran in, itself included (null: served one at a time)"),
        Column("batch_rows_decode", _D, "--max-batch > 1: the mean rows of the decode steps it took part in "
                                        "(null: served one at a time, or answered in one token)"),
        Column("alone_max_crops", _L, "the crops the controller would have chosen alone, where the batch the "
                                      "request joined changed its choice (docs/serving.md#the-batch-factor); null "
                                      "where it did not", "crops"),
        Column("alone_top_k", _L, "the top-K stage 2 would have chosen alone, where the batch changed the choice "
                                  "at the same crops; null otherwise (null too where the crops differ: stage 2 "
                                  "alone would read another vision pass)"),
        Column("alone_num_active_blocks", _L, "the blocks stage 2 would have chosen alone (as alone_top_k)",
               "blocks"),
    ),
)


def schema_markdown(table: TableSchema) -> str:
    """The docs/schema.md section of one table, generated so docs and code cannot drift."""
    lines = [
        f"#### `{table.name}`",
        "",
        table.description + f" Primary key: ({', '.join(table.primary_key)}).",
        "",
        "| column | type | unit | description |",
        "|---|---|---|---|",
    ]
    for c in table.columns:
        description = c.description.replace("|", "\\|")  # a bare | would split the table cell
        lines.append(f"| `{c.name}` | {duckdb_type(c.dtype)} | {c.unit or ''} | {description} |")
    return "\n".join(lines)


def schemas_markdown() -> str:
    """All tables' docs/schema.md sections (``ctrl schema`` prints this)."""
    return "\n\n".join(schema_markdown(t) for t in (*TABLES.values(), *FEATURE_TABLES.values(), *RUN_TABLES.values(),
                                                     REQUESTS))
