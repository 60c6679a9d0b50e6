"""Trust (DESIGN.md §8) on real grpc.aio / aiohttp servers on loopback, in-process: API keys on
the gateway's APIs, TLS, mutual TLS on the internal links, sequence ids scoped to the connection
that made them. Certificates come from specsplit.certs (a throwaway CA per test module)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from drafter.engine import DrafterEngine
from drafter.servicer import DrafterServicer
from gateway.auth import ApiKeys, Refused, parse_keys
from gateway.grpc_clients import GrpcDrafterClient, GrpcVerifierClient
from gateway.openai_http import OpenAIServer
from gateway.request import Chunk, GenerationRequest, ModelInfo
from gateway.scheduler import Scheduler
from specsplit import cli, cli_generate, convert, tls
from specsplit.certs import LocalPKI, make_local_pki
from specsplit.messages import DraftInput, SpecParams, VerifyInput
from specsplit.server import CHANNEL_OPTIONS, ServiceHost
from specsplit.tls import TLSFiles, channel, http_ssl_context
from specsplit.tree import DraftTree
from specsplit.v1 import (
    common_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2_grpc,
)
from tests.integration.services import (
    ROLES,
    Services,
    free_port,
    generate,
    ids_of,
    token_request,
)
from tests.support import save_tiny_llama
from verifier.engine import VerifierEngine
from verifier.servicer import VerifierServicer

KEY, OTHER_KEY = "sk-right-key", "sk-second-key"
# a client of its own: gRPC shares one connection among a process's channels with equal options
OWN_CONNECTION = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
PROMPT = list(range(10, 50))  # 40 tokens: 3 pages of 16


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> LocalPKI:
    return make_local_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stranger_pki(tmp_path_factory: pytest.TempPathFactory) -> LocalPKI:
    """Another CA, with a "gateway" client certificate the services must not accept."""
    return make_local_pki(tmp_path_factory.mktemp("stranger"))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("security") / "target", seed=3)


def _verifier(target_dir: Path, orphan_grace_s: float = 5.0) -> VerifierServicer:
    return VerifierServicer(
        lambda: VerifierEngine.load(str(target_dir), num_pages=64), orphan_grace_s=orphan_grace_s
    )


def _engine(servicer: VerifierServicer) -> VerifierEngine:
    engine = servicer.engine.loaded
    assert engine is not None
    return engine


async def _host(servable: Any, tls: TLSFiles | None = None, **kwargs: Any) -> ServiceHost:
    host = ServiceHost(servable, "127.0.0.1:0", grace=0.1, tls=tls, **kwargs)
    await host.start()
    await host.load()
    return host


def _prefill(seq_id: str, begin: bool = True, committed: int = 0) -> VerifyInput:
    pending = PROMPT if begin else [7]
    return VerifyInput(seq_id, begin, committed, pending, DraftTree())


async def _pages_used(address: str) -> int:
    async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as ch:
        response = await verifier_pb2_grpc.VerifierStub(ch).Release(common_pb2.ReleaseRequest())
        return int(response.num_pages_used)


# -- mutual TLS on the internal links -------------------------------------------------------


async def _refused(open_round: Callable[[grpc.aio.Channel], Awaitable[Any]], ch: Any) -> str:
    """The details of the UNAVAILABLE a client gets when its round is refused at the handshake."""
    async with ch:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(open_round(ch), 10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    return refused.value.details() or ""


async def _health_check(ch: grpc.aio.Channel) -> Any:
    return await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())


def test_stranger_without_a_client_certificate_cannot_open_a_stream_to_verifier_or_drafter(
    target_dir: Path, pki: LocalPKI, stranger_pki: LocalPKI
) -> None:
    async def verify_round(ch: grpc.aio.Channel) -> Any:
        call = verifier_pb2_grpc.VerifierStub(ch).VerifyStream()
        await call.write(convert.verify_request_to_proto([_prefill("s")]))
        return await call.read()

    async def draft_round(ch: grpc.aio.Channel) -> Any:
        call = drafter_pb2_grpc.DrafterStub(ch).DraftStream()
        item = DraftInput("s", True, 0, PROMPT, SpecParams(2, 1, 2))
        await call.write(convert.draft_request_to_proto([item]))
        return await call.read()

    async def run() -> None:
        verifier_servicer = _verifier(target_dir)
        verifier = await _host(verifier_servicer, pki.files("verifier"))
        drafter = await _host(
            DrafterServicer(lambda: DrafterEngine.load("ngram", None)), pki.files("drafter")
        )
        try:
            for host, round_ in ((verifier, verify_round), (drafter, draft_round)):
                address = f"localhost:{host.port}"
                no_cert = TLSFiles(ca=pki.ca)  # trusts the service, shows no certificate
                stranger_cert = stranger_pki.files("gateway")
                wrong_ca = TLSFiles(stranger_cert.cert, stranger_cert.key, ca=pki.ca)
                for stranger in (
                    channel(address, no_cert, OWN_CONNECTION),
                    channel(address, wrong_ca, OWN_CONNECTION),
                    grpc.aio.insecure_channel(address, options=OWN_CONNECTION),
                ):
                    await _refused(round_, stranger)
                await _refused(_health_check, channel(address, no_cert, OWN_CONNECTION))
            # the gateway's certificate opens both
            gateway_tls = pki.files("gateway")
            verifier_client = GrpcVerifierClient(f"localhost:{verifier.port}", gateway_tls)
            drafter_client = GrpcDrafterClient(f"127.0.0.1:{drafter.port}", gateway_tls)
            out = await verifier_client.verify([_prefill("s")])
            assert out[0].kv_committed_len == len(PROMPT)
            drafted = await drafter_client.draft([DraftInput("s", True, 0, PROMPT, SpecParams())])
            assert drafted[0].seq_id == "s"
            await verifier_client.release(["s"])
            await drafter_client.release(["s"])
            assert _engine(verifier_servicer).num_pages_used == 0
            await verifier_client.close()
            await drafter_client.close()
        finally:
            await verifier.stop()
            await drafter.stop()

    asyncio.run(run())


# -- sequence ids scoped to their connection ------------------------------------------------


def test_a_service_with_tls_on_a_unix_socket_opens_no_round_lane(
    target_dir: Path, pki: LocalPKI, tmp_path: Path
) -> None:
    """The round lane has no credentials: beside a TLS socket it would let anyone past mutual
    TLS. The service opens none and the gateway's client stays on gRPC."""
    address = f"unix:{tmp_path}/verifier.sock"

    async def run() -> None:
        host = ServiceHost(_verifier(target_dir), address, grace=0.1, tls=pki.files("verifier"))
        await host.start()
        await host.load()
        try:
            assert (tmp_path / "verifier.sock").exists()
            assert not (tmp_path / "verifier.sock.rounds").exists()
            assert GrpcVerifierClient(address, pki.files("gateway")).lane is None
            assert GrpcVerifierClient(address).lane is not None  # plaintext: the lane
        finally:
            await host.stop()

    asyncio.run(run())


