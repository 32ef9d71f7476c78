"""Memory of the eval reference's Ray Data pass (training/eval/reference_dataset.py) against the number of
eval pictures: the driver holds only the reference table, every worker's peak stays flat.

Per size ``n`` (default 100k, 300k, 700k pictures): a clip_benchmark-layout classification set of ``n``
synthetic 32×32 JPEGs (random pixels, so every pHash differs) in shards of ``--shard-rows``, each shard
generated and written by a Ray task on a worker (no picture passes through the driver); then
``build_reference`` over it on a local Ray of ``--cpus`` CPUs (pHash only: no checkpoint). Measured:
the driver's anonymous memory (RssAnon sampled every 0.1 s) above its level before the pass (after a
warm-up pass, so Ray Data's own first-use cost is not counted), the reference table's bytes, and the
peak RssAnon of every Ray worker process that read a part (the largest one reported). Flat is the claim: the ratio of each figure at the largest size over the smallest, against
the ratio of sizes. Writes ``--out`` (bench/schema.py's records).

Usage: python -m bench.eval_reference_scale [--sizes 100000,300000,700000] [--shard-rows 5000] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shutil
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.memory import anon_kb
from bench.schema import write_records

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "eval_reference_scale.json"
CLASSES = 10


def _ray_workers() -> dict[int, str]:
    """Ray worker processes (their command line starts ``ray::``) and what they run now."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as fh:
                    head = fh.read(200)
            except OSError:
                continue
            if head.startswith(b"ray::"):
                out[int(d)] = head.split(b"\0")[0].decode(errors="replace")
    return out


class Peaks:
    """The driver's largest RssAnon and each Ray worker's, sampled every 0.1 s while the block runs."""

    def __enter__(self):
        self.driver, self.workers, self.ran, self.stop = anon_kb(), {}, set(), threading.Event()
        self.t = threading.Thread(target=self._watch, daemon=True)
        self.t.start()
        return self

    def _watch(self):
        while not self.stop.wait(0.1):
            self.driver = max(self.driver, anon_kb())
            for pid, name in _ray_workers().items():
                self.workers[pid] = max(self.workers.get(pid, 0), anon_kb(pid))
                if "part_rows" in name or "write_shard" in name:  # ran a part (not an idle or Ray Data's own)
                    self.ran.add(pid)

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()


def write_shard(path: str, s: int, rows: int, seed: int) -> int:
    """One shard of ``rows`` random 32×32 JPEGs with their classes (runs on a worker)."""
    from PIL import Image

    rng = np.random.default_rng([seed, s])
    with tarfile.open(path, "w") as tar:
        for i in range(rows):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
            for ext, data in (("jpg", buf.getvalue()), ("cls", str(i % CLASSES).encode())):
                info = tarfile.TarInfo(f"{s:05d}{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return rows


def synth_set(folder: Path, n: int, shard_rows: int) -> list:
    """The set's files; its shards written by Ray tasks."""
    import ray

    from training.eval.sets import Task

    (folder / "test").mkdir(parents=True)
    (folder / "classnames.txt").write_text("\n".join(f"class {c}" for c in range(CLASSES)) + "\n")
    (folder / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\n")
    task = ray.remote(num_cpus=1)(write_shard)
    shards = -(-n // shard_rows)
    ray.get([task.remote(str(folder / "test" / f"{s}.tar"), s, min(shard_rows, n - s * shard_rows), n)
             for s in range(shards)])  # fmt: skip
    return [Task(name="synth", path=str(folder), kind="zeroshot_classification", main_metric="acc1")]


def one_size(n: int, shard_rows: int) -> dict:
    from training.eval.reference_dataset import build_reference

    folder = Path(tempfile.mkdtemp(prefix="eval-ref-scale-"))
    try:
        t0 = time.perf_counter()
        tasks = synth_set(folder, n, shard_rows)
        gen_s = time.perf_counter() - t0
        before = anon_kb()
        t0 = time.perf_counter()
        with Peaks() as peaks:
            table = build_reference(tasks)
        wall = time.perf_counter() - t0
        assert table.num_rows == n, (table.num_rows, n)
        workers = sorted(peaks.workers[p] for p in peaks.ran)
        return {"n": n, "shards": -(-n // shard_rows), "generate_s": gen_s, "reference_s": wall,
                "pictures_per_s": n / wall, "table_mib": table.nbytes / 2**20,
                "table_bytes_per_picture": table.nbytes / n,
                "driver_growth_mib": (peaks.driver - before) / 1024, "driver_peak_mib": peaks.driver / 1024,
                "worker_peak_mib": workers[-1] / 1024 if workers else 0.0,
                "worker_median_peak_mib": float(np.median(workers)) / 1024 if workers else 0.0,
                "workers": len(workers)}  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _records(d: dict) -> list[dict]:
    sizes = d["sizes"]
    lo, hi = sizes[0], sizes[-1]
    cmd, load, when = "python -m bench.eval_reference_scale", f"{d['load']:.2f}", d["date"]

    def row(what: str, field: str, unit: str = "MiB") -> dict:
        figs = ", ".join(f"{s['n'] / 1e3:g}k: {s[field]:.1f}" for s in sizes)
        ratio = hi[field] / lo[field] if lo[field] else float("nan")
        return {"what": f"{what} ({unit})", "command": cmd,
                "figure": f"{figs}; {hi['n'] / lo['n']:g}× pictures → {ratio:.2f}×",
                "spread": "one run a size", "load": load, "date": when}  # fmt: skip

    return [
        row("eval reference: driver peak (RssAnon, Ray client included)", "driver_peak_mib"),
        row("eval reference: driver memory growth over the pass", "driver_growth_mib"),
        row("eval reference: the reference table the driver holds", "table_mib"),
        row("eval reference: largest Ray worker peak (RssAnon)", "worker_peak_mib"),
        row("eval reference: pictures hashed a second", "pictures_per_s", "pictures/s"),
    ]


def main(argv: list[str] | None = None) -> int:
    import ray

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100000,300000,700000")
    ap.add_argument("--shard-rows", type=int, default=5000)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    try:
        one_size(500, 250)  # Ray Data's first use loads its modules into the driver: not the pass's cost
        sizes = []
        for n in [int(x) for x in args.sizes.split(",")]:
            sizes.append(one_size(n, args.shard_rows))
            print(json.dumps(sizes[-1]), flush=True)
    finally:
        ray.shutdown()
    d = {"shard_rows": args.shard_rows, "cpus": args.cpus, "sizes": sizes, "load": os.getloadavg()[0],
         "date": datetime.date.today().isoformat()}  # fmt: skip
    write_records(
        args.out, "Eval reference on Ray Data against the number of eval pictures", __doc__, _records(d), d
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
