"""Train the embedded model on the testbed task (CPU, minutes, deterministic) and evaluate its knob trade-off.

Recipe (``TestbedRecipe``): start from ``write_embedded_model(seed=base_seed, pool=image_pool)``
(the embedded default's architecture, tokenizer and directory format; ``image_pool`` sets the image
tokens per crop), rescale the routers (``router_init_gain``), set fixed periodic filters in the
ViT's patch embedding (``vision_init``), train the vision path alone with a temporary answer head
(``vision_pretrain_steps``, :func:`pretrain_vision`), then AdamW (vision path at ``vision_lr``) on
the teacher-forced next-token loss of the answer tokens (answer + EOS) after
``runtime.format_prompt(question)``, the image going through ``runtime.preprocess``. The parts in
``frozen`` keep their starting values (:func:`frozen_modules`); the experts keep the seeded weights
plus, with ``expert_lora_rank``, a trained low-rank update (``testbed.lowrank``), or train whole
with ``train_experts``. The trained parameters and update factors end rounded to float16 values
(:func:`round_trained_parameters`, ``merge_low_rank_updates``), so that the result ships compactly
(``testbed.shipped``). Every optimizer step draws one knob setting for its whole batch:

* ``max_crops`` from ``crops_choices`` (the preprocessing of that step),
* the MoE top-K of every layer from ``top_k_choices`` (``layer.mlp.gate.top_k``),
* the number of active blocks n from ``min_blocks..16``, the blocks being
  ``runtime.blocks_for(n)`` (the importance rule used at inference; block 0 always runs). With
  probability ``full_prob``, and always during the first ``full_warmup`` share of the steps, the
  step runs the full model instead (the largest top-K, all blocks). The default recipe draws one
  top-K and 16 blocks only: trained at one setting, the model pays for a lower one at inference.

The experts run through transformers' ``grouped_mm`` implementation (its CPU fallback has an
autograd formula; checked against ``eager``). Deterministic for a config: one seeded
generator for the data order and knobs, ``torch.manual_seed``, a fixed thread count and
``torch.use_deterministic_algorithms`` during training.

The trained model is cached as ``<cache root>/testbed-v<version>-<recipe hash>`` (``$CTRL_CACHE_DIR``
or ``~/.cache/ctrl``): written to a temporary sibling, marker last, renamed into place, reused
when present, rebuilt from the shipped weights when they are this recipe's (:func:`train_testbed`;
``--model testbed`` loads :func:`cached_testbed_dir` and never trains). ``testbed.json`` in it
records the recipe and the training log.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from PIL import Image

from pipeline.knobs import BALANCED_MAX_CROPS, BALANCED_NUM_ACTIVE_BLOCKS, BALANCED_TOP_K
from runtime import ExecutionOptions, load_runtime
from runtime.cache import cache_tmp_dir
from runtime.embedded import EmbeddedRuntime
from runtime.embedded_model import (
    RECIPE_FILE,
    ROUTER_INIT_GAIN,
    publish_model_dir,
    save_embedded_model,
    write_embedded_model,
)
from runtime.registry import TESTBED_VERSION, TestbedRecipe, cached_testbed_dir, testbed_model_dir
from runtime.scoring import score_answer
from testbed.dataset import VqaDataset, read_dataset
from testbed.lowrank import LORA_FILE, add_low_rank_updates, merge_low_rank_updates
from testbed.shipped import SHIPPED_WEIGHTS, materialise, serialize_factors, shipped_recipe_hash, trained_parameters
from testbed.task import FAMILIES, TaskSpec, generate_dataset


@dataclass
class TrainReport:
    model_dir: Path
    trained: bool
    #: rebuilt from the shipped weights (``testbed.shipped``) instead of trained
    from_shipped: bool = False
    train_seconds: float = 0.0
    losses: list[float] = field(default_factory=list)


# -- helpers ------------------------------------------------------------------------------------

@contextmanager
def _deterministic(threads: int) -> Iterator[None]:
    """Fixed thread count and deterministic algorithms for the duration; previous state restored."""
    saved_threads = torch.get_num_threads()
    saved_det = torch.are_deterministic_algorithms_enabled()
    saved_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(max(1, int(threads)))
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved_det, warn_only=saved_warn)
        torch.set_num_threads(saved_threads)


def _answer_ids(runtime: EmbeddedRuntime, answer: str) -> list[int]:
    return list(runtime.tokenizer(" " + answer.strip(), add_special_tokens=False)["input_ids"]) + [runtime.eos_id]


def _set_top_k(runtime: EmbeddedRuntime, top_k: int) -> None:
    for layer in runtime.decoder_layers:
        layer.mlp.gate.top_k = int(top_k)


def _batch_loss(runtime: EmbeddedRuntime, items: Sequence[tuple[Image.Image, str, str]], max_crops: int,
                blocks: Sequence[int]) -> torch.Tensor:
    """Mean over the batch of each example's mean next-token loss on its answer tokens (+ EOS).

    Sequences are right-padded and run without an attention mask: causal attention never lets
    a real token see the padding after it, and every sequence starts at position 0.
    """
    seqs, images, answer_spans = [], [], []
    for image, question, answer in items:
        inputs = runtime.preprocess(image, question, max_crops)
        prompt = inputs.input_ids[0].tolist()
        target = _answer_ids(runtime, answer)
        seqs.append(prompt + target[:-1])
        images.append(inputs.images)
        answer_spans.append((len(prompt) - 1, target))
    emb_layer = runtime.decoder.get_input_embeddings()
    tokens = runtime.vision_backbone(torch.cat(images)).reshape(-1, emb_layer.embedding_dim)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), runtime.tokenizer.pad_token_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    embeds = emb_layer(ids)
    is_image = ids == runtime.image_patch_id
    # image features replace the placeholders, row-major over (example, position) as the arrays were stacked
    embeds = embeds.masked_scatter(is_image[..., None], tokens.to(embeds.dtype))
    with runtime.running_layers(blocks):
        logits = runtime.decoder(inputs_embeds=embeds, use_cache=False).logits
    losses = []
    for i, (start, target) in enumerate(answer_spans):
        pred = logits[i, start:start + len(target)].float()
        losses.append(torch.nn.functional.cross_entropy(pred, torch.tensor(target)))
    return torch.stack(losses).mean()


def periodic_patch_filters(patch_px: int, count: int) -> torch.Tensor:
    """(count <= 21, 3, patch, patch) fixed filters on luminance: cosines of periods 2-5 px, phases 0
    and pi/2 (0 only for period 2), along x (vertical lines), along y and their product (checks), each
    zero-mean (a plain patch of any colour gives 0) and of unit norm.

    A linear patch embedding with these responds to fine periodic patterns of either phase
    (one of the two phases is away from zero), which a randomly initialised 3-layer ViT does not
    learn to pick out within minutes of training."""
    xs = torch.arange(patch_px, dtype=torch.float64)
    filters = []
    for period in (2, 3, 4, 5):
        for phase in ((0.0,) if period == 2 else (0.0, math.pi / 2)):  # sin(pi x) is 0 on the pixel grid
            wave = torch.cos(2 * math.pi * xs / period + phase)
            filters += [wave[None, :].expand(patch_px, patch_px), wave[:, None].expand(patch_px, patch_px),
                        wave[:, None] * wave[None, :]]
    if not 0 <= count <= len(filters):
        msg = f"periodic_filters must be in 0..{len(filters)}, got {count}"
        raise ValueError(msg)
    bank = torch.stack(filters[:count])
    bank = bank - bank.mean(dim=(1, 2), keepdim=True)  # zero response to any plain patch
    bank = bank / bank.flatten(1).norm(dim=1)[:, None, None]
    return (bank[:, None].expand(count, 3, patch_px, patch_px) / math.sqrt(3)).float()


def _init_vision(runtime: EmbeddedRuntime, config: TestbedRecipe) -> None:
    if config.vision_init == "random":
        return
    if config.vision_init != "periodic":
        msg = f"vision_init must be 'random' or 'periodic', got {config.vision_init!r}"
        raise ValueError(msg)
    conv = runtime.vision.embeddings.patch_embedding
    n = config.periodic_filters
    with torch.no_grad():
        scale = conv.weight[n:].flatten(1).norm(dim=1).mean()  # as strong as the other filters
        conv.weight[:n] = periodic_patch_filters(conv.weight.shape[-1], n) * scale


def _lr_at(step: int, config: TestbedRecipe) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def pretrain_vision(runtime: EmbeddedRuntime, dataset: VqaDataset, config: TestbedRecipe,
                    progress: Callable[[int, float], None] | None = None) -> list[float]:
    """Train the vision path alone: mean image token -> linear head -> the answer, cross-entropy
    over the answers of the sample's question family only (the head does not see the question,
    so one softmax over every family's answers would mostly learn which family an image
    belongs to), AdamW at the vision learning rate, max_crops drawn per step. The head is
    discarded afterwards; returns the per-step losses."""
    samples = [s for s in dataset.samples
               if not config.vision_pretrain_families or s.family in config.vision_pretrain_families]
    if not samples:
        msg = f"no training samples of the vision pretraining families {config.vision_pretrain_families}"
        raise ValueError(msg)
    classes = sorted({(s.family, s.answers[0]) for s in samples})
    label_of = {key: i for i, key in enumerate(classes)}
    # additive mask per family: 0 on its own answers, -inf elsewhere
    family_mask = {f: torch.tensor([0.0 if cf == f else -math.inf for cf, _ in classes])
                   for f in {cf for cf, _ in classes}}
    head = torch.nn.Linear(runtime.image_feature_dim, len(label_of))
    module = runtime.vision_backbone
    module.requires_grad_(True)
    module.train()
    optimizer = torch.optim.AdamW([*module.parameters(), *head.parameters()], lr=config.vision_peak_lr,
                                  betas=(0.9, 0.98),
                                  weight_decay=config.weight_decay)
    rng = random.Random(config.seed + 1)
    losses: list[float] = []
    try:
        for step in range(config.vision_pretrain_steps):
            max_crops = rng.choice(config.crops_choices)
            feats, labels, masks = [], [], []
            for s in rng.sample(samples, min(config.batch_size, len(samples))):
                with Image.open(dataset.image_path(s)) as img:
                    inputs = runtime.preprocess(img.convert("RGB"), s.question, max_crops)
                feats.append(module(inputs.images).mean(dim=(0, 1)))
                labels.append(label_of[(s.family, s.answers[0])])
                masks.append(family_mask[s.family])
            logits = head(torch.stack(feats)) + torch.stack(masks)
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(labels))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(module.parameters()), config.grad_clip)
            optimizer.step()
            losses.append(float(loss.detach()))
            if progress is not None:
                progress(step + 1, losses[-1])
    finally:
        module.requires_grad_(False)
        module.eval()
    return losses


def train_model(runtime: EmbeddedRuntime, dataset_dir: Path, config: TestbedRecipe,
                progress: Callable[[int, float], None] | None = None,
                pretrain_progress: Callable[[int, float], None] | None = None) -> list[float]:
    """Train the runtime's modules in place on the dataset; returns the per-step losses
    (after :func:`pretrain_vision` when ``config.vision_pretrain_steps``)."""
    dataset = read_dataset(dataset_dir)
    samples = list(dataset.samples)
    if not samples:
        msg = f"{dataset_dir}: no samples to train on"
        raise ValueError(msg)
    torch.manual_seed(config.seed)  # the pretraining head's init (reseeded below for the main phase)
    if config.vision_pretrain_steps:
        pretrain_vision(runtime, dataset, config, pretrain_progress)
    modules = (runtime.vision_backbone, runtime.decoder)  # the backbone holds the ViT and the projector
    for m in modules:
        m.requires_grad_(True)
        m.train()
    if not config.train_experts:
        for layer in runtime.decoder_layers:
            layer.mlp.experts.requires_grad_(False)
    if config.expert_lora_rank:
        add_low_rank_updates(runtime.decoder_layers, config.expert_lora_rank, seed=config.seed + 7)
    for module in frozen_modules(runtime, config.frozen):
        module.requires_grad_(False)
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    groups = []
    for module, lr in ((runtime.vision_backbone, config.vision_peak_lr), (runtime.decoder, config.lr)):
        own = [p for p in module.parameters() if p.requires_grad]
        groups += [{"params": [p for p in own if p.ndim >= 2], "weight_decay": config.weight_decay, "base_lr": lr},
                   {"params": [p for p in own if p.ndim < 2], "weight_decay": 0.0, "base_lr": lr}]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.98))
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    order: list[int] = []
    losses: list[float] = []
    default_top_k = runtime.default_top_k
    try:
        for step in range(config.steps):
            batch = []
            for _ in range(config.batch_size):
                if not order:
                    order = list(range(len(samples)))
                    rng.shuffle(order)
                batch.append(samples[order.pop()])
            max_crops = rng.choice(config.crops_choices)
            if step < config.full_warmup * config.steps or rng.random() < config.full_prob:
                top_k, num_blocks = max(config.top_k_choices), runtime.num_layers
            else:
                top_k = rng.choice(config.top_k_choices)
                num_blocks = rng.randint(config.min_blocks, runtime.num_layers)
            items = []
            for s in batch:
                with Image.open(dataset.image_path(s)) as img:
                    items.append((img.convert("RGB"), s.question, s.answers[0]))
            _set_top_k(runtime, top_k)
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, config) * group["base_lr"] / config.lr
            loss = _batch_loss(runtime, items, max_crops, runtime.blocks_for(num_blocks))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            optimizer.step()
            losses.append(float(loss.detach()))
            if progress is not None:
                progress(step + 1, losses[-1])
    finally:
        _set_top_k(runtime, default_top_k)
        for m in modules:
            m.requires_grad_(False)
            m.eval()
    return losses


#: the parts a recipe can leave at their starting values (``TestbedRecipe.frozen``)
FREEZABLE_PARTS = ("embeddings", "lm_head", "attention_values", "vision")


def frozen_modules(runtime: EmbeddedRuntime, parts: Sequence[str]) -> list[torch.nn.Module]:
    """The modules of the named parts (:data:`FREEZABLE_PARTS`)."""
    unknown = sorted(set(parts) - set(FREEZABLE_PARTS))
    if unknown:
        msg = f"frozen: unknown parts {unknown}; known: {', '.join(FREEZABLE_PARTS)}"
        raise ValueError(msg)
    modules: list[torch.nn.Module] = []
    if "embeddings" in parts:
        modules.append(runtime.decoder.get_input_embeddings())
    if "lm_head" in parts:
        modules.append(runtime.decoder.get_output_embeddings())
    if "attention_values" in parts:
        modules += [m for layer in runtime.decoder_layers for m in (layer.self_attn.v_proj, layer.self_attn.o_proj)]
    if "vision" in parts:
        modules.append(runtime.vision_backbone)
    return modules


def _init_router(runtime: EmbeddedRuntime, config: TestbedRecipe) -> None:
    """Rescale every router's weight to std ``router_init_gain / sqrt(fan_in)``."""
    if config.router_init_gain is None:
        return
    with torch.no_grad():
        for layer in runtime.decoder_layers:
            layer.mlp.gate.weight.mul_(config.router_init_gain / ROUTER_INIT_GAIN)


