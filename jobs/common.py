"""What every job shares: the error rule (``job_main``), the one config parser (preset → file → flags →
--set, with ``--help-config`` and ``--print-config``), starting Ray quietly, tables.

Jobs stay thin: parse → check inputs → start Ray → call one library function → write the manifest → print
a summary. Nothing here imports torch or Ray at module level: ``--help`` answers before either loads.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import logging
import os
import sys
import threading
import traceback
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import yaml

from pipeline.common.config import ConfigError, field_type, resolve, to_dict
from pipeline.common.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, JobError, UsageError, os_error
from pipeline.common.storage import redact_text

T = TypeVar("T")
LOOPBACK = "127.0.0.1"
EXIT_CODES = """\
exit status: 0 done, 2 config error, 3 input error, 4 storage error, 5 refused (the output holds
another run), 130 interrupted, 1 a bug (printed with its traceback); docs/jobs.md, "Errors and exit codes"."""


def _cause(exc: BaseException) -> BaseException:
    """The library error inside a Ray task or actor error (Ray wraps it, keeping its class as a base)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def report_error(exc: BaseException) -> int:
    """The error rule: an anticipated failure is one line ``<kind>: <what and where>`` on stderr and its
    kind's exit status; an ``OSError`` that escaped a check is classified by ``errors.os_error``; anything
    else is a bug: its traceback, then one line saying so, exit 1."""
    inner = _cause(exc)
    if isinstance(inner, OSError) and not isinstance(inner, JobError):
        inner = os_error(inner, inner.filename or "")
    if isinstance(inner, JobError):
        text = " ".join(redact_text(str(inner)).split())
        print(f"{inner.kind}: {text}", file=sys.stderr)
        return inner.exit_code
    traceback.print_exception(exc)
    print(
        f"internal error: {type(exc).__name__} is a bug in prolip-ray, not a problem with your input or "
        "config; the traceback above says where (please report it with the command you ran)",
        file=sys.stderr,
    )
    return EXIT_INTERNAL


