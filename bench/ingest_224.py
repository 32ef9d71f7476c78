"""224-px training ingest per core: ours against open_clip_train's own webdataset loader, same shards.

Contenders, each a long-lived process driven over stdin so both stay warm, alternated A B A B (bench/
alternate.py's method) for ``--rounds`` (>= 3) rounds per recipe:

- ``ours``: the real training ingest (pipeline/ingest/dataset.py: strict shard read → window shuffle →
  decode + crop to uint8 + tokenize in ``--procs`` Ray Data tasks → ``iter_torch_batches`` with the
  masked-variant collate) on a private local Ray; the pixel jitter/normalisation runs on the training
  device, so it is not CPU work here (its CPU cost per sample is measured beside, ``device_augment_cpu``).
- ``open_clip``: ``open_clip_train.data.get_wds_dataset`` with ``--procs`` DataLoader workers, open_clip's
  train transform for the same recipe (``image_transform(224, is_train=True, aug_cfg=...)``, which
  normalises to float32 on the CPU) and its CLIP tokenizer, unmodified, from a separate install
  (torchvision 0.28.0 and open_clip_torch in a --target directory, webdataset 0.2.86 in another, two
  empty torchvision modules from a sitecustomize.py: docs/environment.md), set up here under the system
  temp directory from the local package index.
- the per-core limits beside them, in-process on one core: our decode + crop + tokenize (uint8 out) and
  open_clip's per-sample transform + tokenizer.

Recipes: ``datacomp-small`` (open_clip's default: RandomResizedCrop area 0.9–1.0, no jitter) and
``prolip-b16`` (area 0.8–1.0, colour jitter (0.32, 0.32, 0.32, 0.08) p 0.8, grayscale p 0.2). Shards:
``--samples`` variants of scikit-image's photographs (random crops and scales, longest side 256–512, JPEG
q95 as the build writes them) with 8–20-word captions. The pipelines' figure is samples per CPU second
(= samples/s per core) of each contender's whole process tree, counted by the cgroup it runs in (Ray's
GCS, raylet and workers; the DataLoader's workers; exited processes included), the method checked first
against two processes burning a known CPU time; the wall-clock rate per process is kept beside it. Needs
root (a cgroup per contender).

Writes bench/results/ingest_224.json. Usage: python -m bench.ingest_224 [--samples 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.alternate import MIN_ROUNDS, loads_note, results_path, spread

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "ingest_224.json"
RECIPES = ("datacomp-small", "prolip-b16")
PHOTOS = ("astronaut", "cat", "chelsea", "coffee", "hubble_deep_field", "immunohistochemistry", "retina",
          "rocket", "brick", "camera", "cell", "coins", "grass", "gravel", "moon")  # fmt: skip
WORDS = ("a photo of the small red large dog cat on in with sky field street house person woman man car "
         "tree water blue green white black old new two people standing sitting near beach city view "
         "close up image picture background light dark colorful wooden metal table room").split()  # fmt: skip
BASELINE_PKGS = ("torchvision==0.28.0", "open_clip_torch==3.3.0")
BASELINE_WDS = ("webdataset<=0.2.86", "braceexpand")
SITECUSTOMIZE = """# Empty stand-ins for the two torchvision modules that register detection-op kernels the CPU torch lacks.
import sys, types
for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(_name, types.ModuleType(_name))
"""


# --- data ---------------------------------------------------------------------------------------------


def photo_samples(n: int, seed: int = 0) -> list[dict]:
    """``n`` JPEGs cut from scikit-image's photographs (longest side 256–512, q95) with captions."""
    import skimage.data
    from PIL import Image

    rng = np.random.default_rng(seed)
    bases = []
    for name in PHOTOS:
        a = getattr(skimage.data, name)()
        bases.append(np.stack([a] * 3, -1) if a.ndim == 2 else a[..., :3])
    out = []
    for i in range(n):
        a = bases[i % len(bases)]
        h, w = a.shape[:2]
        frac = rng.uniform(0.6, 1.0)
        ch, cw = int(h * frac * rng.uniform(0.8, 1.0)), int(w * frac * rng.uniform(0.8, 1.0))
        y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        im = Image.fromarray(np.ascontiguousarray(a[y : y + ch, x : x + cw]))
        side = int(rng.integers(256, 513))
        scale = side / max(im.size)
        im = im.resize((max(1, round(im.size[0] * scale)), max(1, round(im.size[1] * scale))), Image.BICUBIC)
        if rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=95)
        caption = " ".join(rng.choice(WORDS, int(rng.integers(8, 21))))
        out.append({"__key__": f"{seed:016x}{i:016x}", "jpg": buf.getvalue(), "txt": caption})
    return out


