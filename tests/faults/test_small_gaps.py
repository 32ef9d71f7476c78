"""Failure 6, the small gaps: two config ranges and host names that can never resolve.

- ``run.keep_checkpoints=0`` passed the config check and failed later inside Ray Train;
  ``data.max_bad_shards=-1`` is held to the same rule (both stop the job at start, exit status 2).
- An invalid host name (an empty or 64-character label) or one the resolver says does not exist was a
  *transient* ``connection_error``, fetched again by every ``retry_failed`` pass. It is now final:
  ``invalid_url`` before any lookup, ``failed_to_download:unknown_host`` after one.
"""

from __future__ import annotations

import socket

import pytest

from jobs import train as train_job
from pipeline import schema as S
from pipeline.download.fetch import fetch
from pipeline.download.netguard import UrlGuard


@pytest.mark.parametrize("setting", ["run.keep_checkpoints=0", "data.max_bad_shards=-1"])
def test_out_of_range_training_settings_stop_the_job_at_start(setting, capsys) -> None:
    rc = train_job.main(["--preset", "demo", "--set", setting])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"config error: {setting.split('=')[0]}:"), err


@pytest.mark.parametrize(
    "host", ["a..b.example", "x" * 64 + ".example", "-bad-.example", "bad-.example", "a" * 250 + ".ex"]
)
def test_a_host_name_that_cannot_exist_is_final_before_any_lookup(host) -> None:
    looked_up = []

    def resolver(*args, **_kw):  # records the lookup it must never be asked for
        looked_up.append(args[0])
        raise AssertionError("no lookup for an invalid name")

    res = _fetch(f"http://{host}/x.jpg", UrlGuard([], resolver=resolver))
    assert res.status == S.STATUS_INVALID_URL and not S.is_transient(res.status) and not looked_up


def test_a_name_the_resolver_does_not_know_is_final_an_outage_is_not() -> None:
    answers = {"gone.example": socket.EAI_NONAME, "flaky.example": socket.EAI_AGAIN}
    calls: dict[str, int] = {}

    def resolver(host, *_a, **_kw):  # glibc's two answers, as getaddrinfo raises them
        calls[host] = calls.get(host, 0) + 1
        raise socket.gaierror(answers[host], "from the resolver")

    guard = UrlGuard([], resolver=resolver)
    gone = _fetch("http://gone.example/x.jpg", guard, retries=2)
    flaky = _fetch("http://flaky.example/x.jpg", guard, retries=2)
    assert gone.status == "failed_to_download:unknown_host" and not S.is_transient(gone.status)
    assert flaky.status == "failed_to_download:connection_error" and S.is_transient(flaky.status)
    assert calls == {"gone.example": 1, "flaky.example": 3}  # the final one is not asked again


def test_real_resolver_on_a_reserved_invalid_name_is_never_transient() -> None:
    # RFC 6761: ".invalid" never resolves; with or without a DNS server the row must not stay transient
    # unless the resolver itself could not answer.
    res = _fetch("http://no-such-host.invalid/x.jpg", UrlGuard([]))
    assert res.status in ("failed_to_download:unknown_host", "failed_to_download:connection_error")
    if res.status.endswith("connection_error"):
        assert "Temporary failure" in res.error or "resolve" in res.error


def _fetch(url: str, guard: UrlGuard, retries: int = 0):
    return fetch(url, timeout_s=1.0, retries=retries, max_bytes=1 << 20, guard=guard, user_agent="t/1",
                 honor_robots=True)  # fmt: skip
