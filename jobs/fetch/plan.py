"""Which hub repos ``jobs.fetch`` copies and where each file lands: the pool metadata flat in one folder (as
DataComp's ``download_upstream.py`` links them, each ``.npz`` beside its parquet, where the build's
semantic dedup looks for it), and each evaluation set where the task list's reader looks for it
(training/eval/sets.py, training/eval/hf_sets.py).

- A webdataset set ``wds_<task>_test`` comes from ``<eval_owner>/wds_<task>_test`` (DataComp's
  ``download_evalsets.py``): ``classnames.txt``, ``zeroshot_classification_templates.txt`` and ``test/``.
- A set DataComp loads with ``datasets`` (Flickr 1k, MSCOCO 5k, WinoGAViL, ``hf_dataset`` in the list)
  comes as the parquet files of its ``test`` split, from the first revision in ``eval_hf_revisions`` that
  has them (its ``main`` branch, else the hub's ``refs/convert/parquet`` conversion), into the cache layout
  ``<cache>/<ns>___<name>/<config>/0.0.0/hub/<name>-test[-NNNNN-of-NNNNN].parquet``.
"""

from __future__ import annotations

import posixpath

from jobs.fetch.config import FetchConfig
from pipeline.common.config import ConfigError
from pipeline.hub.mirror import Source
from training.eval import hf_sets
from training.eval.sets import Task, load_tasks

WDS_PATTERNS = ("*.txt", "test/*")


def sources(cfg: FetchConfig) -> list[Source]:
    out = [metadata_source(cfg)] if cfg.metadata_repo else []
    return out + (eval_sources(cfg) if cfg.eval_tasks else [])


def metadata_source(cfg: FetchConfig) -> Source:
    patterns = ("*.parquet", "*.npz") if cfg.npz else ("*.parquet",)
    return Source(
        "metadata", cfg.metadata_repo, cfg.metadata_root(), patterns, (cfg.metadata_revision,), flat
    )


def flat(paths: list[str]) -> dict[str, str]:
    """Every file by its name alone in one folder (by its repo path when two share a name)."""
    names = [posixpath.basename(p) for p in paths]
    return {p: n if names.count(n) == 1 else p for p, n in zip(paths, names, strict=True)}


def eval_sources(cfg: FetchConfig) -> list[Source]:
    tasks = load_tasks(cfg.eval_tasks, root=cfg.eval_root())
    unknown = sorted(set(cfg.eval_only) - {t.name for t in tasks})
    if unknown:
        raise ConfigError(f"eval_only: {', '.join(unknown)} not in task list {cfg.eval_tasks}")
    chosen = [t for t in tasks if not cfg.eval_only or t.name in cfg.eval_only]
    return [eval_source(cfg, t) for t in chosen]


def eval_source(cfg: FetchConfig, task: Task) -> Source:
    name = f"eval set {task.name}"
    if task.hf_dataset:
        root = hf_sets.dataset_dir(task)
        return Source(
            name, task.hf_dataset, root, ("*.parquet",), tuple(cfg.eval_hf_revisions), test_split(task)
        )
    repo = f"{cfg.eval_owner}/{posixpath.basename(task.path.rstrip('/'))}"
    return Source(name, repo, task.path, WDS_PATTERNS)


def test_split(task: Task):
    """Repo parquet paths → the cache layout of ``task``'s test split (the other splits are left out)."""
    base = task.hf_dataset.rsplit("/", 1)[-1]

    def place(paths: list[str]) -> dict[str, str]:
        mine = sorted(p for p in paths if _is_test(p))
        config = next((p.split("/")[0] for p in mine if p.count("/") >= 2), "default")
        n = len(mine)
        suffix = (lambda i: "") if n == 1 else (lambda i: f"-{i:05d}-of-{n:05d}")
        return {p: f"{config}/0.0.0/hub/{base}-test{suffix(i)}.parquet" for i, p in enumerate(mine)}

    return place


def _is_test(path: str) -> bool:
    """A file of the test split: under a ``test/`` folder (the parquet conversion's ``<config>/test/``) or
    named ``test-…``/``…-test…`` (the hub's data-file conventions)."""
    *dirs, name = path.split("/")
    stem = name.rsplit(".", 1)[0]
    return "test" in dirs or stem == "test" or stem.startswith("test-") or "-test" in stem
