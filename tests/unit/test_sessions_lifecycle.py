"""Sessions around their turns (DESIGN.md §7): a second concurrent turn, unknown and closed
sessions, a cancelled turn, expiry, eviction under memory pressure, a lost session on either
service, closing during a turn, text and chat continuations. Every path ends with a strict leak
check (no KV pages left in either service)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch

from gateway.request import GenerationRequest, ModelInfo, build_request
from gateway.session_state import Session
from inprocess.stack import LocalStack
from specsplit import metrics
from specsplit.errors import Code, ServiceError
from specsplit.messages import SpecParams
from specsplit.sampling import SamplingParams
from tests.support import (
    TINY_VOCAB,
    Conversation,
    check_no_leaks,
    check_session_kv,
    collect,
    generated_ids,
    make_stack,
    save_tiny_llama,
)

SPEC = SpecParams(3, 1, 3)
CHAT_VOCAB = 49152  # SmolLM2's tokenizer: text and chat prompts


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("session_life") / "target", seed=9)


def _prompt(seed: int, n: int = 6) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist()


def _run(stack: LocalStack, body: Callable[[Conversation], Awaitable[None]]) -> None:
    """`body` with a started scheduler and one open session; then stop and check no leak."""

    async def run() -> None:
        await stack.scheduler.start()
        try:
            await body(Conversation(stack, SamplingParams()))
        finally:
            await stack.scheduler.stop()

    asyncio.run(run())
    check_no_leaks(stack)


def _code(call: Callable[[], object]) -> Code:
    with pytest.raises(ServiceError) as err:
        call()
    return err.value.code


def test_a_second_turn_while_one_runs_is_failed_precondition(target_dir, smollm2_tokenizer):
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, SPEC)

    async def body(conv: Conversation) -> None:
        scheduler = conv.scheduler
        long = scheduler.generate(conv.turn_request(_prompt(1), 200))
        await anext(long)  # running, with KV in both services
        second = conv.turn_request(_prompt(2), 4)
        assert _code(lambda: scheduler.generate(second)) == Code.FAILED_PRECONDITION
        await long.aclose()  # the first turn taken back: nothing is kept
        await conv.session.ready.wait()
        assert conv.session.tokens == [] and stack.verifier.num_pages_used == 0
        await conv.turn(_prompt(2), 4)  # the session works on

    _run(stack, body)


def test_unknown_and_closed_sessions_are_not_found(target_dir, smollm2_tokenizer):
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, SPEC)

    async def body(conv: Conversation) -> None:
        scheduler = conv.scheduler
        await conv.turn(_prompt(1), 4)
        assert await scheduler.sessions.close(conv.session.session_id) == len(conv.tokens)
        check_no_leaks(stack)
        closed = conv.turn_request(_prompt(2), 4)
        assert _code(lambda: scheduler.generate(closed)) == Code.NOT_FOUND
        unknown = GenerationRequest(_prompt(2), 4, session_id="sess-nope", turn_prompt=None)
        assert _code(lambda: scheduler.generate(unknown)) == Code.NOT_FOUND
        with pytest.raises(ServiceError) as err:
            await scheduler.sessions.close(conv.session.session_id)
        assert err.value.code == Code.NOT_FOUND

    _run(stack, body)


@pytest.mark.parametrize("overlap", ["serial", "groups"])
def test_a_cancelled_turn_leaves_the_session_as_it_was(target_dir, smollm2_tokenizer, overlap):
    stack = make_stack(target_dir, "model", smollm2_tokenizer, SPEC, page_size=4, overlap=overlap)

    async def body(conv: Conversation) -> None:
        await conv.turn(_prompt(1), 5)
        before = list(conv.tokens)
        long = conv.scheduler.generate(conv.turn_request(_prompt(2), 200))
        await anext(long)
        await anext(long)  # a few rounds in: the verifier holds the new turn's KV
        await long.aclose()
        await conv.session.ready.wait()
        assert conv.session.tokens == before
        check_session_kv(stack, conv.session.seq_id, before)
        await conv.turn(_prompt(3), 5)  # equal to a fresh request without the cancelled turn

    _run(stack, body)


def test_stopping_the_gateway_mid_turn_frees_everything(target_dir, smollm2_tokenizer):
    stack = make_stack(target_dir, "model", smollm2_tokenizer, SPEC)

    async def body(conv: Conversation) -> None:
        await conv.turn(_prompt(1), 5)
        long = conv.scheduler.generate(conv.turn_request(_prompt(2), 200))
        await anext(long)
        await conv.scheduler.stop()  # the turn fails with UNAVAILABLE; sessions are freed
        with pytest.raises(ServiceError) as err:
            async for _ in long:
                pass
        assert err.value.code == Code.UNAVAILABLE

    _run(stack, body)


def test_an_idle_session_expires_after_its_ttl(target_dir, smollm2_tokenizer):
    stack = make_stack(target_dir, "model", smollm2_tokenizer, SPEC)
    now = [1000.0]
    stack.scheduler.sessions.clock = lambda: now[0]

    async def body(conv: Conversation) -> None:
        sessions = conv.scheduler.sessions
        short = sessions.open(ttl_s=30)
        conv.session = short
        await conv.turn(_prompt(1), 5)
        other = sessions.open()  # the default TTL, 600 s
        long = conv.scheduler.generate(conv.turn_request(_prompt(2), 200))
        await anext(long)  # `short` runs a turn: not idle, so it does not expire
        now[0] += 31
        assert await sessions.expire() == 0
        await long.aclose()
        await short.ready.wait()
        before = metrics.SESSION_EVICTIONS.labels(reason="expired")._value.get()
        assert await sessions.expire() == 0  # just used: the turn's end counts
        now[0] += 31
        assert await sessions.expire() == 1  # `other` (600 s) stays
        assert metrics.SESSION_EVICTIONS.labels(reason="expired")._value.get() == before + 1
        assert short.session_id not in sessions.sessions and other.session_id in sessions.sessions
        check_no_leaks(stack)
        request = conv.turn_request(_prompt(3), 4)
        assert _code(lambda: conv.scheduler.generate(request)) == Code.NOT_FOUND

    _run(stack, body)


def test_idle_sessions_are_evicted_before_a_running_request_is_refused(
    target_dir, smollm2_tokenizer
):
    # 24 pages of 4: an idle session of ~45 tokens (12 pages) and a request of ~64 (17) do not fit
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, SPEC, page_size=4, num_pages=24)

    async def body(conv: Conversation) -> None:
        await conv.turn(_prompt(1, 20), 25)
        before = metrics.SESSION_EVICTIONS.labels(reason="memory")._value.get()
        fresh = await collect(conv.scheduler, GenerationRequest(_prompt(2, 30), 30))
        assert fresh[-1].finish_reason == "length"  # it ran: the idle session gave way
        assert metrics.SESSION_EVICTIONS.labels(reason="memory")._value.get() == before + 1
        assert not conv.session.holds_kv and conv.session.seq_id not in stack.verifier.seqs
        out = await conv.turn(_prompt(3), 5)  # re-prefilled from the gateway's tokens
        assert out[-1].stats is not None and out[-1].stats.num_reused_tokens == 0

    _run(stack, body)


@pytest.mark.parametrize("service", ["verifier", "drafter"])
def test_a_service_that_lost_the_session_gets_it_re_prefilled(
    target_dir, smollm2_tokenizer, service
):
    """As after a restart: the service no longer holds the session's sequence."""
    stack = make_stack(target_dir, "model", smollm2_tokenizer, SPEC)

    async def body(conv: Conversation) -> None:
        await conv.turn(_prompt(1), 5)
        engine = stack.verifier if service == "verifier" else stack.drafter
        assert engine.release([conv.session.seq_id]) == 1
        await conv.turn(_prompt(2), 5)  # the same tokens as a fresh request
        await conv.turn(_prompt(3), 5)

    _run(stack, body)


