"""What every job shares: argument parsing (preset / config file / --set), starting Ray, printing tables.

Jobs stay thin: parse → resolve config → call one library function → write the manifest → print a summary.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pipeline.config import ConfigError, resolve

T = TypeVar("T")


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
        print(f"config error: {exc}", file=sys.stderr)
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
