"""Userinfo and credentials never reach a file or a printed line: the manifest, its storage entry, the
one-line config error of every job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.common.manifest import write_manifest
from pipeline.common.storage import Storage, redact_text, redact_url

ROOT = Path(__file__).resolve().parents[3]
SECRET = "S3CR3TxYz"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (f"http://AKID:{SECRET}@127.0.0.1:8333", "http://127.0.0.1:8333"),
        (f"AKID:{SECRET}@127.0.0.1:8333", "127.0.0.1:8333"),  # a bare endpoint (https) with userinfo
        (f"//AKID:{SECRET}@h:1/x", "//h:1/x"),
        (f"s3://AKID:{SECRET}@bucket/key", "s3://bucket/key"),
        (f"https://b.s3.amazonaws.com/k?X-Amz-Credential=AKID&X-Amz-Signature={SECRET}&v=1",
         "https://b.s3.amazonaws.com/k?X-Amz-Credential=REDACTED&X-Amz-Signature=REDACTED&v=1"),
        ("http://h:9000/a@b", "http://h:9000/a@b"),  # an @ in the path is not userinfo
        ("someone@example.com", "someone@example.com"),  # neither is a contact address
        ("runs/demo", "runs/demo"),
    ],
)  # fmt: skip
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_manifest_holds_no_userinfo_or_credential(tmp_path) -> None:
    config = {
        "s3_endpoint": f"AKID:{SECRET}@127.0.0.1:8333",
        "metadata": f"http://u:{SECRET}@h/x.parquet",
        "nested": [{"url": f"https://b/k?X-Amz-Signature={SECRET}"}],
    }
    store = Storage(endpoint=f"http://AKID:{SECRET}@127.0.0.1:8333", access_key="AKID", secret_key=SECRET)
    path = write_manifest(str(tmp_path), job="build_dataset", config=config, counts={"n": 1}, timings={},
                          store=store, extra={"note": f"//x:{SECRET}@h"})  # fmt: skip
    text = Path(path).read_text()
    assert SECRET not in text and "AKID:" not in text
    entry = json.loads(text)["jobs"]["build_dataset"]
    assert entry["storage"]["s3_endpoint"] == "http://127.0.0.1:8333"
    assert entry["config"]["s3_endpoint"] == "127.0.0.1:8333"
    assert SECRET not in repr(store)


def test_job_config_error_line_is_redacted(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jobs.build_dataset", "--set", f"samples_per_shard=http://u:{SECRET}@h:1/x"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "samples_per_shard" in out.stderr
    assert SECRET not in out.stderr + out.stdout
    assert (
        redact_text(f"GET http://a:{SECRET}@h/x?token={SECRET} failed")
        == "GET http://h/x?token=REDACTED failed"
    )
