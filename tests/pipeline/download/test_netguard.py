"""UrlGuard decisions on literal addresses and on a fake resolver: no traffic leaves this process."""

from __future__ import annotations

import socket

import pytest

from pipeline.download.netguard import UrlGuard, is_forbidden_ip

BLOCKED = [
    "http://10.0.0.1/a.jpg",
    "http://172.16.0.1/",
    "http://192.168.1.1/",
    "http://169.254.169.254/latest/meta-data/",
    "http://127.0.0.2:8080/",
    "http://127.0.0.1/",
    "http://[::1]/",
    "http://[fe80::1]/",
    "http://[fd00:ec2::254]/latest/",
    "http://0.0.0.0/",
    "http://[::]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:10.1.2.3]/",
    "http://[64:ff9b::a9fe:a9fe]/",  # NAT64 form of 169.254.169.254
    "http://[2002:7f00:1::]/",  # 6to4 around 127.0.0.1
    "http://224.0.0.1/",
    "http://100.64.0.1/",  # carrier-grade NAT
    "http://100.100.100.200/",  # Alibaba metadata
    "http://168.63.129.16/",  # Azure WireServer, public address space
    "https://240.0.0.1/",  # reserved
]


@pytest.mark.parametrize("url", BLOCKED)
def test_internal_literals_are_blocked(url: str) -> None:
    assert UrlGuard([]).check(url) == "blocked_address"


@pytest.mark.parametrize(
    "url", ["http://8.8.8.8/x.jpg", "https://[2606:4700::1111]/x", "HTTP://1.1.1.1:8080/"]
)
def test_public_literals_pass(url: str) -> None:
    assert UrlGuard([]).check(url) is None


@pytest.mark.parametrize(
    "url", ["http://2130706433/", "http://0177.0.0.1/", "http://0x7f.1/", "http://127.1/"]
)
def test_numeric_spellings_of_loopback_are_blocked(url: str) -> None:
    # glibc's getaddrinfo parses these as 127.0.0.1 (no DNS); if a resolver refuses them, still no fetch.
    assert UrlGuard([]).check(url) in ("blocked_address", "failed_to_download:connection_error")


@pytest.mark.parametrize(
    "url",
    ["ftp://example.com/a.jpg", "file:///etc/passwd", "gopher://x/", "http:///nohost", "http://[::1/", "",
     "http://exa mple.com/", "http://example.com:99999/", "javascript:alert(1)", "data:image/png;base64,AA"],
)  # fmt: skip
def test_invalid_urls(url: str) -> None:
    assert UrlGuard([]).check(url) == "invalid_url"


def test_allow_list_by_ip_name_and_network() -> None:
    assert UrlGuard(["127.0.0.1"]).check("http://127.0.0.1:1234/x") is None
    assert UrlGuard(["127.0.0.1"]).check("http://127.0.0.2:1234/x") == "blocked_address"
    assert UrlGuard(["10.0.0.0/8"]).check("http://10.9.9.9/") is None
    assert UrlGuard(["[::1]"]).check("http://[::1]:80/") is None


def _fake_resolver(table: dict[str, list[str]]):
    def resolve(host, port, type=0, **_kw):  # noqa: A002 (getaddrinfo's own keyword)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        out = []
        for ip in table[host]:
            fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
            addr = (ip, port, 0, 0) if fam == socket.AF_INET6 else (ip, port)
            out.append((fam, socket.SOCK_STREAM, 6, "", addr))
        return out

    return resolve


def test_hostname_resolving_to_internal_is_blocked_and_pins_public_only() -> None:
    guard = UrlGuard(
        [],
        resolver=_fake_resolver(
            {"evil.example": ["10.0.0.5"], "mixed.example": ["127.0.0.1", "93.184.216.34"]}
        ),
    )
    assert guard.check("http://evil.example/a.jpg") == "blocked_address"
    decision = guard.resolve("http://mixed.example/a.jpg?x=1#frag")
    assert decision.status is None
    # Only the checked public address is handed to the connector: no rebinding to the loopback one.
    assert [sa[0] for _fam, sa in decision.addresses] == ["93.184.216.34"]
    assert decision.target == "/a.jpg?x=1" and decision.port == 80 and decision.host == "mixed.example"


def test_allow_listed_name_allows_what_it_resolves_to() -> None:
    guard = UrlGuard(["Demo.Local"], resolver=_fake_resolver({"demo.local": ["127.0.0.1"]}))
    assert guard.check("http://demo.local:8000/x.jpg") is None


def test_a_name_that_does_not_exist_is_final_and_a_resolver_outage_transient() -> None:
    decision = UrlGuard([], resolver=_fake_resolver({})).resolve("http://nonexistent.invalid/")
    assert decision.status == "failed_to_download:unknown_host" and not decision.transient

    def outage(*_a, **_kw):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    decision = UrlGuard([], resolver=outage).resolve("http://example.com/")
    assert decision.status == "failed_to_download:connection_error" and decision.transient


def test_target_escapes_spaces_and_utf8_but_keeps_existing_escapes() -> None:
    guard = UrlGuard([], resolver=_fake_resolver({"ex.com": ["93.184.216.34"]}))
    assert guard.resolve("http://ex.com/a b/é%20c.jpg?q=1&r=ü").target == "/a%20b/%C3%A9%20c.jpg?q=1&r=%C3%BC"


def test_is_forbidden_ip_direct() -> None:
    import ipaddress

    assert is_forbidden_ip(ipaddress.ip_address("::ffff:169.254.169.254"))
    assert not is_forbidden_ip(ipaddress.ip_address("93.184.216.34"))


def test_allow_list_entries_with_a_port_allow_that_port_only() -> None:
    guard = UrlGuard(["127.0.0.1:8080", "[::1]:9000", "10.0.0.0/8:80"])
    assert guard.check("http://127.0.0.1:8080/x") is None
    assert guard.check("http://127.0.0.1:8081/x") == "blocked_address"
    assert guard.check("http://127.0.0.1/x") == "blocked_address"  # port 80 by default
    assert (
        guard.check("http://[::1]:9000/") is None and guard.check("http://[::1]:9001/") == "blocked_address"
    )
    assert guard.check("http://10.1.2.3/") is None and guard.check("https://10.1.2.3/") == "blocked_address"
    named = UrlGuard(["demo.local:8000"], resolver=_fake_resolver({"demo.local": ["127.0.0.1"]}))
    assert named.check("http://demo.local:8000/a") is None
    assert named.check("http://demo.local:8001/a") == "blocked_address"
    # A bare entry keeps allowing every port; the redirect-to-another-port bypass needs the port too.
    assert UrlGuard(["127.0.0.1"]).check("http://127.0.0.1:8265/") is None


@pytest.mark.parametrize("entry", ["127.0.0.1:0", "127.0.0.1:99999", "host:http", "[::1]x", "[::1]:"])
def test_bad_allow_list_port_is_refused_naming_the_entry(entry: str) -> None:
    from pipeline.common.config import ConfigError
    from pipeline.config import DownloadConfig

    with pytest.raises(ValueError, match="allow_hosts entry"):
        UrlGuard([entry])
    with pytest.raises(ConfigError, match="allow_hosts"):
        DownloadConfig(allow_hosts=[entry])