def write_photo_shards(directory: Path, n: int, per_shard: int = 128) -> list[str]:
    from pipeline.shards.writer import write_shard

    directory.mkdir(parents=True, exist_ok=True)
    samples = photo_samples(n)
    paths = []
    for s in range(0, n, per_shard):
        path = str(directory / f"{s // per_shard:08d}.tar")
        write_shard(path, samples[s : s + per_shard])
        paths.append(path)
    return paths


# --- the baseline's install ---------------------------------------------------------------------------


def baseline_env(base: Path) -> dict[str, str]:
    """open_clip_train, torchvision and webdataset 0.2.86 in their own --target dirs, on a PYTHONPATH."""
    pkgs, wds, site = base / "pkgs", base / "wds", base / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target"]
    if not (pkgs / "open_clip_train").is_dir():
        subprocess.run([*pip, str(pkgs), *BASELINE_PKGS], check=True)
    if not (wds / "webdataset").is_dir():
        subprocess.run([*pip, str(wds), *BASELINE_WDS], check=True)
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"PYTHONPATH": os.pathsep.join(str(p) for p in (site, pkgs, wds))}


# --- the two contenders (server side) -----------------------------------------------------------------


class CpuGroup:
    """A cgroup holding one contender's whole process tree, so its CPU time counts every process it starts
    (Ray's GCS, raylet and workers; the DataLoader's workers), live or exited: a child joins its parent's
    group at fork. cgroup v1's cpuacct, else v2's cpu.stat; needs root. ``check_cpu_group`` validates it."""

    V1, V2 = Path("/sys/fs/cgroup/cpuacct"), Path("/sys/fs/cgroup")

    def __init__(self, name: str) -> None:
        v1 = (self.V1 / "cpuacct.usage").is_file()
        self.path = (self.V1 if v1 else self.V2) / f"prolip-bench-{name}-{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        self.v1 = v1

    def enter(self) -> None:
        """Move the calling process into the group (a ``preexec_fn``: the contender and all it forks)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def cpu_s(self) -> float:
        if self.v1:
            return int((self.path / "cpuacct.usage").read_text()) / 1e9
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6

    def process_cpu(self) -> dict[int, tuple[float, str]]:
        """Live member pid → (its user + system CPU seconds, its command line)."""
        tick, out = os.sysconf("SC_CLK_TCK"), {}
        for pid in map(int, (self.path / "cgroup.procs").read_text().split()):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # exited meanwhile: the group's total still counts it
                continue
            out[pid] = ((int(fields[11]) + int(fields[12])) / tick, cmd)
        return out

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:  # a straggler still inside: the empty group is left for the kernel to keep
            pass


BUSY = """import os, sys, time
def burn(seconds):
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass
child = os.fork()
burn(float(sys.argv[1]))
if child == 0:
    os._exit(0)
