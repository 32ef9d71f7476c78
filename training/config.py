"""Typed training configuration and its presets (``demo``, ``datacomp-small``, ``prolip-b16``).

Resolved like every job's config (``pipeline.config.resolve``: preset → YAML file → ``--set a.b=v``), so
an unknown key or a wrong type stops ``python -m jobs.train`` at start naming the key.

Sources of the defaults:

- ``datacomp-small``: DataComp's small-track recipe (Gadre et al. 2023, Table 2 / App. N): ViT-B/32,
  12.8M samples seen, global batch 4096, lr 5e-4, 500 warmup steps, AdamW β2 0.98, ε 1e-6, wd 0.2,
  cosine schedule. Objective ``prolip`` by default; ``--set loss.name=clip`` gives DataComp's CLIP. CLIP's
  BPE tokenizer (context 77), as DataComp's fixed recipe uses.
- ``prolip-b16``: ProLIP App. B.1 (docs/math.md "Training"): ViT-B/16, 1.28B seen, batch 16,384 (512 × 32
  GPUs), lr 5e-4, β (0.9, 0.95), wd 0.2, 10k warmup then cosine, bf16, α₁ 1e-7, α₂ 1e-3, β_VIB 1e-4,
  augmentation RandomResizedCrop (0.8, 1.0), colour jitter (0.32, 0.32, 0.32, 0.08) p 0.8, grayscale p 0.2.
- ``demo``: the tiny model on two CPU workers; lr 5e-4 with normalised pixels and no weight decay on the
  logit scale/bias (docs/environment.md: 1e-3 collapsed, 5e-4 trained, un-normalised pixels plateaued).
- Pixel mean/std: OpenAI CLIP's, as open_clip uses for every CLIP/SigLIP-style model trained from scratch.

Elastic training: ``scaling.min_workers > 0`` turns ``num_workers`` into the range
``(min_workers, num_workers)`` given to Ray Train. The *global* batch stays ``global_batch_size``: each
worker takes ``global_batch_size // world_size`` samples per step, so every world size in the range must
divide the global batch (checked at start). Steps, the LR schedule and the checkpoint cadence count
optimizer steps, so a resize (which Ray Train handles as a restart from the latest checkpoint) changes
neither the schedule nor the samples seen per step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from pipeline.config import ConfigError, check_seed, check_types, from_dict, non_negative, positive, require
from training.losses.inclusion import REDUCTIONS
from training.losses.registry import LOSS_SPECS
from training.model.config import MODEL_CONFIGS, VARIANTS, ModelConfig, model_config  # noqa: F401  re-exported

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
PRECISIONS = ("auto", "bf16", "fp32")
TEXT_MASK_MODES = ("mask", "drop", "salient")


@dataclass(frozen=True)
class DataConfig:
    """Training ingest (pipeline/ingest/transforms.py)."""

    shards: str = ""  # directory, glob or comma-separated .tar paths; local or s3://
    s3_endpoint: str = ""
    augment: bool = True
    crop_scale: tuple[float, float] = (0.8, 1.0)  # RandomResizedCrop area range (ProLIP B.1)
    crop_ratio: tuple[float, float] = (0.75, 4.0 / 3.0)  # aspect range (torchvision's default)
    color_jitter: tuple[float, float, float, float] = (0.32, 0.32, 0.32, 0.08)  # b, c, s, hue
    color_jitter_p: float = 0.8
    grayscale_p: float = 0.2
    mean: tuple[float, float, float] = OPENAI_MEAN
    std: tuple[float, float, float] = OPENAI_STD
    shuffle_window: int = 1024  # rows per windowed shuffle of raw samples (before decode); 0 = off
    # None: fresh entropy every epoch. Set: a repeatable order (Ray Data keeps its output order), and a
    # one-worker run repeats bit for bit (tests/training/train/test_train.py); the track sets it to each model's seed.
    shuffle_seed: int | None = None
    local_shuffle_buffer: int = 0  # extra per-worker buffer (decoded rows) in iter_torch_batches; 0 = off
    augment_seed: int | None = None  # None: fresh entropy per decode actor
    read_cpus: float = 0.25  # CPUs reserved per shard-read task (I/O bound)
    decode_batch_size: int = 64
    decode_tasks: int = 2  # max concurrent decode/augment tasks
    decode_cpus: float = 1.0  # CPUs reserved per decode task
    prefetch_batches: int = 2
    # Keep the rows a worker decoded in its first epoch in its memory and serve later epochs from there, in
    # a fresh order each epoch (masked variants still drawn per epoch). For small datasets without
    # augmentation: re-reading and re-decoding a 1,680-row demo subset every epoch took a third of a 2-core
    # laptop and a Ray Data start-up per epoch. Each worker keeps its first-epoch share of the rows.
    cache_decoded: bool = False
    trim_text_padding: bool = True  # cut all-padding token columns per batch (exact; off for static shapes)
    max_bad_shards: int = 10  # distinct corrupt/truncated shards tolerated before the job stops
    mask_fraction: float = 0.125  # samples per batch with a masked variant (ProLIP §4.1)
    text_mask_ratio: float = 0.75  # text tokens replaced by [MASK] (§4.1)
    # "mask": the masked text tokens become [MASK] (§4.1); "drop": they are removed, so the masked caption is
    # a shorter caption (the text counterpart of the image side's patch drop; an experiment, docs/track.md);
    # "salient": removed too, but the model chooses which — up to text_mask_ratio of the words whose removal
    # moves the caption's mean most (training/train/salient_masking.py, docs/track.md "Round 9").
    text_mask_mode: str = "mask"
    # "salient" only: the share of each batch's masked captions the model chooses for; the others keep their
    # random drop (length still teaches σ² through them; docs/track.md "Round 9").
    salient_share: float = 1.0
    patch_keep_ratio: float = 0.25  # image patches kept (75% dropped, §4.1)
    mask_seed: int = 0
    label_selector: dict[str, str] = field(
        default_factory=dict
    )  # ingest nodes (pipeline/common/placement.py)


@dataclass(frozen=True)
class LossConfig:
    """Objective and its weights; which fields reach which loss is declared by its ``LossSpec``
    (training/losses/registry.py)."""

    name: str = "prolip"
    # Sigmoid losses (prolip, siglip): initial logit bias b. SigLIP's −10 ≈ −log(32k), i.e. p ≈ 1/B at its
    # batch of 32k; at a small batch, −log(B) starts at the same prior instead of first collapsing every
    # embedding together to lift all logits (the plateau of docs/environment.md at B = 128).
    init_bias: float = -10.0
    alpha1: float = 1e-7  # ProLIP L_inc(v ⊂ t) weight (B.1)
    alpha2: float = 1e-3  # masked inclusion weight (B.1)
    beta: float = 1e-4  # VIB weight (official runs)
    c: float = 1000.0  # inclusion-loss scale, with log ε = −20 (paper's runs)
    log_eps: float = -20.0
    # How the inclusion and VIB terms reduce over the D dimensions (docs/fidelity.md): "joint" = the paper's
    # formulas (one sigmoid per sample on H summed over d; KL summed over d), "official" = the official
    # code's (one sigmoid per dimension, inclusion and KL averaged over d), under which α₁, α₂, β were tuned.
    reduction: str = "joint"
    pcme_alpha: float = 0.1  # PCME++ pseudo-positive weight
    pcme_beta: float = 1e-4  # PCME++ VIB weight
    mix_fraction: float = 0.25  # PCME++ Mixup/CutMix share of a local batch


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-6
    weight_decay: float = 0.2
    warmup_steps: int = 500
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float = 0.0  # max global grad norm; 0 = off
    # LR multiplier for the σ heads (each tower's log σ² projection and [UNC] token, ``model.unc_params``):
    # 1 everywhere but the demo, whose ~300 steps are too few for the heads to move at the base LR.
    unc_lr_mult: float = 1.0
    # The image tower's σ head alone (None: ``unc_lr_mult``). The two heads meet different gradients (text
    # captions repeat across pictures, pictures do not), so a study may want them apart (docs/track.md
    # "Round 17"); no preset sets it.
    unc_lr_mult_image: float | None = None


@dataclass(frozen=True)
class ScalingSettings:
    num_workers: int = 2  # fixed size, or the maximum when min_workers > 0
    min_workers: int = 0  # > 0: elastic (min_workers, num_workers)
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 1.0  # only with use_gpu
    label_selector: dict[str, str] = field(default_factory=dict)  # Train worker nodes; empty = anywhere
    # Intra-op threads per worker: 0 = Ray's default (OMP_NUM_THREADS = the worker's CPUs), -1 = every core
    # of the node (one CPU worker on a laptop, with the ingest tasks taking turns on the same cores).
    torch_threads: int = 0


@dataclass(frozen=True)
class RunSettings:
    storage_path: str = "runs/train"  # local directory or s3://bucket/prefix
    name: str = "demo"  # same storage_path + name = resume from the latest checkpoint
    s3_endpoint: str = ""  # e.g. http://127.0.0.1:8333; else AWS_ENDPOINT_URL(_S3)
    max_failures: int = 0  # automatic worker-group restarts from the last checkpoint
    checkpoint_every: int = 100  # optimizer steps
    keep_checkpoints: int = 2
    log_every: int = 10
    tensorboard: bool = True
    fail_at_step: int = 0  # test hook: rank `fail_rank` raises at this step on a run not resumed
    fail_rank: int = 0


@dataclass(frozen=True)
class TrainConfig:
    model: str = "tiny"  # training.model.two_tower.MODEL_CONFIGS name
    grad_checkpointing: bool = False
    # "clip" (CLIP's BPE from open_clip_torch), "clip:PATH" (its bpe_simple_vocab_16e6.txt.gz), a saved
    # tokenizer directory or any tokenizer.json (e.g. SigLIP's); empty = train a BPE on the captions
    tokenizer: str = ""
    tokenizer_clean: str = (
        ""  # for a tokenizer.json: "", "lower" (CLIP's cleaning), "canonicalize" (SigLIP's)
    )
    tokenizer_vocab: int = 4096
    global_batch_size: int = 128
    samples_seen: int = 60_000  # total training samples; steps = samples_seen // global_batch_size
    precision: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    run: RunSettings = field(default_factory=RunSettings)

    @property
    def total_steps(self) -> int:
        return self.samples_seen // self.global_batch_size

    def world_sizes(self) -> list[int]:
        lo = self.scaling.min_workers or self.scaling.num_workers
        return list(range(lo, self.scaling.num_workers + 1))

    def __post_init__(self) -> None:
        """Field and cross-field checks on construction; ``ConfigError`` names the key."""
        check_types(self)
        positive(self, "global_batch_size", "samples_seen", "tokenizer_vocab")
        if self.model not in MODEL_CONFIGS:
            raise ConfigError(f"model: unknown {self.model!r} (known: {', '.join(MODEL_CONFIGS)})")
        if self.loss.name not in LOSS_SPECS:
            raise ConfigError(f"loss.name: unknown {self.loss.name!r} (known: {', '.join(LOSS_SPECS)})")
        if LOSS_SPECS[self.loss.name].probabilistic:  # e.g. demo-32px-cnn has no [UNC] token for σ²
            try:
                dataclasses.replace(MODEL_CONFIGS[self.model], probabilistic=True)
            except ConfigError as exc:
                raise ConfigError(
                    f"model: {self.model!r} cannot train loss.name={self.loss.name!r}: {exc}"
                ) from None
        if self.tokenizer_clean not in ("", "lower", "canonicalize"):
            raise ConfigError(
                f"tokenizer_clean: {self.tokenizer_clean!r} not in ('', 'lower', 'canonicalize')"
            )
        if self.loss.reduction not in REDUCTIONS:
            raise ConfigError(f"loss.reduction: {self.loss.reduction!r} not in {REDUCTIONS}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision: {self.precision!r} not in {PRECISIONS}")
        if self.total_steps < 1:
            raise ConfigError(
                f"samples_seen={self.samples_seen} is less than one global batch ({self.global_batch_size})"
            )
        s = self.scaling
        if s.num_workers < 1 or s.min_workers < 0 or s.min_workers > s.num_workers:
            raise ConfigError(f"scaling: need 0 <= min_workers <= num_workers >= 1, got {s}")
        bad = [w for w in self.world_sizes() if self.global_batch_size % w]
        if bad:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not divisible by world size(s) {bad} "
                f"(scaling.num_workers={s.num_workers}, scaling.min_workers={s.min_workers})"
            )
        if self.scaling.torch_threads < -1:
            raise ConfigError(f"scaling.torch_threads must be >= -1, got {self.scaling.torch_threads}")
        if self.data.cache_decoded and self.data.augment:
            raise ConfigError(
                "data.cache_decoded needs data.augment=false (cached crops would repeat every epoch)"
            )
        for name in ("shuffle_seed", "augment_seed", "mask_seed"):
            check_seed(getattr(self.data, name), f"data.{name}")
        if self.run.checkpoint_every < 1 or self.run.log_every < 1:
            raise ConfigError("run.checkpoint_every and run.log_every must be >= 1")
        for name in (
            "mask_fraction",
            "text_mask_ratio",
            "salient_share",
            "patch_keep_ratio",
            "color_jitter_p",
            "grayscale_p",
        ):
            value = getattr(self.data, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"data.{name} must be in [0, 1], got {value}")
        if self.data.text_mask_mode not in TEXT_MASK_MODES:
            raise ConfigError(f"data.text_mask_mode: {self.data.text_mask_mode!r} not in {TEXT_MASK_MODES}")
        if self.data.salient_share != 1.0 and self.data.text_mask_mode != "salient":
            raise ConfigError(
                f"data.salient_share={self.data.salient_share} needs data.text_mask_mode='salient', "
                f"got {self.data.text_mask_mode!r}"
            )
        if not 0.0 < self.data.crop_scale[0] <= self.data.crop_scale[1] <= 1.0:
            raise ConfigError(f"data.crop_scale must satisfy 0 < lo <= hi <= 1, got {self.data.crop_scale}")
        o = self.optim
        for key, ok in (
            ("lr", math.isfinite(o.lr) and o.lr > 0),
            ("eps", o.eps > 0),
            ("weight_decay", o.weight_decay >= 0),
            ("warmup_steps", o.warmup_steps >= 0),
            ("grad_clip", o.grad_clip >= 0),
            ("betas", all(0 <= b < 1 for b in o.betas)),
            ("min_lr_ratio", 0 <= o.min_lr_ratio <= 1),
            ("unc_lr_mult", math.isfinite(o.unc_lr_mult) and o.unc_lr_mult > 0),
            (
                "unc_lr_mult_image",
                o.unc_lr_mult_image is None
                or (math.isfinite(o.unc_lr_mult_image) and o.unc_lr_mult_image > 0),
            ),
        ):
            require(ok, f"optim.{key}", "is out of range", getattr(o, key))


_DEMO = TrainConfig(
    model="tiny",
    global_batch_size=128,
    samples_seen=60_000,
    # Logical CPUs on a 2-core laptop: two 0.5-CPU workers leave room for the ingest tasks.
    data=DataConfig(shards="runs/demo/shards", decode_batch_size=64, shuffle_window=512, decode_cpus=0.5),
    optim=OptimConfig(lr=5e-4, betas=(0.9, 0.98), warmup_steps=50, weight_decay=0.2),
    scaling=ScalingSettings(num_workers=2, cpus_per_worker=0.5),
    run=RunSettings(storage_path="runs/demo/train", name="demo", checkpoint_every=100, log_every=10),
)

TRAIN_PRESETS: dict[str, TrainConfig] = {
    "demo": _DEMO,
    "datacomp-small": TrainConfig(
        model="ViT-B-32",
        tokenizer="clip",
        global_batch_size=4096,
        samples_seen=12_800_000,
        data=DataConfig(
            shards="s3://my-bucket/datacomp-small/shards",
            decode_tasks=32,
            decode_batch_size=128,
            shuffle_window=4096,
        ),
        optim=OptimConfig(lr=5e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.2, warmup_steps=500),
        scaling=ScalingSettings(num_workers=8, use_gpu=True, cpus_per_worker=4),
        run=RunSettings(
            storage_path="s3://my-bucket/datacomp-small/train", name="datacomp-small", checkpoint_every=500
        ),
    ),
    "prolip-b16": TrainConfig(
        model="ViT-B-16-ProLIP",
        grad_checkpointing=False,
        global_batch_size=16_384,
        samples_seen=1_280_000_000,
        precision="bf16",
        data=DataConfig(
            shards="s3://my-bucket/datacomp-1b/shards",
            decode_tasks=256,
            decode_batch_size=256,
            shuffle_window=8192,
        ),
        loss=LossConfig(name="prolip", alpha1=1e-7, alpha2=1e-3, beta=1e-4),
        optim=OptimConfig(lr=5e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.2, warmup_steps=10_000),
        scaling=ScalingSettings(num_workers=32, use_gpu=True, cpus_per_worker=8),
        run=RunSettings(
            storage_path="s3://my-bucket/prolip-b16/train",
            name="prolip-b16",
            checkpoint_every=2000,
            max_failures=3,
            log_every=50,
        ),
    ),
}


def to_plain(cfg: TrainConfig) -> dict:
    """A JSON-able dict (tuples as lists) that ``from_plain`` turns back into the same config."""
    return dataclasses.asdict(cfg)


def from_plain(data: dict) -> TrainConfig:

    return from_dict(TrainConfig, data)


# --- evaluation (training/eval/run.py, ``python -m jobs.evaluate``) --------------------------------------


@dataclass(frozen=True)
class EvalConfig:
    """What ``python -m jobs.evaluate`` resolves (preset → YAML → --set → flags)."""

    checkpoint: str = ""
    tasks: str = "demo"  # a task-list name (training/eval/tasks/NAME.yaml) or a YAML file
    eval_root: str = ""  # root of the task list's relative paths
    out: str = ""
    s3_endpoint: str = ""
    num_actors: int = 1
    num_gpus: float = 0.0  # per actor; 0 on CPU-only clusters (a GPU request there waits forever)
    batch_size: int = 256
    analyses: bool = True
    max_samples: int | None = None  # per task, for quick checks
    seed: int = 0
    resume: bool = True  # keep the tasks already in --out's eval_results.jsonl (ours or DataComp's)

    def __post_init__(self) -> None:
        check_types(self)
        positive(self, "num_actors", "batch_size")
        non_negative(self, "num_gpus")
        if self.max_samples is not None:
            positive(self, "max_samples")


EVAL_PRESETS = {
    "demo": EvalConfig(batch_size=128),
    "datacomp-small": EvalConfig(tasks="datacomp", num_actors=1, batch_size=256),
    "prolip-b16": EvalConfig(tasks="datacomp", num_actors=4, num_gpus=1.0, batch_size=512),
}
