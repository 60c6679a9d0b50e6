"""TLS for every link (DESIGN.md §8): PEM files in, gRPC / ssl credentials out.

    client API (gateway)        TLS: the gateway's certificate; clients authenticate with API keys
    gateway -> drafter/verifier mutual TLS: each side's certificate checked against the CA

`TLSFiles()` (no files) is plaintext, for local development. The drafter and the verifier only
serve mutual TLS: with a certificate they need a CA, and accept only clients holding a
certificate it issued (the gateway's).
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of one side of a link; all None = plaintext."""

    cert: str | None = None  # certificate chain this side presents
    key: str | None = None  # its private key
    ca: str | None = None  # CA bundle the peer's certificate must chain to

    @property
    def enabled(self) -> bool:
        return any((self.cert, self.key, self.ca))

    def check(self, what: str, *, require_ca: bool = False, require_cert: bool = True) -> None:
        """Raise ValueError when the files cannot make the credentials `what` needs."""
        if not self.enabled:
            return
        if bool(self.cert) != bool(self.key):
            raise ValueError(f"{what}: a TLS certificate and its key go together")
        if require_cert and not self.cert:
            raise ValueError(f"{what}: TLS needs a certificate and key")
        if require_ca and not self.ca:
            raise ValueError(f"{what}: mutual TLS needs the CA that issues client certificates")
        for path in (self.cert, self.key, self.ca):
            if path and not Path(path).is_file():
                raise ValueError(f"{what}: {path} is not a file")


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def server_credentials(tls: TLSFiles, *, mutual: bool) -> grpc.ServerCredentials:
    """A gRPC server's credentials; mutual = a client certificate from `tls.ca` is required."""
    tls.check("server", require_ca=mutual)
    assert tls.cert is not None and tls.key is not None
    pair = (Path(tls.key).read_bytes(), Path(tls.cert).read_bytes())
    return grpc.ssl_server_credentials(
        [pair], root_certificates=_read(tls.ca) if mutual else None, require_client_auth=mutual
    )


def channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    """A client's credentials: trust `tls.ca` (None = the system's roots), present `tls.cert`
    when set (mutual TLS)."""
    tls.check("client", require_cert=False)
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca),
        private_key=_read(tls.key),
        certificate_chain=_read(tls.cert),
    )


def add_port(server: grpc.aio.Server, address: str, tls: TLSFiles, *, mutual: bool) -> int:
    """Bind `address` plaintext (no files) or with TLS; returns the port (0 = failed)."""
    if not tls.enabled:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls, mutual=mutual))


def channel(
    address: str, tls: TLSFiles, options: Sequence[tuple[str, int | str]] = ()
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address`: plaintext, or TLS with `tls`'s credentials."""
    if not tls.enabled:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=list(options))


def http_ssl_context(tls: TLSFiles) -> ssl.SSLContext | None:
    """An HTTPS server context for the gateway's HTTP API (None = plain HTTP)."""
    if not tls.enabled:
        return None
    tls.check("HTTP")
    assert tls.cert is not None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert, tls.key)
    return context
