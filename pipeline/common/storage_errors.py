"""One line for the storage failures that stop a job: a full disk and an object store out of reach.

Both leave a consistent state (writes publish by rename or by a completed upload; a part counts once its
marker exists), so the line says what to fix and that a re-run resumes. Any other error is not ours to
explain here (``explain`` returns None) and keeps its traceback.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

from pipeline.common.storage import redact_text

_RESUME = "the state is consistent and a re-run resumes where this one stopped"
# pyarrow's S3 client and botocore report an unreachable endpoint in these words (lower-cased).
_UNREACHABLE = ("could not connect to the endpoint", "network_connection", "connection refused",
                "failed to connect", "couldn't connect to server", "connect timeout")  # fmt: skip


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _botocore_connection(exc: BaseException) -> bool:
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
    except ImportError:  # no boto: pyarrow's S3 errors are OSErrors, matched by their text
        return False
    return isinstance(exc, BotoConnectionError)


def explain(exc: BaseException, output: str) -> str | None:
    """The one line for ``exc`` raised by a job writing under ``output``, or None when it is no storage failure."""
    for e in _chain(exc):
        if isinstance(e, OSError) and (e.errno == errno.ENOSPC or "[errno 28]" in str(e).lower()):
            where = getattr(e, "filename", None) or output
            return f"disk full: no space left on the device of {where}: free space or choose another output; {_RESUME}"
        text = redact_text(str(e)).splitlines()[0] if str(e) else type(e).__name__
        if _botocore_connection(e) or (
            isinstance(e, OSError) and any(w in text.lower() for w in _UNREACHABLE)
        ):
            return f"storage unreachable: {output}: {text}; {_RESUME}"
    return None