def test_closing_a_session_during_its_turn_frees_it_when_the_turn_ends(
    target_dir, smollm2_tokenizer
):
    stack = make_stack(target_dir, "model", smollm2_tokenizer, SPEC)

    async def body(conv: Conversation) -> None:
        await conv.turn(_prompt(1), 5)
        turn = conv.scheduler.generate(conv.turn_request(_prompt(2), 12))
        first = await anext(turn)
        await conv.scheduler.sessions.close(conv.session.session_id)
        rest = [chunk async for chunk in turn]  # the turn itself goes on to its end
        assert rest[-1].finish_reason == "length"
        assert len(generated_ids([first, *rest])) == 12
        await conv.session.ready.wait()
        check_no_leaks(stack)

    _run(stack, body)


# -- text and chat continuations, with SmolLM2's tokenizer -----------------------------------


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    root = tmp_path_factory.mktemp("session_chat")
    return save_tiny_llama(root / "target", seed=5, vocab_size=CHAT_VOCAB)


def _model(tokenizer: object) -> ModelInfo:
    return ModelInfo(tokenizer=tokenizer, vocab_size=CHAT_VOCAB, max_context=512)


def _text_or_chat(
    model: ModelInfo, kind: str, prompt: object, session: Session | None, stop: str = ""
) -> GenerationRequest:
    return build_request(
        model,
        kind,  # type: ignore[arg-type]
        prompt,  # type: ignore[arg-type]
        max_new_tokens=6,
        sampling=SamplingParams(),
        stop_strings=[stop] if stop else [],
        session_id=None if session is None else session.session_id,
    )


