"""Security flags of the `specsplit` command line: API keys from flags or the environment, TLS
files per service, and what `specsplit up` hands its children (gateway/auth.py, specsplit/tls.py,
specsplit/up_security.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from specsplit import cli, cli_server_flags, up
from specsplit.up_security import UpSecurity


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SPECSPLIT_"):
            monkeypatch.delenv(name)


def test_gateway_api_keys_from_repeated_flags_or_comma_separated_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert cli.parse_args(["serve-gateway"]).api_key == ()  # open
    args = cli.parse_args(["serve-gateway", "--api-key", "a", "--api-key", "b"])
    assert args.api_key == ("a", "b") and args.max_concurrent_per_key == 0
    monkeypatch.setenv("SPECSPLIT_API_KEY", "k1, k2")
    monkeypatch.setenv("SPECSPLIT_MAX_CONCURRENT_PER_KEY", "4")
    args = cli.parse_args(["serve-gateway"])
    assert args.api_key == ("k1", "k2") and args.max_concurrent_per_key == 4
    assert cli.parse_args(["generate", "hi"]).api_key == ("k1", "k2")  # sends the first
    assert cli.parse_args(["serve-gateway", "--api-key", "x"]).api_key == ("x",)


def test_a_service_certificate_needs_its_key_and_the_drafter_and_verifier_need_the_client_ca(
    tmp_path: Path,
) -> None:
    files = {}
    for name in ("cert.pem", "key.pem", "ca.pem"):
        files[name] = tmp_path / name
        files[name].write_text("-")
    cert = ["--tls-cert", str(files["cert.pem"]), "--tls-key", str(files["key.pem"])]
    for service in ("serve-verifier", "serve-drafter"):
        with pytest.raises(SystemExit):  # mutual TLS only: the clients' CA is required
            cli.parse_args([service, *cert])
        args = cli.parse_args([service, *cert, "--tls-ca", str(files["ca.pem"])])
        assert cli_server_flags.tls_files(args).ca == str(files["ca.pem"])
    gateway = cli.parse_args(["serve-gateway", *cert])
    assert cli_server_flags.tls_files(gateway).cert == str(files["cert.pem"])
    with pytest.raises(SystemExit):
        cli.parse_args(["serve-gateway", "--tls-cert", str(files["cert.pem"])])  # no key
    with pytest.raises(SystemExit):
        cli.parse_args(["serve-gateway", "--backend-tls-ca", str(tmp_path / "missing.pem")])


def test_up_tls_auto_gives_every_child_tls_files_and_the_gateway_its_keys_in_the_environment() -> (
    None
):
    args = cli.parse_args(
        ["up", "--tls", "auto", "--api-key", "secret", "--max-concurrent-per-key", "2"]
    )
    security = UpSecurity.from_args(args)
    pki = security.pki
    assert pki is not None
    try:
        commands = security.commands(up.child_commands(args))
        children = {name: cli.parse_args(argv[3:]) for name, argv in commands.items()}
        assert all(
            argv[:3] == [sys.executable, "-m", "specsplit.cli"] for argv in commands.values()
        )
        for name in ("verifier", "drafter"):
            tls = cli_server_flags.tls_files(children[name])
            assert tls.cert and tls.key and tls.ca == pki.ca
        gateway = children["gateway"]
        assert (
            cli_server_flags.tls_files(gateway).cert
            and cli_server_flags.tls_files(gateway).ca is None
        )
        backend = cli_server_flags.tls_files(gateway, "backend_tls")
        assert backend.cert == cli_server_flags.tls_files(gateway).cert and backend.ca == pki.ca
        assert gateway.max_concurrent_per_key == 2
        assert all("secret" not in argv for argv in commands.values())  # `ps` shows argv
        envs = security.envs(up.child_envs(args))
        assert envs["gateway"]["SPECSPLIT_API_KEY"] == "secret"
        assert "SPECSPLIT_API_KEY" not in envs["verifier"]
        assert security.client_tls() == pki.files("gateway")
    finally:
        security.close()
    assert not pki.directory.exists()  # the throwaway CA is gone with `up`
    plain = UpSecurity.from_args(cli.parse_args(["up"]))
    assert plain.pki is None and plain.client_tls() is None
    assert plain.commands({"gateway": ["g"]}) == {"gateway": ["g", "--max-concurrent-per-key", "0"]}
