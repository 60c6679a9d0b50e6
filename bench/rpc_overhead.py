"""What one Verify round costs beyond the verifier's engine time, measured exactly per round (no
histogram buckets), and how that splits between the gateway's client, the transport and the
service.

Starts the real verifier service (`specsplit serve-verifier`, another process) and drives
decode rounds on it (one sequence: a prefill, then one token per round, no drafts):

- `client`: the gateway's own `GrpcVerifierClient.verify` (protobuf conversions, trace context,
  metrics, the round stream) — what the scheduler pays per round;
- `stub`: the same requests written to a bare stream of the generated stub, the messages built
  once — the client's own work taken out;
- `echo`: a bare aio servicer in another process answering every request at once — gRPC's
  transport alone (no engine, no servicer code); and again holding its event loop
  --echo-block-ms per request before answering (spinning, as an engine call on the loop's thread
  holds it): what holding the loop adds to the transport.

The service reports its engine time per response (`verify_ns`); "beyond engine" is the round's
wall time less that. A round's engine time is the verifier thread's whole call (the forward,
acceptance, commit). --transport unix serves the verifier and the echo child on Unix sockets in
a private temporary directory (what `specsplit up` does by default) instead of TCP loopback;
there the gateway's client takes the verifier's round lane (specsplit.lane), measured beside the
same client on gRPC, and the echo child answers on a lane too (frames alone).

    PYTHONPATH=. python bench/rpc_overhead.py --model /tmp/tiny_target [--rounds 400]
        [--device cpu] [--transport tcp|unix] [--address 127.0.0.1:50391]
        [--verifier-arg=--engine-calls=loop]

Without --model only the echo rows are measured (no context limit: --rounds 5000 is fine; a
tiny model's 512 positions allow ~450 rounds of the verifier's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import grpc

from gateway.grpc_clients import GrpcVerifierClient, wait_ready
from specsplit import rounds
from specsplit.lane import LaneConnection, LaneServer, lane_path
from specsplit.lane_frames import Buffer, Kind
from specsplit.messages import VerifyInput
from specsplit.scopes import ConnectionScopes
from specsplit.tree import DraftTree
from specsplit.up import LANE_POLL_MS_ON_GPU
from specsplit.v1 import verifier_pb2, verifier_pb2_grpc

PROMPT = list(range(10, 42))  # 32 tokens
TCP_ADDRESSES = ("127.0.0.1:50391", "127.0.0.1:50392")  # the verifier's, the echo child's


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="the verifier's checkpoint; none = the echo rows alone")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--transport", default="tcp", choices=("tcp", "unix"))
    parser.add_argument("--address", default=None, help="the verifier's; default: by --transport")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument(
        "--verifier-arg",
        action="append",
        default=[],
        help="one more serve-verifier argument, repeatable (e.g. --verifier-arg=--engine-calls=loop"
        " on a CPU, so that its engine calls run on the loop's thread as on a GPU)",
    )
    parser.add_argument("--echo", action="store_true", help=argparse.SUPPRESS)  # the echo child
    parser.add_argument(
        "--echo-block-ms",
        type=float,
        default=1.5,
        help="a second echo run whose servicer holds its event loop this long per request",
    )
    return parser.parse_args()


class Echo(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, block_s: float) -> None:
        self.block_s = block_s

    def answer(self) -> verifier_pb2.VerifyResponse:
        """After holding the event loop `block_s` (spinning, as an engine call on the loop's
        thread holds it), the response."""
        end = time.perf_counter() + self.block_s
        while time.perf_counter() < end:
            pass
        return verifier_pb2.VerifyResponse(verify_ns=int(self.block_s * 1e9))

    async def VerifyStream(self, request_iterator, context):  # type: ignore[no-untyped-def]
        async for _ in request_iterator:
            yield self.answer()


class LaneEcho:
    """An echo on a round lane (specsplit.lane): every round answered with `answer()`, a
    message and the bytes of rows beside it (here the Unix-socket echo's, no rows;
    bench/lane_rows.py's a Verify answer's rows). Nothing is held, so a connection's scope goes
    as the connection does (no orphan grace)."""

    name = "echo"

    def __init__(self, answer: Callable[[], tuple[verifier_pb2.VerifyResponse, Buffer]]) -> None:
        self.answer = answer

        async def free(_select: object) -> int:
            return 0

        self.scopes = ConnectionScopes(free, orphan_grace_s=0.0)

    async def round_in(
        self, scope: object, request: object, beside: object = None, received_ns: object = None
    ) -> tuple[verifier_pb2.VerifyResponse, Buffer]:
        return self.answer()

    async def release_in(self, scope: object, request: object) -> None:
        raise NotImplementedError

    async def truncate_in(self, scope: object, request: object) -> None:
        raise NotImplementedError


async def serve_echo(address: str, block_s: float) -> None:
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(Echo(block_s), server)
    server.add_insecure_port(address)
    await server.start()
    path = lane_path(address)
    if path is not None:
        answer = Echo(block_s).answer
        echo = LaneEcho(lambda: (answer(), b""))
        await LaneServer(echo, path, verifier_pb2.VerifyRequest).start()  # type: ignore[arg-type]
    await server.wait_for_termination()


def addresses(args: argparse.Namespace, socket_dir: str) -> tuple[str, str]:
    """The verifier's and the echo child's addresses: by --transport, or next to --address."""
    if args.address is None:
        if args.transport == "tcp":
            return TCP_ADDRESSES
        return f"unix:{socket_dir}/verifier.sock", f"unix:{socket_dir}/echo.sock"
    unix = args.address.startswith("unix:")
    return args.address, args.address + ".echo" if unix else TCP_ADDRESSES[1]


def decode_input(seq_id: str, committed: int, pending: list[int]) -> VerifyInput:
    return VerifyInput(
        seq_id=seq_id,
        begin=committed == 0,
        kv_committed_len=committed,
        pending_tokens=pending,
        tree=DraftTree(),
    )


def summary(name: str, beyond: list[float], engine: list[float]) -> str:
    """The row of one path (printed at once too: a later path's failure keeps it)."""
    beyond, engine = sorted(beyond), sorted(engine)
    p50 = statistics.median(beyond) * 1e6
    p99 = beyond[int(0.99 * (len(beyond) - 1))] * 1e6
    eng = statistics.median(engine) * 1e6
    row = f"| {name} | {p50:.0f} | {p99:.0f} | {eng:.0f} | {len(beyond)} |"
    print(row, flush=True)
    return row


async def run_client(
    address: str, n: int, warmup: int, seq_id: str, round_lane: bool = True, spin: bool = True
) -> tuple[list, list]:
    """Rounds through the gateway's client (on the round lane when `address` is a Unix socket
    and `round_lane`; its loop polling for the answer as `up` on a GPU has it unless not
    `spin`); (beyond-engine
    seconds, engine seconds)."""
    poll_s = LANE_POLL_MS_ON_GPU / 1e3 if spin else 0.0
    client = GrpcVerifierClient(address, round_lane=round_lane, lane_poll_s=poll_s)
    try:
        (out,) = await client.verify([decode_input(seq_id, 0, PROMPT)])
        committed, token = out.kv_committed_len, out.bonus_token
        beyond, engine = [], []
        for i in range(n + warmup):
            start = time.perf_counter()
            (out,) = await client.verify([decode_input(seq_id, committed, [token])])
            wall = time.perf_counter() - start
            committed, token = out.kv_committed_len, out.bonus_token
            if i >= warmup:
                beyond.append(wall - client.last_engine_seconds)
                engine.append(client.last_engine_seconds)
        await client.release([seq_id])
        return beyond, engine
    finally:
        await client.close()


async def run_stub(address: str, n: int, warmup: int, seq_id: str) -> tuple[list, list]:
    """The same rounds on a bare stream: requests converted before the clock starts."""
    channel = grpc.aio.insecure_channel(address)
    call = verifier_pb2_grpc.VerifierStub(channel).VerifyStream()
    try:
        await call.write(rounds.VERIFY.request_to_proto([decode_input(seq_id, 0, PROMPT)], None))
        (out,) = rounds.VERIFY.response_from_proto(await call.read(), None)
        committed, token = out.kv_committed_len, out.bonus_token
        beyond, engine = [], []
        for i in range(n + warmup):
            request = rounds.VERIFY.request_to_proto(
                [decode_input(seq_id, committed, [token])], None
            )
            start = time.perf_counter()
            await call.write(request)
            response = await call.read()
            wall = time.perf_counter() - start
            (out,) = rounds.VERIFY.response_from_proto(response, None)
            committed, token = out.kv_committed_len, out.bonus_token
            if i >= warmup:
                engine_s = rounds.VERIFY.engine_ns(response) / 1e9
                beyond.append(wall - engine_s)
                engine.append(engine_s)
        return beyond, engine
    finally:
        call.cancel()
        await channel.close()


async def run_echo(address: str, n: int, warmup: int) -> tuple[list, list]:
    channel = grpc.aio.insecure_channel(address)
    await asyncio.wait_for(channel.channel_ready(), 120)  # the echo child still importing
    call = verifier_pb2_grpc.VerifierStub(channel).VerifyStream()
    request = rounds.VERIFY.request_to_proto([decode_input("a", 33, [7])], None)
    beyond, engine = [], []
    for i in range(n + warmup):
        start = time.perf_counter()
        await call.write(request)
        response = await call.read()
        if i >= warmup:
            held = rounds.VERIFY.engine_ns(response) / 1e9
            beyond.append(time.perf_counter() - start - held)
            engine.append(held)
    call.cancel()
    await channel.close()
    return beyond, engine


async def run_lane_echo(address: str, n: int, warmup: int, spin: bool) -> tuple[list, list]:
    """The echo child's round lane (after run_echo: the child is up): frames alone."""
    path = lane_path(address)
    assert path is not None
    lane = LaneConnection("echo", path, LANE_POLL_MS_ON_GPU / 1e3 if spin else 0.0)
    body = rounds.VERIFY.request_to_proto([decode_input("a", 33, [7])], None).SerializeToString()
    beyond, engine = [], []
    for i in range(n + warmup):
        start = time.perf_counter()
        answer = await lane.request(Kind.ROUND, body)
        response = verifier_pb2.VerifyResponse.FromString(answer.body)
        if i >= warmup:
            held = response.verify_ns / 1e9
            beyond.append(time.perf_counter() - start - held)
            engine.append(held)
    lane.close()
    return beyond, engine


def start(argv: list[str]) -> subprocess.Popen[bytes]:
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, *argv], env=env)