def test_text_turns_continue_without_special_tokens(chat_dir, smollm2_tokenizer):
    stack = make_stack(chat_dir, "ngram", smollm2_tokenizer, SPEC)
    model = _model(smollm2_tokenizer)

    async def body(conv: Conversation) -> None:
        scheduler, session = conv.scheduler, conv.session
        first = await collect(scheduler, _text_or_chat(model, "text", "The sea is", session))
        await session.ready.wait()
        held = list(session.tokens)
        assert held == smollm2_tokenizer.encode("The sea is") + generated_ids(first)
        text = " and the sky above it"
        ids = held + smollm2_tokenizer.encode(text, add_special_tokens=False)
        expected = await collect(scheduler, GenerationRequest(ids, 6))
        got = await collect(scheduler, _text_or_chat(model, "text", text, session))
        assert generated_ids(got) == generated_ids(expected)
        assert got[-1].prompt_tokens == len(ids)
        await session.ready.wait()
        chat = [{"role": "user", "content": "hi"}]
        with pytest.raises(ServiceError) as err:  # a chat turn continues only a chat session
            async for _ in scheduler.generate(_text_or_chat(model, "chat", chat, session)):
                pass
        assert err.value.code == Code.INVALID_ARGUMENT
        await session.ready.wait()
        check_session_kv(stack, session.seq_id, session.tokens)

    _run(stack, body)


def test_chat_turns_equal_a_fresh_chat_with_the_replies_as_received(chat_dir, smollm2_tokenizer):
    stack = make_stack(chat_dir, "model", smollm2_tokenizer, SPEC)
    model = _model(smollm2_tokenizer)

    async def body(conv: Conversation) -> None:
        scheduler, session = conv.scheduler, conv.session
        history: list[dict[str, str]] = []
        prompt_len = 0  # of the previous turn
        for i, question in enumerate(["Hello there", "Tell me more", "And then?"]):
            turn = [{"role": "user", "content": question}]
            if i == 0:
                turn.insert(0, {"role": "system", "content": "Be brief."})
            whole = [*history, *turn]
            stop = ""
            if i == 1:  # the reply ends at a stop string: its tokens stay, its text does not
                probe = await collect(scheduler, _text_or_chat(model, "chat", whole, None))
                text = "".join(chunk.text for chunk in probe)
                stop = text[len(text) // 2 :][:2]
                assert stop.strip(), text
            expected = await collect(scheduler, _text_or_chat(model, "chat", whole, None, stop))
            got = await collect(scheduler, _text_or_chat(model, "chat", turn, session, stop))
            assert generated_ids(got) == generated_ids(expected)
            if stop:
                assert got[-1].finish_reason == "stop"
            held = list(session.tokens)
            assert got[-1].prompt_tokens == expected[-1].prompt_tokens
            reply = "".join(chunk.text for chunk in got)
            history += [*turn, {"role": "assistant", "content": reply}]
            await session.ready.wait()
            assert session.messages == history
            check_session_kv(stack, session.seq_id, session.tokens)
            stats = got[-1].stats
            assert stats is not None and stats.num_reused_tokens >= prompt_len  # kept from before
            if i == 2:  # rendered with the reply as received: the stop string's tokens went
                assert session.tokens[: len(held)] != held
                assert stats.num_reused_tokens < len(held)
            prompt_len = got[-1].prompt_tokens

    _run(stack, body)


def test_a_turn_over_the_context_is_invalid_argument(target_dir, smollm2_tokenizer):
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, SPEC)

    async def body(conv: Conversation) -> None:
        await conv.turn(_prompt(1, 200), 5)
        with pytest.raises(ServiceError) as err:  # 205 + 300 + 20 > 512
            async for _ in conv.scheduler.generate(conv.turn_request(_prompt(2, 20), 300)):
                pass
        assert err.value.code == Code.INVALID_ARGUMENT
        await conv.session.ready.wait()
        check_session_kv(stack, conv.session.seq_id, conv.tokens)

    _run(stack, body)


@pytest.mark.parametrize("overlap", ["serial", "groups"])
def test_session_turns_preempted_under_memory_pressure_keep_their_tokens(
    target_dir, smollm2_tokenizer, overlap
):
    """No idle session to evict: a running turn is preempted (its KV freed in both services),
    re-prefilled from the whole conversation later, and its output is unchanged."""
    # each turn ends with ~61 tokens' KV on the verifier (16 pages of 4): two do not fit in 28
    stack = make_stack(
        target_dir, "ngram", smollm2_tokenizer, SPEC, page_size=4, num_pages=28, overlap=overlap
    )

    async def body(conv: Conversation) -> None:
        convs = [conv, Conversation(stack, SamplingParams())]
        for i, c in enumerate(convs):  # one at a time: each fits alone
            await c.turn(_prompt(10 + i, 8), 4)
        prompts = [_prompt(20 + i, 6) for i in range(2)]
        expected = [
            generated_ids(await c.fresh(p, 40, ignore_eos=True))
            for c, p in zip(convs, prompts, strict=True)
        ]
        preemptions = conv.scheduler.num_preemptions
        outs = await asyncio.gather(
            *(
                collect(conv.scheduler, c.turn_request(p, 40, ignore_eos=True))
                for c, p in zip(convs, prompts, strict=True)
            )
        )
        assert [generated_ids(o) for o in outs] == expected
        assert conv.scheduler.num_preemptions > preemptions
        for c, p, out in zip(convs, prompts, outs, strict=True):
            await c.session.ready.wait()
            assert c.session.tokens == c.tokens + p + generated_ids(out)

    _run(stack, body)
