"""The failures a job anticipates, one class per kind, each with the exit status it ends the job with.

Every job stops on an anticipated failure with one line on stderr, ``<kind>: <what and where>``, and the
kind's exit status (docs/jobs.md, "Errors and exit codes"); ``jobs.common.run_job`` prints it. Anything
that is not one of these is a bug: the job prints the traceback and a line saying so, and exits 1.

| class          | kind            | exit | for                                                                 |
|----------------|-----------------|------|---------------------------------------------------------------------|
| ``UsageError`` | ``config error``  | 2    | a bad flag, config key, value, preset or ``--config`` file          |
| ``InputError`` | ``input error``   | 3    | an input that is missing, unreadable or not the kind of file asked  |
| ``StorageError`` | ``storage error`` | 4  | storage unreachable, access denied, out of space                    |
| ``RefusedError`` | ``refused``     | 5    | an output that holds another run (a resume that would mix two runs) |

A library error class takes the kind as a base (``class CheckpointError(InputError, RuntimeError)``), so the
job needs no table of which exception means what, and ``except RuntimeError`` callers keep working.
"""

from __future__ import annotations

import contextlib
import errno
import re
from collections.abc import Iterator

from pipeline.common.storage import redact_text

EXIT_INTERNAL = 1  # a bug: traceback, then one line saying so
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, the shell's convention)


class JobError(Exception):
    """An anticipated failure: ``str(exc)`` names what and where; ``kind`` and ``exit_code`` say which."""

    kind = "error"
    exit_code = EXIT_INTERNAL


class UsageError(JobError):
    kind = "config error"
    exit_code = 2


class InputError(JobError):
    kind = "input error"
    exit_code = 3


class StorageError(JobError):
    kind = "storage error"
    exit_code = 4


class RefusedError(JobError):
    kind = "refused"
    exit_code = 5


# Words in pyarrow's (AWS SDK) and s3fs's messages that mean the store itself failed, not the object.
_STORAGE_WORDS = (
    "NETWORK_CONNECTION",
    "Could not connect",
    "Could not resolve",
    "curlCode",
    "Connection refused",
    "ACCESS_DENIED",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "Unable to locate credentials",
    "timed out",
)
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ECONNREFUSED, errno.ETIMEDOUT}


def os_error(exc: OSError, what: str) -> JobError:
    """``exc`` raised while reading or writing ``what`` (a path, with what it is for; "" = the exception's
    own text names it) as the kind it is.

    Unreachable or refusing storage and a full disk are ``StorageError``; a missing path, a permission
    refused on a local file or a directory where a file was asked are ``InputError``. The message keeps the
    first line of the library's own text, which carries the endpoint or the errno's words.
    """
    text = " ".join(str(exc).split()) or type(exc).__name__

    def say(words: str) -> str:
        return f"{what}: {words}" if what else _short(text)

    text = re.sub(
        r"^When \w+ [^:]*? (?:key|bucket) '[^']*'(?: in bucket '[^']*')?: ", "", text
    )  # the path again
    if exc.errno in _STORAGE_ERRNOS or any(w in text for w in _STORAGE_WORDS):
        return StorageError(f"{what}: {_short(text)}" if what else _short(text))
    if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in text or "does not exist" in text:
        return InputError(say("not found"))
    if isinstance(exc, IsADirectoryError):
        return InputError(say("a directory, not a file"))
    if isinstance(exc, NotADirectoryError):
        return InputError(say("a path component is a file, not a directory"))
    if isinstance(exc, PermissionError):
        return InputError(say("permission denied"))
    return InputError(f"{what}: {_short(text)}" if what else _short(text))


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


@contextlib.contextmanager
def naming(what: str) -> Iterator[None]:
    """An ``OSError`` inside the block re-raised as the ``JobError`` it is (``os_error``), naming ``what``."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, JobError):
            raise
        raise os_error(exc, what) from None


# ---------------------------------------------------------------- a build's storage failures in one line
# One line for the storage failures that stop a job: a full disk and an object store out of reach.
#
# Both leave a consistent state (writes publish by rename or by a completed upload; a part counts once its
# marker exists), so the line says what to fix and that a re-run resumes. Any other error is not ours to
# explain here (``explain`` returns None) and keeps its traceback.

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
