"""Reading training shards strictly, and counting what is damaged (stage 1 of pipeline/ingest_train.py).

``make_shard_datasource`` is Ray Data's file-based read of webdataset ``.tar`` shards — what
``read_webdataset(decoder=None)`` does (one read task per shard, raw bytes, ``FileShuffleConfig`` shard
order, local or S3 paths) — with one difference: Ray's reader streams through ``tarfile`` in ``r|``
mode, which silently stops at a damaged header or at a shard cut on a member boundary (a 10-sample shard
cut after 5 reads as 5 samples; tested), so a corrupt shard could never be counted. We parse with
``pipeline.shards.iter_shard``, which demands the end-of-archive block: the intact samples before the
damage are kept, the rest of the shard is skipped with a warning, and the distinct damaged shards are
counted in a small named actor (``IngestCounters``, which also counts undecodable images). Past
``max_bad_shards`` the read raises ``TooManyBadShards`` naming the shard, which stops the job.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from pipeline import shards, storage

log = logging.getLogger(__name__)

READ_CHUNK_ROWS = 256  # rows per block yielded by a read task


class TooManyBadShards(RuntimeError):
    """More distinct corrupt/truncated shards than ``max_bad_shards``; names the last one."""


class IngestCounters:
    """Counts shared by every ingest task (run as a named Ray actor): damaged shards and dropped images;
    also the train loop's latest metrics, so the driver can print progress without worker log streaming."""

    def __init__(self) -> None:
        self.bad_shards: dict[str, str] = {}
        self.bad_images = 0
        self.bad_image_examples: list[str] = []
        self.progress: dict[str, Any] = {}

    def set_progress(self, metrics: dict[str, Any]) -> None:
        """The train loop's latest logged metrics, for the driver's progress line."""
        self.progress = dict(metrics)

    def latest_progress(self) -> dict[str, Any]:
        return self.progress

    def bad_shard(self, path: str, error: str) -> int:
        self.bad_shards.setdefault(path, error)
        return len(self.bad_shards)

    def add_bad_images(self, n: int, examples: Sequence[str]) -> None:
        self.bad_images += n
        self.bad_image_examples = (self.bad_image_examples + list(examples))[:20]

    def snapshot(self) -> dict[str, Any]:
        return {
            "bad_shards": len(self.bad_shards),
            "bad_shard_paths": sorted(self.bad_shards),
            "bad_images": self.bad_images,
            "bad_image_examples": list(self.bad_image_examples),
        }


_LIVE_COUNTERS: dict[str, Any] = {}


def counters_handle(name: str | None) -> Any:
    if not name:
        return None
    import ray

    try:
        return ray.get_actor(name)
    except ValueError:
        return None


def start_counters(name: str | None = None) -> str:
    """Start the shared ``IngestCounters`` actor (needs Ray) and return its name."""
    import ray

    name = name or f"prolip-ingest-{uuid.uuid4().hex[:12]}"
    # A named actor is still garbage-collected once no handle exists: the driver keeps one.
    _LIVE_COUNTERS[name] = ray.remote(num_cpus=0)(IngestCounters).options(name=name).remote()
    return name


def stop_counters(name: str | None) -> None:
    """Let the counters actor go (its process would otherwise idle on, one per finished training)."""
    import ray

    handle = _LIVE_COUNTERS.pop(name, None) if name else None
    if handle is not None:
        ray.kill(handle)


def read_counters(name: str) -> dict[str, Any]:
    import ray

    handle = counters_handle(name)
    return ray.get(handle.snapshot.remote()) if handle is not None else {}


def publish_progress(name: str | None, metrics: dict[str, Any]) -> None:
    """Fire-and-forget: the loop never waits on the driver's progress line."""
    handle = counters_handle(name)
    if handle is not None:
        handle.set_progress.remote(metrics)


