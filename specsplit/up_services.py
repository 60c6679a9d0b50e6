"""`specsplit up`'s child processes: started in their own process group (and sent SIGTERM if
`up` dies), a drafter or verifier that exits restarted after a backoff (`RestartPolicy`), the
gateway's exit ending `up`, and stopped in order (the gateway first, so that it releases its
sequences on both services)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger("specsplit.up")
T = TypeVar("T")


def _die_with_parent() -> None:
    """In a child, before exec: get SIGTERM if `up` dies without stopping it (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Interrupted(Exception):
    """SIGINT / SIGTERM reached `up`."""


class ServiceDied(Exception):
    """A service process exited while `up` needed it."""


RESTARTED = ("drafter", "verifier")  # the gateway holds the clients' streams: its exit ends `up`
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # before a service's 1st, 2nd, ... restart
RESTART_WINDOW_S = 60.0


class RestartPolicy:
    """When `up` restarts a service that died: after a backoff that grows with the restarts it
    had in the last minute, and not at all once it had `max_per_minute` of them."""

    def __init__(
        self,
        max_per_minute: int = 5,
        backoff_s: tuple[float, ...] = RESTART_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_per_minute = max_per_minute
        self.backoff_s = backoff_s
        self.clock = clock
        self._restarts: dict[str, deque[float]] = defaultdict(deque)  # when, in the window

    def next_delay(self, name: str) -> float | None:
        """Seconds until `name` restarts (the restart is counted), or None: no more this minute."""
        now, recent = self.clock(), self._restarts[name]
        while recent and now - recent[0] > RESTART_WINDOW_S:
            recent.popleft()
        if len(recent) >= self.max_per_minute:
            return None
        recent.append(now)
        return self.backoff_s[min(len(recent), len(self.backoff_s)) - 1]


class Services:
    """The three child processes of `up`; a drafter or verifier that dies is started again
    (RestartPolicy), the gateway rides that out (DESIGN.md §4)."""

    def __init__(
        self,
        commands: dict[str, list[str]],
        envs: dict[str, dict[str, str]] | None = None,
        restarts: RestartPolicy | None = None,
    ) -> None:
        self.commands = commands
        self.envs = envs or {}
        self.restarts = restarts or RestartPolicy()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._restart_at: dict[str, float] = {}  # services that died: when they start again

    def start(self) -> None:
        for name in self.commands:
            self._start(name)

    def _start(self, name: str) -> None:
        # Their own process group: a terminal's Ctrl-C reaches `up` only, which stops them in
        # order; if `up` dies, the kernel sends them SIGTERM (Linux).
        linux = sys.platform.startswith("linux")
        env = {**os.environ, **self.envs.get(name, {})}
        proc = subprocess.Popen(
            self.commands[name],
            env=env,
            process_group=0,
            preexec_fn=_die_with_parent if linux else None,
        )
        self.procs[name] = proc
        log.info("started %s (pid %d)", name, proc.pid)

    async def supervise(self, work: Awaitable[T], stop: asyncio.Event) -> T:
        """Await `work` while tending the processes (`tend`): ServiceDied when the gateway
        exits or a service used up its restarts, Interrupted when `stop` is set first."""
        task = asyncio.ensure_future(work)
        stopping = asyncio.create_task(stop.wait())
        try:
            while not task.done():
                await asyncio.wait({task, stopping}, timeout=0.2, return_when="FIRST_COMPLETED")
                if stop.is_set():
                    raise Interrupted
                self.tend()
            return task.result()
        finally:
            for pending in (task, stopping):
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending

    def tend(self) -> None:
        """Schedule a restart of a drafter or verifier that exited (after its backoff) and
        start those whose time has come. ServiceDied for the gateway, or for a service that had
        its restarts for this minute."""
        now = time.monotonic()
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is None or name in self._restart_at:
                continue
            if name not in RESTARTED:
                raise ServiceDied(f"{name} exited with {code}")
            delay = self.restarts.next_delay(name)
            if delay is None:
                limit = self.restarts.max_per_minute
                raise ServiceDied(f"{name} exited with {code} after {limit} restarts in a minute")
            log.warning("%s exited with %d: restarting it in %.1f s", name, code, delay)
            self._restart_at[name] = now + delay
        for name, at in list(self._restart_at.items()):
            if now >= at:
                del self._restart_at[name]
                self._start(name)

    def stop(self, timeout: float) -> int:
        """SIGTERM the gateway and let it finish (it releases its sequences on both services),
        then the drafter and verifier; SIGKILL what is left after `timeout`. 1 if one failed."""
        deadline = time.monotonic() + timeout
        worst = 0
        for stage in (("gateway",), ("drafter", "verifier")):
            procs = {n: self.procs[n] for n in stage if n in self.procs}
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for name, proc in procs.items():
                try:
                    code = proc.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s: killing it", name, timeout)
                    proc.kill()
                    code = proc.wait()
                if code not in (0, -signal.SIGTERM):  # -SIGTERM: stopped before it could catch it
                    log.warning("%s exited with %d", name, code)
                    worst = 1
        return worst