os.waitpid(child, 0)
t = os.times()
print(t.user + t.system + t.children_user + t.children_system)
"""


def check_cpu_group(seconds: float = 1.5) -> dict[str, float]:
    """The method against a known load: a parent and a forked child each burn ``seconds`` of CPU; the
    group must count what they report (their own process time plus the reaped child's)."""
    group = CpuGroup("check")
    try:
        before = group.cpu_s()
        out = subprocess.run([sys.executable, "-c", BUSY, str(seconds)], preexec_fn=group.enter,
                             capture_output=True, text=True, check=True)  # fmt: skip
        counted, reported = group.cpu_s() - before, float(out.stdout)
    finally:
        group.remove()
    assert abs(counted - reported) < 0.05 * reported + 0.2, (
        f"cgroup counted {counted:.2f} s of {reported:.2f}"
    )
    return {"reported_cpu_s": reported, "cgroup_cpu_s": counted}


def raw_columns(samples: list[dict]) -> dict[str, np.ndarray]:
    return {k: np.array([s[m] for s in samples], dtype=object) for k, m in
            (("key", "__key__"), ("jpg", "jpg"), ("txt", "txt"))}  # fmt: skip


class Ours:
    def __init__(self, shards: str, recipe: str, procs: int, batch: int) -> None:
        import ray

        from pipeline.common.storage import LOCAL
        from pipeline.ingest.dataset import build_train_dataset
        from pipeline.ingest.tokenizer import clip_bpe_tokenizer
        from training.config import TRAIN_PRESETS
        from training.model.config import model_config

        preset = TRAIN_PRESETS[recipe]
        self.cfg = model_config(preset.model)
        self.data = dataclasses.replace(preset.data, shards=shards, decode_tasks=procs, decode_cpus=1.0,
                                        decode_batch_size=64, shuffle_window=512)  # fmt: skip
        self.tok = clip_bpe_tokenizer()  # prolip-b16's SigLIP vocabulary needs the Hub: CLIP's BPE for both
        ray.init(address="local", num_cpus=procs + 1, include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        self.ds = build_train_dataset(self.data, LOCAL, self.tok, 224, self.cfg.context_length)
        self.batch, self.epoch = batch, 0

    def epoch_pass(self) -> int:
        from pipeline.ingest.dataset import RayTrainCollate
        from pipeline.ingest.transforms import MaskedVariants, TrainCollate

        t = self.tok
        masker = MaskedVariants(
            self.cfg.n_patches, t.pad_id, t.end_id, t.mask_id, protected_ids=(t.start_id,)
        )
        collate = RayTrainCollate(TrainCollate(masker, self.epoch, t.pad_id))
        n = 0
        for b in self.ds.iterator().iter_torch_batches(
            batch_size=self.batch, drop_last=True, collate_fn=collate, prefetch_batches=2, device="cpu"
        ):
            n += b["images"].shape[0]
        self.epoch += 1
        return n

    def limit(self, samples: list[dict]) -> int:
        from pipeline.ingest.transforms import DecodeAugment

        stage = DecodeAugment(224, self.cfg.context_length, self.tok, self.data, seed=0)
        for i in range(0, len(samples), 64):
            stage(raw_columns(samples[i : i + 64]))
        return len(samples)


class OpenClip:
    def __init__(self, shards: str, recipe: str, procs: int, batch: int) -> None:
        import open_clip
        from open_clip.transform import AugmentationCfg

        aug = AugmentationCfg(scale=(0.9, 1.0))
        if recipe == "prolip-b16":
            aug = AugmentationCfg(scale=(0.8, 1.0), color_jitter=(0.32, 0.32, 0.32, 0.08),
                                  color_jitter_prob=0.8, gray_scale_prob=0.2)  # fmt: skip
        self.preprocess = open_clip.image_transform(224, is_train=True, aug_cfg=aug)
        self.tokenizer = open_clip.get_tokenizer("ViT-B-32")
        paths = sorted(Path(shards).glob("*.tar"))
        self.urls = f"{shards}/{{{paths[0].stem}..{paths[-1].stem}}}.tar"
        self.procs, self.batch, self.epoch, self.data = procs, batch, 0, None

    def epoch_pass(self) -> int:
        from types import SimpleNamespace

        from open_clip_train.data import get_wds_dataset

        if self.data is None:
            n = int(os.environ["BENCH_SAMPLES"])
            args = SimpleNamespace(train_data=self.urls, val_data=None, train_num_samples=n, batch_size=self.batch,
                                   workers=self.procs, world_size=1, seed=0, dataset_resampled=False,
                                   train_data_upsampling_factors=None)  # fmt: skip
            self.data = get_wds_dataset(args, self.preprocess, True, 0, tokenizer=self.tokenizer)
        self.data.set_epoch(self.epoch)
        n = sum(images.shape[0] for images, _ in self.data.dataloader)
        self.epoch += 1
        return n

    def limit(self, samples: list[dict]) -> int:
        from PIL import Image

        for s in samples:
            self.preprocess(Image.open(io.BytesIO(s["jpg"])).convert("RGB"))
            self.tokenizer(s["txt"])
        return len(samples)


def serve(kind: str, shards: str, recipe: str, procs: int, batch: int, limit_n: int) -> None:
    import torch

    # One intra-op thread, as in a DataLoader worker or a 1-CPU Ray task: idle OpenMP threads spin, and
    # process CPU time would count the spinning.
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    contender = (Ours if kind == "ours" else OpenClip)(shards, recipe, procs, batch)
    samples = photo_samples(limit_n, seed=1)
    reply = sys.__stdout__
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        load = os.getloadavg()[0]
        wall, cpu = time.perf_counter(), time.process_time()
        n = contender.epoch_pass() if cmd == "epoch" else contender.limit(samples)
        cpu = time.process_time() - cpu  # the limit's; an epoch's is the driver's cgroup count
        reply.write(
            json.dumps({"n": n, "wall_s": time.perf_counter() - wall, "cpu_s": cpu, "load": load}) + "\n"
        )
        reply.flush()


# --- the driver ---------------------------------------------------------------------------------------


class Server:
    def __init__(
        self, kind: str, env: dict[str, str], args: argparse.Namespace, recipe: str, shards: str
    ) -> None:
        cmd = [sys.executable, "-m", __spec__.name, "--serve", kind, "--recipe", recipe, "--shards", shards,
               "--procs", str(args.procs), "--batch", str(args.batch), "--limit-samples", str(args.limit_samples)]  # fmt: skip
        env = {**os.environ, **env, "BENCH_SAMPLES": str(args.samples), "RAY_USAGE_STATS_ENABLED": "0"}
        if kind == "ours":
            env["PYTHONPATH"] = str(ROOT)
        self.group = CpuGroup(kind)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                                     cwd=ROOT, stderr=subprocess.DEVNULL, preexec_fn=self.group.enter)  # fmt: skip

    def ask(self, cmd: str) -> dict:
        cpu, procs = self.group.cpu_s(), self.group.process_cpu()
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"contender {self.proc.args[3]} exited ({self.proc.wait()})")
        out = json.loads(line)
        if cmd == "epoch":  # the whole tree's CPU: the contender, its Ray session or DataLoader workers
            out["cpu_s"] = self.group.cpu_s() - cpu
            out["roles_cpu_s"] = roles(procs, self.group.process_cpu(), self.proc.pid, out["cpu_s"])
        return out

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
        self.group.remove()