def test_pre_created_guessed_seq_ids_on_the_verifier_do_not_break_a_real_clients_requests(
    target_dir: Path,
) -> None:
    async def run() -> None:
        servicer = _verifier(target_dir, orphan_grace_s=0.05)
        host = await _host(servicer)
        address = f"127.0.0.1:{host.port}"
        engine = _engine(servicer)
        try:
            async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as attacker:
                stub = verifier_pb2_grpc.VerifierStub(attacker)
                squat = stub.VerifyStream()
                guesses = [f"seq-{i}" for i in range(4)]
                await squat.write(convert.verify_request_to_proto([_prefill(s) for s in guesses]))
                assert len((await squat.read()).seq_ids) == 4

                gateway = GrpcVerifierClient(address)
                out = await gateway.verify([_prefill("seq-0")])  # refused before: "exists"
                assert out[0].seq_id == "seq-0" and out[0].kv_committed_len == len(PROMPT)
                # the attacker cannot release it either
                released = await stub.Release(common_pb2.ReleaseRequest(seq_ids=["seq-0"]))
                assert released.num_released == 1  # its own seq-0, not the gateway's
                out = await gateway.verify([_prefill("seq-0", False, len(PROMPT))])
                assert out[0].kv_committed_len == len(PROMPT) + 1
                await gateway.release(["seq-0"])
                await gateway.close()
                assert engine.num_pages_used == 3 * 3  # the attacker's three left
                squat.cancel()
            async with asyncio.timeout(10):  # its connection gone: its sequences are freed
                while await _pages_used(address):
                    await asyncio.sleep(0.02)
        finally:
            await host.stop()

    asyncio.run(run())


