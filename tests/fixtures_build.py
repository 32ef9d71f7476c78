"""What a finished build hands back, in a form two builds can be compared by (uid, status, bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from pipeline import schema as S
from pipeline.shards import iter_shard
from pipeline.subset import read_subset


def snapshot(out: str | Path) -> dict:
    """What a build hands back, comparable across runs: statuses, shard members per uid, tar bytes, subsets."""
    out = Path(out)
    st = pq.read_table(out / "metadata" / "status.parquet")
    statuses = sorted(
        zip(st.column("uid").to_pylist(), st.column("status").to_pylist(), strict=True), key=str
    )
    members: dict[str, dict[str, bytes]] = {}
    for tar in sorted((out / "shards").glob("*.tar")):
        for s in iter_shard(str(tar), decode=False):
            uid = json.loads(s["json"])["uid"]
            assert uid not in members, f"{uid} twice in the shards"
            members[uid] = {k: v for k, v in s.items() if k != "__url__"}
    subsets = {
        p.stem: S.u8pairs_to_uids(read_subset(str(p))) for p in sorted((out / "subsets").glob("*.npy"))
    }
    tars = [p.read_bytes() for p in sorted((out / "shards").glob("*.tar"))]
    return {"status": statuses, "members": members, "subsets": subsets, "tars": tars}


def check_invariants(snap: dict, n_rows: int, scope: str = "metadata") -> None:
    """Exactly one status per input row; shards = successes, each once; every subset lists each uid once,
    within its scope: the valid uids of the pool ("metadata", the default) or the successes ("downloaded")."""
    assert len(snap["status"]) == n_rows
    success = {u for u, s in snap["status"] if s == S.STATUS_SUCCESS}
    assert set(snap["members"]) == success
    listed = {u for u, _ in snap["status"] if S.is_valid_uid(u)} if scope == "metadata" else success
    for name, uids in snap["subsets"].items():
        assert len(uids) == len(set(uids)), f"subset {name} repeats a uid"
        assert set(uids) <= listed, name
    assert set(snap["subsets"]["no_filter"]) == listed
