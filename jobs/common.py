"""What every job shares: argument parsing (preset / config file / --set), starting Ray, printing tables.

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

from pipeline.common.storage import redact_text
from pipeline.config import ConfigError, merge, resolve

T = TypeVar("T")
LOOPBACK = "127.0.0.1"


def config_parser(
    description: str, presets: Mapping[str, Any], default: str = "demo"
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", default=default, choices=sorted(presets), help="named configuration")
    parser.add_argument("--config", default=None, help="YAML file layered over the preset")
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. a.b=1"
    )
    return parser


def resolve_config(args: argparse.Namespace, presets: Mapping[str, T]) -> T:
    try:
        return resolve(presets, args.preset, args.config, args.sets)
    except ConfigError as exc:
        print(f"config error: {redact_text(str(exc))}", file=sys.stderr)
        raise SystemExit(2) from exc


def parse_job_config(
    argv: Sequence[str] | None,
    description: str,
    presets: Mapping[str, T],
    flags: Mapping[str, str] | None = None,
    default: str = "demo",
    required: Sequence[str] = (),
) -> T:
    """The one way a job reads its config: ``--preset`` → ``--config FILE.yaml`` → flags → ``--set k=v``.

    ``flags`` maps a convenience flag (``"--shards"``) to the config key it sets (``"shards"``); its type
    follows the field: a bool is a switch, a list takes one or more values (repeatable), anything else one
    value coerced like ``--set``. ``--set`` is applied last, so it wins. A config error prints one line
    naming the field (and the YAML file) and exits 2.
    """
    parser = config_parser(description, presets, default)
    hints = typing.get_type_hints(type(next(iter(presets.values()))))
    for flag, key in (flags or {}).items():
        tp = hints[key]
        if tp is bool:
            parser.add_argument(
                flag, dest=key, action="store_const", const=True, default=None, help=f"sets {key}"
            )
        elif typing.get_origin(tp) in (list, tuple):
            parser.add_argument(flag, dest=key, action="extend", nargs="+", default=None, help=f"sets {key}")
        else:
            parser.add_argument(flag, dest=key, default=None, help=f"sets {key}")
    args = parser.parse_args(argv)
    sets = list(args.sets)
    args.sets = []
    cfg = resolve_config(args, presets)
    given = {key: getattr(args, key) for key in (flags or {}).values() if getattr(args, key) is not None}
    try:
        cfg = merge(cfg, given)
        cfg = resolve({"given": cfg}, "given", None, sets) if sets else cfg
        missing = [key for key in required if not getattr(cfg, key)]
        if missing:
            how = ", ".join(next((f for f, k in (flags or {}).items() if k == key), key) for key in missing)
            raise ConfigError(f"{', '.join(missing)} required (give {how} or --set KEY=VALUE)")
        return cfg
    except ConfigError as exc:
        print(f"config error: {redact_text(str(exc))}", file=sys.stderr)
        raise SystemExit(2) from exc


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
