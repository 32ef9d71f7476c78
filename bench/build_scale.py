"""Cost of the build against the amount of work at demo sizes: download + shard, reshard, re-run. The
build at DataComp sizes (1M–16M rows, the driver's and workers' memory): bench/build_at_scale.py.

(b) ``download`` ``pipeline.build.build`` at ``--pool-sizes`` rows from 127.0.0.1 (bench/build_throughput.py's
                 photo-like JPEGs, ``--corpus`` distinct images served under many URLs), DataComp's settings;
                 a least-squares line wall = fixed + n / rate gives images/s and the fixed overhead apart
                 (every row is fetched and processed; rows whose image repeats one served under another
                 URL end as ``duplicate_image`` after the download, so the rate counts rows, not successes);
                 each size's images/s is reported against the fitted rate (flat = no per-row cost growing
                 with the pool).
(d) ``rerun``    ``build()`` again on each finished output (resume with nothing to do): its wall time as a
                 fraction of the first run's.
(c) ``reshard``  a ``--reshard-n`` sample pool of part tars (1,000 samples each, 4–12 kB bodies), half of it
                 selected by a subset: ``pipeline.subsets.reshard.reshard`` against a plain sequential baseline
                 written here in the way DataComp's resharder works per worker (stream each input tar,
                 parse the sample's json for its uid, ``np.searchsorted`` in the sorted ``u8,u8`` subset,
                 append the members to a rolling output tar of ``samples_per_shard``).

Writes ``--out`` (JSON) and a PNG beside it. ``--quick`` runs every part small (a check, not a figure).
Usage: python -m bench.build_scale [--quick] [--what download,reshard]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_OUT = ROOT / "bench" / "results" / "build_scale.json"
CACHE = Path(tempfile.gettempdir()) / "prolip-bench-build-scale"


def load() -> float:
    return os.getloadavg()[0]


# --- (b) download + shard, (d) re-run --------------------------------------------------------------------


def write_pool_metadata(n: int, corpus: list[Path], base_url: str, out: Path) -> Path:
    """``n`` rows over the corpus's images, each under its own URL (a query string the server ignores)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(n)
    hexes = rng.bytes(16 * n).hex()
    rows = {
        "uid": [hexes[32 * i : 32 * i + 32] for i in range(n)],
        "url": [f"{base_url}/{corpus[i % len(corpus)].name}?row={i}" for i in range(n)],
        "text": [f"a photo of a scene, number {i}" for i in range(n)],
    }
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), out / "metadata.parquet")
    return out / "metadata.parquet"


def run_download(sizes: list[int], corpus_n: int) -> dict:
    import ray

    from bench import build_throughput as BT
    from jobs.common import init_ray

    cores = os.cpu_count() or 1
    corpus = BT.make_corpus(corpus_n, 0, cores)
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    server = BT.ImageServer(corpus[0].parent)
    runs = []
    try:
        t = time.perf_counter()
        init_ray(num_cpus=cores)
        ray_init = time.perf_counter() - t
        BT.run_ours(
            BT.bench_config(write_pool_metadata(64, corpus, server.base_url, work / "m0"), work / "w0", {})
        )
        for n in sizes:
            meta = write_pool_metadata(n, corpus, server.base_url, work / f"m{n}")
            cfg = BT.bench_config(meta, work / f"out{n}", {})
            first = BT.run_ours(cfg)
            again = BT.run_ours(cfg)
            runs.append(
                {"n": n, "first": first, "rerun": again, "rerun_fraction": again["wall_s"] / first["wall_s"]}
            )
            print(f"(b) {n} rows: {first['wall_s']:.1f}s ({n / first['wall_s']:.1f} rows/s, load "
                  f"{first['load_avg_1m']:.1f}); (d) re-run {again['wall_s']:.1f}s = "
                  f"{100 * runs[-1]['rerun_fraction']:.1f}%", flush=True)  # fmt: skip
            shutil.rmtree(work / f"out{n}", ignore_errors=True)
    finally:
        ray.shutdown()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    ns = np.array([r["n"] for r in runs], float)
    walls = np.array([r["first"]["wall_s"] for r in runs])
    dl = np.array([r["first"]["download_s"] for r in runs])
    slope, fixed = np.polyfit(ns, walls, 1)
    dl_slope, dl_fixed = np.polyfit(ns, dl, 1)
    return {
        "ray_init_s": ray_init,
        "corpus_images": corpus_n,
        "runs": runs,
        "fit_whole": {"images_per_s": 1 / slope, "fixed_s": fixed},
        "fit_download_phase": {"images_per_s": 1 / dl_slope, "fixed_s": dl_fixed},
        # each size's images/s once the fitted fixed overhead is taken out, ÷ the fitted rate (1 = flat)
        "per_size_rate_over_fit": [(r["n"] / (r["first"]["wall_s"] - fixed)) * slope for r in runs],
    }


# --- (c) reshard ----------------------------------------------------------------------------------------


def make_reshard_pool(n: int, folder: Path) -> tuple[list[str], np.ndarray]:
    """``n`` samples in part tars of 1,000 (jpg, txt, json with the uid), and a subset of half of them."""
    from pipeline import schema as S
    from pipeline.shards.writer import ShardWriter

    rng = np.random.default_rng(1)
    hexes = rng.bytes(16 * n).hex()
    uids = sorted(hexes[32 * i : 32 * i + 32] for i in range(n))
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    body = rng.bytes(12_000)
    for p, start in enumerate(range(0, n, 1000)):
        path = str(folder / f"part-{p:06d}.tar")
        with ShardWriter(path) as w:
            for i in range(start, min(n, start + 1000)):
                size = 4000 + (i * 7919) % 8000
                w.write({"__key__": uids[i], "jpg": body[:size], "txt": f"caption {i}",
                         "json": {"uid": uids[i], "caption": f"caption {i}"}})  # fmt: skip
        paths.append(path)
    chosen = [u for u, k in zip(uids, rng.random(n) < 0.5, strict=True) if k]
    return paths, np.sort(S.uids_to_u8pairs(chosen))


