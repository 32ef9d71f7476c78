"""Typed training configuration and its presets (``demo``, ``datacomp-small``, ``prolip-b16``).

Declared in the one config dialect (``pipeline.common.config``): an unknown key, a wrong type or a value
out of range stops ``python -m jobs.train`` at start with one line naming the key path.

Sources of the defaults:

- ``datacomp-small``: DataComp's small-track recipe (Gadre et al. 2023, Table 2 / App. N; its train.py and
  scale_configs.py): ViT-B/32, 12.8M samples seen, global batch 4096, lr 5e-4, 500 warmup steps, AdamW β2
  0.98, ε 1e-6, wd 0.2 on open_clip's parameter groups, cosine schedule, float16 amp with a loss scale,
  shards drawn with replacement. Objective ``prolip`` by default; ``--set loss.name=clip`` gives DataComp's
  CLIP (open_clip's ViT-B-32 parameter for parameter). CLIP's BPE tokenizer (context 77), as DataComp's
  fixed recipe uses.
- ``prolip-b16``: ProLIP App. B.1 (docs/math.md "Training"): ViT-B/16, 1.28B seen, batch 16,384 (512 × 32
  GPUs), lr 5e-4, β (0.9, 0.95), wd 0.2, 10k warmup then cosine, bf16, α₁ 1e-7, α₂ 1e-3, β_VIB 1e-4,
  augmentation RandomResizedCrop (0.8, 1.0), colour jitter (0.32, 0.32, 0.32, 0.08) p 0.8, grayscale p 0.2.
- ``demo``: the tiny model on two CPU workers; lr 5e-4 with normalised pixels and no weight decay on the
  logit scale/bias (docs/environment.md: 1e-3 collapsed, 5e-4 trained, un-normalised pixels plateaued).
- Pixel mean/std: OpenAI CLIP's, as open_clip uses for every CLIP/SigLIP-style model trained from scratch.

Augmentation is each recipe's: ``datacomp-small`` open_clip's default train transform, which DataComp's
fixed recipe uses (RandomResizedCrop area (0.9, 1.0), no colour jitter, no grayscale); ``prolip-b16`` and
the ``DataConfig`` defaults ProLIP App. B.1's. The crop runs in the decode tasks, the pixel operations on
the training device (pipeline/ingest/device_augment.py).

Elastic training: ``scaling.min_workers > 0`` turns ``num_workers`` into the range
``(min_workers, num_workers)`` given to Ray Train, which restarts the worker group from the latest
checkpoint at whatever size the cluster then holds (a lost node, a spot reclaim). The *global* batch stays
``global_batch_size`` at every size: rank r takes ``global_batch_size // world`` samples, one more on the
first ``global_batch_size % world`` ranks (training/train/distributed.py ``local_batch_sizes``), so no size
has to divide it; a local batch above ``scaling.max_local_batch`` runs in micro-batches whose summed
gradients are the one-batch step's (training/train/accumulation.py), so any world down to
one can hold the global batch (docs/decisions/0088-elastic-by-exact-accumulation.md). Steps, the LR schedule and the checkpoint cadence count optimizer steps of one global
batch. A run that loses one of its two Train hosts continues at world 1 when the Train workers ask for
a resource only train nodes hold (GPUs, or ``scaling.resources`` on CPU train nodes): Ray Train 2.60
counts the workers a cluster can hold without its label selectors, so data nodes' CPUs would count
(docs/decisions/0065-elastic-with-uneven-local-batches.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import Field

from pipeline.common.components import one_of
from pipeline.common.config import (
    ConfigError,
    NonNegative,
    NonNegativeFloat,
    Positive,
    PositiveFloat,
    Seed,
    config_class,
    load,
    require,
    to_dict,
)
from pipeline.common.storage_config import StorageConfig
from training.losses.objectives import LossConfig, ProLIPLossConfig
from training.model.config import MODEL_CONFIGS

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
Unit = Annotated[float, Field(ge=0, le=1)]
Beta = Annotated[float, Field(ge=0, lt=1)]
LrMult = Annotated[float, Field(gt=0, allow_inf_nan=False)]


@config_class
class DataConfig:
    """Training ingest (pipeline/ingest/transforms.py)."""

    shards: str = ""  # directory, glob or comma-separated .tar paths; local or s3://
    # A DataComp subset .npy (u8,u8 uids; local or s3://) of the pool in ``shards``: train on its rows
    # only, each as often as it is listed — the samples jobs.reshard would write, read from the build's
    # own shards (pipeline/ingest/subset_reader.py). Empty: every row of ``shards``.
    subset: str = ""
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment
    augment: bool = True  # RandomResizedCrop, colour jitter and grayscale (ProLIP B.1); off = resize only
    crop_scale: tuple[float, float] = (0.8, 1.0)  # RandomResizedCrop area range (ProLIP B.1)
    crop_ratio: tuple[float, float] = (0.75, 4.0 / 3.0)  # aspect range (torchvision's default)
    color_jitter: tuple[float, float, float, float] = (0.32, 0.32, 0.32, 0.08)  # b, c, s, hue
    color_jitter_p: Unit = 0.8  # probability of the colour jitter
    grayscale_p: Unit = 0.2  # probability of a grayscale image
    mean: tuple[float, float, float] = OPENAI_MEAN  # pixel normalisation (OpenAI CLIP's)
    std: tuple[float, float, float] = OPENAI_STD  # pixel normalisation (OpenAI CLIP's)
    shuffle_window: NonNegative = 1024  # rows per windowed shuffle of raw samples (before decode); 0 = off
    # "epochs": every pass reads each shard once, in a fresh order; "resampled": every pass reads as many
    # shards as there are, drawn with replacement (open_clip's --dataset-resampled, DataComp's setting).
    sampling: Literal["epochs", "resampled"] = "epochs"
    # None: fresh entropy every epoch. Set: a repeatable order (Ray Data keeps its output order), and a
    # one-worker run repeats bit for bit (tests/training/train/test_train.py); the track sets it to each
    # model's seed.
    shuffle_seed: Seed | None = None
    local_shuffle_buffer: NonNegative = 0  # extra per-worker buffer (decoded rows) in iter_torch_batches
    augment_seed: Seed | None = None  # None: fresh entropy per decode actor
    # CPUs reserved per shard-read task; None: decode_cpus, so Ray runs no more worker processes than decode
    # tasks and starts none anew each epoch (docs/decisions/0085-shard-reads-reserve-the-decode-cpus.md)
    read_cpus: PositiveFloat | None = None
    decode_batch_size: Positive = 64  # samples per decode/augment task call
    # Concurrent decode tasks at most; 0 = no cap: Ray Data runs as many as the ingest nodes' free CPUs
    # allow and the autoscaler adds nodes from the backlog (the cluster presets; the train workers' CPUs
    # stay reserved for them). How many cores a GPU needs: docs/gpu.md.
    decode_tasks: NonNegative = 2
    decode_cpus: PositiveFloat = 1.0  # CPUs reserved per decode task
    prefetch_batches: NonNegative = 2  # batches each worker's iterator prepares ahead
    # Page-locked host batches, copied to the GPU on a side stream one batch ahead (CUDA only).
    pin_memory: bool = True
    # Keep the rows a worker decoded in its first epoch in its memory and serve later epochs from there, in
    # a fresh order each epoch (masked variants still drawn per epoch): for small datasets without
    # augmentation, where a re-read and re-decode per epoch costs more than the step (each worker keeps its
    # first-epoch share of the rows).
    cache_decoded: bool = False
    trim_text_padding: bool = True  # cut all-padding token columns per batch (exact; off for static shapes)
    max_bad_shards: NonNegative = 10  # distinct corrupt/truncated shards tolerated before the job stops
    # Drop (and count) samples whose bytes differ from the checksums the build stored (pipeline/shards/checksums.py)
    verify_checksums: bool = False
    mask_fraction: Unit = 0.125  # samples per batch with a masked variant (ProLIP §4.1)
    text_mask_ratio: Unit = 0.75  # text tokens replaced by [MASK] (§4.1)
    # "mask": the masked text tokens become [MASK] (§4.1); "drop": they are removed, so the masked caption is
    # a shorter caption (the text counterpart of the image side's patch drop); "salient": removed too, but
    # the model chooses which — up to text_mask_ratio of the words whose removal moves the caption's mean
    # most (training/train/salient_masking.py).
    text_mask_mode: Literal["mask", "drop", "salient"] = "mask"
    # "salient" only: the share of each batch's masked captions the model chooses for; the others keep their
    # random drop.
    salient_share: Unit = 1.0
    patch_keep_ratio: Unit = 0.25  # image patches kept (75% dropped, §4.1)
    mask_seed: Seed = 0  # which samples get a masked variant and which tokens/patches (with uid, epoch)
    exact_position: bool = False  # each rank reads a planned order; a resume trains the rest exactly (0094)
    label_selector: dict[str, str] = field(
        default_factory=dict
    )  # ingest nodes (pipeline/common/placement.py)

    def __post_init__(self) -> None:
        lo, hi = self.crop_scale
        require(0.0 < lo <= hi <= 1.0, "crop_scale", "must satisfy 0 < lo <= hi <= 1", self.crop_scale)
        require(
            not (self.cache_decoded and self.augment),
            "cache_decoded",
            "needs augment=false (cached crops would repeat every epoch)",
            self.cache_decoded,
        )
        ok = not self.exact_position or (self.shuffle_seed is not None and self.sampling == "epochs")
        require(ok and not (self.exact_position and self.cache_decoded), "exact_position", "needs shuffle_seed, sampling='epochs' and no cache_decoded", self.exact_position)  # fmt: skip
        require(
            self.salient_share == 1.0 or self.text_mask_mode == "salient",
            "salient_share",
            f"needs text_mask_mode='salient' (text_mask_mode is {self.text_mask_mode!r})",
            self.salient_share,
        )


@config_class
class OptimConfig:
    lr: PositiveFloat = 5e-4  # peak learning rate, after warmup
    betas: tuple[Beta, Beta] = (0.9, 0.98)  # AdamW's β1, β2
    eps: PositiveFloat = 1e-6  # AdamW's ε
    weight_decay: NonNegativeFloat = 0.2  # AdamW's (training/model/param_groups.py: which parameters)
    warmup_steps: NonNegative = 500  # linear warmup, then cosine to min_lr_ratio
    min_lr_ratio: Unit = 0.0  # cosine floor as a fraction of lr
    grad_clip: NonNegativeFloat = 0.0  # max global grad norm; 0 = off
    # LR multiplier for the σ heads (each tower's log σ² projection and [UNC] token, ``model.unc_params``):
    # 1 everywhere but the demo, whose ~300 steps are too few for the heads to move at the base LR.
    unc_lr_mult: LrMult = 1.0
    # The image tower's σ head alone (None: ``unc_lr_mult``). The two heads meet different gradients (text
    # captions repeat across pictures, pictures do not), so a study may want them apart; no preset sets it.
    unc_lr_mult_image: LrMult | None = None
    # Which parameters decay (training/model/param_groups.py): "prolip" (App. B.1: no embeddings or tokens)
    # or "open_clip" (every tensor of two or more dimensions, open_clip_train's rule in DataComp's recipe).
    decay_rule: Literal["prolip", "open_clip"] = "prolip"


@config_class
class WorkersConfig:
    """How many Ray Train workers, what each one gets and where they run (the ``scaling.`` keys)."""

    num_workers: Positive = 2  # fixed size, or the maximum when min_workers > 0
    min_workers: NonNegative = 0  # > 0: elastic (min_workers, num_workers)
    use_gpu: bool = False  # one GPU per worker (gpus_per_worker), bf16 autocast
    cpus_per_worker: PositiveFloat = 1.0  # Ray CPUs reserved per Train worker
    gpus_per_worker: PositiveFloat = 1.0  # only with use_gpu
    label_selector: dict[str, str] = field(default_factory=dict)  # Train worker nodes; empty = anywhere
    # Custom Ray resources each Train worker also asks for, e.g. {"train_slot": 1} on CPU-only train nodes:
    # Ray Train's elastic count ignores label selectors (docs/decisions/0065-elastic-with-uneven-local-batches.md)
    resources: dict[str, PositiveFloat] = field(default_factory=dict)
    # Intra-op threads per worker: 0 = Ray's default (OMP_NUM_THREADS = the worker's CPUs), -1 = every core
    # of the node (one CPU worker on a laptop, with the ingest tasks taking turns on the same cores).
    torch_threads: Annotated[int, Field(ge=-1)] = 0
    # Seconds a collective may wait before the process group fails (NCCL's watchdog); Ray's default is
    # 1800 s, so a hung rank would hold a whole GPU cluster for half an hour before the restart.
    collective_timeout_s: Positive = 600
    # Most samples one worker runs through the towers at once (0: no cap); a larger local batch runs in
    # micro-batches with the one-batch step's gradients (exact accumulation, TrainConfig.micro_batches).
    max_local_batch: NonNegative = 0

    def __post_init__(self) -> None:
        require(
            self.min_workers <= self.num_workers, "min_workers", "must be <= num_workers", self.min_workers
        )
        builtin = sorted(set(self.resources) & {"CPU", "GPU", "memory", "object_store_memory"})
        require(
            not builtin,
            "resources",
            "takes custom resources only (cpus_per_worker, gpus_per_worker)",
            builtin,
        )


@config_class
class RunOutputConfig:
    """Where a training run writes and how it checkpoints, logs and restarts (the ``run.`` keys)."""

    storage_path: str = "runs/train"  # local directory or s3://bucket/prefix
    name: str = "demo"  # same storage_path + name = resume from the latest checkpoint
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment
    max_failures: NonNegative = 0  # automatic worker-group restarts from the last checkpoint
    checkpoint_every: Positive = 100  # optimizer steps
    keep_checkpoints: Positive = 2  # newest checkpoints kept in storage_path/name (at least the latest)
    log_every: Positive = 10  # optimizer steps between progress lines and metrics
    tensorboard: bool = True  # TensorBoard event files in the run directory
    fail_at_step: NonNegative = 0  # test hook: rank `fail_rank` raises at this step on a run not resumed
    fail_rank: NonNegative = 0  # test hook: the rank that fails at fail_at_step


@config_class
class TrainConfig:
    model: str = "tiny"  # training.model.config.MODEL_CONFIGS name
    grad_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% more time
    # "clip" (CLIP's BPE from open_clip_torch), "clip:PATH" (its bpe_simple_vocab_16e6.txt.gz), "hf-hub:REPO"
    # (a Hub repository's tokenizer.json, cached), a saved tokenizer directory or any tokenizer.json (e.g.
    # SigLIP's); empty = train a BPE on the captions
    tokenizer: str = ""
    # for a tokenizer.json: "", "lower" (CLIP's cleaning), "canonicalize" (SigLIP's)
    tokenizer_clean: Literal["", "lower", "canonicalize"] = ""
    tokenizer_vocab: Positive = 4096  # with tokenizer empty: the BPE's vocabulary size
    global_batch_size: Positive = 128  # samples per optimizer step over all workers
    samples_seen: Positive = 60_000  # total training samples; steps = samples_seen // global_batch_size
    # auto: bf16 autocast on CUDA, fp32 on CPU; amp: float16 autocast with a dynamic loss scale
    # (training/train/optimizer.py), open_clip's --precision amp, which DataComp's recipe trains with
    precision: Literal["auto", "bf16", "amp", "fp32"] = "auto"
    # torch.compile the towers with dynamic shapes (captions are trimmed per batch, so the text length
    # changes from step to step); off by default: a compile costs minutes before the first step.
    compile: bool = False
    seed: Seed = 0  # model initialisation (and the data order when data.shuffle_seed is set by the track)
    data: DataConfig = field(default_factory=DataConfig)
    # The objective and its parameters (training/losses/objectives.py): ``--set loss.name=clip``,
    # ``--set loss.beta=2e-4`` or the shorthand ``--set loss=pcmepp:alpha=0.2``.
    loss: one_of(LossConfig) = field(default_factory=ProLIPLossConfig)  # type: ignore[valid-type]
    optim: OptimConfig = field(default_factory=OptimConfig)
    scaling: WorkersConfig = field(default_factory=WorkersConfig)
    run: RunOutputConfig = field(default_factory=RunOutputConfig)

    @property
    def total_steps(self) -> int:
        return self.samples_seen // self.global_batch_size

    def world_sizes(self) -> list[int]:
        lo = self.scaling.min_workers or self.scaling.num_workers
        return list(range(lo, self.scaling.num_workers + 1))

    def micro_batches(self, world: int) -> int:
        """Micro-batches every worker splits its local batch into at ``world`` workers: the fewest that keep
        each under ``scaling.max_local_batch`` (1 without a cap); the same on every rank."""
        cap = self.scaling.max_local_batch
        largest_local = -(-self.global_batch_size // world)
        return 1 if cap == 0 else -(-largest_local // cap)

    def __post_init__(self) -> None:
        """Rules across sections; each field's own range is in its type."""
        require(
            self.model in MODEL_CONFIGS, "model", f"must be one of {', '.join(MODEL_CONFIGS)}", self.model
        )
        self._check_model_fits_loss()
        require(
            self.total_steps >= 1,
            "samples_seen",
            f"is less than one global batch ({self.global_batch_size})",
            self.samples_seen,
        )
        require(
            self.global_batch_size >= max(self.world_sizes()),
            "global_batch_size",
            f"is smaller than scaling.num_workers={self.scaling.num_workers} (a worker would get no sample)",
            self.global_batch_size,
        )

    def _check_model_fits_loss(self) -> None:
        if self.loss.probabilistic:  # e.g. demo-32px-cnn has no [UNC] token for σ²
            try:
                # a ProLIP appends its own CLS/UNC tokens (training/train/step.py build_module)
                dataclasses.replace(MODEL_CONFIGS[self.model], probabilistic=True, text_pool="cls")
            except ConfigError as exc:
                raise ConfigError(
                    f"model {self.model!r} cannot train loss.name={self.loss.name!r}: {exc}"
                ) from None


