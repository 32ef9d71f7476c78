"""Evaluation task lists and eval sets in clip_benchmark's webdataset layout, local or ``s3://``.

A task list is YAML (``training/eval/tasks/<name>.yaml``, or any file)::

    defaults: {optional: false}          # optional tasks whose directory is absent are skipped
    tasks:
      - {name: imagenet1k, path: wds_imagenet1k_test, kind: zeroshot_classification,
         main_metric: acc1, group: imagenet}

Relative ``path``s resolve against the ``root`` the caller passes (``--eval-root``). Kinds:
``zeroshot_classification`` (``classnames.txt``, ``zeroshot_classification_templates.txt`` with ``{c}``,
``test/*.tar`` of image + ``.cls``), ``retrieval`` and ``hierarchy`` (``test/*.tar`` of image + ``.txt``,
one caption per line; in a hierarchy set line k is level k, general → specific). Group-wise metrics
(WILDS, DataComp fairness) read per-sample ``.npy`` metadata: ``group_column`` selects the column.

``association`` (WinoGAViL: which candidate images go with a cue) and any task with ``hf_dataset`` read
the Hugging Face ``datasets`` cache that DataComp's downloader fills (``training/eval/hf_sets.py``).

``validate_task`` checks a set before any Ray work and raises ``EvalSetError`` naming the file.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pipeline.common import storage
from pipeline.common.config import yaml_problem
from pipeline.common.errors import InputError
from pipeline.common.storage import LOCAL, Storage
from pipeline.shards.reader import IMAGE_EXTS, iter_shard
from pipeline.shards.tar_format import ShardError

KINDS = ("zeroshot_classification", "retrieval", "hierarchy", "association")
GROUPS = ("", "imagenet", "imagenet_dist_shift", "vtab", "retrieval")
TASKS_DIR = Path(__file__).resolve().parent / "tasks"


class EvalSetError(InputError, ValueError):
    """A task list or an eval set is malformed; the message names the file."""


@dataclass(frozen=True)
class Task:
    """One evaluation task; ``group`` is its DataComp aggregate group ("" for none)."""

    name: str
    path: str
    kind: str
    main_metric: str
    group: str = ""
    display: str = ""
    optional: bool = False
    group_column: int | None = None  # column of the per-sample .npy metadata for worst-group metrics
    group_metric: str = "acc1"
    group_exclude: tuple[int, ...] = field(default_factory=tuple)
    key: str = ""  # DataComp's task key (tasklist.yml), e.g. "vtab/caltech101"; "" = name
    # A set in the Hugging Face datasets cache at ``path`` (training/eval/hf_sets.py), e.g.
    # "nlphuji/flickr_1k_test_image_text_retrieval"; "" = clip_benchmark's webdataset layout.
    hf_dataset: str = ""


def _resolve_path(path: str, root: str | None) -> str:
    if storage.is_s3(path) or Path(path).is_absolute() or not root:
        return path
    return storage.join(root, path)


def load_tasks(path_or_name: str, root: str | None = None) -> list[Task]:
    """Tasks of a YAML list: a name (``demo`` → ``training/eval/tasks/demo.yaml``) or a file path."""
    file = TASKS_DIR / f"{path_or_name}.yaml"
    if not (file.is_file() and "/" not in path_or_name):
        file = Path(path_or_name)
    if not file.is_file():
        known = ", ".join(sorted(p.stem for p in TASKS_DIR.glob("*.yaml")))
        raise EvalSetError(f"task list not found: {path_or_name} (known names: {known})")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise EvalSetError(f"{file}: not valid YAML ({yaml_problem(e)})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise EvalSetError(f"{file}: cannot read the task list ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("tasks"), list):
        raise EvalSetError(f"{file}: expected a mapping with a 'tasks' list")
    defaults = data.get("defaults") or {}
    names = {f.name for f in dataclasses.fields(Task)}
    tasks = []
    for i, entry in enumerate(data["tasks"]):
        where = f"{file}: tasks[{i}]"
        if not isinstance(entry, dict):
            raise EvalSetError(f"{where}: expected a mapping")
        entry = {**defaults, **entry}
        unknown = sorted(set(entry) - names)
        if unknown:
            raise EvalSetError(f"{where}: unknown key(s) {', '.join(unknown)}")
        for key in ("name", "path", "kind", "main_metric"):
            if not entry.get(key):
                raise EvalSetError(f"{where}: missing '{key}'")
        if entry["kind"] not in KINDS:
            raise EvalSetError(f"{where}: kind {entry['kind']!r} is not one of {', '.join(KINDS)}")
        if entry.get("hf_dataset") and entry["kind"] not in ("retrieval", "association"):
            raise EvalSetError(f"{where}: hf_dataset sets are retrieval or association sets")
        if entry["kind"] == "association" and not entry.get("hf_dataset"):
            raise EvalSetError(f"{where}: an association set is read from the datasets cache (hf_dataset)")
        if entry.get("group", "") not in GROUPS:
            raise EvalSetError(f"{where}: group {entry['group']!r} is not one of {GROUPS}")
        entry["group_exclude"] = tuple(int(x) for x in entry.get("group_exclude", ()))
        entry["path"] = _resolve_path(str(entry["path"]), root)
        tasks.append(Task(**entry))
    if len({t.name for t in tasks}) != len(tasks):
        raise EvalSetError(f"{file}: duplicate task names")
    return tasks


# ---------------------------------------------------------------- layout


def shard_paths(task: Task, store: Storage = LOCAL) -> list[str]:
    """The ``test/*.tar`` shards in numeric order (``nshards.txt`` is checked when present)."""
    test = storage.join(task.path, "test")
    tars = store.list_files(test, suffix=".tar")

    def number(p: str) -> tuple[int, str]:
        stem = p.rsplit("/", 1)[-1][: -len(".tar")]
        return (int(stem), "") if stem.isdigit() else (1 << 62, stem)

    tars.sort(key=number)
    if not tars:
        raise EvalSetError(f"eval set {task.name}: no shards in {test}/ (clip_benchmark layout test/N.tar)")
    nshards = storage.join(test, "nshards.txt")
    if store.exists(nshards):
        text = store.read_bytes(nshards).decode().strip()
        if not text.isdigit() or int(text) != len(tars):
            raise EvalSetError(f"{nshards} says {text!r} but {len(tars)} shard(s) are in {test}/")
    return tars


def read_lines(path: str, store: Storage = LOCAL) -> list[str]:
    """Non-empty stripped lines of a text file; a missing file raises ``EvalSetError`` naming it."""
    if not store.exists(path):
        raise EvalSetError(f"eval set file missing: {path}")
    lines = [ln.strip() for ln in store.read_bytes(path).decode("utf-8").splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines:
        raise EvalSetError(f"eval set file is empty: {path}")
    return lines


def classnames(task: Task, store: Storage = LOCAL) -> list[str]:
    return read_lines(storage.join(task.path, "classnames.txt"), store)


def templates(task: Task, store: Storage = LOCAL) -> list[str]:
    """Prompt templates with ``{c}`` for the class name (clip_benchmark's file)."""
    path = storage.join(task.path, "zeroshot_classification_templates.txt")
    lines = read_lines(path, store)
    bad = [t for t in lines if "{c}" not in t]
    if bad:
        raise EvalSetError(f"{path}: template without '{{c}}': {bad[0]!r}")
    return lines


def _image_ext(sample: dict[str, Any]) -> str | None:
    return next((e for e in IMAGE_EXTS if e in sample), None)


def validate_task(task: Task, store: Storage = LOCAL) -> list[str]:
    """Check the set's layout (files, shard count, first sample's members); returns its shard paths."""
    if task.kind == "zeroshot_classification":
        names = classnames(task, store)
        templates(task, store)
    tars = shard_paths(task, store)
    try:
        first = next(iter_shard(tars[0], store, decode=False), None)
    except (ShardError, OSError) as e:
        raise EvalSetError(f"eval set {task.name}: unreadable shard {tars[0]}: {e}") from e
    if first is None:
        raise EvalSetError(f"eval set {task.name}: shard {tars[0]} holds no sample")
    if _image_ext(first) is None:
        raise EvalSetError(f"{tars[0]}: sample {first['__key__']!r} has no image ({'/'.join(IMAGE_EXTS)})")
    need = "cls" if task.kind == "zeroshot_classification" else "txt"
    if need not in first:
        raise EvalSetError(f"{tars[0]}: sample {first['__key__']!r} has no .{need} member ({task.kind} set)")
    if need == "cls":
        label = first["cls"].decode().strip()
        if not label.lstrip("-").isdigit() or not 0 <= int(label) < len(names):
            raise EvalSetError(
                f"{tars[0]}: sample {first['__key__']!r} has class {label!r} outside 0..{len(names) - 1}"
            )
    if task.group_column is not None and "npy" not in first:
        raise EvalSetError(f"{tars[0]}: task {task.name} needs per-sample .npy metadata (group_column)")
    return tars


# ---------------------------------------------------------------- rows


def sample_row(sample: dict[str, Any], kind: str, group_column: int | None = None) -> dict[str, Any]:
    """One sample as a flat row: ``image`` bytes, ``label`` (−1 if none), ``captions`` ("\\n"-joined), ``group``."""
    ext = _image_ext(sample)
    label, captions, group = -1, "", -1
    if kind == "zeroshot_classification" and "cls" in sample:
        label = int(bytes(sample["cls"]).decode().strip())
    if "txt" in sample:
        captions = bytes(sample["txt"]).decode("utf-8", "replace").strip()
    if group_column is not None and "npy" in sample:
        meta = np.load(io.BytesIO(bytes(sample["npy"])), allow_pickle=False)
        group = int(np.asarray(meta).reshape(-1)[group_column])
    return {"image": bytes(sample[ext]) if ext else b"", "label": label, "captions": captions, "group": group}


def iter_rows(
    path: str, kind: str, store: Storage = LOCAL, limit: int | None = None, group_column: int | None = None
) -> Iterator[dict[str, Any]]:
    """Rows of one shard in order, at most ``limit``; ``pos`` is the sample's index within the shard."""
    for pos, sample in enumerate(iter_shard(path, store, decode=False)):
        if limit is not None and pos >= limit:
            return
        yield {"pos": pos, **sample_row(sample, kind, group_column)}


def split_captions(captions: str) -> list[str]:
    return [c.strip() for c in captions.splitlines() if c.strip()]
