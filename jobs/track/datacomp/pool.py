"""``pool=datacomp``: the build as DataComp's download made its pool, so ``no_filter`` follows its rules.

DataComp's ``download_upstream.py`` (img2dataset) neither verifies sha256 nor retries, and its released pool
was decontaminated before release (no further removal when downloading). Our build's defaults are safer
and differ (docs/datacomp.md, "Differences from DataComp"): it refuses bodies whose sha256 differs
(``hash_mismatch``), retries transient failures, and removes near-copies of the eval pictures
(``eval_leak``) from every subset. ``datacomp_pool`` turns those off, with the near-duplicate and semantic
dedupe, which DataComp's pool also did not run again; what remains different is listed in the docs.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def datacomp_pool(bcfg: Any) -> Any:
    """The build config ``bcfg`` under DataComp's pool rules (module docstring)."""
    return dataclasses.replace(
        bcfg,
        download=dataclasses.replace(bcfg.download, verify_sha256=False, retries=0, late_retries=0),
        decontam=dataclasses.replace(bcfg.decontam, reference=""),
        dedupe=dataclasses.replace(bcfg.dedupe, near_duplicates=False, semantic=False),
    )