def job_main(main: Callable[[Sequence[str] | None], int]) -> Callable[[Sequence[str] | None], int]:
    """Wrap a job's ``main(argv) -> int`` in the error rule (``report_error``); Ctrl-C exits 130 in one
    line. ``--help``, ``--help-config`` and ``--print-config`` still exit through ``SystemExit(0)``."""

    @functools.wraps(main)
    def run(argv: Sequence[str] | None = None) -> int:
        try:
            return main(argv)
        except KeyboardInterrupt:
            print(
                "interrupted: stopped by Ctrl-C; the same command resumes what it committed", file=sys.stderr
            )
            return EXIT_INTERRUPTED
        except Exception as exc:  # noqa: BLE001 (the one place that turns every failure into an exit status)
            return report_error(exc)

    return run


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``UsageError`` line, not its usage block and exit 2."""

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(
            f"{message} (python -m {self.prog.removeprefix('python -m ')} --help lists the flags)"
        )


def parse_job_config(
    argv: Sequence[str] | None,
    summary: str,
    presets: Mapping[str, T],
    flags: Mapping[str, str | tuple[str, Any]] | None = None,
    default: str = "demo",
    required: Sequence[str] | Mapping[str, Sequence[str]] = (),
    *,
    prog: str = "",
    example: str = "",
) -> T:
    """The one way every job reads its config: ``--preset`` → ``--config FILE.yaml`` → flags → ``--set k=v``.

    ``flags`` maps a shorthand flag (``"--shards"``) to the dotted config key it sets (``"data.shards"``),
    or to ``(key, value)`` for a switch that sets a fixed value (``"--no-analyses": ("analyses", False)``);
    a name without dashes (``"RUN_DIR"``) is a positional argument. A flag's form follows the key's type:
    a bool is a switch, a list takes one or more values, anything else one value, read as ``--set`` values
    are; its help is the key's meaning. ``required`` keys must be non-empty after every layer (a mapping:
    the keys per preset, ``"*"`` for every preset). ``prog`` is the module (``jobs.train``), ``example`` one
    command line shown under ``--help``. Errors raise ``ConfigError``/``UsageError`` (one line, exit 2,
    through ``job_main``).
    """
    from pipeline.common.config_help import key_meaning

    cls = type(next(iter(presets.values())))
    name = f"python -m {prog}" if prog else os.path.basename(sys.argv[0])
    parser = _parser(name, summary, example, presets, default)
    dests: dict[str, tuple[str, Any]] = {}
    for flag, target in (flags or {}).items():
        key, const = target if isinstance(target, tuple) else (target, _NO_CONST)
        dest = "flag_" + flag.lstrip("-").replace("-", "_").lower()
        dests[dest] = (key, const)
        _add_flag(parser, flag, dest, key, const, field_type(cls, key), key_meaning(cls, key))
    args = parser.parse_args(argv)
    if args.help_config:
        _print_help_config(name, presets, args.preset)
    given = {}
    for dest, (key, const) in dests.items():
        value = getattr(args, dest)
        if const is not _NO_CONST:
            value = const if value else None
        if value is not None:
            given[key] = value
    cfg = resolve(presets, args.preset, args.config, args.sets, given)
    if isinstance(required, Mapping):
        required = tuple(dict.fromkeys((*required.get("*", ()), *required.get(args.preset, ()))))
    missing = [] if args.print_config else [key for key in required if not _value(cfg, key)]
    if missing:
        how = ", ".join(
            next((f for f, t in (flags or {}).items() if t == k), f"--set {k}=…") for k in missing
        )
        raise ConfigError(f"{', '.join(missing)} required (give {how})")
    if args.print_config:
        print(redact_text(yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)), end="")
        raise SystemExit(0)
    return cfg


_NO_CONST = object()


def _parser(name: str, summary: str, example: str, presets: Mapping[str, Any], default: str) -> _Parser:
    description = summary.strip() + (f"\n\nexample:\n  {example}" if example else "")
    parser = _Parser(
        prog=name,
        description=description,
        epilog="--help-config lists every config key with its type, default and meaning.\n" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset", default=default, choices=sorted(presets), help=f"named configuration (default: {default})"
    )
    parser.add_argument(
        "--config", default=None, metavar="FILE.yaml", help="YAML file layered over the preset"
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key (--help-config lists them), dotted for nested ones; repeatable",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML (usable as --config) and exit",
    )
    parser.add_argument(
        "--help-config",
        action="store_true",
        help="list every config key with its type, the preset's value and its meaning, and exit",
    )
    return parser


def _print_help_config(name: str, presets: Mapping[str, Any], preset: str) -> typing.NoReturn:
    from pipeline.common.config_help import render_keys

    others = ", ".join(p for p in sorted(presets) if p != preset)
    title = (
        f"{name}: every config key, with the value of preset {preset!r}"
        + (f" (--preset {others} shows theirs)" if others else "")
        + ".\nSet a key with --set KEY=VALUE or in a --config YAML file; --print-config shows the result."
    )
    print(redact_text(render_keys(presets[preset], title)), end="")
    raise SystemExit(0)


def _add_flag(
    parser: argparse.ArgumentParser, flag: str, dest: str, key: str, const: Any, tp: Any, meaning: str
) -> None:
    text = f"{key}: {meaning}" if meaning else f"sets {key}"
    if const is not _NO_CONST:
        shown = str(const).lower() if isinstance(const, bool) else const
        parser.add_argument(
            flag, dest=dest, action="store_true", help=f"{key}={shown}" + (f": {meaning}" if meaning else "")
        )
        return
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    listed = typing.get_origin(tp) in (list, tuple)
    if not flag.startswith("-"):
        parser.add_argument(dest, metavar=flag, nargs="*" if listed else "?", default=None, help=text)
    elif tp is bool:
        parser.add_argument(flag, dest=dest, action="store_const", const=True, default=None, help=text)
    elif listed:
        parser.add_argument(flag, dest=dest, action="extend", nargs="+", default=None, help=text)
    else:
        parser.add_argument(flag, dest=dest, default=None, metavar=key.rsplit(".", 1)[-1].upper(), help=text)


def _value(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def init_ray(num_cpus: int = 0, **kwargs: Any) -> None:
    """Attach to the cluster a job was submitted to, else start a private local one, quietly.

    ``ray job submit`` sets RAY_ADDRESS for the entrypoint; anywhere else we start our own local instance
    (``address="local"``) so a stray cluster on the machine is never picked up by accident. Ray's lines
    that tell our users nothing are silenced or explained once (``quiet_ray``).
    """
    import ray

    quiet_ray()  # after Ray's import, whose own warnings filter would otherwise come first
    # No implicit ray.init(): a thread still calling Ray after a Ctrl-C shut it down would start a second
    # local Ray (or attach to a stray one); it gets Ray's "not initialized" error instead.
    ray._private.auto_init_hook.enable_auto_connect = False
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs.setdefault("logging_level", "warning")  # our own progress lines say what runs; Ray's are noise
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], **kwargs)
    else:
        loopback_only(ray)
        no_cloud_probe(ray)
        kwargs.setdefault("_node_ip_address", LOOPBACK)
        kwargs.setdefault("dashboard_host", LOOPBACK)
        ray.init(
            address="local",
            num_cpus=num_cpus or None,
            include_dashboard=False,
            log_to_driver=False,
            **kwargs,
        )
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)  # per-dataset INFO lines would drown ours
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False


# Ray's lines that tell a user of these jobs nothing, and why (docs/jobs.md, "What a job prints").
RAY_NOISE: tuple[tuple[str, str], ...] = (
    ("Token authentication is enabled for this Ray cluster",
     "a private local Ray uses a token in ~/.ray/auth_token; nothing to do"),
    ("Progress bars disabled. To enable",
     "our jobs print their own progress lines instead of Ray Data's bars"),
    ("has constructor arguments in the object store and max_restarts > 0",
     "every Ray Data actor pool of Ray 2.60 logs this E-level line; a lost argument fails the task, "
     "which our stages retry or report"),
    ("PYTHON worker processes have been started on node",
     "fractional-CPU tasks (downloads, reads) start more workers than cores, as intended"),
)  # fmt: skip
_DEPRECATED = r"`ExecutionOptions.exclude_resources` is deprecated"  # Ray Train's own call, not ours


def quiet_ray() -> None:
    """Silence ``RAY_NOISE`` in this process's output (set ``PROLIP_RAY_NOISE=1`` to keep it).

    Ray's C++ core worker, Python loggers and log monitor all write to file descriptors 1 and 2, so those
    go through a pipe whose thread forwards every other line, when the streams are this process's own (not
    a test's capture). Call it after ``import ray``, whose own warnings filter would otherwise come first.
    """
    warnings.filterwarnings("ignore", message=_DEPRECATED)
    if os.environ.get("PROLIP_RAY_NOISE") == "1" or _LineFilter.installed:
        return
    if sys.stdout is not sys.__stdout__ or sys.stderr is not sys.__stderr__:
        return
    try:
        filters = [_LineFilter(fd, tuple(p.encode() for p, _ in RAY_NOISE)) for fd in (1, 2)]
    except OSError:
        return  # a closed or unusual stream: keep the output as it is
    _LineFilter.installed = True
    atexit.register(_drain, filters)


def _drain(filters: list[_LineFilter]) -> None:
    """At exit: Ray's shutdown first (its atexit hook, registered at its import, would run after this one
    and print its deduplicated log lines past the filter), then every filter drained and restored."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    for f in filters:
        f.close()


