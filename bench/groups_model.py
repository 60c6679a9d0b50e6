"""The gateway's pipelined groups with and without the early Verify, on modelled services: the
in-process stack (a tiny random target drafting for itself, on the CPU) whose verifier is a
serial device taking --verify-ms a Verify, whose drafter is another taking --draft-ms a Draft,
and whose every call travels --rpc-ms each way. Tokens/s and the modelled verifier's busy
fraction, each mode run --passes times (A B A B). This isolates the gateway's scheduling from
the services' own costs: what the modes would give if the services cost only those times.

A group's round trip is serial (its Draft needs its last Verify's outcome, its Verify its
Draft): Verify + Draft + 4 RPC legs. With two groups the verifier can be busy at most
2 x Verify / (Verify + Draft + 4 RPC legs) of the time; the early Verify only removes the wait
for the other group's round where the Verify is the longer call.

    PYTHONPATH=. python bench/groups_model.py --verify-ms 20 --draft-ms 17 --rpc-ms 5 --batch 8
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from specsplit.messages import DraftInput, DraftOutput, SpecParams, VerifyInput, VerifyOutput
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.loader import load_tokenizer
from tests.support import (
    PassThroughDrafter,
    PassThroughVerifier,
    generate_all,
    generated_ids,
    make_stack,
    mixed_requests,
    save_tiny_llama,
)

T = TypeVar("T")


class Device:
    """A serial device taking `seconds` a call (the call's own work counted in it), behind a
    link taking `rpc` seconds each way; its busy time added up."""

    def __init__(self, seconds: float, rpc: float) -> None:
        self.seconds, self.rpc = seconds, rpc
        self.lock = asyncio.Lock()
        self.busy = 0.0

    async def call(self, work: Callable[[], Awaitable[T]]) -> T:
        await asyncio.sleep(self.rpc)
        async with self.lock:
            start = time.perf_counter()
            out = await work()
            left = self.seconds - (time.perf_counter() - start)
            if left > 0:
                await asyncio.sleep(left)
            self.busy += time.perf_counter() - start
        await asyncio.sleep(self.rpc)
        return out


def run(
    target: Path, tokenizer: object, early: bool, args: argparse.Namespace
) -> tuple[float, float]:
    """(tokens/s, the verifier's busy fraction) of one generation at --batch."""
    stack = make_stack(
        target, "model", tokenizer, SpecParams(3, 1, 3), overlap="groups", early_verify=early
    )
    scheduler = stack.scheduler
    verifier = Device(args.verify_ms / 1e3, args.rpc_ms / 1e3)
    drafter = Device(args.draft_ms / 1e3, args.rpc_ms / 1e3)

    class ModelledVerifier(PassThroughVerifier):
        async def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]:
            return await verifier.call(lambda: self.inner.verify(inputs))

    class ModelledDrafter(PassThroughDrafter):
        async def draft(self, inputs: list[DraftInput]) -> list[DraftOutput]:
            return await drafter.call(lambda: self.inner.draft(inputs))

    scheduler.verifier = ModelledVerifier(scheduler.verifier)
    scheduler.drafter = ModelledDrafter(scheduler.drafter)
    requests = mixed_requests(args.batch, 3, args.max_new_tokens)
    for request in requests:
        request.ignore_eos = True
    start = time.perf_counter()
    out = generate_all(stack, requests)
    wall = time.perf_counter() - start
    return sum(len(generated_ids(c)) for c in out) / wall, verifier.busy / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verify-ms", type=float, default=20.0)
    parser.add_argument("--draft-ms", type=float, default=17.0)
    parser.add_argument("--rpc-ms", type=float, default=5.0, help="each way")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    tokenizer = load_tokenizer(embedded_default_model_path())
    target = save_tiny_llama(Path(tempfile.mkdtemp()) / "target", seed=0)
    legs = args.verify_ms + args.draft_ms + 4 * args.rpc_ms
    print(
        f"verify {args.verify_ms} ms, draft {args.draft_ms} ms, rpc {args.rpc_ms} ms each way,"
        f" batch {args.batch}: two groups' bound on the verifier's busy fraction"
        f" {min(1.0, 2 * args.verify_ms / legs):.2f}"
    )
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.passes):
        for early in (False, True):
            results[early].append(run(target, tokenizer, early, args))
    for early, runs in results.items():
        cells = ", ".join(f"{tps:.1f} tok/s busy {busy:.2f}" for tps, busy in runs)
        print(f"groups{'-early' if early else ''}: {cells}")


if __name__ == "__main__":
    main()