def save_trained(runtime: EmbeddedRuntime, directory: Path, recipe: dict,
                 lora_factors: dict[str, torch.Tensor] | None = None) -> None:
    """Save the runtime's modules in the embedded directory format plus the recipe file (and the
    float16 expert update factors, when the recipe trained them)."""
    _set_top_k(runtime, runtime.default_top_k)
    extra: dict[str, str | bytes] = {RECIPE_FILE: json.dumps(recipe, indent=2, sort_keys=True) + "\n"}
    if lora_factors:
        extra[LORA_FILE] = serialize_factors(lora_factors)
    save_embedded_model(directory, runtime.spec, runtime.vision, runtime.decoder, runtime.tokenizer, runtime.projector,
                        extra_files=extra)


def round_trained_parameters(runtime: EmbeddedRuntime, config: TestbedRecipe) -> None:
    """Round the parameters the recipe trained to float16 values (kept as float32): the last step
    of the recipe, so that the result is exactly what ``testbed.shipped`` stores."""
    with torch.no_grad():
        for name, param in trained_parameters(runtime).items():
            rounded = param.half()
            if not torch.isfinite(rounded).all():
                msg = f"trained parameter {name} does not fit float16 (training diverged?)"
                raise ValueError(msg)
            param.copy_(rounded.float())
    if config.train_experts:
        with torch.no_grad():
            for layer in runtime.decoder_layers:
                for param in layer.mlp.experts.parameters():
                    param.copy_(param.half().float())