class ProgressPrinter:
    """A driver-side thread printing the train loop's latest metrics every ``every_s`` seconds:
    step/total, loss, samples/s and an ETA, so a long run is never silent."""

    def __init__(self, name: str, label: str, every_s: float = 15.0, log: Any = print) -> None:
        import threading

        self.name, self.label, self.every_s, self.log = name, label, every_s, log
        self._stop = threading.Event()
        self._last_step = -1
        self._thread = threading.Thread(target=self._run, name="train-progress", daemon=True)

    def __enter__(self) -> ProgressPrinter:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import ray

        while not self._stop.wait(self.every_s):
            handle = counters_handle(self.name)
            try:
                m = ray.get(handle.latest_progress.remote(), timeout=5) if handle is not None else {}
            except Exception:  # a progress line is best effort; training is unaffected
                continue
            step, total = int(m.get("step", 0)), int(m.get("total_steps", 0))
            if not m or step == self._last_step:
                continue
            self._last_step = step
            rate = float(m.get("samples_per_s", 0.0))
            left = (total - step) * (m.get("samples_seen", 0) / max(step, 1)) / rate if rate > 0 else 0.0
            self.log(
                f"[train {self.label}] step {step}/{total} loss {m.get('loss/total', float('nan')):.4f} "
                f"{rate:.0f} samples/s, data wait {100 * float(m.get('data_wait_fraction', 0.0)):.0f}%, "
                f"~{left:.0f}s left"
            )


def list_shards(spec: str, s3_endpoint: str = "") -> list[str]:
    """Shard paths from a directory, a glob, or a comma-separated list (local or s3://), sorted."""
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part.endswith(".tar") and not any(c in part for c in "*?["):
            out.append(part)
        else:
            out.extend(storage.list_files(part, suffix=".tar", s3_endpoint=s3_endpoint))
    if not out:
        raise FileNotFoundError(f"no .tar shards at {spec!r}")
    return sorted(set(out))


def make_shard_datasource(*args: Any, **kwargs: Any) -> Any:
    from ray.data.datasource import FileBasedDatasource

    class ShardDatasource(FileBasedDatasource):
        """Raw samples (``key``, ``jpg``, ``txt``) read with pipeline.shards' strict tar parser."""

        _FILE_EXTENSIONS = ["tar"]

        def __init__(
            self,
            paths: list[str],
            *,
            s3: bool,
            s3_endpoint: str,
            counters: str | None,
            max_bad_shards: int,
            image_exts: Sequence[str] = ("jpg", "jpeg", "png", "webp"),
            **kw: Any,
        ) -> None:
            super().__init__(paths, **kw)
            self._s3, self._endpoint = s3, s3_endpoint
            self._counters_name, self._max_bad = counters, max_bad_shards
            self._image_exts = tuple(image_exts)

        def _open_input_source(self, filesystem: Any, path: str, **open_args: Any) -> Any:
            # The strict parser opens the shard itself (pipeline.storage); nothing to open twice.
            return pa.BufferReader(b"")

        def _read_stream(self, f: Any, path: str) -> Iterator[pa.Table]:
            full = storage.S3_PREFIX + path if self._s3 else path
            exts = {*self._image_exts, "txt"}
            rows: list[tuple[str, bytes, str]] = []
            try:
                for s in shards.iter_shard(full, self._endpoint, decode=False, extensions=exts):
                    img = next((s[e] for e in self._image_exts if e in s), None)
                    if img is None:
                        continue  # a sample without an image cannot train; webdataset skips these too
                    rows.append((s["__key__"], img, s.get("txt", b"").decode("utf-8", "replace")))
                    if len(rows) >= READ_CHUNK_ROWS:
                        yield _rows_table(rows)
                        rows = []
            except (shards.ShardError, OSError) as exc:
                self._bad_shard(full, exc)
            if rows:
                yield _rows_table(rows)

        def _bad_shard(self, path: str, exc: Exception) -> None:
            handle = counters_handle(self._counters_name)
            if handle is None:
                n = 1
            else:
                import ray

                n = ray.get(handle.bad_shard.remote(path, f"{type(exc).__name__}: {exc}"))
            if n > self._max_bad:
                raise TooManyBadShards(
                    f"{n} damaged shards exceed data.max_bad_shards={self._max_bad}; last: {path} ({exc})"
                ) from exc
            log.warning("skipping the rest of damaged shard %s (%d so far): %s", path, n, exc)

    return ShardDatasource(*args, **kwargs)


def _rows_table(rows: list[tuple[str, bytes, str]]) -> pa.Table:
    keys, jpgs, txts = zip(*rows, strict=True)
    return pa.table(
        {
            "key": pa.array(keys, pa.string()),
            "jpg": pa.array(jpgs, pa.binary()),
            "txt": pa.array(txts, pa.string()),
        }
    )
