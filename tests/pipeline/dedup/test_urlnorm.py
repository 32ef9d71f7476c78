"""URL normalisation: the rule the URL dedupe and the demo truth share."""

from __future__ import annotations

import pytest

from pipeline.dedup.urlnorm import normalize_url


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("http://example.com/a.jpg", "http://example.com/a.jpg"),
        ("  HTTP://Example.COM/a.jpg  ", "http://example.com/a.jpg"),
        ("http://example.com:80/a.jpg", "http://example.com/a.jpg"),
        ("https://example.com:443/a.jpg", "https://example.com/a.jpg"),
        ("http://example.com:443/a.jpg", "http://example.com:443/a.jpg"),
        ("http://example.com/a.jpg#top", "http://example.com/a.jpg"),
        ("http://example.com/A.jpg?Size=L&b=2", "http://example.com/A.jpg?Size=L&b=2"),
        ("http://User:Pw@Example.com:8080/x", "http://User:Pw@example.com:8080/x"),
        ("http://[::1]:8080/x#f", "http://[::1]:8080/x"),
        ("HTTP://127.0.0.1:5000/img/x.jpg#main", "http://127.0.0.1:5000/img/x.jpg"),
        ("not a url", "not a url"),
        ("http://host:notaport/x", "http://host:notaport/x"),
    ],
)
def test_normalize_url(url, want):
    assert normalize_url(url) == want


def test_normalize_url_is_idempotent():
    for url in ("HTTP://A.b:80/x#y", "ftp://H/x", "https://h:444/p?q#f"):
        assert normalize_url(normalize_url(url)) == normalize_url(url)