def train_testbed(config: TestbedRecipe = TestbedRecipe(), cache_dir: str | Path | None = None, force: bool = False,
                  progress: Callable[[int, float], None] | None = None,
                  pretrain_progress: Callable[[int, float], None] | None = None,
                  shipped: Path | None = SHIPPED_WEIGHTS) -> TrainReport:
    """The testbed model of this recipe in the cache: reused when there, else rebuilt from the
    ``shipped`` weights when they were trained with this recipe (seconds), else trained (minutes).
    ``force`` trains in any case and replaces the cached directory."""
    cached = cached_testbed_dir(config, cache_dir)
    if cached is not None and not force:
        return TrainReport(cached, trained=False)
    target = testbed_model_dir(config, cache_dir)
    tmp = cache_tmp_dir(target)
    use_shipped = not force and shipped is not None and shipped_recipe_hash(shipped) == config.recipe_hash()
    try:
        base, model_dir, data_dir = tmp / "base", tmp / "model", tmp / "data"
        base.mkdir()
        model_dir.mkdir()
        if use_shipped:
            materialise(model_dir, shipped)
            publish_model_dir(model_dir, target)
            return TrainReport(target, trained=False, from_shipped=True)
        with _deterministic(config.threads):
            write_embedded_model(base, seed=config.base_seed, pool=config.image_pool)
            generate_dataset(data_dir, config.num_train_samples, seed=config.seed, split="train",
                             spec=TaskSpec(families=config.families))
            runtime = EmbeddedRuntime(base, dtype="float32")  # trained in float32 whatever the device
            _init_vision(runtime, config)
            _init_router(runtime, config)
            start = time.perf_counter()
            losses = train_model(runtime, data_dir, config, progress, pretrain_progress)
            round_trained_parameters(runtime, config)
            factors = merge_low_rank_updates(runtime.decoder_layers) if config.expert_lora_rank else None
            seconds = time.perf_counter() - start
            recipe = {"format": "ctrl-testbed", "testbed_version": TESTBED_VERSION, "recipe_hash": config.recipe_hash(),
                      "config": asdict(config), "final_loss": sum(losses[-20:]) / len(losses[-20:])}
            save_trained(runtime, model_dir, recipe, factors)
        publish_model_dir(model_dir, target, replace=force)  # a stale (no marker) one is replaced too
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return TrainReport(target, trained=True, train_seconds=seconds, losses=losses)