def test_dropped_internal_stream_frees_its_sequences(target_dir: Path) -> None:
    async def run() -> None:
        servicer = _verifier(target_dir, orphan_grace_s=0.3)
        host = await _host(servicer)
        address = f"127.0.0.1:{host.port}"
        try:
            gateway = GrpcVerifierClient(address)
            await gateway.verify([_prefill("a"), _prefill("b")])
            assert await _pages_used(address) == 6
            # a stream broken between rounds and reopened at once keeps the connection's state
            gateway.streams.close()
            out = await gateway.verify([_prefill("a", False, len(PROMPT))])
            assert out[0].kv_committed_len == len(PROMPT) + 1
            await gateway.close()  # the gateway goes away without releasing
            async with asyncio.timeout(10):
                while await _pages_used(address):
                    await asyncio.sleep(0.05)
            assert not _engine(servicer).seqs
        finally:
            await host.stop()

    asyncio.run(run())


def test_gateway_seq_ids_are_random_128_bit(smollm2_tokenizer: Any) -> None:
    scheduler = Scheduler(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        tokenizer=smollm2_tokenizer,
        eos_token_ids=(),
        default_spec=SpecParams(0, 1, 0),
    )
    ids = {scheduler._new_sequence(GenerationRequest([5, 6], 2)).seq_id for _ in range(64)}
    assert len(ids) == 64
    for seq_id in ids:
        digits = seq_id.removeprefix("seq-")
        assert len(digits) == 32 and int(digits, 16) >= 0, seq_id


# -- API keys on the gateway ----------------------------------------------------------------


