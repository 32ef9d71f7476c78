"""Kill points: named places where a test makes this process die exactly as a crash would (SIGKILL).

The fault suite (tests/faults/) proves that a build or a training killed at any of these points resumes
into what an uninterrupted run gives. A point costs one environment lookup when nothing is armed.

- ``PROLIP_KILL_AT="name@n,other@m"``: the n-th time this process reaches ``name`` (``@n`` left out:
  the first), it sends itself SIGKILL. With ``PROLIP_KILL_STATE=file`` each armed point fires once
  across processes (a restarted worker does not die at the same point again): the file lists the points
  that fired, written before the signal. ``PROLIP_KILL_ORDERED=1`` arms only the first entry that has not
  fired yet, so the n-th process of a restarting run dies at the n-th entry (a kill sequence that does
  not depend on which process reaches a point first).
- ``PROLIP_KILL_TRACE=file``: every point reached is appended to ``file`` (how often each is reached, so
  a suite can pick a random occurrence).
- ``PROLIP_SAMPLES_TRACE=dir``: the training loop appends every step's samples to
  ``dir/{attempt}-r{rank}.txt`` (``step epoch key`` lines; ``attempt`` orders the run's (re)starts), so a
  suite can compare what a killed and resumed run trained with an uninterrupted run.
"""

from __future__ import annotations

import fcntl
import os
import signal

ARM, STATE, TRACE, ORDERED = "PROLIP_KILL_AT", "PROLIP_KILL_STATE", "PROLIP_KILL_TRACE", "PROLIP_KILL_ORDERED"
SAMPLES = "PROLIP_SAMPLES_TRACE"
_hits: dict[str, int] = {}


def point(name: str) -> None:
    """Die here if ``name`` is armed for this occurrence (module docstring); otherwise nothing."""
    env = os.environ
    if TRACE in env:
        with open(env[TRACE], "a") as f:
            f.write(name + "\n")
    armed = env.get(ARM)
    if not armed:
        return
    entries = [e.strip() for e in armed.split(",") if e.strip()]
    if env.get(ORDERED) == "1":
        entries = [e for e in entries if not _fired(e)][:1]
    entries = [e for e in entries if e.partition("@")[0] == name]
    _hits[name] = _hits.get(name, 0) + 1
    if not entries:
        return
    for entry in entries:
        if int(entry.partition("@")[2] or 1) != _hits[name]:
            continue
        state = env.get(STATE)
        if not state:
            os.kill(os.getpid(), signal.SIGKILL)
        with open(state, "a+") as f:
            # two ranks at the same point at once: the lock lets one of them fire, held until it dies
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            if entry in {line.strip() for line in f}:
                continue
            f.write(entry + "\n")
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)


def _fired(entry: str) -> bool:
    state = os.environ.get(STATE)
    if not state or not os.path.exists(state):
        return False
    with open(state) as f:
        return entry in {line.strip() for line in f}


def samples(attempt: int, rank: int, step: int, epoch: int, keys: list[str]) -> None:
    """Record the samples of one step (module docstring); nothing unless ``PROLIP_SAMPLES_TRACE`` is set."""
    where = os.environ.get(SAMPLES)
    if not where:
        return
    with open(os.path.join(where, f"{attempt}-r{rank}.txt"), "a") as f:
        f.write("".join(f"{step} {epoch} {k}\n" for k in keys))