# -- evaluation ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalRow:
    max_crops: int
    top_k: int
    num_blocks: int
    family: str  # a family name or "all"
    accuracy: float
    num_samples: int
    mean_latency_ms: float


def evaluate_testbed(model_dir: str | Path, dataset_dir: str | Path, crops: Sequence[int] = BALANCED_MAX_CROPS,
                     top_ks: Sequence[int] = BALANCED_TOP_K, blocks: Sequence[int] = BALANCED_NUM_ACTIVE_BLOCKS,
                     max_new_tokens: int = 6, num_samples: int | None = None, threads: int = 1,
                     progress: Callable[[int], None] | None = None, dtype: str = "auto") -> list[EvalRow]:
    """VQA score of ``runtime.generate`` per configuration and family on a dataset (greedy, KV cache),
    the model's weights held in ``dtype`` (``runtime.precision``)."""
    dataset = read_dataset(dataset_dir)
    samples = list(dataset.samples)[:num_samples]
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runtime = load_runtime(str(model_dir), ExecutionOptions(dtype=dtype))
        images = {}
        for s in samples:
            with Image.open(dataset.image_path(s)) as img:
                images[s.example_id] = img.convert("RGB")
        rows: list[EvalRow] = []
        for c in crops:
            prepared = [runtime.preprocess(images[s.example_id], s.question, c) for s in samples]
            for k in top_ks:
                for b in blocks:
                    scores: dict[str, list[float]] = {}
                    elapsed = 0.0
                    with runtime.knobs(top_k=k, num_active_blocks=b):
                        for s, inputs in zip(samples, prepared):
                            t0 = time.perf_counter()
                            text = runtime.generate(inputs, max_new_tokens=max_new_tokens).text
                            elapsed += time.perf_counter() - t0
                            score, _ = score_answer(dataset.name, text, s.answers)
                            scores.setdefault(s.family, []).append(score)
                    mean_ms = 1000 * elapsed / max(1, len(samples))
                    everything = [x for v in scores.values() for x in v]
                    rows.append(EvalRow(c, k, b, "all", sum(everything) / max(1, len(everything)), len(everything),
                                        mean_ms))
                    for fam in sorted(scores, key=lambda f: (FAMILIES.index(f) if f in FAMILIES else 99, f)):
                        v = scores[fam]
                        rows.append(EvalRow(c, k, b, fam, sum(v) / len(v), len(v), mean_ms))
                    if progress is not None:
                        progress(1)
    finally:
        torch.set_num_threads(saved_threads)
    return rows


