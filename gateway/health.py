"""A backend's health as the gateway reads it (the gRPC health service's answer, or none)."""

from __future__ import annotations

import enum


class Health(enum.Enum):
    SERVING = "SERVING"
    LOADING = "LOADING"  # answers NOT_SERVING: starting, loading or warming up its model
    DOWN = "DOWN"  # does not answer
