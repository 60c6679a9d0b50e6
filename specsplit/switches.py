"""On / off switches read from the environment."""

from __future__ import annotations

import os


def env_switch(name: str, default: bool = True) -> bool:
    """$name as "1" (on) or "0" (off), `default` where unset; any other value exits."""
    value = os.environ.get(name, "1" if default else "0")
    if value not in ("0", "1"):
        raise SystemExit(f"{name}={value!r}: 0 or 1")
    return value == "1"
