"""A throwaway local CA and certificates for `specsplit up --tls auto` (and tests).

One run of `up` makes a CA (its key never touches the disk), a server certificate for the
verifier and the drafter, and one for the gateway that is also its client certificate towards
them (mutual TLS). Every certificate names localhost, 127.0.0.1, ::1 and the hosts asked for.
Keys are ECDSA P-256: quick to make, and accepted by gRPC's BoringSSL and Python's ssl.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from specsplit.tls import TLSFiles

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
VALID_FOR = datetime.timedelta(days=7)  # a local run's certificates: short-lived on purpose


@dataclass(frozen=True)
class LocalPKI:
    """Where the files of a local CA's certificates are."""

    directory: Path

    @property
    def ca(self) -> str:
        return str(self.directory / "ca.pem")

    def files(self, name: str, *, trust: bool = True) -> TLSFiles:
        """`name`'s certificate and key, and the CA (trust=True) to check its peer with."""
        return TLSFiles(
            cert=str(self.directory / f"{name}.pem"),
            key=str(self.directory / f"{name}.key"),
            ca=self.ca if trust else None,
        )


def make_local_pki(
    directory: Path,
    *,
    servers: Iterable[str] = ("verifier", "drafter"),
    clients: Iterable[str] = ("gateway",),
    hosts: Iterable[str] = (),
) -> LocalPKI:
    """Write ca.pem and NAME.pem + NAME.key for every server (serverAuth) and client (both
    serverAuth and clientAuth: the gateway serves its clients too) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("specsplit local CA")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    (directory / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    names = list(dict.fromkeys([*LOCAL_HOSTS, *hosts]))
    client_names = set(clients)
    for name in [*servers, *client_names]:
        usages = [ExtendedKeyUsageOID.SERVER_AUTH]
        if name in client_names:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _builder(_name(f"specsplit {name}"), ca_name, key.public_key(), now)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(_alt_names(names)), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path = directory / f"{name}.key"
        key_path.touch(mode=0o600)
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return LocalPKI(directory)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a little clock skew
        .not_valid_after(now + VALID_FOR)
    )


def _alt_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(host))
    return names
