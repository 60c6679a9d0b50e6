"""Where a service's threads run: `specsplit up --cpu-affinity on` gives each of its three
processes cores of its own, and each service pins every thread of it to them once loaded
(`--cpu-cores`, `specsplit.server.ServiceHost`). Off by default: on two H200s, batch-1 rounds
through the services ran alike pinned and not, alternating runs (bench/RESULTS.md,
forty-fourth session); one earlier run each (25-47% shorter host phases pinned) came first on a
fresh machine and measured the machine warming up."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

log = logging.getLogger(__name__)

CORES_PER_SERVICE = 2  # a service's main thread (engine calls, its event loop) and the rest


def affinity_plan(
    available: Sequence[int], names: Sequence[str], per_service: int = CORES_PER_SERVICE
) -> dict[str, set[int]]:
    """Disjoint cores for each of `names`, `per_service` each, from the top of `available`
    (the low cores take most interrupts), in the order named; {} when that would leave fewer
    than two cores for the rest of the machine."""
    cores = sorted(available, reverse=True)
    if len(cores) < per_service * len(names) + 2:
        return {}
    return {
        name: set(cores[i * per_service : (i + 1) * per_service]) for i, name in enumerate(names)
    }


def pin_to_cores(cores: frozenset[int]) -> None:
    """Every thread of this process on `cores` only (Linux; threads started later inherit
    their starter's); a warning where the OS refuses (cores outside a container's cpuset)."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, cores)
    except (OSError, AttributeError, ValueError) as err:
        log.warning("not pinned to cores %s: %s", sorted(cores), err)
        return
    log.info("%d threads pinned to cores %s", len(threads), sorted(cores))