class _Endless(gateway_pb2_grpc.GatewayServicer):
    """A Generate that streams one response and then waits for the client to go."""

    service_name = "specsplit.v1.Gateway"

    def register(self, server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(self, server)

    async def load(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.write(gateway_pb2.GenerateResponse(token_ids=[7], text="a"))
        await asyncio.Event().wait()


def _auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def _first(stub: Any, key: str | None) -> Any:
    call = stub.Generate(gateway_pb2.GenerateRequest(), metadata=_auth(key) if key else None)
    return call, await asyncio.wait_for(call.read(), 10)


def test_grpc_client_without_or_with_a_wrong_key_is_unauthenticated_health_stays_open(
    pki: LocalPKI,
) -> None:
    keys = ApiKeys([KEY, OTHER_KEY], max_concurrent_per_key=1)

    async def run() -> None:
        server_tls = pki.files("gateway", trust=False)  # TLS on the client API only
        host = await _host(_Endless(), server_tls, interceptors=[keys.grpc_interceptor()])
        client_tls = TLSFiles(ca=pki.ca)
        try:
            async with channel(f"localhost:{host.port}", client_tls, CHANNEL_OPTIONS) as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                for key in (None, "sk-wrong", KEY + "x", KEY[:-1]):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await _first(stub, key)
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, key
                call, first = await _first(stub, KEY)
                assert first.text == "a"
                # over the per-key limit: RESOURCE_EXHAUSTED; another key is not affected
                with pytest.raises(grpc.aio.AioRpcError) as over:
                    await _first(stub, KEY)
                assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                other, _ = await _first(stub, OTHER_KEY)
                call.cancel()
                other.cancel()
                async with asyncio.timeout(10):
                    while keys.in_flight():
                        await asyncio.sleep(0.01)
                again, _ = await _first(stub, KEY)  # the slot came back
                again.cancel()
                # health and reflection need no key
                health = health_pb2_grpc.HealthStub(ch)
                status = (await health.Check(health_pb2.HealthCheckRequest())).status
                assert status == health_pb2.HealthCheckResponse.SERVING
                reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
                request = reflection_pb2.ServerReflectionRequest(list_services="")
                async for answer in reflection.ServerReflectionInfo(iter([request])):
                    names = {s.name for s in answer.list_services_response.service}
                    assert "specsplit.v1.Gateway" in names
                    break
        finally:
            await host.stop()

    asyncio.run(run())


class _OneChunk:
    """The scheduler as the HTTP API sees it: one finished chunk, or held open."""

    def __init__(self) -> None:
        self.hold = asyncio.Event()

    async def generate(self, req: GenerationRequest, waiting_too: int = 0) -> AsyncIterator[Chunk]:
        if req.max_new_tokens == 99:
            await self.hold.wait()
        yield Chunk(token_ids=[7], text="a", finish_reason="stop", prompt_tokens=2)


def test_http_client_without_or_with_a_wrong_key_is_401_in_openai_error_shape(
    pki: LocalPKI,
) -> None:
    keys = ApiKeys([KEY], max_concurrent_per_key=1)
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 4}

    async def run() -> None:
        scheduler = _OneChunk()
        with ThreadPoolExecutor(1) as tokenize:
            model = ModelInfo(tokenizer=None, vocab_size=100, max_context=512)
            server = OpenAIServer(model, scheduler, "m", tokenize, keys)
            server.ready = True
            address = f"127.0.0.1:{free_port()}"
            await server.start(address, 0.5, http_ssl_context(pki.files("gateway", trust=False)))
            url = f"https://{address}"
            trust = ssl.create_default_context(cafile=pki.ca)
            try:
                async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(ssl=trust)
                ) as session:
                    for headers in (
                        {},
                        {"Authorization": "Bearer sk-wrong"},
                        {"Authorization": KEY},
                    ):
                        async with session.post(
                            f"{url}/v1/completions", json=body, headers=headers
                        ) as response:
                            assert response.status == 401, headers
                            error = (await response.json())["error"]
                            assert error["type"] == "invalid_request_error"
                            assert error["code"] == "invalid_api_key" and error["message"]
                            assert response.headers["WWW-Authenticate"] == "Bearer"
                    for path in ("/v1/models", "/v1/models/m"):
                        async with session.get(f"{url}{path}") as response:
                            assert response.status == 401, path
                    for path in ("/health", "/ping"):  # open: probes carry no key
                        async with session.get(f"{url}{path}") as response:
                            assert response.status == 200, path
                    auth = {"Authorization": f"Bearer {KEY}"}
                    async with session.post(
                        f"{url}/v1/completions", json=body, headers=auth
                    ) as response:
                        assert response.status == 200
                        assert (await response.json())["choices"][0]["text"] == "a"
                    held = asyncio.create_task(
                        session.post(
                            f"{url}/v1/completions", json={**body, "max_tokens": 99}, headers=auth
                        )
                    )
                    async with asyncio.timeout(10):
                        while not keys.in_flight():
                            await asyncio.sleep(0.01)
                    async with session.post(
                        f"{url}/v1/completions", json=body, headers=auth
                    ) as response:
                        assert response.status == 429
                        assert (await response.json())["error"]["code"] == "rate_limit_exceeded"
                    scheduler.hold.set()
                    async with await held as response:
                        assert response.status == 200
            finally:
                await server.stop()

    asyncio.run(run())


