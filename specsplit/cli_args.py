"""The command line's flag builders and value parsers: `flag` and `switch` add a flag whose
default comes from a SPECSPLIT_* environment variable (shown in --help); the parsers read a
flag's value (none, milliseconds, comma-separated lists, cores)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env_bool(name: str, default: bool | None) -> bool | None:
    value = os.environ.get(name)
    if value is None or (default is None and value.lower() == "auto"):
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise SystemExit(f"specsplit: {name}={value!r} is not a boolean ({'/'.join(_TRUE + _FALSE)})")


def _env_name(flag: str, env: str | None = None) -> str:
    return "SPECSPLIT_" + (env or flag.removeprefix("--").replace("-", "_").upper())


def switch(parser: argparse.ArgumentParser, flag: str, default: bool | None, help: str) -> None:
    """--flag / --no-flag whose default is $SPECSPLIT_<FLAG> (a boolean) when set; a default of
    None is "auto" (the reader decides)."""
    name = _env_name(flag)
    shown = "auto" if default is None else "on" if default else "off"
    parser.add_argument(
        flag,
        action=argparse.BooleanOptionalAction,
        default=_env_bool(name, default),
        help=f"{help} (env {name}, default {shown})",
    )


def flag(
    parser: argparse.ArgumentParser,
    flag: str,
    default: Any,
    help: str,
    *,
    env: str | None = None,
    type: Callable[[str], Any] = str,
    **kwargs: Any,
) -> None:
    """--flag whose default is $SPECSPLIT_<FLAG> (or $SPECSPLIT_<env>) when set, parsed like a
    command-line value."""
    name = _env_name(flag, env)
    value = os.environ.get(name)
    if value is not None and "choices" in kwargs and type(value) not in kwargs["choices"]:
        raise SystemExit(f"specsplit: {name}={value!r}: choose from {kwargs['choices']}")
    shown = "none" if default is None else default
    help = f"{help} (env {name}, default {shown})"
    default = value if value is not None else default
    parser.add_argument(flag, type=type, default=default, help=help, **kwargs)


def optional_int(value: str) -> int | None:
    return None if value.lower() in ("", "none") else int(value)


def positive_int(value: str) -> int:
    """An integer >= 1 (a batch's size, a page's tokens: 0 would stall or break the service)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number}: want 1 or more")
    return number


def milliseconds(value: str) -> float:
    """A duration in milliseconds, finite and >= 0."""
    ms = float(value)
    if not 0 <= ms < math.inf:  # NaN too
        raise argparse.ArgumentTypeError(f"{value}: want milliseconds >= 0, finite")
    return ms


def optional_float(value: str) -> float | None:
    return None if value.lower() in ("", "none") else float(value)


def comma_separated(value: str, convert: Callable[[str], T], what: str) -> tuple[T, ...] | None:
    """A flag's comma-separated values (none: None); ArgumentTypeError naming `what`."""
    if value.lower() in ("", "none"):
        return None
    try:
        return tuple(convert(item) for item in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {value!r}") from None


def cpu_cores(value: str) -> frozenset[int] | None:
    """--cpu-cores: "30,31" (none: not pinned)."""
    cores = comma_separated(value, int, "comma-separated core numbers")
    if cores is not None and min(cores) < 0:
        raise argparse.ArgumentTypeError(f"core numbers are >= 0: {value!r}")
    return None if cores is None else frozenset(cores)


def optional_str(value: str) -> str | None:
    return None if value.lower() in ("", "none") else value