def format_eval_table(rows: Sequence[EvalRow]) -> list[str]:
    """A Markdown table: one line per configuration, accuracy overall and per family, mean latency."""
    families = [f for f in dict.fromkeys(r.family for r in rows) if f != "all"]
    configs = list(dict.fromkeys((r.max_crops, r.top_k, r.num_blocks) for r in rows))
    by_key = {(r.max_crops, r.top_k, r.num_blocks, r.family): r for r in rows}
    head = ["crops", "top_k", "blocks", "ms", "all", *families]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for c, k, b in configs:
        allrow = by_key[(c, k, b, "all")]
        cells = [str(c), str(k), str(b), f"{allrow.mean_latency_ms:.1f}", f"{allrow.accuracy:.3f}"]
        cells += [f"{by_key[(c, k, b, f)].accuracy:.3f}" if (c, k, b, f) in by_key else "" for f in families]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def marginal_table(rows: Sequence[EvalRow]) -> list[str]:
    """Accuracy averaged over the other two knobs, per knob value and family (Markdown)."""
    families = list(dict.fromkeys(r.family for r in rows))
    lines = ["| knob | value | " + " | ".join(families) + " |", "|---|---:|" + "---:|" * len(families)]
    for name, attr in (("max_crops", "max_crops"), ("top_k", "top_k"), ("blocks", "num_blocks")):
        for value in sorted({getattr(r, attr) for r in rows}):
            cells = []
            for fam in families:
                v = [r.accuracy for r in rows if getattr(r, attr) == value and r.family == fam]
                cells.append(f"{sum(v) / len(v):.3f}" if v else "")
            lines.append(f"| {name} | {value} | " + " | ".join(cells) + " |")
    return lines
