"""Log-probabilities on the gateway: a round's are cut with its tokens where the stop rules cut
them; a choice lists the tokens whose text it returns (not the stop token ending it); a token's
bytes are its own, also where it holds part of a character; completions' text offsets count the
listed tokens' text."""

from __future__ import annotations

import pytest

from gateway.openai_logprobs import TokenTexts, chat_logprobs, completion_logprobs, listed_tokens
from gateway.request import Chunk, GenerationRequest
from gateway.sequence import Sequence
from gateway.stopping import StopChecker
from gateway.text import IncrementalDetokenizer
from specsplit.messages import SpecParams, TokenLogprobs, VerifyOutput

EOS = 2


def _logprobs(n: int) -> TokenLogprobs:
    return TokenLogprobs(
        [-0.1 * (i + 1) for i in range(n)],
        [[100 + i, 200 + i] for i in range(n)],
        [[-0.05, -3.0] for _ in range(n)],
    )


def _sequence(tokenizer, max_new_tokens: int, stop: tuple[str, ...] = ()) -> Sequence:
    prompt = tokenizer.encode("Hello")
    request = GenerationRequest(prompt, max_new_tokens, stop_strings=stop, logprobs=2)
    checker = StopChecker(
        IncrementalDetokenizer(tokenizer, prompt),
        eos_token_ids=[EOS],
        max_new_tokens=max_new_tokens,
        stop_strings=stop,
    )
    seq = Sequence("s", request, SpecParams(), checker, tokens=list(prompt))
    seq.num_prompt_tokens = len(prompt)
    return seq


def test_logprobs_are_cut_with_the_tokens_at_max_new_tokens(smollm2_tokenizer) -> None:
    seq = _sequence(smollm2_tokenizer, max_new_tokens=3)
    words = smollm2_tokenizer.encode(" one two three four five")
    out = VerifyOutput("s", words[:4], words[4], len(seq.tokens) + 4, logprobs=_logprobs(5))
    committed = seq.commit(out)
    assert committed.token_ids == words[:3]
    assert committed.logprobs == _logprobs(5).cut(3)
    chunk = seq.chunk(committed)
    assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.token_ids) == 3


def test_logprobs_are_cut_at_a_stop_string(smollm2_tokenizer) -> None:
    seq = _sequence(smollm2_tokenizer, max_new_tokens=10, stop=(" three",))
    words = smollm2_tokenizer.encode(" one two three four")
    out = VerifyOutput("s", words[:-1], words[-1], len(seq.tokens) + len(words) - 1)
    out.logprobs = _logprobs(len(words))
    committed = seq.commit(out)
    kept = len(committed.token_ids)
    assert kept < len(words) and seq.finish_reason == "stop"
    assert committed.logprobs == _logprobs(len(words)).cut(kept)


def test_a_choice_does_not_list_the_stop_token_that_ends_it() -> None:
    lp = _logprobs(3)
    ending = Chunk(token_ids=[11, 12, EOS], text="ab", finish_reason="stop", logprobs=lp)
    assert [e[0] for e in listed_tokens(ending, frozenset({EOS}))] == [11, 12]
    at_length = Chunk(token_ids=[11, 12, EOS], text="ab", finish_reason="length", logprobs=lp)
    assert [e[0] for e in listed_tokens(at_length, frozenset({EOS}))] == [11, 12, EOS]
    going_on = Chunk(token_ids=[11, EOS, 13], text="ab", logprobs=lp)  # (ignore_eos)
    assert listed_tokens(going_on, frozenset()) == [
        (11, -0.1, [(100, -0.05), (200, -3.0)]),
        (EOS, -0.2, [(101, -0.05), (201, -3.0)]),
        (13, -0.30000000000000004, [(102, -0.05), (202, -3.0)]),
    ]
    assert listed_tokens(Chunk(token_ids=[11], text="a"), frozenset()) == []


def test_token_bytes_are_the_tokens_own_also_for_part_of_a_character(smollm2_tokenizer) -> None:
    texts = TokenTexts(smollm2_tokenizer)
    ids = smollm2_tokenizer.encode("snow ☃ flake")
    pieces = [bytes(texts(t)[1]) for t in ids]
    assert b"".join(pieces) == "snow ☃ flake".encode()
    assert any("\ufffd" in texts(t)[0] for t in ids)  # (☃ spans tokens: its bytes split)
    assert texts(ids[0]) is texts(ids[0])  # made once


def test_completion_offsets_count_the_listed_tokens_text(smollm2_tokenizer) -> None:
    texts = TokenTexts(smollm2_tokenizer)
    ids = smollm2_tokenizer.encode(" one two")
    entries = [(t, -0.5, [(t, -0.5)]) for t in ids]
    block, end = completion_logprobs(entries, texts, offset=4)
    assert "".join(block["tokens"]) == " one two"
    assert block["text_offset"][0] == 4 and end == 4 + len(" one two")
    assert block["top_logprobs"][0] == {block["tokens"][0]: -0.5}
    chat = chat_logprobs(entries, texts)["content"]
    assert [c["token"] for c in chat] == block["tokens"]
    assert chat[0]["top_logprobs"] == [
        {"token": chat[0]["token"], "logprob": -0.5, "bytes": chat[0]["bytes"]}
    ]


def test_grpc_asks_are_checked_and_chunks_carry_one_entry_per_token(smollm2_tokenizer) -> None:
    from gateway.request import ModelInfo
    from gateway.servicer import chunk_to_proto, generation_request
    from specsplit.errors import Code, ServiceError
    from specsplit.v1 import gateway_pb2

    model = ModelInfo(smollm2_tokenizer, smollm2_tokenizer.vocab_size, 2048)
    msg = gateway_pb2.GenerateRequest(text="Hi", max_new_tokens=4, logprobs=3)
    assert generation_request(msg, model).logprobs == 3
    unasked = gateway_pb2.GenerateRequest(text="Hi", max_new_tokens=4)
    assert generation_request(unasked, model).logprobs is None
    msg.logprobs = 21
    with pytest.raises(ServiceError) as err:
        generation_request(msg, model)
    assert err.value.code == Code.INVALID_ARGUMENT and "logprobs" in err.value.message
    chunk = Chunk(token_ids=[11, EOS], text="a", finish_reason="stop", logprobs=_logprobs(2))
    entries = chunk_to_proto(chunk, 0).logprobs
    assert [e.token_id for e in entries] == [11, EOS]  # (the EOS too: token_ids' order)
    assert [[t.token_id for t in e.top_logprobs] for e in entries] == [[100, 200], [101, 201]]
    assert entries[1].logprob == pytest.approx(-0.2)
