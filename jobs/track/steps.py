"""The steps of ``jobs.track.run.run_track`` after the build: each returns a JSON-able record that
``track_state.json`` keeps, so a resumed track skips it.

Every step calls the same library function as its stand-alone job (``jobs.train``, ``jobs.filter``,
``jobs.reshard``, ``jobs.evaluate``), so the track adds no second implementation of any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jobs.track.config import TrackConfig, paths, train_config
from pipeline import storage
from training.config import TrainConfig

Log = Callable[[str], None]


def train_models(cfg: TrackConfig, runs: dict[str, tuple[TrainConfig, str, int]], log: Log) -> dict[str, Any]:
    """Train each ``name → (base config, shards, seed)`` in turn; the cluster could run them side by side,
    but on a laptop they would only compete for the same cores."""
    from training.trainer import train

    out: dict[str, Any] = {}
    for name, (base, shards, seed) in runs.items():
        tcfg = train_config(cfg, base, name, shards, seed)
        log(f"[track]   train {name}: {tcfg.loss.name}, {tcfg.samples_seen} samples seen, seed {seed}")
        res = train(tcfg)
        final = res.metrics[-1] if res.metrics else {}
        out[name] = {
            "checkpoint": res.checkpoint_path,
            "loss": tcfg.loss.name,
            "samples_seen": tcfg.samples_seen,
            "steps": res.return_value.get("final_step"),
            "seed": seed,
            "wall_s": round(res.wall_s, 1),
            "final_loss": final.get("loss/total"),
            "first_loss": res.metrics[0].get("loss/total") if res.metrics else None,
            "ingest": res.ingest,
        }
        log(
            f"[track]   {name}: loss {out[name]['first_loss']} → {out[name]['final_loss']} in {res.wall_s:.0f}s"
        )
    return out


def score_pool(cfg: TrackConfig, checkpoint: str, log: Log) -> dict[str, Any]:
    from training.scoring import score_shards

    p = paths(cfg)
    res = score_shards(
        p["shards"],
        checkpoint,
        p["scores"],
        s3_endpoint=cfg.s3_endpoint,
        num_actors=cfg.score_actors,
        num_gpus=cfg.score_gpus,
    )
    log(f"[track]   scored {res.n_rows} pairs ({res.n_failed} failed) at {res.pairs_per_s:.0f} pairs/s")
    return {
        "path": p["scores"],
        "n_rows": res.n_rows,
        "n_failed": res.n_failed,
        "pairs_per_s": res.pairs_per_s,
    }


def make_subsets(
    cfg: TrackConfig, build_subsets: dict[str, str], scores_path: str, log: Log
) -> dict[str, Any]:
    """One DataComp ``.npy`` per requested subset: the build's baselines as they are, the score filters
    from ``scores.parquet``; the random control last, sized like ``cfg.random_of``."""
    from pipeline.score_filters import apply
    from pipeline.subset import subset_uids, write_subset

    p = paths(cfg)
    scores = storage.read_parquet(scores_path, s3_endpoint=cfg.s3_endpoint)
    rules: dict[str, tuple[str, dict[str, Any]]] = {
        "csd": ("csd_best", {"fraction": cfg.csd_fraction}),
        "csd_uncertainty": (
            "csd_uncertainty_aware",
            {"fraction": cfg.csd_fraction, "text_unc_quantile": cfg.text_unc_quantile},
        ),
        "clip_score": ("clip_score_best", {"fraction": cfg.clip_fraction}),
    }
    out: dict[str, Any] = {}
    # The random control goes last: it is sized like ``cfg.random_of``.
    order = sorted(cfg.subsets, key=lambda s: s == "random")
    for name in order:
        if name not in rules and name != "random":  # a build baseline, used as the build wrote it
            path, counts, rule, params = build_subsets[name], {}, f"build:{name}", {}
            uids = subset_uids(path)
        else:
            if name == "random":
                rule, params = (
                    "random_same_size",
                    {"n_keep": out[cfg.random_of]["size"], "seed": cfg.seeds[0]},
                )
            else:
                rule, params = rules[name]
            outcome = apply(rule, scores, **params)
            uids, counts = list(outcome.uids_kept), dict(outcome.counts_by_reason)
            # Named by rule so they never overwrite the build's own subsets (its ``random`` is another draw).
            path = storage.join(p["subsets"], f"{rule}.npy")
            write_subset(uids, path)
        out[name] = {"path": path, "size": len(uids), "rule": rule, "params": params, "dropped": counts}
        log(f"[track]   subset {name}: {len(uids)} uids ({rule})")
    return out


def reshard_subsets(cfg: TrackConfig, subsets: dict[str, Any], log: Log) -> dict[str, Any]:
    from pipeline.reshard import reshard

    p = paths(cfg)
    out: dict[str, Any] = {}
    for name, info in subsets.items():
        target = storage.join(p["subset_shards"], name)
        res = reshard(
            p["shards"],
            info["path"],
            target,
            samples_per_shard=cfg.build.samples_per_shard,
            s3_endpoint=cfg.s3_endpoint,
            overwrite=True,
        )
        if res.n_missing:
            raise RuntimeError(f"subset {name}: {res.n_missing} uids not found in {p['shards']}")
        out[name] = {"dir": target, "n": res.n_written, "shards": len(res.shards)}
        log(f"[track]   resharded {name}: {res.n_written} samples in {len(res.shards)} shard(s)")
    return out


def evaluate_models(cfg: TrackConfig, models: dict[str, Any], log: Log) -> dict[str, Any]:
    """Each model on the task list; the scorer with the uncertainty analyses too (it is the ProLIP
    trained on the whole pool, the model whose σ² the paper's claims are about)."""
    from training.eval.run import evaluate
    from training.eval.sets import load_tasks

    p = paths(cfg)
    tasks = load_tasks(cfg.eval_tasks, root=p["eval_root"])
    out: dict[str, Any] = {}
    for name, info in models.items():
        rep = evaluate(
            info["checkpoint"],
            tasks,
            storage.join(p["eval"], name),
            s3_endpoint=cfg.s3_endpoint,
            num_gpus=cfg.eval_gpus,
            analyses=name == "scorer",
            max_samples=cfg.eval_max_samples or None,
            seed=info.get("seed", 0),
        )
        out[name] = {
            "results": rep.results,
            "aggregates": rep.aggregates,
            "analyses": rep.analyses,
            "plots": list(rep.plots),
            "dir": rep.out_dir,
        }
        avg = rep.aggregates.get("average")
        log(f"[track]   evaluated {name}: average {avg if avg is None else round(avg, 4)}")
    return out
