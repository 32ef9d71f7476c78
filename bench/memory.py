"""Process memory as the scale benchmarks read it: anonymous resident memory (RssAnon), which a memory map
of input files does not inflate, and its peak while a block runs."""

from __future__ import annotations

import threading


def anon_kb(pid: int | str = "self") -> int:
    """RssAnon of process ``pid`` in KiB; 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakAnon:
    """The largest RssAnon of this process seen while the block runs, sampled every ``every_s``."""

    def __init__(self, every_s: float = 0.1):
        self.every_s = every_s

    def __enter__(self):
        self.peak, self.stop = anon_kb(), threading.Event()
        self.t = threading.Thread(target=self._watch, daemon=True)
        self.t.start()
        return self

    def _watch(self):
        while not self.stop.wait(self.every_s):
            self.peak = max(self.peak, anon_kb())

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()
        self.peak = max(self.peak, anon_kb())


def _title(pid: str) -> str:
    """A process's title (Ray titles a worker by the task it runs: ``ray::group_pairs``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read(200).split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _titled(prefix: str) -> list[str]:
    """PIDs of the processes whose command line starts with ``prefix`` (Ray names its workers ``ray::…``)."""
    import os

    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if fh.read(len(prefix)).decode(errors="replace") == prefix:
                        found.append(pid)
            except OSError:
                pass
    return found


class PeakAnonWorkers(PeakAnon):
    """The largest RssAnon any one process titled ``prefix`` reached while the block runs (the object
    store's shared pages are not anonymous, so a worker's figure is what it holds itself)."""

    def __init__(self, prefix: str = "ray::", every_s: float = 0.25):
        super().__init__(every_s)
        self.prefix = prefix

    def __enter__(self):
        self.peak, self.stop = 0, threading.Event()
        self.t = threading.Thread(target=self._watch, daemon=True)
        self.t.start()
        return self

    def _watch(self):
        self.title = ""
        while not self.stop.wait(self.every_s):
            for pid in _titled(self.prefix):
                kb = anon_kb(pid)
                if kb > self.peak:
                    self.peak, self.title = kb, _title(pid)

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()