RAY_OWN_ACTORS = ("ray::_StatsActor", "ray::DashboardAgent", "ray::_AutoscalingCoordinatorActor")


def roles(before: dict, after: dict, main: int, total: float) -> dict[str, float]:
    """An epoch's CPU by role: ``main`` (the contender's process: the batch iterator and the collate),
    ``workers`` (ingest workers: Ray task workers or DataLoader workers, live through the epoch) and
    ``other`` (the rest of the group's count: Ray's daemons and its own actors, processes that exited)."""
    delta = {pid: cpu - before.get(pid, (0.0, ""))[0] for pid, (cpu, _) in after.items()}
    is_worker = {pid: (cmd.startswith("ray::") and not cmd.startswith(RAY_OWN_ACTORS)) or
                 (pid != main and cmd == after.get(main, (0.0, ""))[1]) for pid, (_, cmd) in after.items()}  # fmt: skip
    main_s = delta.get(main, 0.0)
    workers_s = sum(d for pid, d in delta.items() if is_worker[pid] and pid != main)
    # at least 0: /proc counts in clock ticks, the group in nanoseconds
    return {"main": main_s, "workers": workers_s, "other": max(0.0, total - main_s - workers_s)}


def h100_samples_per_s(recipe: str) -> float:
    """The preset's training samples/s on an H100 at 30% MFU, as the trainer sizes a run (trainer.h100_rate)."""
    from training.config import TRAIN_PRESETS
    from training.model.config import model_config
    from training.train.trainer import h100_rate

    preset = TRAIN_PRESETS[recipe]
    return h100_rate(preset, model_config(preset.model))[1]


def per_core(r: dict, procs: int) -> dict[str, float]:
    return {"cpu": r["n"] / r["cpu_s"], "wall": r["n"] / r["wall_s"] / procs}


