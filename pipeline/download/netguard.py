"""SSRF guard for the download stage: which URLs we may fetch, and which addresses we may connect to.

A metadata pool is untrusted input: any row can point at ``http://169.254.169.254/`` (cloud credentials),
``http://127.0.0.1:8265/`` (the Ray dashboard) or a private service. Destinations resolving
to private, loopback, link-local or cloud-metadata addresses are refused unless allow-listed; img2dataset
1.47 (``downloader.download_image``) has no such check and lets urllib follow redirects unchecked.

Decisions (docs/download.md explains them):

- Only ``http``/``https`` URLs with a host are valid; anything else is ``invalid_url``.
- The host is resolved once with ``socket.getaddrinfo``; every resolved address is classified. Addresses
  that are not globally routable (private, loopback, link-local, multicast, reserved, unspecified, CGNAT,
  IPv4 embedded in IPv6 mapped/NAT64/6to4/Teredo forms of those) and known metadata endpoints are refused.
- The caller connects only to the addresses this guard returned (``GuardDecision.addresses``), never
  re-resolving the name: that closes the DNS-rebinding window between check and connect.
- A host resolving to a mix of allowed and refused addresses keeps only the allowed ones; with none left
  the URL is ``blocked_address``. Safe because of the pinning above.
- ``allow_hosts`` entries are host names (matched case-insensitively against the URL's host), IP
  addresses, or CIDR networks (matched against each resolved address). An allow-listed host name allows
  whatever it resolves to — it is an explicit operator decision (the demo and tests allow ``127.0.0.1``).
  An entry with a port (``127.0.0.1:8080``, ``[::1]:8080``, ``images.internal:443``, ``10.0.0.0/8:80``)
  allows that port only; a bare entry allows every port (``parse_allow_entry``).
- A host name that cannot be one (an empty or over-long label, a character outside letters, digits,
  ``-`` and ``_``, a label starting or ending with ``-``, over 253 characters) is ``invalid_url``. A name
  the resolver says does not exist (``EAI_NONAME``, ``EAI_NODATA``) is ``failed_to_download:unknown_host``,
  final like a 404: a ``retry_failed`` pass would ask again and get the same answer. Only a resolver that
  could not answer (``EAI_AGAIN``, a socket error) leaves the row transient, ``connection_error``.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

from pipeline.schema import STATUS_BLOCKED_ADDRESS, STATUS_INVALID_URL, failed_download

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[..., list]

# Metadata endpoints that the generic "not global" rule would miss or that deserve an explicit entry:
# AWS/GCP/Azure IMDS (link-local anyway), AWS IPv6 IMDS (ULA anyway), Alibaba (CGNAT anyway), and Azure's
# WireServer 168.63.129.16, which sits in public address space.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "168.63.129.16")
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_TARGET_SAFE = "/%?=&;:@!$'()*+,~-._[]"
# One DNS label after IDNA encoding (RFC 1123, plus "_", which real CDN host names carry).
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
# The resolver's "this name has no address" answers (glibc: NXDOMAIN, or a name without A/AAAA records).
_NO_SUCH_NAME = frozenset(
    code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if code is not None
)


@dataclass(frozen=True)
class GuardDecision:
    """Outcome of checking one URL. ``status`` is None when the URL may be fetched."""

    status: str | None
    error: str = ""
    scheme: str = ""
    host: str = ""
    port: int = 0
    target: str = "/"  # request target: path + query, fragment dropped
    # (family, sockaddr) pairs, already checked, in resolver order: connect to these and nothing else.
    addresses: list[tuple[int, tuple]] = field(default_factory=list)
    transient: bool = False


def _embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, NAT64, 6to4, Teredo client), if any."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return None


def is_forbidden_ip(ip: IPAddress) -> bool:
    """True for addresses a public-web crawler has no business connecting to."""
    inner = _embedded_ipv4(ip)
    if inner is not None and is_forbidden_ip(inner):
        return True
    if ip in METADATA_ADDRESSES:
        return True
    return (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or not ip.is_global  # catches CGNAT 100.64/10, benchmarking 198.18/15, documentation ranges, ...
    )


def host_name_problem(host: str) -> str | None:
    """Why ``host`` (lower-cased, brackets stripped) cannot be a host name; None if it can be one."""
    if _parse_ip(host) is not None:
        return None
    name = host.rstrip(".")
    try:
        ascii_name = name.encode("idna").decode("ascii")
    except UnicodeError as exc:
        return f"host name {host!r} is not valid ({exc})"
    if not ascii_name or len(ascii_name) > 253:
        return f"host name {host!r} is empty or longer than 253 characters"
    bad = next((label for label in ascii_name.split(".") if not _LABEL.fullmatch(label)), None)
    if bad is not None:
        return f"host name {host!r} has an invalid label {bad!r}"
    return None


def _parse_ip(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        return None


AllowNet = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_allow_entry(entry: str) -> tuple[str | AllowNet, int | None] | None:
    """``allow_hosts`` entry → (host name or network, port or None for any); None for an empty entry.

    Raises ``ValueError`` naming the entry for a bad port or an unbracketed IPv6 address with a port.
    """
    text = entry.strip().lower()
    if not text:
        return None
    port: int | None = None
    if text.startswith("["):  # [v6] or [v6]:port or [v6/len]:port
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"allow_hosts entry {entry!r}: expected [address]:port")
            port = _port(rest[1:], entry)
    elif text.count(":") == 1:  # v4, name or v4 network, with a port
        host, _, p = text.partition(":")
        port = _port(p, entry)
    else:  # a bare name, v4, v6 or network
        host = text
    try:
        return ipaddress.ip_network(host, strict=False), port
    except ValueError:
        return host.rstrip("."), port


def _port(text: str, entry: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"allow_hosts entry {entry!r}: port must be 1..65535")
    return int(text)


def _unresolved(host: str, exc: Exception) -> GuardDecision:
    """The resolver could not answer (no DNS server reachable, a timeout): worth asking again later."""
    why = f"cannot resolve {host!r}: {exc}"
    return GuardDecision(failed_download("connection_error"), why, transient=True)


class UrlGuard:
    """Validates URLs and resolves their hosts to connectable, non-internal addresses.

    ``resolver`` defaults to ``socket.getaddrinfo``; tests inject a fake one to simulate hostile DNS.
    """

    def __init__(self, allow_hosts: Iterable[str] = (), *, resolver: Resolver | None = None) -> None:
        self._allow_names: list[tuple[str, int | None]] = []
        self._allow_nets: list[tuple[AllowNet, int | None]] = []
        for entry in allow_hosts:
            parsed = parse_allow_entry(entry)
            if parsed is None:
                continue
            what, port = parsed
            if isinstance(what, str):
                self._allow_names.append((what, port))
            else:
                self._allow_nets.append((what, port))
        self._resolve = resolver or socket.getaddrinfo

    def _name_allowed(self, host: str, port: int) -> bool:
        return any(host == name and p in (None, port) for name, p in self._allow_names)

    def _ip_allowed(self, ip: IPAddress, port: int) -> bool:
        return any(
            ip.version == net.version and ip in net and p in (None, port) for net, p in self._allow_nets
        ) or not is_forbidden_ip(ip)

    def resolve(self, url: str) -> GuardDecision:
        """Parse ``url``, resolve its host once, and return the addresses it may connect to."""
        if not isinstance(url, str) or not url.strip() or any(ord(c) < 0x20 or c == "\x7f" for c in url):
            return GuardDecision(STATUS_INVALID_URL, "empty URL or control characters")
        try:
            parts = urlsplit(url.strip())
            scheme = parts.scheme.lower()
            host = parts.hostname  # lower-cased, brackets stripped
            port = parts.port
        except ValueError as exc:
            return GuardDecision(STATUS_INVALID_URL, f"unparseable URL: {exc}")
        if scheme not in ("http", "https"):
            return GuardDecision(STATUS_INVALID_URL, f"scheme {scheme!r} is not http/https")
        if not host or any(c in host for c in ' <>"{}|\\^`'):
            return GuardDecision(STATUS_INVALID_URL, f"URL has no valid host: {host!r}")
        port = port or (443 if scheme == "https" else 80)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        # Web URLs in the wild carry raw spaces and UTF-8; http.client refuses those, browsers escape them.
        target = quote(target, safe=_TARGET_SAFE)
        problem = host_name_problem(host)
        if problem is not None:
            return GuardDecision(STATUS_INVALID_URL, problem)
        try:
            infos = self._resolve(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in _NO_SUCH_NAME:
                return GuardDecision(failed_download("unknown_host"), f"{host!r} does not resolve: {exc}")
            return _unresolved(host, exc)
        except (UnicodeError, OSError) as exc:
            return _unresolved(host, exc)
        name_allowed = self._name_allowed(host.rstrip("."), port)
        allowed: list[tuple[int, tuple]] = []
        refused: list[str] = []
        for family, _type, _proto, _canon, sockaddr in infos:
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = _parse_ip(sockaddr[0])
            if ip is None:
                continue
            if name_allowed or self._ip_allowed(ip, port):
                if (family, sockaddr) not in allowed:
                    allowed.append((family, sockaddr))
            else:
                refused.append(str(ip))
        if not allowed:
            why = f"{host} resolves to refused address(es) {', '.join(refused)}" if refused else "no address"
            return GuardDecision(STATUS_BLOCKED_ADDRESS, why)
        return GuardDecision(None, "", scheme, host, port, target, allowed)

    def check(self, url: str) -> str | None:
        """None if ``url`` may be fetched, else its status (``invalid_url``, ``blocked_address``, ...)."""
        return self.resolve(url).status
