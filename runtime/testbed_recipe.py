"""The testbed's training recipe: everything that determines the trained testbed's weights, whose hash
names its directory in the model cache (``runtime.registry.testbed_model_dir``). Imports no torch."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from pipeline import knobs
from pipeline.options import option
from runtime.formats import EMBEDDED_VERSION

#: bump when the testbed training code changes in a way the recipe fields do not capture
TESTBED_VERSION = 5


@dataclass(frozen=True)
class TestbedRecipe:
    """Everything that determines the trained testbed's weights; its hash names the cache directory.

    The fields with a help text are the options of ``ctrl testbed train`` (the training itself:
    ``testbed.train``); the module imports no torch, so that ``ctrl --help`` can read them.
    """

    seed: int = option(0, help="Seed of the training set, data order and knob draws.")
    #: the embedded model's seed the training starts from
    base_seed: int = 0
    num_train_samples: int = option(4000, min=1, help="Size of the generated training set.")
    steps: int = option(800, min=1, help="Optimizer steps.")
    batch_size: int = option(8, min=1, help="Samples per step (one knob setting per step).")
    lr: float = option(3e-3, help="AdamW peak learning rate.")
    #: the vision tower learns fine patterns only at a lower rate than the decoder tolerates
    vision_lr: float | None = option(1e-3, min=0.0, help=
        "Peak learning rate of the ViT and projector.")
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
    vision_pretrain_steps: int = option(1500, min=0, help=
        "Steps training the vision path alone first, before the main phase (0 = none).")
    #: the question families the vision pretraining draws from (empty = all). Fine detail only by
    #: default: the coarse families are learned from the global image in the main phase, and mixed
    #: in here they kept the tower from learning the 1-2 px textures (docs/decisions.md)
    vision_pretrain_families: tuple[str, ...] = ("texture",)
    #: one thread is also the fastest on a shared 2-core machine: OpenMP workers spin-wait when the
    #: cores are oversubscribed
    threads: int = option(1, min=1, help="Torch threads (part of the recipe: results depend on it).")

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