def run_recipe(recipe: str, args: argparse.Namespace, shards: str, env: dict[str, str]) -> dict:
    servers = {
        "ours": Server("ours", {}, args, recipe, shards),
        "open_clip": Server("open_clip", env, args, recipe, shards),
    }
    try:
        for s in servers.values():  # warm-up: worker processes, imports, first-epoch setup
            s.ask("epoch")
        rounds = []
        for _ in range(args.rounds):
            row = {}
            for name, s in servers.items():
                row[name] = s.ask("epoch")
                row[f"{name}_limit"] = s.ask("limit")
            rounds.append(row)
    finally:
        for s in servers.values():
            s.close()
    out: dict = {"rounds": rounds}
    for name in ("ours", "open_clip"):
        out[name] = {k: spread([per_core(r[name], args.procs)[k] for r in rounds]) for k in ("cpu", "wall")}
        out[f"{name}_limit"] = spread([r[f"{name}_limit"]["n"] / r[f"{name}_limit"]["cpu_s"] for r in rounds])
    for k in ("cpu", "wall"):
        out[f"ratio_{k}"] = spread([per_core(r["ours"], args.procs)[k] / per_core(r["open_clip"], args.procs)[k]
                                    for r in rounds])  # fmt: skip
    out["limit_ratio"] = spread([(r["ours_limit"]["n"] / r["ours_limit"]["cpu_s"])
                                 / (r["open_clip_limit"]["n"] / r["open_clip_limit"]["cpu_s"]) for r in rounds])  # fmt: skip
    for name in ("ours", "open_clip"):  # where each tree's CPU goes, per sample
        out[f"{name}_roles_ms_per_sample"] = {
            role: spread([1e3 * r[name]["roles_cpu_s"][role] / r[name]["n"] for r in rounds])
            for role in ("main", "workers", "other")
        }
    out["loads"] = [r[c]["load"] for r in rounds for c in r]
    return out


def device_augment_cpu(n: int = 256) -> dict:
    """CPU seconds per sample of the device half (jitter, grayscale, normalise) if the device were a core."""
    import torch

    from pipeline.ingest import augment as A
    from pipeline.ingest.device_augment import DeviceAugment, hue_rows_by_position

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    f, o = A.draw_jitter(n, (0.32, 0.32, 0.32, 0.08), 0.8, rng)
    batch = {"images": torch.from_numpy(rng.integers(0, 256, (n, 224, 224, 3), dtype=np.uint8)),
             "jitter": torch.from_numpy(f), "jitter_order": torch.from_numpy(o),
             "gray": torch.from_numpy(A.draw_grayscale(n, 0.2, rng))}  # fmt: skip
    batch |= {f"hue_rows_{p}": torch.from_numpy(r) for p, r in enumerate(hue_rows_by_position(f, o))}
    aug = DeviceAugment((0.5,) * 3, (0.5,) * 3)
    aug(batch)
    times = []
    for _ in range(3):
        t = time.process_time()
        aug(batch)
        times.append(n / (time.process_time() - t))
    plain = {"images": batch["images"]}
    t = time.process_time()
    aug(plain)
    return {
        "jitter_samples_per_cpu_s": spread(times),
        "normalise_only_samples_per_cpu_s": n / (time.process_time() - t),
    }


