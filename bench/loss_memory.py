"""ProLIP objective, forward + backward on CPU: time and peak memory against two baselines in one run.

Cases per batch size B (D = 512 by default), single process (B rows x B columns), plus one worker-shaped
row (--worker-shape, default 512 local rows x 16,384 global columns: the paper's 512 per GPU x 32 GPUs,
the share one worker computes under training/losses/contrastive.py's distributed contract):
  prolip  `training.losses.contrastive.prolip_objective`: PPCL + inclusion (v in t) + masked inclusion on B/8 + VIB
  ppcl    `training.losses.contrastive.ppcl_loss` alone, the pairwise term that replaces SigLIP's
  naive   the full objective with the PPCL variance term built as the official code does, from a
          (B, B, D) tensor of sigma^2 sums; skipped when that tensor alone would exceed --naive-limit-gib
  siglip  `training.losses.contrastive.siglip_loss` on the same means
Memory: peak resident set size (`getrusage(RUSAGE_SELF).ru_maxrss`) during the first forward + backward,
minus the resident size (/proc/self/statm) just before it, inputs already allocated; one fresh
subprocess per case so no earlier case can hide a peak. It counts all the loss allocates, autograd
buffers included, but is coarse below a few MiB (allocator arenas, page granularity).
Time: the cases alternate in one subprocess per shape (bench/alternate.py): every round runs each case
once, in turn, so load on a shared machine hits them alike; per round the ratios prolip/siglip and
ppcl/siglip of wall and of CPU time, reported as median (min–max) over --rounds (>= 3), with the
1-minute load average of those rounds beside them. A loaded run (load > cores) is flagged and does not
overwrite bench/results/loss_memory.json unless --allow-loaded.
Threads: --threads (default 1). On a busy machine OpenMP's spinning barriers make small multi-threaded
ops 10-100x slower (measured on our 2-core CI box), which would swamp the comparison.
Writes bench/results/loss_memory.json. Usage: python -m bench.loss_memory [--sizes 256 1024 4096] [--rounds 7]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.alternate import MIN_ROUNDS, alternate, fmt_spread, loads_note, ratios, results_path, times
from training.losses.contrastive import siglip_loss
from training.losses.inclusion import inclusion_loss, vib_kl
from training.losses.prolip import ppcl_loss, prolip_objective

ROOT = Path(__file__).resolve().parents[1]

CASES = ("prolip", "ppcl", "naive", "siglip")
MASKED_KEYS = ("mu_v_masked", "logvar_v_masked", "mu_t_masked", "logvar_t_masked")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _naive_objective(mu_v, logvar_v, mu_t_all, logvar_t_all, log_scale, bias, masked, index):
    b, n = mu_v.shape[0], mu_t_all.shape[0]
    mu_t, logvar_t = mu_t_all[:b], logvar_t_all[:b]
    # The official formulation: an explicit (B, N, D) tensor of variance sums, reduced over D.
    var = (logvar_v.exp()[:, None, :] + logvar_t_all.exp()[None, :, :]).sum(-1)
    logits = log_scale.exp() * (mu_v @ mu_t_all.T - 0.5 * var) + bias
    ppcl = -F.logsigmoid((2 * torch.eye(b, n) - 1) * logits).sum() / n
    kw = dict(c=1000.0, log_eps=-20.0)
    inc_vt = inclusion_loss(mu_v, logvar_v, mu_t, logvar_t, **kw).sum() / n
    inc_v = inclusion_loss(mu_v[index], logvar_v[index], masked[0], masked[1], **kw).mean()
    inc_t = inclusion_loss(mu_t[index], logvar_t[index], masked[2], masked[3], **kw).mean()
    vib = (vib_kl(mu_v, logvar_v).sum() + vib_kl(mu_t, logvar_t).sum()) / n
    return ppcl + 1e-7 * inc_vt + 1e-3 * (inc_v + inc_t) + 1e-4 * vib


def make_steps(batch: int, dim: int, columns: int) -> dict[str, Callable[[], None]]:
    """One forward + backward per case, all on the same inputs: `batch` local rows, `columns` text columns."""
    g = torch.Generator().manual_seed(0)
    mu_v = F.normalize(torch.randn(batch, dim, generator=g), dim=-1).requires_grad_()
    logvar_v = (torch.randn(batch, dim, generator=g) - 10).requires_grad_()
    mu_t_all = F.normalize(torch.randn(columns, dim, generator=g), dim=-1).requires_grad_()
    logvar_t_all = (torch.randn(columns, dim, generator=g) - 9).requires_grad_()
    mu_t, logvar_t = mu_t_all[:batch], logvar_t_all[:batch]  # this worker's texts are global rows 0..B-1
    index = torch.randperm(batch, generator=g)[: batch // 8]
    masked = [mu_v[index], logvar_v[index] + 1, mu_t[index], logvar_t[index] + 1]
    masked = [t.detach().clone().requires_grad_() for t in masked]
    log_scale = torch.tensor(2.3, requires_grad=True)
    bias = torch.tensor(-10.0, requires_grad=True)
    leaves = [mu_v, mu_t_all, logvar_v, logvar_t_all, log_scale, bias, *masked]
    gaussians = (mu_v, logvar_v, mu_t, logvar_t, log_scale, bias)
    cols = dict(mu_t_all=mu_t_all, logvar_t_all=logvar_t_all)

    losses = {
        "prolip": lambda: prolip_objective(
            *gaussians, **cols, masked_index=index, **dict(zip(MASKED_KEYS, masked, strict=True))
        )["total"],
        "ppcl": lambda: ppcl_loss(*gaussians, **cols),
        "naive": lambda: _naive_objective(
            mu_v, logvar_v, mu_t_all, logvar_t_all, log_scale, bias, masked, index
        ),
        "siglip": lambda: siglip_loss(mu_v, mu_t, log_scale, bias, mu_t_all=mu_t_all),
    }

    def stepper(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            loss_fn().backward()
            for t in leaves:
                t.grad = None

        return step

    return {name: stepper(fn) for name, fn in losses.items()}


def measure_memory(case: str, batch: int, dim: int, columns: int) -> dict:
    step = make_steps(batch, dim, columns)[case]
    before = _rss_bytes()
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_mib": max(peak - before, 0) / 2**20}


def measure_time(cases: list[str], batch: int, dim: int, columns: int, rounds: int) -> dict:
    steps = make_steps(batch, dim, columns)
    log = alternate({c: steps[c] for c in cases}, rounds)
    out: dict = {c: times(log, c) for c in cases}
    out["ratios"] = {f"{num}/siglip": ratios(log, num, "siglip") for num in ("prolip", "ppcl")}
    out["rounds"] = log
    return out


def _child(args: list[str]) -> dict:
    cmd = [sys.executable, "-m", __spec__.name, *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


DEFAULT_OUT = ROOT / "bench" / "results" / "loss_memory.json"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7, help="alternated rounds per shape (>= 3)")
    parser.add_argument("--naive-limit-gib", type=float, default=6.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker-shape", type=int, nargs=2, default=[512, 16384], metavar=("ROWS", "COLS"))
    parser.add_argument("--no-worker-shape", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--allow-loaded", action="store_true", help="write --out even if load > cores")
    parser.add_argument("--child", choices=["memory", "time"], help=argparse.SUPPRESS)
    parser.add_argument("--cases", nargs="+", default=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--columns", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _measure_shape(args: argparse.Namespace, batch: int, columns: int) -> dict:
    """One result row: peak memory per case (a subprocess each), alternated times (one subprocess), ratios."""
    naive_gib = batch * columns * args.dim * 4 / 2**30
    cases = [c for c in CASES if c != "naive" or naive_gib <= args.naive_limit_gib]
    common = ["--batch", str(batch), "--columns", str(columns), "--dim", str(args.dim)]
    common += ["--threads", str(args.threads)]
    memory = {c: _child(["--child", "memory", "--cases", c, *common])["peak_mib"] for c in cases}
    timing = _child(["--child", "time", "--cases", *cases, "--rounds", str(args.rounds), *common])
    row: dict = {"rows": batch, "columns": columns, "dim": args.dim, "peak_mib": memory}
    row["time"] = {c: timing[c] for c in cases}
    row["time_ratios"] = timing["ratios"]
    row["rounds"] = timing["rounds"]
    if "naive" not in cases:
        row["naive_skipped"] = f"(rows, columns, D) float32 tensor alone is {naive_gib:.0f} GiB"
    row["memory_ratios"] = {
        "prolip peak / (rows*columns*4 bytes)": memory["prolip"] * 2**20 / (4 * batch * columns)
    }
    if "naive" in cases:
        row["memory_ratios"]["prolip/naive memory"] = memory["prolip"] / memory["naive"]
        row["time_ratios"]["prolip/naive"] = ratios(timing["rounds"], "prolip", "naive")
    return row


def _print_rows(rows: list[dict], args: argparse.Namespace, cores: int) -> None:
    cols = ["prolip", "ppcl", "naive", "siglip"]
    print(f"time: median wall s of {args.rounds} alternated forward+backward rounds; memory: peak RSS increase (MiB); D = {args.dim}")  # fmt: skip
    head = " ".join(f"{c + ' s':>9}" for c in cols) + " " + " ".join(f"{c + ' MiB':>11}" for c in cols)
    print(f"{'rows x cols':>12} {head}")
    for r in rows:
        t = " ".join(
            f"{r['time'][c]['wall_s']['median']:9.4f}" if c in r["time"] else f"{'skipped':>9}" for c in cols
        )
        mems = " ".join(
            f"{r['peak_mib'][c]:11.1f}" if c in r["peak_mib"] else f"{'skipped':>11}" for c in cols
        )
        print(f"{r['rows']:>5} x {r['columns']:<5} {t} {mems}")
    print()
    for r in rows:
        print(
            f"{r['rows']} x {r['columns']}: "
            + ", ".join(f"{k} = {v:.3f}" for k, v in r["memory_ratios"].items())
        )
        for k, v in r["time_ratios"].items():
            print(f"  {k} time: wall {fmt_spread(v['wall'])}, CPU {fmt_spread(v['cpu'])}, "
                  f"{loads_note([v['load_min'], v['load_max']], cores)}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.child == "memory":
        print(json.dumps(measure_memory(args.cases[0], args.batch, args.dim, args.columns)))
        return 0
    if args.child == "time":
        print(json.dumps(measure_time(args.cases, args.batch, args.dim, args.columns, args.rounds)))
        return 0
    if args.rounds < MIN_ROUNDS:
        print(f"note: --rounds {args.rounds} < {MIN_ROUNDS}: a smoke run, not a measurement")

    cores = os.cpu_count() or 1
    shapes = [(b, b) for b in args.sizes] + ([] if args.no_worker_shape else [tuple(args.worker_shape)])
    rows = [_measure_shape(args, batch, columns) for batch, columns in shapes]
    _print_rows(rows, args, cores)
    max_load = max(v["load_max"] for r in rows for v in r["time_ratios"].values())
    result = {
        "benchmark": "loss_memory",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": f"cpu {platform.machine()}, {cores} cores, torch threads {torch.get_num_threads()}",
        "torch": torch.__version__,
        "goal": "prolip/siglip time <= 1.3 at B = 4096, D = 512",
        "memory_method": "peak RSS (getrusage ru_maxrss) minus RSS before the first forward+backward, "
        "one subprocess per case",
        "time_method": f"cases alternated in one process, {args.rounds} rounds after one warm-up round; "
        "per-round ratios of wall and CPU time, median (min–max); load = 1-min load average",
        "max_load_avg_1m": max_load,
        "loaded": max_load > cores,
        "rows": rows,
    }
    out = results_path(args.out, DEFAULT_OUT, max_load, cores, args.allow_loaded)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
