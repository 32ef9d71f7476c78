"""Runs after every other test of tests/cluster (pytest orders the files by name): the namespace clusters
those tests made are gone — no namespace, link, host process or S3 server of the harness is left."""

from __future__ import annotations

import subprocess

import pytest

from tests.fixtures import netns_cluster as H

pytestmark = pytest.mark.cluster


def test_no_namespace_link_or_process_of_the_harness_remains() -> None:
    reason = H.unavailable()
    if reason:
        pytest.skip(reason)
    assert H.LIVE == {}, f"clusters not stopped: {list(H.LIVE)}"
    assert H.leftovers() == []
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if "netns_host.sh" in line or "198.18." in line]
