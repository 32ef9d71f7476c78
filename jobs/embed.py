"""``python -m jobs.embed --checkpoint C --shards S --out O.parquet [--num-actors N --num-gpus G]``.

Writes the frozen embeddings of every pool pair — what the post-hoc adapters (ProbVLM, AsymVLM) train
on — with Ray batch inference (``training.infer.batch_inference.embed_shards``). One parquet file, local or ``s3://``,
rows in arrival order (join on ``uid``), one row per sample with an image:

=================  ===============================  ==================================================
column             Arrow type                       meaning
=================  ===============================  ==================================================
``uid``            string                           the sample's json uid (else its key)
``ok``             bool                             the image decoded; False → image columns are NaN
``text``           string                           the caption as stored in the shard
``image_mu``       fixed_size_list<float32>[D]      μ_v, L2-normalised (D = the model's embed_dim)
``text_mu``        fixed_size_list<float32>[D]      μ_t, L2-normalised
``image_logvar``   fixed_size_list<float32>[D]      log σ²_v — probabilistic checkpoints only
``text_logvar``    fixed_size_list<float32>[D]      log σ²_t — probabilistic checkpoints only
=================  ===============================  ==================================================

Deterministic checkpoints (CLIP/SigLIP) write no logvar columns rather than NaN-filled ones: half the
file, and a reader tells the kinds apart from the schema. The schema metadata holds ``checkpoint`` and
``columns``. Read vectors back with ``np.stack(table.column("image_mu").to_numpy(zero_copy_only=False))``
or ``table.column("image_mu").combine_chunks().flatten().to_numpy().reshape(-1, D)``. The checkpoint, the
shards and the output location are checked before Ray starts.
"""

from __future__ import annotations

import os
import sys
from dataclasses import fields

from jobs.common import init_ray, job_main, parse_job_config, print_table
from pipeline.common import storage
from pipeline.common.config import NonNegativeFloat, Positive, PositiveFloat, config_class
from pipeline.common.preflight import input_dir, input_files, output_location
from pipeline.common.shared_storage import require_shared_storage
from pipeline.common.storage_config import StorageConfig


@config_class
class EmbedJobConfig:
    checkpoint: str = ""  # checkpoint directory (local or s3://)
    shards: str = ""  # shard directory, glob or comma list (local or s3://)
    out: str = ""  # output .parquet (local or s3://)
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment
    num_actors: Positive = 1  # encoding actors, one model each
    num_gpus: NonNegativeFloat = 0.0  # GPUs per actor (0 on CPU)
    cpus_per_actor: PositiveFloat = 1.0  # Ray CPUs reserved per encoding actor
    batch_size: Positive = 256  # pairs per encoder call


PRESETS = {"demo": EmbedJobConfig()}
FLAGS = {f"--{f.name.replace('_', '-')}": f.name for f in fields(EmbedJobConfig) if f.name != "storage"}
FLAGS["--s3-endpoint"] = "storage.s3_endpoint"
SUMMARY = """\
Frozen image and caption embeddings (μ, and log σ² for a probabilistic checkpoint) of every pair in the
shards, by Ray batch inference, as one parquet file: what jobs.adapters fits on."""
EXAMPLE = "python -m jobs.embed --checkpoint runs/demo/train/scorer/checkpoint_00001500 --shards runs/demo/shards --out emb.parquet"


@job_main
def main(argv: list[str] | None = None) -> int:
    args = parse_job_config(
        argv, SUMMARY, PRESETS, FLAGS, required=("checkpoint", "shards", "out"), prog="jobs.embed",
        example=EXAMPLE,
    )  # fmt: skip
    store = args.storage.store()
    input_dir(store, args.checkpoint, "checkpoint")  # before torch loads to read it
    input_files(store, args.shards, "shards", "tar", ".tar")
    parent = os.path.dirname(args.out.rstrip("/")) if not storage.is_s3(args.out) else args.out
    output_location(store, parent or ".", "out")
    from training.infer.batch_inference import embed_shards
    from training.infer.scoring import verify_checkpoint

    verify_checkpoint(args.checkpoint, store)  # before any actor starts, naming the file
    init_ray()
    require_shared_storage({"shards": args.shards, "checkpoint": args.checkpoint})  # read on every host
    res = embed_shards(
        args.shards,
        args.checkpoint,
        args.out,
        store=store,
        num_actors=args.num_actors,
        num_gpus=args.num_gpus,
        batch_size=args.batch_size,
        cpus_per_actor=args.cpus_per_actor,
    )
    rows = [
        ("rows", res.n_rows),
        ("images failed", res.n_failed),
        ("wall s", f"{res.wall_s:.1f}"),
        ("pairs/s", f"{res.pairs_per_s:.1f}"),
    ]
    print_table(f"embeddings → {res.path}", rows, ("", "value"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
