"""What one streamed chunk's write costs the gateway's event loop: a grpc.aio server streams
`--chunks` GenerateResponse messages (16 token ids and their text, as a round of 16 decode
steps gives one stream) to a client in another process, one every `--every-ms` (as rounds
come), and times each `await context.write(...)`; then the same back to back.

    PYTHONPATH=. python bench/grpc_write.py [--chunks 300] [--every-ms 4]

Prints the median and p90 wall time of a write and the server process's CPU time per write
(the event loop's and gRPC's threads', the paced loop's own wake-ups included). At 32 streams
the gateway writes 32 chunks a round: they stay off a round's path only while they finish
before the verifier answers.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import grpc

from specsplit.v1 import gateway_pb2, gateway_pb2_grpc

CLIENT = """
import sys, grpc
from specsplit.v1 import gateway_pb2, gateway_pb2_grpc
stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(sys.argv[1]))
for _ in range(2):  # paced, then back to back
    sum(1 for _ in stub.Generate(gateway_pb2.GenerateRequest(text="x")))
"""


def chunk(i: int) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        token_ids=list(range(1000, 1016)), text=" word" * 16, elapsed_ns=i
    )


class Streamer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, chunks: int, every_s: float) -> None:
        self.chunks, self.every_s = chunks, every_s
        self.results: list[tuple[str, list[float], float]] = []

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        paced = not self.results
        walls = []
        cpu0 = time.process_time()
        for i in range(self.chunks):
            if paced:
                await asyncio.sleep(self.every_s)
            start = time.perf_counter()
            await context.write(chunk(i))
            walls.append(time.perf_counter() - start)
        cpu = (time.process_time() - cpu0) / self.chunks
        kind = f"one every {self.every_s * 1e3:g} ms" if paced else "back to back"
        self.results.append((kind, walls, cpu))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, default=300)
    parser.add_argument("--every-ms", type=float, default=4.0)
    args = parser.parse_args()
    streamer = Streamer(args.chunks, args.every_ms / 1e3)
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(streamer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{port}"])
    while client.poll() is None:
        await asyncio.sleep(0.05)
    await server.stop(0)
    if client.returncode:
        raise SystemExit(f"the client failed ({client.returncode})")
    for kind, walls, cpu in streamer.results:
        walls.sort()
        p90 = walls[int(0.9 * (len(walls) - 1))]
        print(
            f"{kind}: write median {statistics.median(walls) * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us"
            f" wall; process CPU {cpu * 1e6:.0f} us a write"
        )


if __name__ == "__main__":
    asyncio.run(main())
