"""The three services as real processes with the gateway drafting ahead (--overlap ahead, its
misses plain: the default --ahead-miss), on Unix sockets and their round lanes: while a round
is verified the drafter drafts the next round's trees for its likely outcomes, a guessed round
sends no Draft before its Verify, and a round not guessed is verified at once with no tree.
Concurrent greedy streams equal target-only decoding token for token, the guesses hit through the
real services, and no KV is left; mid-stream faults (the drafter killed, the verifier killed and
restarted) lose and repeat nothing."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from specsplit.v1 import common_pb2, gateway_pb2
from tests.integration.services import (
    Services,
    check_drafter_killed_mid_stream,
    check_verifier_restarted_mid_stream,
    generate,
    ids_of,
    scrape,
    target_only,
    token_request,
    value,
)
from tests.support import save_tiny_llama

VOCAB = 49152
CHAIN = common_pb2.SpecParams(num_steps=3, topk=1, num_draft_tokens=3)  # draft-ahead: chains


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("services_ahead")
    model = save_tiny_llama(root / "target", seed=6, vocab_size=VOCAB, tokenizer=smollm2_tokenizer)
    svc = Services(
        str(model),
        root,
        extra={
            # the draft model is the target: its guess of the bonus token is the target's own
            "drafter": ["--drafter", "model", "--draft-model", str(model)],
            "gateway": ["--overlap", "ahead"],
        },
        metrics=True,
        unix_dir=root,  # the rounds on the lanes, as `up` and docker compose run them
    )
    yield from svc.serving()


def _ahead_rounds(services: Services) -> tuple[float, float]:
    samples = scrape(services, "gateway")
    hits = value(samples, "specsplit_draft_ahead_total", outcome="hit")
    return hits, value(samples, "specsplit_draft_ahead_total", outcome="miss")


def test_draft_ahead_streams_equal_target_only_and_their_guesses_hit(services: Services) -> None:
    stub = services.gateway()
    prompts = [[(41 * i + 13 * j) % 4000 + 100 for j in range(3 + 5 * i)] for i in range(3)]
    hits_before, misses_before = _ahead_rounds(services)

    def run(prompt: list[int]) -> list[gateway_pb2.GenerateResponse]:
        return generate(stub, token_request(prompt, 24, spec=CHAIN, ignore_eos=True))

    with ThreadPoolExecutor(len(prompts)) as pool:
        ahead = list(pool.map(run, prompts))
    hits, misses = _ahead_rounds(services)
    assert [ids_of(out) for out in ahead] == target_only(services, prompts, 24)
    for out in ahead:
        assert out[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    # rounds whose trees were drafted ahead: with the target drafting, most are guessed
    assert hits - hits_before > misses - misses_before, (hits, misses)
    services.wait_no_pages_used()


def test_draft_ahead_drafter_killed_mid_stream_every_stream_keeps_its_tokens(
    services: Services,
) -> None:
    prompts = [[(23 * i + 9 * j) % 4000 + 100 for j in range(4 + 3 * i)] for i in range(3)]
    check_drafter_killed_mid_stream(services, prompts, 64, CHAIN)


def test_draft_ahead_verifier_restarted_mid_stream_loses_and_repeats_nothing(
    services: Services,
) -> None:
    prompts = [[(19 * i + 3 * j) % 4000 + 100 for j in range(5 + 2 * i)] for i in range(3)]
    check_verifier_restarted_mid_stream(services, prompts, 64, CHAIN)


@pytest.fixture(scope="module")
def services_on_loop(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer
) -> Iterator[Services]:
    """The same with the engines' calls on the services' event loops (--engine-calls loop, a
    GPU's default): the verifier launches hinted rounds there, after each answer is written or
    when a hint comes late (VerifierEngine.launch_parked, hint_next). A one-layer draft model
    and a deeper, wider target, so that some draft-ahead calls answer before their Verify and
    their hints go out (on the 2-core VM most still come late)."""
    root = tmp_path_factory.mktemp("services_ahead_on_loop")
    tokenizer = smollm2_tokenizer
    model = save_tiny_llama(root / "target", 6, VOCAB, 16, hidden_size=256, tokenizer=tokenizer)
    draft = save_tiny_llama(root / "draft", 6, VOCAB, num_layers=1, tokenizer=tokenizer)
    on_loop = ["--engine-calls", "loop"]
    svc = Services(
        str(model),
        root,
        extra={
            "drafter": ["--drafter", "model", "--draft-model", str(draft), *on_loop],
            "verifier": on_loop,
            "gateway": ["--overlap", "ahead"],
        },
        metrics=True,
        unix_dir=root,
    )
    yield from svc.serving()


def test_verify_ahead_on_the_loop_streams_equal_target_only(services_on_loop: Services) -> None:
    """Concurrent greedy streams whose hints reach a verifier with its calls on the event loop:
    whichever way each next round launches (after the answer, on a late hint, or at the
    Verify), the tokens are target-only decoding's and no KV is left; every draft-ahead round
    counts its hint as sent or late."""
    services = services_on_loop
    stub = services.gateway()
    prompts = [[(31 * i + 7 * j) % 4000 + 100 for j in range(4 + 5 * i)] for i in range(3)]
    before = scrape(services, "gateway")

    def run(prompt: list[int]) -> list[gateway_pb2.GenerateResponse]:
        return generate(stub, token_request(prompt, 24, spec=CHAIN, ignore_eos=True))

    with ThreadPoolExecutor(len(prompts)) as pool:
        ahead = list(pool.map(run, prompts))
    assert [ids_of(out) for out in ahead] == target_only(services, prompts, 24)
    after = scrape(services, "gateway")
    hints = sum(
        value(after, "specsplit_hints_total", outcome=x)
        - value(before, "specsplit_hints_total", outcome=x)
        for x in ("sent", "late")
    )
    assert hints > 0
    services.wait_no_pages_used()