def records(results: dict, args: argparse.Namespace, date: str) -> list[dict]:
    cmd = (
        f"python -m bench.ingest_224 --samples {args.samples} --rounds {args.rounds} --procs {args.procs}"
        + (f" --recipes {args.recipes}" if args.recipes != ",".join(RECIPES) else "")
    )
    out = []
    for recipe, r in results.items():
        load = f"{min(r['loads']):.1f}–{max(r['loads']):.1f} on {os.cpu_count()} cores"
        rc, rw, ours, theirs = r["ratio_cpu"], r["ratio_wall"], r["ours"], r["open_clip"]
        out.append({"what": f"{recipe}: our ingest ÷ open_clip_train's get_wds_dataset, samples per CPU second of "
                            f"each whole process tree (a cgroup each; {args.procs} decode processes each)",
                    "command": cmd, "figure": f"{rc['median']:.2f}×",
                    "spread": f"{rc['min']:.2f}–{rc['max']:.2f} over {rc['n']} rounds; ours {ours['cpu']['median']:.0f}, "
                              f"open_clip {theirs['cpu']['median']:.0f} samples per CPU s; wall clock per process "
                              f"{rw['median']:.2f}× ({rw['min']:.2f}–{rw['max']:.2f}; ours {ours['wall']['median']:.0f}, "
                              f"open_clip {theirs['wall']['median']:.0f} samples/s)",
                    "load": load, "date": date})  # fmt: skip
        ro, rt = r["ours_roles_ms_per_sample"], r["open_clip_roles_ms_per_sample"]
        fmt = lambda x: "/".join(f"{x[k]['median']:.2f}" for k in ("main", "workers", "other"))  # noqa: E731
        workers_rate = 1e3 / ro["workers"]["median"]
        gpu = h100_samples_per_s(recipe)
        out.append({"what": f"{recipe}: where each tree's CPU goes, ms per sample: the contender's process (batch "
                            "iterator, collate) / ingest workers (Ray tasks, DataLoader workers) / the rest (Ray's "
                            "daemons and own actors)", "command": cmd,
                    "figure": f"ours {fmt(ro)}; open_clip {fmt(rt)}",
                    "spread": f"ours' workers alone {workers_rate:.0f} samples per CPU s: "
                              f"{gpu / workers_rate:.1f} worker cores per H100 at 30% MFU ({gpu:.0f} samples/s)",
                    "load": load, "date": date})  # fmt: skip
        lim = r["ours_limit"]
        out.append({"what": f"{recipe}: per-core decode + crop + tokenize limit, uint8 out (one core, in process)",
                    "command": cmd, "figure": f"{lim['median']:.0f} samples/s",
                    "spread": f"{lim['min']:.0f}–{lim['max']:.0f} over {lim['n']} rounds; open_clip's per-sample "
                              f"transform {r['open_clip_limit']['median']:.0f} samples/s "
                              f"({r['limit_ratio']['median']:.2f}× ours ÷ theirs)", "load": load, "date": date})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", choices=("ours", "open_clip"))
    ap.add_argument("--recipe", choices=RECIPES, default="datacomp-small")
    ap.add_argument("--shards", default="")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--limit-samples", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--allow-loaded", action="store_true")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.shards, args.recipe, args.procs, args.batch, args.limit_samples)
        return
    assert args.rounds >= MIN_ROUNDS, f"--rounds must be >= {MIN_ROUNDS}"
    check = check_cpu_group()  # the CPU count is trusted only once it counts a known load
    tmp = Path(tempfile.gettempdir())
    env = baseline_env(tmp / "prolip-bench-openclip")
    shards = tmp / f"prolip-bench-photos-{args.samples}"
    if not shards.is_dir() or len(list(shards.glob("*.tar"))) < args.procs:
        write_photo_shards(shards, args.samples)
    results = {}
    for recipe in args.recipes.split(","):
        results[recipe] = r = run_recipe(recipe, args, str(shards), env)
        print(f"{recipe}: ours ÷ open_clip per core {r['ratio_cpu']['median']:.2f}× "
              f"({r['ratio_cpu']['min']:.2f}–{r['ratio_cpu']['max']:.2f}); ours {r['ours']['cpu']['median']:.0f}, "
              f"open_clip {r['open_clip']['cpu']['median']:.0f} samples/CPU-s; limit "
              f"{r['ours_limit']['median']:.0f} vs {r['open_clip_limit']['median']:.0f}; "
              f"{loads_note(r['loads'], os.cpu_count() or 1)}")  # fmt: skip
    aug = device_augment_cpu()
    date = datetime.datetime.now().isoformat(timespec="seconds")
    doc = {
        "title": "224-px training ingest per core (ours vs open_clip_train's loader)",
        "about": (
            "Alternated rounds, one epoch of the same photo shards per contender per round. Each contender "
            "runs in its own cgroup, whose CPU time counts every process of its tree (Ray's daemons and "
            "workers, the DataLoader's workers): samples per CPU second is samples/s per core; checked "
            f"against a known load ({check['cgroup_cpu_s']:.2f} s counted of {check['reported_cpu_s']:.2f} s "
            "burnt by two processes). The pixel jitter and normalisation run on the "
            "training device in ours (their CPU cost per sample, were the device a core: "
            f"{aug['jitter_samples_per_cpu_s']['median']:.0f} samples/s with the prolip-b16 jitter, "
            f"{aug['normalise_only_samples_per_cpu_s']:.0f} normalising only)."
        ),
        "records": records(results, args, date),
        "results": results,
        "device_augment_cpu": aug,
        "cpu_group_check": check,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    loads = [v for r in results.values() for v in r["loads"]]
    out = results_path(args.out, RESULT, max(loads), os.cpu_count() or 1, args.allow_loaded)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
