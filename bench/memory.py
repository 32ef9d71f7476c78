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
