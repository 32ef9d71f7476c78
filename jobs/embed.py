"""``python -m jobs.embed --checkpoint C --shards S --out O.parquet [--num-actors N --num-gpus G]``.

Writes the frozen embeddings of every pool pair — what the post-hoc adapters (ProbVLM, AsymVLM) train
on — with Ray batch inference (``training.scoring.embed_shards``). One parquet file, local or ``s3://``,
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
or ``table.column("image_mu").combine_chunks().flatten().to_numpy().reshape(-1, D)``.
"""

from __future__ import annotations

import argparse
import sys

from jobs.common import init_ray, print_table
from training.model import CheckpointError
from training.scoring import embed_shards, verify_checkpoint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (local or s3://)")
    p.add_argument("--shards", required=True, help="shard directory, glob or comma list (local or s3://)")
    p.add_argument("--out", required=True, help="output .parquet (local or s3://)")
    p.add_argument("--s3-endpoint", default="", help="e.g. http://127.0.0.1:8333 (else AWS_ENDPOINT_URL)")
    p.add_argument("--num-actors", type=int, default=1, help="encoding actors, one model each")
    p.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per actor (0 on CPU)")
    p.add_argument("--cpus-per-actor", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=256)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # fail before any actor starts, naming the file
        verify_checkpoint(args.checkpoint, args.s3_endpoint)
    except CheckpointError as exc:
        print(f"embed: {exc}", file=sys.stderr)
        return 2
    init_ray()
    res = embed_shards(
        args.shards,
        args.checkpoint,
        args.out,
        s3_endpoint=args.s3_endpoint,
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
