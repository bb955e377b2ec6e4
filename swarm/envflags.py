"""Every command-line flag can also come from an environment variable (for `docker run -e`).

`--initial-peers` reads `SWARM_INITIAL_PEERS`, `--metrics-port` reads `SWARM_METRICS_PORT`, and so
on. A flag given on the command line wins over the environment. The programs call
:func:`apply_env_defaults` on their parser; nothing here runs at import.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

PREFIX = "SWARM_"


def env_name(option: str) -> str:
    """`--initial-peers` -> `SWARM_INITIAL_PEERS`."""
    return PREFIX + option.lstrip("-").replace("-", "_").upper()


def apply_env_defaults(parser: Any, environ: Mapping[str, str] | None = None) -> None:
    """Make each long option of an argparse parser default to its environment variable."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or longs[0] == "--help":
            continue
        name = env_name(longs[0])
        action.help = f"{action.help or ''} [env {name}]".strip()
        if name not in environ:
            continue
        raw = environ[name]
        if action.nargs == 0:  # store_true / store_false
            action.default = raw.strip().lower() in ("1", "true", "yes", "on")
        elif action.nargs in ("+", "*"):
            action.default = raw.split()
            action.required = False
        else:
            action.default = raw
            action.required = False


def positive_int(value: str) -> int:
    """argparse type: a whole number of at least 1."""
    try:
        x = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {value!r}") from None
    if x < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return x
