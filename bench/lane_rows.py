"""What a round's feature rows cost on one hop of the round lane: a Verify answer of --batch
sequences x --rows rows of --width (bf16) built and serialized, sent through a real `LaneServer`
and `LaneConnection` over a Unix socket (an echo service builds and serializes it each round
and answers with it), then parsed and converted back. Median us per round over --rounds rounds
after --warmup. No engine, no GPU: the host's copies of the rows alone (the issue-8 split; an
8B target's EAGLE-3 head reads 12288-wide rows, SmolLM2's shipped head 1728). --mode beside:
the rows beside the message (wire_tensors.Beside, as the lane sends them); in: in the message's
tensor field (as gRPC sends them). --echo-process: the echo serves from another process (as the
services do: each end's own event loop and core), not on the client's loop.

Multi-MB figures depend on glibc's malloc state: a buffer above its mmap threshold is fresh
pages each time (page faults), and the threshold moves with what the process allocated and
freed before (what it imported, too). With MALLOC_MMAP_THRESHOLD_=67108864 the 3 MB row's
copies cost ~5x less on the 2-core VM (bench/RESULTS.md); compare runs under one setting.

    PYTHONPATH=. python bench/lane_rows.py [--width 12288 1728 0] [--batch 32] [--rows 4]
        [--mode beside in] [--echo-process]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.rpc_overhead import LaneEcho
from specsplit import convert, wire_tensors
from specsplit.lane import LaneConnection, LaneServer
from specsplit.lane_frames import Buffer, Kind
from specsplit.messages import VerifyOutput
from specsplit.v1 import verifier_pb2


def answer_of(batch: int, rows: int, width: int) -> list[VerifyOutput]:
    """A chain-3 round's outputs, `rows` feature rows a sequence (none when width is 0)."""
    hidden = torch.randn(batch * rows, max(width, 1)).to(torch.bfloat16).split(rows)
    return [
        VerifyOutput(f"seq-{i:032x}", [1, 2, 3], 5, 300, hidden[i] if width else None)
        for i in range(batch)
    ]


def build(outputs: list[VerifyOutput], beside: bool) -> tuple[verifier_pb2.VerifyResponse, Buffer]:
    """The answer's message and its rows' bytes beside it (none unless `beside`)."""
    rows = wire_tensors.Beside() if beside else None
    message = convert.verify_response_to_proto(outputs, 1, rows)
    return message, b"" if rows is None else rows.data()


def echo_server(outputs: list[VerifyOutput], beside: bool, path: str) -> LaneServer:
    return LaneServer(LaneEcho(lambda: build(outputs, beside)), path, verifier_pb2.VerifyRequest)  # type: ignore[arg-type]


def serve_forever(outputs: list[VerifyOutput], beside: bool, path: str) -> None:
    """The echo in a process of its own (--echo-process), until it is terminated."""

    async def serve() -> None:
        await echo_server(outputs, beside, path).start()
        await asyncio.Event().wait()

    asyncio.run(serve())


async def measure(
    outputs: list[VerifyOutput], beside: bool, rounds: int, warmup: int, process: bool
) -> dict[str, float]:
    """Median us: the answer built + serialized; the lane's round trip (a small request out, the
    echo's answer built and serialized on its side and back); the answer parsed + converted."""
    path = str(Path(tempfile.mkdtemp()) / "echo.sock")
    server, child = None, None
    if process:
        child = multiprocessing.get_context("fork").Process(
            target=serve_forever, args=(outputs, beside, path), daemon=True
        )
        child.start()
        while not os.path.exists(path):
            await asyncio.sleep(0.01)
    else:
        server = echo_server(outputs, beside, path)
        await server.start()
    lane = LaneConnection("echo", path)
    request = verifier_pb2.VerifyRequest().SerializeToString()  # the echo does not read it
    times: dict[str, list[float]] = {"build": [], "trip": [], "read": []}
    try:
        for i in range(warmup + rounds):
            t0 = time.perf_counter()
            build(outputs, beside)[0].SerializeToString()
            t1 = time.perf_counter()
            got = await lane.request(Kind.ROUND, request)
            t2 = time.perf_counter()
            message = verifier_pb2.VerifyResponse.FromString(got.body)
            convert.verify_response_from_proto(message, got.rows)
            t3 = time.perf_counter()
            if i >= warmup:
                for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    times[key].append(seconds)
    finally:
        lane.close()
        if server is not None:
            await server.close()
        if child is not None:
            child.terminate()
            child.join()
        await asyncio.sleep(0.05)  # the connection's scope lets go (no orphan grace)
    return {key: 1e6 * statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, nargs="+", default=[12288, 1728, 0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rows", type=int, default=4, help="feature rows a sequence")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--mode", nargs="+", choices=("beside", "in"), default=["beside", "in"])
    parser.add_argument("--echo-process", action="store_true", help="the echo in another process")
    args = parser.parse_args()
    print(
        "| width | rows' bytes | rows | build + serialize us | lane round trip us "
        "| parse + convert us |"
    )
    print("|---:|---:|---|---:|---:|---:|")
    for width in args.width:
        outputs = answer_of(args.batch, args.rows, width)
        size = args.batch * args.rows * width * 2
        for mode in args.mode:
            beside = mode == "beside"
            us = asyncio.run(measure(outputs, beside, args.rounds, args.warmup, args.echo_process))
            print(
                f"| {width} | {size} | {mode} | {us['build']:.0f} | {us['trip']:.0f} "
                f"| {us['read']:.0f} |"
            )


if __name__ == "__main__":
    main()