async def main() -> None:
    args = parse_args()
    if args.echo:
        await serve_echo(args.address, args.echo_block_ms / 1e3)
        return
    with tempfile.TemporaryDirectory(prefix="rpc-overhead-") as socket_dir:
        await measure(args, *addresses(args, socket_dir))


async def measure(args: argparse.Namespace, address: str, echo_address: str) -> None:
    rows = [] if args.model is None else await verifier_rows(args, address)
    for block_ms in sorted({0.0, args.echo_block_ms}):
        echo = start(
            [__file__, "--echo", "--address", echo_address, "--echo-block-ms", str(block_ms)]
        )
        name = "echo (transport only)" if not block_ms else f"echo, loop held {block_ms} ms"
        try:
            rows.append(summary(name, *await run_echo(echo_address, args.rounds, args.warmup)))
            if lane_path(echo_address) is not None:
                for spin in (True, False):
                    lane = await run_lane_echo(echo_address, args.rounds, args.warmup, spin)
                    polling = "" if spin else ", no polling"
                    rows.append(summary(f"{name}, round lane{polling}", *lane))
        finally:
            echo.kill()
            echo.wait()
    print(f"\nVerify rounds, batch 1 decode, {args.device}, {address}")
    print("| path | beyond engine p50 us | p99 us | engine p50 us | rounds |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


async def verifier_rows(args: argparse.Namespace, address: str) -> list[str]:
    """The rows of the real verifier (a serve-verifier child on `address`)."""
    verifier = start(
        [
            "-m",
            "specsplit.cli",
            "--log-level",
            "warning",
            "serve-verifier",
            "--listen",
            address,
            "--model",
            args.model,
            "--device",
            args.device,
            "--metrics-listen",
            "none",
            *args.verifier_arg,
        ]
    )
    n, warmup = args.rounds, args.warmup
    rows = []
    try:
        if not await wait_ready(address, 300):
            raise SystemExit("the verifier did not become ready")
        lane = lane_path(address) is not None
        client = "gateway client, round lane" if lane else "gateway client"
        rows.append(summary(client, *await run_client(address, n, warmup, "c")))
        if lane:
            no_spin = await run_client(address, n, warmup, "n", spin=False)
            rows.append(summary(f"{client}, no polling", *no_spin))
            grpc_only = await run_client(address, n, warmup, "g", round_lane=False)
            rows.append(summary("gateway client, gRPC", *grpc_only))
        rows.append(summary("bare stub", *await run_stub(address, n, warmup, "s")))
        again = await run_client(address, n, warmup, "c2")
        rows.append(summary(f"{client} (again)", *again))
    finally:
        verifier.terminate()
        verifier.wait()
    return rows


if __name__ == "__main__":
    asyncio.run(main())
