"""The steps of ``jobs.track.run.run_track`` after the build: each returns a JSON-able record that
``track_state.json`` keeps, so a resumed track skips it.

Every step calls the same library function as its stand-alone job (``jobs.train``; ``jobs.filter``'s
``pipeline.filters.specs`` specs, random control and resharding; ``jobs.evaluate``), so the track adds no
second implementation of any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jobs.track.config import TrackConfig, paths, train_config
from pipeline.common import storage
from pipeline.common.storage import Storage
from training.config import TrainConfig
from training.infer.scoring import read_scores

Log = Callable[[str], None]
# the rest come from the build
_SCORE_SUBSETS = (
    "csd", "csd_uncertainty", "scorer_cosine", "random", "csd_ucb", "csd_inclusion", "csd_posterior",
    "neg_clip_loss", "norm_sim",
)  # fmt: skip


def build_pool(cfg: TrackConfig, log: Log) -> dict[str, Any]:
    """The build step: the pool (the demo's generated and served for its duration), its statuses, shards,
    subsets and curation counts."""
    import dataclasses

    import ray

    from jobs.track.datacomp.baselines import with_baselines
    from jobs.track.datacomp.pool import datacomp_pool
    from pipeline.build import build
    from pipeline.demo.source import demo_source

    storage = cfg.storage if cfg.storage.s3_endpoint else cfg.build.storage
    bcfg = dataclasses.replace(cfg.build, output=cfg.output, storage=storage)
    bcfg = with_baselines(cfg, datacomp_pool(bcfg) if cfg.pool == "datacomp" else bcfg)
    bcfg = with_eval_reference(cfg, bcfg, log)
    store = bcfg.storage.store()
    # The demo pool is served on the driver's address: 127.0.0.1 locally, the head's on a cluster.
    source = demo_source(bcfg, log, host=ray.util.get_node_ip_address(), store=store)
    with source as run_cfg:
        res = build(run_cfg, log, store, allow_hosts=source.allow_hosts)
    return {
        "n_input": res.n_input,
        "status": res.status_counts,
        "subsets": res.subsets,
        "curation": res.curation,
    }


def with_eval_reference(cfg: TrackConfig, bcfg: Any, log: Log) -> Any:
    """``bcfg`` (the build's config) with ``decontam.reference="eval"`` replaced by the reference of the
    track's own task list, written first to ``<output>/eval_reference.parquet`` by a Ray Data pass over the
    sets (training/eval/reference_dataset.py): the pool is decontaminated against exactly the sets its
    models are evaluated on."""
    if bcfg.decontam.reference != "eval":
        return bcfg
    import dataclasses

    from training.eval.reference_dataset import write_reference
    from training.eval.sets import load_tasks

    out = storage.join(cfg.output, "eval_reference.parquet")
    store = cfg.storage.store()
    if not store.exists(out):
        counts = write_reference(load_tasks(cfg.eval_tasks, root=paths(cfg)["eval_root"]), out, store)
        log(f"[track]   eval reference: {sum(counts.values())} pictures of {len(counts)} tasks → {out}")
    return dataclasses.replace(bcfg, decontam=dataclasses.replace(bcfg.decontam, reference=out))


def train_models(
    cfg: TrackConfig, runs: dict[str, tuple[TrainConfig, str, int, str]], log: Log
) -> dict[str, Any]:
    """Train each ``name → (base config, shards, seed, subset .npy or "")`` in turn (``run_track`` runs
    ``train_parallel`` such calls side by side)."""
    from training.train.trainer import train

    out: dict[str, Any] = {}
    for name, (base, shards, seed, subset) in runs.items():
        tcfg = train_config(cfg, base, name, shards, seed, subset)
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
            f"[track]   {name}: loss {_loss(out[name]['first_loss'])} → {_loss(out[name]['final_loss'])} in {res.wall_s:.0f}s"
        )
    return out


def _loss(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"  # the table's 4 digits; the state keeps every digit


def score_pool(cfg: TrackConfig, checkpoint: str, log: Log) -> dict[str, Any]:
    from training.infer.batch_inference import score_shards

    p = paths(cfg)
    res = score_shards(
        p["shards"],
        checkpoint,
        p["scores"],
        store=cfg.storage.store(),
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


def logit_scalars(checkpoint: str, store: Storage) -> tuple[float, float]:
    """The scorer's trained logit scale a and bias b (its checkpoint's ``metrics.json``), the posterior
    ``csd_posterior`` weights pairs by."""
    metrics = store.read_json(storage.join(checkpoint, "metrics.json"))
    return float(metrics["logit_scale"]), float(metrics["logit_bias"])


def subset_specs(cfg: TrackConfig, scalars: tuple[float, float] = (10.0, -10.0)) -> list[str]:
    """The track's score-filter subsets as ``pipeline.filters.specs`` specs, labelled by subset kind, each
    from its filter object (the class's defaults at the track's shared size); the random control is the
    library's ``of=`` control, sized like ``cfg.random_of`` and seeded by the first seed; a spec of
    ``cfg.filters`` labelled like a built-in replaces it, at its size unless it gives ``fraction``;
    ``scalars``: the scorer's logit scale and bias (``logit_scalars``)."""
    from pipeline.filters import registry as R
    from pipeline.filters.specs import parse_filter_specs

    p = paths(cfg)
    f, seed = cfg.csd_fraction, cfg.seeds[0]
    filters = {  # keys: _SCORE_SUBSETS
        "csd": R.CsdBest(fraction=f),
        "csd_uncertainty": R.CsdUncertaintyAware(fraction=f),
        "csd_ucb": R.CsdUcb(fraction=f),
        "csd_inclusion": R.CsdInclusion(fraction=f),
        "csd_posterior": R.CsdPosterior(fraction=f, scale=scalars[0], bias=scalars[1], seed=seed),
        "neg_clip_loss": R.NegClipLoss(fraction=f, embeddings_file=p["embeddings"]),
        "norm_sim": R.NormSim(fraction=f, embeddings_file=p["embeddings"], target_file=p["norm_sim_target"]),
        "scorer_cosine": R.ClipScoreBest(fraction=cfg.clip_fraction),
        "random": R.RandomSameSize(seed=seed),
    }
    given = parse_filter_specs(cfg.filters, "filters", known=cfg.subsets) if cfg.filters else []
    variants = []
    for spec in given:  # a variant of a built-in subset keeps that subset's size unless it says otherwise
        size = getattr(filters.get(spec.label), "fraction", None)
        same_size = (
            size is not None and len(spec.parts) == 1 and "fraction" in R.FILTERS[spec.name].defaults()
        )
        variants.append(
            spec.text + (f",fraction={size}" if same_size and "fraction" not in spec.params else "")
        )
    replaced = {spec.label for spec in given}
    built_in = []
    for name in (n for n in cfg.subsets if n in filters and n not in replaced):
        text = filters[name].spec()
        keys = (f"of={cfg.random_of}," if name == "random" else "") + f"label={name}"
        built_in.append(text + ("," if ":" in text else ":") + keys)
    return built_in + variants


def make_subsets(
    cfg: TrackConfig, build_subsets: dict[str, str], scores_path: str, log: Log, checkpoint: str = ""
) -> dict[str, Any]:
    """One DataComp ``.npy`` per requested subset: the build's baselines as they are, the score filters
    (and the random control) run on ``scores.parquet`` the way ``jobs.filter`` runs them."""
    from pipeline.filters.specs import parse_filter_specs, resolve_params, run_filters
    from pipeline.schema import u8pairs_to_uids
    from pipeline.subsets.uid_files import read_subset, write_subsets

    p = paths(cfg)
    store = cfg.storage.store()
    extra = (
        {s.label for s in parse_filter_specs(cfg.filters, "filters", known=cfg.subsets)}
        if cfg.filters
        else set()
    )
    from_build = [name for name in cfg.subsets if name not in (*_SCORE_SUBSETS, *extra)]
    scores = read_scores(scores_path, store)
    scored = set(scores.column("uid").to_pylist())  # every downloaded sample was scored
    listed, sizes = {}, {}
    for name in from_build:
        with store.open_input(build_subsets[name]) as fh:
            uids = u8pairs_to_uids(read_subset(fh, build_subsets[name]))
        listed[name] = len(uids)
        # A metadata-scope subset (DataComp's) lists uids that never downloaded; controls sized "like"
        # it take the size it trains on.
        sizes[name] = sum(u in scored for u in uids)
    scalars = (
        logit_scalars(checkpoint, store) if checkpoint and "csd_posterior" in cfg.subsets else (10.0, -10.0)
    )
    specs = parse_filter_specs(subset_specs(cfg, scalars), "subsets", known=from_build)
    results = run_filters(scores, specs, store=store, sizes=sizes)
    # Named by rule so they never overwrite the build's own subsets (its ``random`` is another draw).
    files = {
        s.label: storage.join(p["subsets"], f"{s.label if s.label in extra else s.name}.npy") for s in specs
    }
    written = write_subsets(store, scores, results, files)
    sizes.update(written)  # a control may be sized like a score subset (of=csd)
    out: dict[str, Any] = {}
    for name in from_build:
        out[name] = {"path": build_subsets[name], "size": listed[name], "downloaded": sizes[name]}
        out[name].update({"rule": f"build:{name}", "params": {}, "dropped": {}})
    for spec in specs:
        params = {k: v for name, given in spec.parts for k, v in resolve_params(name, given).items()}
        if spec.of:
            params["n_keep"] = sizes[spec.of]
        out[spec.label] = {
            "path": files[spec.label],
            "size": written[spec.label],
            "downloaded": written[spec.label],  # score filters choose among scored (downloaded) samples
            "rule": spec.name,
            "params": params,
            "dropped": results[spec.label].counts(),
        }
    for name in cfg.subsets:
        info = out[name]
        log(f"[track]   subset {name}: {info['size']} uids, {info['downloaded']} downloaded ({info['rule']})")
    return {name: out[name] for name in cfg.subsets}


def reshard_subsets(cfg: TrackConfig, subsets: dict[str, Any], log: Log) -> dict[str, Any]:
    """Each subset materialised by the same library call the filter job makes."""
    from pipeline.subsets.materialize import reshard_subsets as reshard_all

    p = paths(cfg)
    store = cfg.storage.store()
    targets = {name: storage.join(p["subset_shards"], name) for name in subsets}
    done = reshard_all(
        store,
        p["shards"],
        {name: info["path"] for name, info in subsets.items()},
        targets,
        cfg.build.samples_per_shard,
    )
    out: dict[str, Any] = {}
    for name, res in done.items():
        # A metadata-scope subset lists uids that never downloaded: only those may be missing.
        want = subsets[name].get("downloaded", subsets[name]["size"])
        if res.n_written != want:
            raise RuntimeError(
                f"subset {name}: {res.n_written} samples found in {p['shards']}, {want} expected"
            )
        out[name] = {"dir": targets[name], "n": res.n_written, "shards": len(res.shards)}
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
            store=cfg.storage.store(),
            num_gpus=cfg.eval_gpus,
            analyses=name == "scorer",
            max_samples=cfg.eval_max_samples or None,
            seed=info.get("seed", 0),
            resume=False,  # the track resumes by its own state; a retrained model reuses its path
            log=lambda line: log(f"[track]   {line}"),
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