def baseline_reshard(inputs: list[str], subset: np.ndarray, out: Path, samples_per_shard: int) -> int:
    """DataComp's per-worker approach, one process: stream, json uid → searchsorted, rolling tar writer."""
    from pipeline import schema as S

    out.mkdir(parents=True, exist_ok=True)
    written, shard, writer = 0, 0, None
    for path in inputs:
        with tarfile.open(path, "r|") as tar:
            group: dict[str, bytes] = {}
            key = None
            for member in itertools.chain(tar, [None]):
                if member is not None:
                    k, _, ext = member.name.partition(".")
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                if member is None or (key is not None and k != key):
                    uid = json.loads(group["json"])["uid"]
                    pair = S.uids_to_u8pairs([uid])[0]
                    count = np.searchsorted(subset, pair, "right") - np.searchsorted(subset, pair, "left")
                    for j in range(count):
                        if writer is None or written % samples_per_shard == 0:
                            if writer is not None:
                                writer.close()
                            writer = tarfile.open(out / f"{shard:08d}.tar", "w")
                            shard += 1
                        for ext_, blob in group.items():
                            info = tarfile.TarInfo(f"{uid}-{j}.{ext_}")
                            info.size = len(blob)
                            writer.addfile(info, __import__("io").BytesIO(blob))
                        written += 1
                    group = {}
                if member is not None:
                    key = k
                    group[ext] = data
    if writer is not None:
        writer.close()
    return written


def run_reshard(n: int, rounds: int) -> dict:
    from pipeline.subsets.reshard import reshard

    folder = Path(tempfile.mkdtemp(prefix="bench-reshard-"))
    try:
        inputs, subset = make_reshard_pool(n, folder / "in")
        times: dict[str, list[float]] = {"ours": [], "baseline": []}
        loads: list[float] = []
        counts = {}
        for _ in range(rounds):  # alternated: ours, baseline, ours, baseline, …
            for name in ("ours", "baseline"):
                out = folder / f"out-{name}"
                shutil.rmtree(out, ignore_errors=True)
                loads.append(load())
                t = time.perf_counter()
                if name == "ours":
                    counts[name] = reshard(inputs, subset, str(out), samples_per_shard=10_000).n_written
                else:
                    counts[name] = baseline_reshard(inputs, subset, out, 10_000)
                times[name].append(time.perf_counter() - t)
        ratio = [b / o for o, b in zip(times["ours"], times["baseline"], strict=True)]
        print(f"(c) reshard {n} → {counts['ours']} samples: ours {np.median(times['ours']):.1f}s, baseline "
              f"{np.median(times['baseline']):.1f}s (load {min(loads):.1f}–{max(loads):.1f})", flush=True)  # fmt: skip
        return {
            "input_samples": n,
            "selected": int(len(subset)),
            "written": counts,
            "seconds": times,
            "ours_samples_per_s_median": n / float(np.median(times["ours"])),
            "baseline_over_ours_time": {
                "median": float(np.median(ratio)),
                "min": min(ratio),
                "max": max(ratio),
            },
            "load_avg_1m": [min(loads), max(loads)],
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --- main -----------------------------------------------------------------------------------------------


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 1, figsize=(6, 4))
    dl = report.get("download")
    if dl:
        ns = [r["n"] for r in dl["runs"]]
        ax.plot(ns, [r["first"]["wall_s"] for r in dl["runs"]], "o", label="build() wall s")
        fit = dl["fit_whole"]
        xs = np.linspace(0, max(ns), 50)
        ax.plot(xs, fit["fixed_s"] + xs / fit["images_per_s"], "-",
                label=f"fit: {fit['fixed_s']:.0f} s + n / {fit['images_per_s']:.0f}/s")  # fmt: skip
        ax.plot(ns, [r["rerun"]["wall_s"] for r in dl["runs"]], "x", label="re-run (nothing to do)")
        ax.set_xlabel("pool rows")
        ax.set_title("(b) download + shard, (d) re-run")
        ax.legend()
    fig.suptitle(
        f"build cost vs work — {report['cores']} cores, load {report['load_avg_1m_start']:.1f} at start"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes everywhere (a check, not a figure)")
    p.add_argument("--what", default="download,reshard")
    p.add_argument("--pool-sizes", default="2000,8000,32000")
    p.add_argument("--corpus", type=int, default=2000, help="distinct images behind the pool's URLs")
    p.add_argument("--reshard-n", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=3, help="alternated reshard rounds")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    if args.quick:
        args.pool_sizes, args.corpus, args.reshard_n = "128,512,2048", 300, 5000
    sizes = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    what = set(args.what.split(","))
    report: dict = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "quick": args.quick,
        "load_avg_1m_start": load(),
    }
    if "download" in what:
        report["download"] = run_download(sizes(args.pool_sizes), args.corpus)
    if "reshard" in what:
        report["reshard"] = run_reshard(args.reshard_n, args.rounds)
    report["load_avg_1m_end"] = load()
    out = Path(args.out)
    # The load the machine had before the bench's own work: every later reading includes the bench itself
    # (the 32k-row build and the parallel reshard keep the 1-min average over the core count on their own).
    if (
        args.quick or report["load_avg_1m_start"] > (os.cpu_count() or 1)
    ) and out.resolve() == DEFAULT_OUT.resolve():
        out = Path(tempfile.gettempdir()) / DEFAULT_OUT.name  # a check or a loaded run is not the figure
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
