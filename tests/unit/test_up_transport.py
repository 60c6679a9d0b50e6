"""`specsplit up`'s internal links on Unix sockets: where the children listen (Unix sockets in a
private directory unless --internal-transport tcp or --tls auto), the directory gone when `up`
is, and the drafter and verifier serving a real round to the gateway's clients over them."""

from __future__ import annotations

import asyncio
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from drafter.engine import DrafterEngine
from drafter.servicer import DrafterServicer
from gateway.grpc_clients import GrpcDrafterClient, GrpcVerifierClient, wait_ready
from specsplit import cli, up
from specsplit.messages import DraftInput, SpecParams, VerifyInput
from specsplit.server import ServiceHost
from tests.support import save_tiny_llama
from verifier.engine import VerifierEngine
from verifier.servicer import VerifierServicer

PROMPT = [5, 6, 7, 8] * 4  # n-gram lookup: 8 was followed by 5, 6, 7
TCP = {"gateway": "127.0.0.1:50051", "drafter": "127.0.0.1:50061", "verifier": "127.0.0.1:50062"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SPECSPLIT_* variable of the developer's shell leaks into a test."""
    import os

    for name in list(os.environ):
        if name.startswith("SPECSPLIT_"):
            monkeypatch.delenv(name)


def _child_args(argv: list[str]) -> Any:
    assert argv[:3] == [sys.executable, "-m", "specsplit.cli"]
    return cli.parse_args(argv[3:])


def test_up_puts_drafter_and_verifier_on_unix_sockets_in_a_private_directory_removed_on_exit() -> (
    None
):
    args = cli.parse_args(["up"])
    with up.service_addresses(args) as addresses:
        socket_dir = Path(addresses["drafter"].removeprefix("unix:")).parent
        assert addresses == {
            "gateway": TCP["gateway"],
            "drafter": f"unix:{socket_dir}/drafter.sock",
            "verifier": f"unix:{socket_dir}/verifier.sock",
        }
        assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700
        commands = up.child_commands(args, addresses)
        children = {name: _child_args(argv) for name, argv in commands.items()}
        assert children["drafter"].listen == addresses["drafter"]
        assert children["verifier"].listen == addresses["verifier"]
        gateway = children["gateway"]
        assert gateway.listen == TCP["gateway"]
        assert (gateway.drafter_address, gateway.verifier_address) == (
            addresses["drafter"],
            addresses["verifier"],
        )
    assert not socket_dir.exists()


@pytest.mark.parametrize(
    "argv", [["up", "--internal-transport", "tcp"], ["up", "--tls", "auto"]], ids=["tcp", "tls"]
)
def test_up_keeps_tcp_loopback_with_the_opt_out_and_with_tls(argv: list[str]) -> None:
    with up.service_addresses(cli.parse_args(argv)) as addresses:
        assert addresses == TCP


def test_logged_addresses_reads_back_the_last_address_up_logged_for_each_service() -> None:
    log = (
        "INFO specsplit.up: drafter listens on unix:/tmp/a/drafter.sock\n"
        "INFO specsplit.up: verifier listens on unix:/tmp/a/verifier.sock\n"
        "INFO specsplit.v1.Drafter listening on unix:/tmp/a/drafter.sock (plaintext)\n"
    )
    assert up.logged_addresses(log) == {
        "drafter": "unix:/tmp/a/drafter.sock",
        "verifier": "unix:/tmp/a/verifier.sock",
    }


def test_drafter_and_verifier_on_unix_sockets_serve_a_round_to_the_gateway_clients(
    tmp_path: Path,
) -> None:
    target = save_tiny_llama(tmp_path / "target", seed=3)
    addresses = {name: f"unix:{tmp_path}/{name}.sock" for name in up.INTERNAL}
    # a socket file left by a service that was killed (`up` restarts it on the same path)
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(addresses["verifier"].removeprefix("unix:"))

    async def run() -> None:
        hosts = [
            ServiceHost(
                DrafterServicer(lambda: DrafterEngine.load("ngram", None)),
                addresses["drafter"],
                grace=0.1,
            ),
            ServiceHost(
                VerifierServicer(lambda: VerifierEngine.load(str(target), num_pages=64)),
                addresses["verifier"],
                grace=0.1,
            ),
        ]
        drafter = GrpcDrafterClient(addresses["drafter"])
        verifier = GrpcVerifierClient(addresses["verifier"])
        try:
            for host in hosts:
                await host.start()
                await host.load()
            ready = [wait_ready(address, 10) for address in addresses.values()]
            assert await asyncio.gather(*ready) == [True, True]
            (draft,) = await drafter.draft([DraftInput("s", True, 0, PROMPT, SpecParams(3, 1, 3))])
            assert draft.tree.tokens == [5, 6, 7]
            verify_input = VerifyInput("s", True, 0, PROMPT, draft.tree)
            (out,) = await verifier.verify([verify_input])
            await verifier.release(["s"])
            await drafter.release(["s"])
        finally:
            for client in (drafter, verifier):
                await client.close()
            for host in hosts:
                await host.stop()
        engine = VerifierEngine.load(str(target), num_pages=64)
        (expected,) = engine.verify([verify_input])
        engine.release(["s"])
        assert (out.accepted_tokens, out.bonus_token) == (
            expected.accepted_tokens,
            expected.bonus_token,
        )
        assert out.kv_committed_len == len(PROMPT) + out.num_accepted_drafts

    asyncio.run(run())