def test_each_choice_of_an_http_body_is_one_of_its_keys_concurrent_calls() -> None:
    keys = ApiKeys([KEY], max_concurrent_per_key=2)
    auth = {"Authorization": f"Bearer {KEY}"}

    async def run() -> None:
        with ThreadPoolExecutor(1) as tokenize:
            model = ModelInfo(tokenizer=None, vocab_size=100, max_context=512)
            server = OpenAIServer(model, _OneChunk(), "m", tokenize, keys)
            server.ready = True
            address = f"127.0.0.1:{free_port()}"
            await server.start(address, 0.5)
            try:
                async with aiohttp.ClientSession() as session:
                    for n, status in ((3, 429), (2, 200), (1, 200)):
                        body = {"model": "m", "prompt": [1, 2], "max_tokens": 4, "n": n}
                        async with session.post(
                            f"http://{address}/v1/completions", json=body, headers=auth
                        ) as response:
                            assert response.status == status, n
                            answer = await response.json()
                        if status == 429:
                            assert answer["error"]["code"] == "rate_limit_exceeded"
                            assert "2 more" in answer["error"]["message"], answer
                        else:
                            assert len(answer["choices"]) == n
                        assert keys.in_flight() == 0  # every slot given back
            finally:
                await server.stop()

    asyncio.run(run())


def test_no_key_configured_lets_every_client_in_and_keys_come_from_flags_or_env() -> None:
    open_gateway = ApiKeys(parse_keys(None, None))
    assert not open_gateway.enabled and "no API key" in open_gateway.describe()
    open_gateway.acquire(None)()  # no key needed, nothing held
    with pytest.raises(Refused) as refused:
        ApiKeys([KEY]).acquire(None)
    assert refused.value.grpc_code == grpc.StatusCode.UNAUTHENTICATED
    assert parse_keys(None, f" {KEY},{OTHER_KEY},") == (KEY, OTHER_KEY)
    assert parse_keys([OTHER_KEY], KEY) == (OTHER_KEY,)  # flags beat the environment


# -- the three services as processes: mutual TLS inside, TLS and an API key outside -----------


def test_services_with_mutual_tls_and_an_api_key_serve_the_keyholder_only(
    tmp_path: Path, pki: LocalPKI, smollm2_tokenizer: Any
) -> None:
    model = save_tiny_llama(
        tmp_path / "target", seed=5, vocab_size=49152, tokenizer=smollm2_tokenizer
    )
    gateway = pki.files("gateway")

    def tls_flags(prefix: str, tls: TLSFiles) -> list[str]:
        pairs = (("-cert", tls.cert), ("-key", tls.key), ("-ca", tls.ca))
        return [arg for suffix, path in pairs if path for arg in (f"{prefix}{suffix}", str(path))]

    svc = Services(
        str(model),
        tmp_path,
        extra={
            "verifier": tls_flags("--tls", pki.files("verifier")),
            "drafter": ["--drafter", "ngram", *tls_flags("--tls", pki.files("drafter"))],
            "gateway": [
                *tls_flags("--tls", TLSFiles(gateway.cert, gateway.key)),
                *tls_flags("--backend-tls", gateway),
            ],
        },
        env={"gateway": {"SPECSPLIT_API_KEY": f"{OTHER_KEY},{KEY}"}},
        credentials=dict.fromkeys(ROLES, tls.channel_credentials(gateway)),
    )
    try:
        svc.start_all()
        stub = svc.gateway()
        request = token_request(PROMPT, 8, ignore_eos=True)
        with pytest.raises(grpc.RpcError) as refused:
            generate(stub, request)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        responses = list(stub.Generate(request, metadata=_auth(KEY), timeout=60))
        assert len(ids_of(responses)) == 8
        assert responses[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        # `specsplit generate` with the key and the CA
        args = cli.parse_args(["generate", "hi", "--max-tokens", "4", "--api-key", KEY])
        args.tls_ca = pki.ca
        assert asyncio.run(cli_generate.stream_generation(svc.address("gateway"), "hi", args)) == 0
        # a stranger reaches neither the verifier nor the drafter
        for role in ("verifier", "drafter"):
            with grpc.insecure_channel(svc.address(role)) as plain:
                with pytest.raises(grpc.RpcError) as stranger:
                    health_pb2_grpc.HealthStub(plain).Check(
                        health_pb2.HealthCheckRequest(), timeout=5
                    )
                assert stranger.value.code() == grpc.StatusCode.UNAVAILABLE, role
        svc.wait_no_pages_used()
    finally:
        codes = svc.stop_all()
    assert all(code == 0 for code in codes.values()), (codes, {r: svc.log(r) for r in codes})
