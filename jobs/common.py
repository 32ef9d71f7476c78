"""What every job shares: the one config parser (preset → file → flags → --set), starting Ray, tables.

Jobs stay thin: parse → resolve config → call one library function → write the manifest → print a summary.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import yaml

from pipeline.common.config import ConfigError, field_type, resolve, to_dict
from pipeline.common.storage import redact_text

T = TypeVar("T")
LOOPBACK = "127.0.0.1"


def parse_job_config(
    argv: Sequence[str] | None,
    description: str,
    presets: Mapping[str, T],
    flags: Mapping[str, str | tuple[str, Any]] | None = None,
    default: str = "demo",
    required: Sequence[str] = (),
) -> T:
    """The one way every job reads its config: ``--preset`` → ``--config FILE.yaml`` → flags → ``--set k=v``.

    ``flags`` maps a shorthand flag (``"--shards"``) to the dotted config key it sets (``"data.shards"``),
    or to ``(key, value)`` for a switch that sets a fixed value (``"--no-analyses": ("analyses", False)``).
    A flag's form follows the key's type: a bool is a switch, a list takes one or more values (repeatable),
    anything else one value, read like ``--set`` values are. ``required`` keys must be non-empty after
    every layer. A config error prints one line naming the key (and the YAML file) and exits 2.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", default=default, choices=sorted(presets), help="named configuration")
    parser.add_argument("--config", default=None, help="YAML file layered over the preset")
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. a.b=1"
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML (a --config file) and exit",
    )
    cls = type(next(iter(presets.values())))
    dests: dict[str, tuple[str, Any]] = {}
    for flag, target in (flags or {}).items():
        key, const = target if isinstance(target, tuple) else (target, _NO_CONST)
        dest = "flag_" + flag.lstrip("-").replace("-", "_")
        dests[dest] = (key, const)
        _add_flag(parser, flag, dest, key, const, field_type(cls, key))
    args = parser.parse_args(argv)
    given = {}
    for dest, (key, const) in dests.items():
        value = getattr(args, dest)
        if const is not _NO_CONST:
            value = const if value else None
        if value is not None:
            given[key] = value
    try:
        cfg = resolve(presets, args.preset, args.config, args.sets, given)
        missing = [] if args.print_config else [key for key in required if not _value(cfg, key)]
        if missing:
            how = ", ".join(
                next((f for f, t in (flags or {}).items() if t == key), f"--set {key}=…") for key in missing
            )
            raise ConfigError(f"{', '.join(missing)} required (give {how})")
    except ConfigError as exc:
        print(f"config error: {redact_text(str(exc))}", file=sys.stderr)
        raise SystemExit(2) from exc
    if args.print_config:
        print(redact_text(yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)), end="")
        raise SystemExit(0)
    return cfg


_NO_CONST = object()


def _add_flag(parser: argparse.ArgumentParser, flag: str, dest: str, key: str, const: Any, tp: Any) -> None:
    if const is not _NO_CONST:
        parser.add_argument(flag, dest=dest, action="store_true", help=f"sets {key}={const}")
        return
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if tp is bool:
        parser.add_argument(
            flag, dest=dest, action="store_const", const=True, default=None, help=f"sets {key}"
        )
    elif typing.get_origin(tp) in (list, tuple):
        parser.add_argument(flag, dest=dest, action="extend", nargs="+", default=None, help=f"sets {key}")
    else:
        parser.add_argument(flag, dest=dest, default=None, help=f"sets {key}")


def _value(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def init_ray(num_cpus: int = 0, **kwargs: Any) -> None:
    """Attach to the cluster a job was submitted to, else start a private local one.

    ``ray job submit`` sets RAY_ADDRESS for the entrypoint; anywhere else we start our own local instance
    (``address="local"``) so a stray cluster on the machine is never picked up by accident.
    """
    import ray

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

    # Our jobs print their own progress lines; Ray Data's per-dataset INFO lines would drown them.
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False


def loopback_only(ray: Any) -> None:
    """Make a private local Ray listen on 127.0.0.1 only (docs/download.md, "Local Ray").

    Ray 2.60 turns an explicit ``_node_ip_address="127.0.0.1"`` back into the machine's routable address
    (``services.resolve_ip_for_localhost``), and its GCS, raylet, workers and agents then listen on all
    interfaces. Its single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the default on macOS
    and Windows) uses the loopback address as the node address instead, and every component binds to
    the node address. The env var reaches the processes Ray starts; the driver read it at import, so its
    copy is set too. tests/jobs/test_local_ray_bind.py lists every listening socket of the process tree.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = ray._private.ray_constants
    if hasattr(constants, "ENABLE_RAY_CLUSTER"):
        constants.ENABLE_RAY_CLUSTER = False


def no_cloud_probe(ray: Any) -> None:
    """Start no dashboard process when there is no dashboard: it would probe the cloud's metadata service.

    With ``include_dashboard=False`` Ray 2.60 still starts its dashboard process, to host one module,
    usage stats, whose start asks ``169.254.169.254`` and ``metadata.google.internal`` which cloud this
    is before it reads that usage stats are off (``usage_stats_head.py``, ``get_cluster_config_to_report``).
    Usage stats are always off in our jobs, so that process has nothing to do: Ray's start is left
    without it (it handles a dashboard that did not start). A job asked for a dashboard keeps Ray's own.
    tests/faults/test_egress.py records every lookup and connection of the job's processes.
    """
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
    cols = [headers, *[tuple(str(c) for c in r) for r in rows]]
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(headers))]
    print(f"\n{title}")
    line = "  ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=True))
    print(line)
    print("-" * len(line))
    for r in cols[1:]:
        print(
            "  ".join(
                str(c).rjust(w) if str(c).replace(".", "").isdigit() else str(c).ljust(w)
                for c, w in zip(r, widths, strict=True)
            )
        )
