"""Sessions through the three real processes (a tiny random Llama with SmolLM2's tokenizer;
draft == target): a multi-turn conversation over gRPC and one over the OpenAI HTTP API, each turn
equal to a fresh request carrying the whole conversation; the gRPC status codes; no KV left in
either service once the sessions are closed."""

from __future__ import annotations

import json
import threading
import urllib.request

import grpc
import openai
import pytest

from specsplit.v1 import gateway_pb2
from tests.integration.services import (
    TINY_MODEL_NAME,
    Services,
    generate,
    ids_of,
    token_request,
)

MODEL_NAME = TINY_MODEL_NAME


@pytest.fixture(scope="module")
def services(tiny_http_services: Services) -> Services:
    return tiny_http_services


def test_a_grpc_conversation_equals_fresh_requests_and_frees_its_kv(services: Services) -> None:
    stub = services.gateway()
    session = stub.OpenSession(gateway_pb2.OpenSessionRequest(ttl_seconds=120), timeout=10)
    assert session.session_id.startswith("sess-") and session.ttl_seconds == 120
    conversation: list[int] = []
    for k in range(3):
        prompt = [100 + 31 * k + 7 * j for j in range(4 + k)]
        fresh = generate(stub, token_request(conversation + prompt, 8, ignore_eos=True))
        turn = generate(
            stub, token_request(prompt, 8, ignore_eos=True, session_id=session.session_id)
        )
        assert ids_of(turn) == ids_of(fresh)
        assert turn[-1].usage.prompt_tokens == len(conversation) + len(prompt)
        if k > 0:  # everything but the pending bonus token was kept
            assert turn[-1].spec_stats.num_reused_tokens == len(conversation) - 1
        conversation += prompt + ids_of(turn)
    closed = stub.CloseSession(
        gateway_pb2.CloseSessionRequest(session_id=session.session_id), timeout=10
    )
    assert closed.num_tokens == len(conversation)
    services.wait_no_pages_used()
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, token_request([5, 6], 2, session_id=session.session_id))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_second_turn_while_one_runs_is_failed_precondition(services: Services) -> None:
    stub = services.gateway()
    session_id = stub.OpenSession(gateway_pb2.OpenSessionRequest(), timeout=10).session_id
    long = stub.Generate(
        token_request([300, 301, 302], 400, ignore_eos=True, session_id=session_id)
    )
    next(long)  # the turn is running
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, token_request([7, 8], 2, session_id=session_id))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    long.cancel()  # taken back: the session is empty again, its next turn runs
    assert len(ids_of(generate(stub, token_request([7, 8], 2, session_id=session_id)))) == 2
    stub.CloseSession(gateway_pb2.CloseSessionRequest(session_id=session_id), timeout=10)
    services.wait_no_pages_used()


def _http(services: Services, method: str, path: str, body: object = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{services.address('http')}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def test_an_http_chat_session_equals_fresh_chats_with_the_replies(services: Services) -> None:
    client = openai.OpenAI(
        base_url=f"http://{services.address('http')}/v1", api_key="x", max_retries=0, timeout=120
    )
    session_id = _http(services, "POST", "/v1/sessions", {"ttl_seconds": 60})["id"]
    history: list[dict[str, str]] = []
    for question in ("Hello there", "Tell me more"):
        turn = [{"role": "user", "content": question}]
        kwargs = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0}
        fresh = client.chat.completions.create(messages=[*history, *turn], **kwargs)  # type: ignore[call-overload]
        got = client.chat.completions.create(
            messages=turn, extra_body={"session_id": session_id}, **kwargs
        )
        assert got.choices[0].message.content == fresh.choices[0].message.content
        assert got.usage is not None and fresh.usage is not None
        assert got.usage.prompt_tokens == fresh.usage.prompt_tokens
        history += [*turn, {"role": "assistant", "content": got.choices[0].message.content or ""}]
    # a turn running (over gRPC: one session, both APIs): another is 409 until it ends
    long = services.gateway().Generate(
        token_request([300, 301], 400, ignore_eos=True, session_id=session_id)
    )
    next(long)
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}],
            model=MODEL_NAME,
            max_tokens=2,
            extra_body={"session_id": session_id},
        )
    long.cancel()  # taken back: the chat is as it was
    deleted = _http(services, "DELETE", f"/v1/sessions/{session_id}")
    assert deleted["deleted"] and deleted["num_tokens"] > 0
    services.wait_no_pages_used()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}],
            model=MODEL_NAME,
            max_tokens=2,
            extra_body={"session_id": session_id},
        )


def test_concurrent_sessions_and_plain_requests_leave_no_kv(services: Services) -> None:
    stub = services.gateway()
    errors: list[BaseException] = []

    def chat(i: int) -> None:
        try:
            sid = stub.OpenSession(gateway_pb2.OpenSessionRequest(), timeout=10).session_id
            for k in range(2):
                prompt = [200 + 17 * i + k, 201 + i, 202 + k]
                generate(stub, token_request(prompt, 6, ignore_eos=True, session_id=sid))
            generate(stub, token_request([400 + i, 401], 6, ignore_eos=True))
            stub.CloseSession(gateway_pb2.CloseSessionRequest(session_id=sid), timeout=10)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    services.wait_no_pages_used()
