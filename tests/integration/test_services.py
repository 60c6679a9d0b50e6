"""The three services as real processes on loopback, driven through the gateway's gRPC API.

A tiny random Llama with SmolLM2's tokenizer (so text prompts work), float32; the drafter is
the target itself (draft == target, so speculation really happens) unless a test says otherwise;
the verifier runs decode steps ahead (`--decode-ahead on`, the GPU default).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.grpc_clients import GrpcVerifierClient
from specsplit.messages import AheadTree, NextTrees
from specsplit.tree import DraftTree
from specsplit.v1 import common_pb2, gateway_pb2, verifier_pb2, verifier_pb2_grpc
from tests.integration.services import Services, generate, ids_of, scrape, token_request, value
from tests.support import save_tiny_llama

VOCAB = 49152
SPEC = common_pb2.SpecParams(num_steps=3, topk=2, num_draft_tokens=5)
NO_SPEC = common_pb2.SpecParams(num_steps=0, topk=1, num_draft_tokens=0)


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("services")
    model = save_tiny_llama(root / "target", seed=5, vocab_size=VOCAB, tokenizer=smollm2_tokenizer)
    extra = {
        "drafter": ["--drafter", "model", "--draft-model", str(model)],
        # off by default on a CPU: on here, so every case below meets its steps run ahead
        "verifier": ["--decode-ahead", "on"],
    }
    svc = Services(str(model), root, extra=extra, metrics=True)
    yield from svc.serving()


def _prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 4000 + 100 for j in range(3 + 4 * i)]


def test_health_serving_and_reflection_on_all_three(services: Services) -> None:
    for role, service in (
        ("gateway", "specsplit.v1.Gateway"),
        ("drafter", "specsplit.v1.Drafter"),
        ("verifier", "specsplit.v1.Verifier"),
    ):
        with grpc.insecure_channel(services.address(role)) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                assert status == health_pb2.HealthCheckResponse.SERVING, (role, name)
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            response = next(iter(reflection.ServerReflectionInfo(iter([request]), timeout=5)))
            names = {s.name for s in response.list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names, (role, names)


def test_concurrent_streams_equal_target_only(services: Services) -> None:
    stub = services.gateway()
    prompts = [_prompt(i) for i in range(6)]

    def run(prompt: list[int], spec: common_pb2.SpecParams) -> list[gateway_pb2.GenerateResponse]:
        return generate(stub, token_request(prompt, 16, spec=spec, ignore_eos=True))

    with ThreadPoolExecutor(6) as pool:
        speculative = list(pool.map(lambda p: run(p, SPEC), prompts))
    plain = [run(p, NO_SPEC) for p in prompts]
    for spec_out, plain_out in zip(speculative, plain, strict=True):
        assert ids_of(spec_out) == ids_of(plain_out)
        assert len(ids_of(spec_out)) == 16
        last = spec_out[-1]
        assert last.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 16
        # draft == target: most drafts are accepted
        assert last.spec_stats.mean_accepted_tokens > 2.0, last.spec_stats
        assert last.spec_stats.rounds < 16
    services.wait_no_pages_used()


def test_plain_rounds_take_the_decode_steps_run_ahead(services: Services) -> None:
    def used() -> float:
        return value(scrape(services, "verifier"), "specsplit_decode_ahead_total", outcome="used")

    stub, prompt = services.gateway(), _prompt(2)
    before = used()
    plain = generate(stub, token_request(prompt, 24, spec=NO_SPEC, ignore_eos=True))
    assert used() - before >= 20  # the prefill's step and each decode step's after it
    assert ids_of(plain) == ids_of(generate(stub, token_request(prompt, 24, ignore_eos=True)))
    sampled = common_pb2.SamplingParams(temperature=0.9, seed=11)
    runs = [
        ids_of(generate(stub, token_request(prompt, 24, spec=NO_SPEC, sampling=sampled,
                                            ignore_eos=True)))
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0] == runs[1] and len(runs[0]) == 24  # seeded: the steps run ahead draw alike
    services.wait_no_pages_used()


@pytest.mark.parametrize("top_p", [1.0, 0.8], ids=["whole", "top-p"])
def test_sampled_chains_cross_both_hops_with_their_draft_probabilities(
    services: Services, top_p: float
) -> None:
    """Sampled speculative chains: each Draft answer's draft probabilities go to the gateway
    and on in the Verify request (one DraftProbs a round each way; under a top-p cut narrower
    than the drafter's support); seeded, the same tokens twice, and the drafter drafted for
    them."""

    def drafts() -> float:
        return value(scrape(services, "drafter"), "specsplit_draft_seconds_count")

    stub, chain = services.gateway(), common_pb2.SpecParams(num_steps=3, topk=1, num_draft_tokens=3)
    sampled = common_pb2.SamplingParams(temperature=0.9, top_p=top_p, seed=7)
    before = drafts()
    runs = [
        ids_of(generate(stub, token_request(_prompt(i % 2 + 1), 16, spec=chain, sampling=sampled,
                                            ignore_eos=True)))
        for i in range(3)
    ]  # fmt: skip
    assert runs[0] == runs[2] != runs[1] and all(len(run) == 16 for run in runs)
    assert drafts() - before >= 3
    services.wait_no_pages_used()


def test_text_prompt_streams_text_that_decodes_the_tokens(
    services: Services, smollm2_tokenizer
) -> None:
    request = gateway_pb2.GenerateRequest(text="Hello there", max_new_tokens=12, ignore_eos=True)
    out = generate(services.gateway(), request)
    text = "".join(r.text for r in out)
    assert text == smollm2_tokenizer.decode(ids_of(out), skip_special_tokens=True)
    assert out[-1].usage.prompt_tokens == len(smollm2_tokenizer.encode("Hello there"))


def test_stop_token_id_ends_the_stream_and_frees_kv(services: Services) -> None:
    stub = services.gateway()
    full = ids_of(generate(stub, token_request(_prompt(2), 12, ignore_eos=True)))
    stop_at = full[5]
    first = full.index(stop_at)
    out = generate(stub, token_request(_prompt(2), 12, stop_token_ids=[stop_at], ignore_eos=True))
    assert ids_of(out) == full[: first + 1]
    assert out[-1].finish_reason == gateway_pb2.FINISH_REASON_STOP
    services.wait_no_pages_used()


@pytest.mark.parametrize(
    ("case", "request_", "field"),
    [
        ("empty_prompt", gateway_pb2.GenerateRequest(max_new_tokens=4), "prompt"),
        ("empty_text", gateway_pb2.GenerateRequest(text="", max_new_tokens=4), "prompt"),
        ("max_new_tokens_zero", token_request([5, 6], 0), "max_new_tokens"),
        ("over_context", token_request([5] * 500, 100), "max_new_tokens"),
        (
            "negative_temperature",
            token_request([5, 6], 4, sampling=common_pb2.SamplingParams(temperature=-0.5)),
            "temperature",
        ),
        (
            "top_p_above_one",
            token_request(
                [5, 6], 4, sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.5)
            ),
            "top_p",
        ),
        (
            "negative_top_k",
            token_request([5, 6], 4, sampling=common_pb2.SamplingParams(temperature=1.0, top_k=-1)),
            "top_k",
        ),
        (
            "inconsistent_spec",
            token_request(
                [5, 6], 4, spec=common_pb2.SpecParams(num_steps=2, topk=1, num_draft_tokens=5)
            ),
            "num_draft_tokens",
        ),
        ("token_outside_vocab", token_request([VOCAB + 3], 4), "token"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_request_is_invalid_argument_naming_the_field(
    services: Services, case: str, request_: gateway_pb2.GenerateRequest, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(services.gateway(), request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    # still serving, nothing leaked
    assert (
        len(ids_of(generate(services.gateway(), token_request([5, 6, 7], 3, ignore_eos=True)))) == 3
    )
    services.wait_no_pages_used()


def test_cancelled_stream_frees_both_services(services: Services) -> None:
    stub = services.gateway()
    call = stub.Generate(token_request(_prompt(4), 400, ignore_eos=True), timeout=120)
    for received, _ in enumerate(call, start=1):
        if received == 2:
            break
    assert services.pages_used()["verifier"] > 0  # the sequence is live
    call.cancel()
    services.wait_no_pages_used()


def _verify_stream_error(services: Services, request: verifier_pb2.VerifyRequest) -> grpc.RpcError:
    with grpc.insecure_channel(services.address("verifier")) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.VerifyStream(iter([request]), timeout=10))
        return err.value


def test_internal_api_refuses_unknown_seq_id_and_malformed_tree(services: Services) -> None:
    unknown = verifier_pb2.VerifyRequest(
        seq_ids=["nobody"], begin=[False], kv_committed_len=[3], num_pending_tokens=[1],
        pending_tokens=[5],
    )  # fmt: skip
    err = _verify_stream_error(services, unknown)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "nobody" in err.details()
    malformed = verifier_pb2.VerifyRequest(
        seq_ids=["fresh"], begin=[True], kv_committed_len=[0], num_pending_tokens=[2],
        pending_tokens=[5, 6], num_tree_nodes=[2], tree_tokens=[7, 8], tree_parents=[-1, 4],
    )  # fmt: skip
    err = _verify_stream_error(services, malformed)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "parents" in err.details()
    ragged = verifier_pb2.VerifyRequest(
        seq_ids=["fresh"], begin=[True], kv_committed_len=[0], num_pending_tokens=[3],
        pending_tokens=[5, 6],
    )  # fmt: skip
    err = _verify_stream_error(services, ragged)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "pending_tokens" in err.details()
    services.wait_no_pages_used()
    assert len(ids_of(generate(services.gateway(), token_request([9, 9], 3, ignore_eos=True)))) == 3


def test_hint_over_grpc_is_taken_and_one_malformed_is_refused(services: Services) -> None:
    """The verifier's unary Hint (the gateway's on a TCP link): a hint for a sequence it does
    not hold changes nothing; one whose columns disagree is INVALID_ARGUMENT."""
    stub = verifier_pb2_grpc.VerifierStub(services.channel("verifier"))
    hint = verifier_pb2.VerifyHint(
        seq_ids=["nobody"], base=[3], plain=[True], num_outcomes=[1], num_outcome_tokens=[1],
        outcome_tokens=[5], num_tree_nodes=[1], tree_tokens=[7], tree_parents=[-1],
    )  # fmt: skip
    assert stub.Hint(hint) == verifier_pb2.VerifyHintResponse()
    hint.num_outcome_tokens[:] = [2]
    with pytest.raises(grpc.RpcError) as err:
        stub.Hint(hint)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    services.wait_no_pages_used()


def test_the_gateways_client_hints_over_grpc(services: Services) -> None:
    """GrpcVerifierClient.hint on a TCP link (no round lane): the unary Hint with the client's
    scope token; from a client that holds no sequence there it is taken and changes nothing."""

    async def hint() -> None:
        client = GrpcVerifierClient(services.address("verifier"))
        assert client.lane is None
        try:
            await client.hint([NextTrees("nobody", 3, [AheadTree([5], DraftTree([7], [-1]))])])
            await client.hint([])  # nothing to send: no call
        finally:
            await client.close()

    asyncio.run(hint())
    services.wait_no_pages_used()


def test_drafter_down_keeps_generating_the_same_tokens(services: Services) -> None:
    stub = services.gateway()
    prompt = _prompt(3)
    expected = ids_of(generate(stub, token_request(prompt, 10, spec=SPEC, ignore_eos=True)))
    services.stop("drafter", signal.SIGKILL)
    try:
        out = generate(stub, token_request(prompt, 10, spec=SPEC, ignore_eos=True))
        assert ids_of(out) == expected
        assert out[-1].spec_stats.num_accepted_drafts == 0  # plain target decoding
    finally:
        services.start("drafter")
        services.wait_serving("drafter", 240)
    # reattached: speculation works again
    deadline_rounds = []
    for _ in range(20):
        out = generate(stub, token_request(prompt, 10, spec=SPEC, ignore_eos=True))
        assert ids_of(out) == expected
        deadline_rounds.append(out[-1].spec_stats.num_accepted_drafts)
        if deadline_rounds[-1] > 0:
            break
        threading.Event().wait(0.5)
    assert deadline_rounds[-1] > 0
    services.wait_no_pages_used()


def test_verifier_restart_mid_stream_loses_and_repeats_nothing(services: Services) -> None:
    stub = services.gateway()
    prompt = _prompt(5)
    expected = ids_of(generate(stub, token_request(prompt, 60, spec=SPEC, ignore_eos=True)))
    call = stub.Generate(token_request(prompt, 60, spec=SPEC, ignore_eos=True), timeout=300)
    received: list[int] = []
    restarted = False
    for response in call:
        received += response.token_ids
        if len(received) >= 6 and not restarted:
            services.stop("verifier", signal.SIGKILL)  # mid-stream: the sequence's KV is gone
            services.start("verifier")  # the gateway re-prefills from its own tokens
            restarted = True
    assert restarted
    assert received == expected
    services.wait_serving("verifier", 240)
    services.wait_no_pages_used()
