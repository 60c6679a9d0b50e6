"""What `specsplit up` adds to its children for security: API keys for the gateway and, with
`--tls auto`, a throwaway local CA (specsplit.certs) in a private temporary directory, removed
when `up` stops: TLS on the gateway's client APIs, mutual TLS from the gateway to the drafter and
verifier. `up` itself checks health and runs `--generate` as the gateway's certificate holder.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from specsplit.certs import LocalPKI, make_local_pki
from specsplit.tls import TLSFiles

log = logging.getLogger("specsplit.up")


class UpSecurity:
    def __init__(self, api_keys: tuple[str, ...], max_concurrent_per_key: int, tls: str) -> None:
        self.api_keys = api_keys
        self.max_concurrent_per_key = max_concurrent_per_key
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.pki: LocalPKI | None = None
        if tls == "auto":
            self._tmp = tempfile.TemporaryDirectory(prefix="specsplit-tls-")
            self.pki = make_local_pki(Path(self._tmp.name))
            log.info("TLS: a throwaway CA for this run at %s (gone when up stops)", self.pki.ca)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> UpSecurity:
        return cls(tuple(args.api_key), args.max_concurrent_per_key, args.tls)

    def commands(self, commands: dict[str, list[str]]) -> dict[str, list[str]]:
        """The children's argv with the TLS files and the gateway's per-key limit."""
        extra: dict[str, list[str]] = {name: [] for name in commands}
        extra["gateway"] = ["--max-concurrent-per-key", str(self.max_concurrent_per_key)]
        if self.pki is not None:
            for name in ("verifier", "drafter"):
                extra[name] += _flags("--tls", self.pki.files(name))
            gateway = self.pki.files("gateway")
            extra["gateway"] += _flags("--tls", TLSFiles(gateway.cert, gateway.key))
            extra["gateway"] += _flags("--backend-tls", gateway)
        return {name: [*argv, *extra[name]] for name, argv in commands.items()}

    def envs(self, envs: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        """The gateway's keys travel in its environment (not in argv, which `ps` shows)."""
        if not self.api_keys:
            return envs
        gateway = {**envs.get("gateway", {}), "SPECSPLIT_API_KEY": ",".join(self.api_keys)}
        return {**envs, "gateway": gateway}

    def client_tls(self) -> TLSFiles | None:
        """How `up` reaches its children (health, --generate): the gateway's certificate."""
        return None if self.pki is None else self.pki.files("gateway")

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _flags(prefix: str, tls: TLSFiles) -> list[str]:
    pairs = (("-cert", tls.cert), ("-key", tls.key), ("-ca", tls.ca))
    return [arg for suffix, path in pairs if path for arg in (prefix + suffix, path)]
