"""Named models and how ``--model`` resolves: what every command that runs a model loads.

* ``embedded``: the seeded embedded model (``runtime.embedded_model``), built into the model
  cache on first use;
* ``testbed``: the embedded model trained on the testbed task (``ctrl testbed train``,
  ``testbed.train``) with the current :class:`TestbedRecipe`, found in the model cache by the
  recipe's hash; never trained implicitly (it takes minutes);
* an existing local directory, loaded as the embedded format when it carries the embedded
  marker and as a MolmoE-1B checkpoint otherwise (``runtime.molmoe``, which refuses a directory
  that is neither with a clear error);
* ``org/name[@revision]`` (not an existing directory): a Hugging Face Hub id, the snapshot in the
  local Hugging Face cache (``runtime.hub``; never downloaded).

Every model runs in a ``dtype`` (``runtime.precision``): ``auto`` is float32 on a CPU and bfloat16
on a GPU, and the fingerprint of a model in another dtype than float32 says so.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline import knobs
from pipeline.execution import ExecutionOptions
from runtime.base import ModelLoadError, ModelRuntime
from runtime.cache import default_cache_root
from runtime.embedded import EmbeddedRuntime
from runtime.embedded_model import (
    EMBEDDED_VERSION,
    build_embedded_model,
    directory_fingerprint,
    is_embedded_dir,
)
from runtime.hub import is_hub_id, resolve_hub_id
from runtime.molmoe import MolmoERuntime, known_checkpoint_fingerprint
from runtime.precision import qualify_fingerprint, resolve_dtype

#: bump when the testbed training code changes in a way the recipe fields do not capture
TESTBED_VERSION = 5


@dataclass(frozen=True)
class TestbedRecipe:
    """Everything that determines the trained testbed's weights; its hash names the cache directory.

    The fields are the options of ``ctrl testbed train`` (the training itself: ``testbed.train``).
    """

    seed: int = 0
    #: the embedded model's seed the training starts from
    base_seed: int = 0
    num_train_samples: int = 4000
    steps: int = 800
    batch_size: int = 8
    lr: float = 3e-3
    #: learning rate of the vision path (ViT + projector); None = ``lr``. The vision tower
    #: learns fine patterns only at a lower rate than the decoder tolerates
    vision_lr: float | None = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    crops_choices: tuple[int, ...] = knobs.BALANCED_MAX_CROPS
    #: the top-K values the main phase draws from. One value, above every profiled top-K but the
    #: largest, by default: like MolmoE-1B, trained at one top-K, a lower top-K at inference then
    #: costs answers (the model leans on every expert it was trained with)
    top_k_choices: tuple[int, ...] = (12,)
    #: the fewest active blocks the main phase draws; 16 (the default) trains the full depth
    #: only, so that dropping blocks at inference costs answers, as it does on MolmoE-1B
    min_blocks: int = 16
    #: the training set's families, in turn (``TaskSpec.families``: a family listed twice gets
    #: twice the samples). ``mix`` is the hard one: a 64-entry table only the experts can hold
    families: tuple[str, ...] = ("color", "presence", "texture", "mix", "mix")
    #: the side of the mean-pooling window over the ViT's 8 x 8 patch grid
    #: (``write_embedded_model(pool=...)``): 1 gives 64 image tokens per crop, so that each crop
    #: costs decoder time as MolmoE-1B's crops do
    image_pool: int = 1
    #: router weights rescaled to std ``gain / sqrt(d_model)`` before training (None: the
    #: embedded model's, gain 4). A flatter router spreads each token over more experts, so the
    #: top-K cut-off removes real contributions
    router_init_gain: float | None = 0.5
    #: rank of a trained low-rank update of every expert weight (0: the experts keep the seeded
    #: weights). Low rank keeps what ships small (``testbed.shipped``) while the experts learn
    #: the task's hard part; merged into the weights at the end (``testbed.lowrank.merge_low_rank``)
    expert_lora_rank: int = 4
    #: parts left at their starting values in the main phase: ``embeddings``, ``lm_head``,
    #: ``attention_values`` (v_proj, o_proj), ``vision`` (after its pretraining). With the linear
    #: paths fixed, the answers have to go through the routed experts and the blocks' attention
    frozen: tuple[str, ...] = ("embeddings", "lm_head", "attention_values", "vision")
    #: train the decoder's full expert weights too (not shippable: ``testbed.shipped``)
    train_experts: bool = False
    #: share of steps that run the full model (largest top-K, all blocks)
    full_prob: float = 0.25
    #: the first ``full_warmup`` share of the steps all run the full model (a curriculum: learn
    #: the task first, then robustness to the knobs)
    full_warmup: float = 0.3
    #: "periodic" sets the first ``periodic_filters`` output channels of the ViT's patch
    #: embedding to fixed stripe/check filters before training (:func:`periodic_patch_filters`),
    #: a stand-in for the pretrained vision tower a real VLM starts from; "random" keeps the
    #: embedded model's weights
    vision_init: str = "periodic"
    periodic_filters: int = 21
    #: steps of a first phase that trains only the vision path (ViT + projector) with a
    #: temporary linear head from the mean image token to the answer (a stand-in for the
    #: pretrained vision tower a real VLM starts from); 0 = none
    vision_pretrain_steps: int = 1500
    #: the question families the vision pretraining draws from (empty = all). Fine detail only by
    #: default: the coarse families are learned from the global image in the main phase, and mixed
    #: in here they kept the tower from learning the 1-2 px textures (docs/decisions.md)
    vision_pretrain_families: tuple[str, ...] = ("texture",)
    #: intra-op threads (part of the recipe: float sums depend on it). One thread is also the
    #: fastest on a shared 2-core machine: OpenMP workers spin-wait when the cores are oversubscribed
    threads: int = 1

    def __post_init__(self) -> None:
        if self.train_experts and self.expert_lora_rank:
            msg = ("train_experts and expert_lora_rank exclude each other: the low-rank update trains on "
                   "fixed expert weights (set expert_lora_rank=0 to train the experts whole)")
            raise ValueError(msg)
        if self.expert_lora_rank < 0:
            msg = f"expert_lora_rank must be >= 0, got {self.expert_lora_rank}"
            raise ValueError(msg)

    @property
    def vision_peak_lr(self) -> float:
        return self.lr if self.vision_lr is None else self.vision_lr

    def recipe_hash(self) -> str:
        payload = json.dumps({"testbed_version": TESTBED_VERSION, "embedded_version": EMBEDDED_VERSION,
                              **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def testbed_model_dir(recipe: TestbedRecipe = TestbedRecipe(), cache_dir: str | Path | None = None) -> Path:
    """Where the testbed of ``recipe`` lives in the model cache (whether it is there or not)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return root / f"testbed-v{TESTBED_VERSION}-{recipe.recipe_hash()}"


