"""`specsplit generate` (and `up --generate`): a gRPC client streaming one generation from a
gateway to the terminal."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

import grpc

from specsplit.cli_server_flags import tls_files
from specsplit.server import CHANNEL_OPTIONS
from specsplit.tls import channel_credentials
from specsplit.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    from specsplit.tls import TLSFiles


async def stream_generation(
    address: str, prompt: str, args: argparse.Namespace, tls: TLSFiles | None = None
) -> int:
    """Stream text to stdout as it arrives; stats to stderr at the end. Returns an exit code.
    Sends args.api_key's first key; tls: how to trust the gateway (None = args.tls, args.tls_ca:
    plaintext unless one is set)."""

    sampling = common_pb2.SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    if args.seed is not None:
        sampling.seed = args.seed
    request = gateway_pb2.GenerateRequest(
        max_new_tokens=args.max_tokens, sampling=sampling, stop=args.stop or []
    )
    if args.chat:
        request.chat.messages.add(role="user", content=prompt)
    else:
        request.text = prompt
    started = time.monotonic()
    last = gateway_pb2.GenerateResponse()
    first_token_ns: int | None = None
    if tls is None and (getattr(args, "tls", False) is True or getattr(args, "tls_ca", None)):
        tls = tls_files(args)  # only a CA (or none: the system's roots)
    channel = (
        grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        if tls is None
        else grpc.aio.secure_channel(address, channel_credentials(tls), options=CHANNEL_OPTIONS)
    )
    api_keys = getattr(args, "api_key", ())
    metadata = (("authorization", f"Bearer {api_keys[0]}"),) if api_keys else None
    async with channel:
        try:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            async for response in stub.Generate(request, metadata=metadata):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if first_token_ns is None and response.token_ids:
                    first_token_ns = response.elapsed_ns
                last = response
        except grpc.aio.AioRpcError as err:
            print("\n" if last.ByteSize() else "", end="", flush=True)
            print(f"specsplit: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(flush=True)
    seconds = time.monotonic() - started
    stats, usage = last.spec_stats, last.usage
    reason = gateway_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_")
    print(
        f"[{reason.lower()}] {usage.prompt_tokens} prompt + {usage.completion_tokens} generated "
        f"tokens in {seconds:.2f} s ({usage.completion_tokens / seconds:.1f} tokens/s, first "
        f"token after {(first_token_ns or 0) / 1e6:.0f} ms); {stats.rounds} rounds, "
        f"{stats.num_accepted_drafts} drafts accepted, {stats.mean_accepted_tokens:.2f} "
        f"tokens per round",
        file=sys.stderr,
    )
    return 0