_DEMO = TrainConfig(
    model="tiny",
    global_batch_size=128,
    samples_seen=60_000,
    # Logical CPUs on a 2-core laptop: two 0.5-CPU workers leave room for the ingest tasks.
    data=DataConfig(shards="runs/demo/shards", decode_batch_size=64, shuffle_window=512, decode_cpus=0.5),
    optim=OptimConfig(lr=5e-4, betas=(0.9, 0.98), warmup_steps=50, weight_decay=0.2),
    scaling=WorkersConfig(num_workers=2, cpus_per_worker=0.5),
    run=RunOutputConfig(storage_path="runs/demo/train", name="demo", checkpoint_every=100, log_every=10),
)

# The cluster presets leave data.shards and run.storage_path empty: jobs.train asks for both, so a
# forgotten flag neither reads nor writes a bucket nobody chose.
TRAIN_PRESETS: dict[str, TrainConfig] = {
    "demo": _DEMO,
    "datacomp-small": TrainConfig(
        model="ViT-B-32",
        tokenizer="clip",
        global_batch_size=4096,
        samples_seen=12_800_000,
        precision="amp",  # DataComp's train.py: --precision amp (float16 + loss scale)
        # open_clip's default train transform, DataComp's recipe: crop area (0.9, 1.0), no jitter or grayscale;
        # shards drawn with replacement (its --dataset-resampled).
        data=DataConfig(
            shards="",  # required: jobs.train --shards
            crop_scale=(0.9, 1.0),
            color_jitter_p=0.0,
            grayscale_p=0.0,
            decode_tasks=0,
            decode_batch_size=128,
            shuffle_window=4096,
            sampling="resampled",
        ),
        optim=OptimConfig(
            lr=5e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.2, warmup_steps=500, decay_rule="open_clip"
        ),
        scaling=WorkersConfig(num_workers=8, use_gpu=True, cpus_per_worker=4),
        run=RunOutputConfig(storage_path="", name="datacomp-small", checkpoint_every=500),
    ),
    "prolip-b16": TrainConfig(
        model="ViT-B-16-ProLIP",
        # SigLIP's 32k SentencePiece vocabulary with its canonicalising cleaner, as the released ProLIP
        # models tokenize (context 64); the cluster image caches it (cluster/Dockerfile).
        tokenizer="hf-hub:timm/ViT-B-16-SigLIP",
        tokenizer_clean="canonicalize",
        grad_checkpointing=False,
        global_batch_size=16_384,
        samples_seen=1_280_000_000,
        precision="bf16",
        data=DataConfig(
            shards="",  # required: jobs.train --shards
            decode_tasks=0,
            decode_batch_size=256,
            shuffle_window=8192,
        ),
        loss=ProLIPLossConfig(),  # B.1's α₁, α₂ and β: ProLIP's defaults
        optim=OptimConfig(lr=5e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.2, warmup_steps=10_000),
        scaling=WorkersConfig(num_workers=32, use_gpu=True, cpus_per_worker=8),
        run=RunOutputConfig(
            storage_path="",
            name="prolip-b16",
            checkpoint_every=2000,
            max_failures=3,
            log_every=50,
        ),
    ),
}


def to_plain(cfg: TrainConfig) -> dict[str, Any]:
    """A JSON-able dict (tuples as lists) that ``from_plain`` turns back into the same config."""
    return to_dict(cfg)


def from_plain(data: dict[str, Any]) -> TrainConfig:
    return load(TrainConfig, data)