def cached_testbed_dir(recipe: TestbedRecipe = TestbedRecipe(), cache_dir: str | Path | None = None) -> Path | None:
    """The trained testbed's directory when it is in the cache, else None (nothing is trained)."""
    target = testbed_model_dir(recipe, cache_dir)
    return target if is_embedded_dir(target) else None


def resolve_model(model: str) -> tuple[str, Path]:
    """("embedded" | "molmoe", directory) for a ``--model`` value; builds the embedded model when needed."""
    if model == "embedded":
        return "embedded", build_embedded_model()
    if model == "testbed":
        path = cached_testbed_dir()
        if path is None:
            msg = ("--model testbed: the trained testbed is not in the cache; "
                   "run `ctrl testbed train` first (seconds with the default recipe, whose weights are shipped)")
            raise ModelLoadError(msg)
        return "embedded", path
    path = Path(model).expanduser()
    if not path.is_dir():
        if is_hub_id(model):
            path = resolve_hub_id(model)
        else:
            msg = (f"{model}: no such model directory (use 'embedded', 'testbed', a local directory or a "
                   "Hugging Face id org/name[@revision])")
            raise ModelLoadError(msg)
    return ("embedded" if is_embedded_dir(path) else "molmoe"), path


def load_runtime(model: str = "embedded", execution: ExecutionOptions | None = None,
                 importance_scores: Path | None = None) -> ModelRuntime:
    """A ready runtime for a ``--model`` value (see the module docstring), run as ``execution``
    says (device, the weights' dtype (``runtime.precision``), the fast path or the eager one;
    default: :class:`ExecutionOptions`'s). The threads are the caller's to apply, around its work
    (``runtime.timing.cpu_threads``).

    ``importance_scores``: an importance file (docs/origin_format.md §6) used by ``blocks_for`` /
    ``knobs(num_active_blocks=...)``;
    without it the default block rule of ``pipeline.knobs.select_active_blocks`` applies.
    """
    execution = execution or ExecutionOptions()
    kind, path = resolve_model(model)
    runtime_class = EmbeddedRuntime if kind == "embedded" else MolmoERuntime
    return runtime_class(path, device=execution.device, importance_scores=importance_scores, dtype=execution.dtype,
                         fast_path=execution.fast_path, float32_attention=execution.float32_attention)


def model_fingerprint(model: str = "embedded", dtype: str = "auto", device: str = "cpu") -> str | None:
    """The fingerprint ``load_runtime(model, device, dtype=dtype)`` would report, without loading
    the weights: lets a fully cached feature run skip the model altogether. None when it cannot be
    known without reading a checkpoint's weights (their first load computes it in passing)."""
    kind, path = resolve_model(model)
    weights = directory_fingerprint(path) if kind == "embedded" else known_checkpoint_fingerprint(path)
    return None if weights is None else qualify_fingerprint(weights, resolve_dtype(dtype, device))