class _LineFilter:
    """File descriptor ``fd`` rerouted through a pipe; a thread forwards each line not holding one of
    ``patterns``. ``close`` drains it and restores the descriptor (``_drain``, at exit)."""

    installed = False

    def __init__(self, fd: int, patterns: tuple[bytes, ...]) -> None:
        self.fd, self.patterns = fd, patterns
        self.saved = os.dup(fd)
        read, self.write = os.pipe()
        os.dup2(self.write, fd)
        self.thread = threading.Thread(target=self._pump, args=(read,), daemon=True, name=f"ray-noise-{fd}")
        self.thread.start()

    _END = b"\x00prolip-end\x00"

    def _pump(self, read: int) -> None:
        pending, open_ = b"", True
        while chunk := os.read(read, 1 << 16):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                end = line.endswith(self._END)  # after any unterminated text written before it
                text = line[: -len(self._END)] if end else line + b"\n"
                if open_ and (end or not any(p in line for p in self.patterns)):
                    open_ = self._forward(text)
                if end:
                    return

    def _forward(self, data: bytes) -> bool:
        """Write ``data`` to the real stream; False once its reader is gone (``| head``): the pipe is then
        still drained, so the job never blocks on a full pipe."""
        try:
            os.write(self.saved, data)
            return True
        except OSError:
            return False

    def close(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(self.saved, self.fd)
        os.write(self.write, self._END + b"\n")
        self.thread.join(timeout=5)


def loopback_only(ray: Any) -> None:
    """Make a private local Ray listen on 127.0.0.1 only (docs/download.md, "Local Ray"): Ray 2.60 turns
    ``_node_ip_address="127.0.0.1"`` back into the routable address and binds every interface, except in its
    single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), set here for its processes and the
    driver's copy. tests/jobs/test_local_ray_bind.py lists every listening socket of the process tree."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = ray._private.ray_constants
    if hasattr(constants, "ENABLE_RAY_CLUSTER"):
        constants.ENABLE_RAY_CLUSTER = False


def no_cloud_probe(ray: Any) -> None:
    """Start no dashboard process when there is no dashboard (docs/decisions/0033): with
    ``include_dashboard=False`` Ray 2.60 still starts one for usage stats, which asks ``169.254.169.254`` and
    ``metadata.google.internal`` which cloud this is before reading that usage stats are off. A job asked
    for a dashboard keeps Ray's own; tests/faults/test_egress.py records every connection of the job."""
    services = ray._private.services
    if getattr(services.start_api_server, "no_cloud_probe", False):
        return
    start = services.start_api_server

    def start_api_server(include_dashboard: Any, *args: Any, **kwargs: Any) -> Any:
        if include_dashboard is False:
            return None, None  # (dashboard URL, process): none started
        return start(include_dashboard, *args, **kwargs)

    start_api_server.no_cloud_probe = True  # type: ignore[attr-defined]
    services.start_api_server = start_api_server


def print_table(title: str, rows: Sequence[tuple[Any, ...]], headers: Sequence[str]) -> None:
    cols = [tuple(map(str, headers)), *[tuple(str(c) for c in r) for r in rows]]
    widths = [max(len(r[i]) for r in cols) for i in range(len(headers))]
    pad = [
        [c.rjust(w) if c.replace(".", "").isdigit() else c.ljust(w) for c, w in zip(r, widths, strict=True)]
        for r in cols
    ]
    print(f"\n{title}\n{'  '.join(h.ljust(w) for h, w in zip(cols[0], widths, strict=True))}")
    print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    print("\n".join("  ".join(r) for r in pad[1:]))
