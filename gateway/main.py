"""Entry point of the gateway service (`specsplit serve-gateway`).

The gateway reads only the target's tokenizer and config (context length, vocabulary, EOS ids);
the weights live on the verifier. It is SERVING once the verifier's health check says SERVING.
The drafter is optional: while it is down the scheduler decodes without drafts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import grpc

from gateway.adaptive import format_ladder
from gateway.auth import ApiKeys
from gateway.decode_steps import QUIET_SECONDS
from gateway.draft_ahead import DEFAULT_AHEAD_GUESSES, DEFAULT_AHEAD_MAX_BATCH, DEFAULT_AHEAD_MISS
from gateway.faults import DEFAULT_VERIFIER_WAIT_S
from gateway.grpc_clients import GrpcDrafterClient, GrpcVerifierClient, wait_ready
from gateway.openai_http import OpenAIServer
from gateway.request import DEFAULT_LIMITS, Limits
from gateway.requests_lifecycle import DEFAULT_MAX_WAITING, SHUTTING_DOWN
from gateway.scheduler import Scheduler
from gateway.servicer import GatewayServicer, ModelInfo
from gateway.sessions import DEFAULT_SESSION_TTL_S
from specsplit.messages import SpecParams
from specsplit.model.loader import load_config, load_tokenizer
from specsplit.server import serve as serve_host
from specsplit.tls import TLSFiles, http_ssl_context

log = logging.getLogger(__name__)

WAIT_LOG_INTERVAL_S = 10.0
# At shutdown, after the drain ended every request: how long HTTP handlers get to send their end.
HTTP_END_S = 1.0


def read_model_info(model_path: str) -> ModelInfo:
    """Tokenizer, vocabulary size, context length and EOS ids of a checkpoint directory or a
    .gguf file (the EOS ids merge the config's, the generation config's and the tokenizer's)."""
    tokenizer = load_tokenizer(model_path)
    config = load_config(model_path)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    eos_ids = config.eos_token_ids + ((tokenizer_eos,) if tokenizer_eos is not None else ())
    return ModelInfo(
        tokenizer=tokenizer,
        vocab_size=config.vocab_size,
        max_context=config.max_position_embeddings,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
    )


class GatewayService:
    """The gateway as specsplit.server hosts it: ready once the verifier is."""

    service_name = GatewayServicer.service_name

    def __init__(
        self,
        servicer: GatewayServicer,
        scheduler: Scheduler,
        drafter: GrpcDrafterClient,
        verifier: GrpcVerifierClient,
        http: OpenAIServer | None = None,
        http_listen: str = "",
        grace: float = 5.0,
        tls: TLSFiles | None = None,
    ) -> None:
        self.http = http  # the OpenAI-compatible API, on http_listen
        self.http_listen = http_listen
        self.grace = grace
        self.tls = tls or TLSFiles()  # the HTTP API's certificate (the gRPC API's too)
        self.servicer = servicer
        self.scheduler = scheduler
        self.drafter = drafter
        self.verifier = verifier

    def register(self, server: grpc.aio.Server) -> None:
        self.servicer.register(server)

    async def load(self) -> None:
        await self.scheduler.start()
        if self.http is not None:  # 503 until the verifier is SERVING
            await self.http.start(self.http_listen, HTTP_END_S, http_ssl_context(self.tls))
        started = time.monotonic()
        log.info("waiting for the verifier at %s", self.verifier.address)
        while not await wait_ready(
            self.verifier.address, WAIT_LOG_INTERVAL_S, tls=self.verifier.tls
        ):
            log.info(
                "still waiting for the verifier at %s (%.0f s)",
                self.verifier.address,
                time.monotonic() - started,
            )
        drafter_up = await wait_ready(self.drafter.address, 0.0, tls=self.drafter.tls)
        log.info(
            "verifier at %s is SERVING; drafter at %s is %s",
            self.verifier.address,
            self.drafter.address,
            "SERVING" if drafter_up else "not serving yet (decoding without drafts until it is)",
        )
        if self.http is not None:
            self.http.ready = True

    async def drain(self, grace: float) -> None:
        """Shutting down: refuse new requests (gRPC UNAVAILABLE, HTTP 503), let the running ones
        finish for `grace` seconds, then end the rest with UNAVAILABLE after the tokens they
        streamed (an SSE stream gets an error event and [DONE]). Their handlers send that end
        while the servers still run."""
        self.servicer.draining = True
        if self.http is not None:
            self.http.draining = True
        if await self.scheduler.drain(grace):
            return
        num_left = len(self.scheduler.running) + len(self.scheduler.waiting)
        log.info("grace period over: ending %d requests with UNAVAILABLE", num_left)
        await self.scheduler.stop(
            f"{SHUTTING_DOWN}: the request did not finish within the {grace:g} s grace period"
        )

    async def close(self) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.scheduler.stop()
        self.servicer.close()
        await self.drafter.close()
        await self.verifier.close()


async def serve(
    address: str,
    model_path: str,
    *,
    drafter_address: str,
    verifier_address: str,
    default_spec: SpecParams,
    max_batch_size: int = 64,
    grace: float = 5.0,
    http_listen: str | None = None,
    served_model_name: str | None = None,
    adaptive_spec: bool = False,
    adaptive_rungs: tuple[SpecParams, ...] | None = None,
    api_keys: ApiKeys | None = None,
    tls: TLSFiles | None = None,
    backend_tls: TLSFiles | None = None,
    limits: Limits = DEFAULT_LIMITS,
    max_waiting: int = DEFAULT_MAX_WAITING,
    verifier_wait_s: float = DEFAULT_VERIFIER_WAIT_S,
    overlap: str = "serial",
    session_ttl_s: float = DEFAULT_SESSION_TTL_S,
    speculation_gate: bool = False,
    ahead_guesses: int = DEFAULT_AHEAD_GUESSES,
    ahead_miss: str = DEFAULT_AHEAD_MISS,
    verify_ahead: bool = True,
    ahead_max_batch: int = DEFAULT_AHEAD_MAX_BATCH,
    round_lane: bool = True,
    lane_poll_s: float = 0.0,
    decode_steps: int = 1,
    adaptive_decode_steps: bool = False,
    decode_steps_quiet_s: float = QUIET_SECONDS,
    decode_lookup: int = 0,
    decode_lookup_max_batch: int = 2,
    prefill_chunk: int = 0,
    prefill_rounds_one_step: bool = True,
    early_verify: bool = False,
    cpu_cores: frozenset[int] | None = None,
) -> None:
    """Listen on `address` (and the OpenAI HTTP API on `http_listen`, None = off) until
    SIGTERM / SIGINT; SERVING once the verifier is. adaptive_spec: adaptive speculation over
    `adaptive_rungs` (None = the default ladder) and `default_spec` (gateway/adaptive.py).
    api_keys: who may call (None = everyone); tls: the client APIs' certificate (None =
    plaintext); backend_tls: the gateway's client certificate and the CA of the drafter's and
    verifier's (mutual TLS; None = plaintext). limits: what one request may ask (tree shape,
    max_new_tokens, prompt and message size); max_waiting: the waiting queue's length.
    verifier_wait_s: how long running requests wait for a verifier that went away (restarting,
    loading: its health) before they end with UNAVAILABLE. overlap: the scheduler's rounds,
    "serial", "groups" (pipelined groups), "gated" (groups, draft-ahead or serial rounds,
    whichever is measured fastest per batch size), "ahead" (draft-ahead, `ahead_guesses` bonus
    tokens guessed per accept length; `ahead_miss`: what a round not guessed does;
    `verify_ahead`: the trees drafted ahead go to the verifier as a hint) or "both"
    (draft-ahead while at most `ahead_max_batch` requests run, groups above). session_ttl_s:
    idle sessions' default lifetime. round_lane: a drafter or verifier on a Unix socket is
    reached on its round lane (specsplit.lane), the event loop polling up to `lane_poll_s` for
    each answer before it sleeps.
    speculation_gate: draft only while it pays, measured (gateway/gate.py). decode_steps: the
    tokens a plain round decodes in one Verify (adaptive_decode_steps: grown from it where the
    verifier's device idles between rounds, once no request arrived for
    `decode_steps_quiet_s`: gateway/decode_steps.py; prefill_rounds_one_step: one step in a
    round that starts a sequence; prefill_chunk: a long prompt's tokens a round). early_verify:
    groups send the other group's Verify while one is in flight (Scheduler)."""
    default_spec.validate()
    api_keys = api_keys or ApiKeys(())
    log.info("%s", api_keys.describe())
    log.info("reading the tokenizer and config of %s", model_path)
    model = await asyncio.to_thread(read_model_info, model_path)
    log.info(
        "vocabulary %d, context %d, EOS ids %s",
        model.vocab_size,
        model.max_context,
        list(model.eos_token_ids),
    )
    drafter = GrpcDrafterClient(drafter_address, backend_tls, round_lane, lane_poll_s)
    verifier = GrpcVerifierClient(verifier_address, backend_tls, round_lane, lane_poll_s)
    scheduler = Scheduler(
        drafter,
        verifier,
        tokenizer=model.tokenizer,
        eos_token_ids=model.eos_token_ids,
        default_spec=default_spec,
        max_batch_size=max_batch_size,
        model_name=served_model_name or os.path.basename(os.path.normpath(model_path)),
        adaptive_spec=adaptive_spec,
        adaptive_rungs=adaptive_rungs,
        max_waiting=max_waiting,
        verifier_wait_s=verifier_wait_s,
        overlap=overlap,
        session_ttl_s=session_ttl_s,
        max_context=model.max_context,
        speculation_gate=speculation_gate,
        ahead_guesses=ahead_guesses,
        ahead_miss=ahead_miss,
        verify_ahead=verify_ahead,
        ahead_max_batch=ahead_max_batch,
        decode_steps=decode_steps,
        adaptive_decode_steps=adaptive_decode_steps,
        decode_steps_quiet_s=decode_steps_quiet_s,
        decode_lookup=decode_lookup,
        decode_lookup_max_batch=decode_lookup_max_batch,
        prefill_chunk=prefill_chunk,
        prefill_rounds_one_step=prefill_rounds_one_step,
        early_verify=early_verify,
    )
    if scheduler.gate is not None:
        log.info("speculation gate on: rounds draft while that pays, measured per batch size")
    if scheduler.adaptive_ladder is not None:
        log.info("adaptive speculation, ladder %s", format_ladder(scheduler.adaptive_ladder))
    servicer = GatewayServicer(model, scheduler, limits)
    scheduler.sessions.executor = servicer.tokenize_executor  # session turns' continuations
    http = None
    if http_listen is not None:
        name = served_model_name or os.path.basename(os.path.normpath(model_path))
        http = OpenAIServer(
            model, scheduler, name, servicer.tokenize_executor, api_keys, limits=limits
        )
    service = GatewayService(
        servicer, scheduler, drafter, verifier, http, http_listen or "", grace=grace, tls=tls
    )
    interceptors = [api_keys.grpc_interceptor()]
    await serve_host(
        service,
        address,
        grace=grace,
        tls=tls,
        interceptors=interceptors,
        max_receive_bytes=limits.max_message_bytes,
        cpu_cores=cpu_cores,
    )
