"""The three services as real processes with the gateway in pipelined-groups mode (--overlap
groups, the other group's Verify sent while one is in flight: --early-verify): the Draft and
Verify streams run at once over gRPC, and concurrent streams still equal
target-only decoding token for token, with no KV left. The drafter and the verifier run their
engine calls on the event loop's thread (--engine-calls loop, a GPU's default), so that mode
also serves concurrent streams, Release and the stream's end over real gRPC. Faults in groups
mode, mid-stream with both groups running: the drafter killed (the streams decode without
drafts, same tokens), the verifier killed and restarted (each sequence re-prefilled from the
gateway's tokens, nothing lost or repeated)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from specsplit.v1 import common_pb2, gateway_pb2
from tests.integration.services import (
    NO_SPEC,
    Services,
    check_drafter_killed_mid_stream,
    check_verifier_restarted_mid_stream,
    generate,
    ids_of,
    token_request,
)
from tests.support import save_tiny_llama

VOCAB = 49152
SPEC = common_pb2.SpecParams(num_steps=3, topk=2, num_draft_tokens=5)
ON_LOOP = ["--engine-calls", "loop"]


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("services_groups")
    model = save_tiny_llama(root / "target", seed=5, vocab_size=VOCAB, tokenizer=smollm2_tokenizer)
    svc = Services(
        str(model),
        root,
        extra={
            "drafter": ["--drafter", "model", "--draft-model", str(model), *ON_LOOP],
            "verifier": ON_LOOP,
            # the other group's Verify sent while one is in flight: two rounds on two lane
            # connections, the second launched behind the first (verifier/pipelined.py)
            "gateway": ["--overlap", "groups", "--early-verify"],
        },
    )
    yield from svc.serving()


def test_groups_mode_concurrent_streams_equal_target_only(services: Services) -> None:
    stub = services.gateway()
    prompts = [[(37 * i + 11 * j) % 4000 + 100 for j in range(3 + 4 * i)] for i in range(6)]

    def run(prompt: list[int], spec: common_pb2.SpecParams) -> list[gateway_pb2.GenerateResponse]:
        return generate(stub, token_request(prompt, 16, spec=spec, ignore_eos=True))

    with ThreadPoolExecutor(6) as pool:
        speculative = list(pool.map(lambda p: run(p, SPEC), prompts))
    plain = [run(p, NO_SPEC) for p in prompts]
    for spec_out, plain_out in zip(speculative, plain, strict=True):
        assert ids_of(spec_out) == ids_of(plain_out)
        last = spec_out[-1]
        assert last.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        assert last.spec_stats.mean_accepted_tokens > 2.0, last.spec_stats  # draft == target
    services.wait_no_pages_used()


def test_groups_drafter_killed_mid_stream_every_stream_keeps_its_tokens(services: Services) -> None:
    prompts = [[(31 * i + 7 * j) % 4000 + 100 for j in range(4 + 3 * i)] for i in range(4)]
    check_drafter_killed_mid_stream(services, prompts, 80, SPEC)


def test_groups_verifier_restarted_mid_stream_every_stream_loses_and_repeats_nothing(
    services: Services,
) -> None:
    prompts = [[(17 * i + 5 * j) % 4000 + 100 for j in range(5 + 2 * i)] for i in range(4)]
    check_verifier_restarted_mid_stream(services, prompts, 80, SPEC)
