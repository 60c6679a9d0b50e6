"""Request options that change the prompt or the text (vLLM's): truncate_prompt_tokens, a
request reading its prompt's last k tokens (after the chat template), a token-id prompt past
the context included, k outside [1, context - 1] and a session's turn refused naming it; and
skip_special_tokens false streaming special tokens' text (a bias makes the target emit one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.request import GenerationRequest, InvalidField, ModelInfo, build_request
from gateway.servicer import generation_request
from specsplit.logit_rules import Penalties
from specsplit.messages import SpecParams
from specsplit.prompt import apply_chat_template
from specsplit.sampling import SamplingParams
from specsplit.v1 import gateway_pb2
from tests.support import generate_all, make_stack, save_tiny_llama

CONTEXT = 64


def _model(tokenizer) -> ModelInfo:  # type: ignore[no-untyped-def]
    return ModelInfo(tokenizer, tokenizer.vocab_size, CONTEXT)


def test_the_prompts_last_tokens_are_kept(smollm2_tokenizer) -> None:
    model = _model(smollm2_tokenizer)
    ids = list(range(100, 100 + 3 * CONTEXT))  # past the context: allowed when truncating
    kept = build_request(
        model, "token_ids", ids, max_new_tokens=4, sampling=SamplingParams(),
        truncate_prompt_tokens=10,
    )  # fmt: skip
    assert kept.prompt_ids == ids[-10:]
    chat = [{"role": "user", "content": "Tell me a story about a cat."}]
    whole = apply_chat_template(smollm2_tokenizer, chat)
    kept = build_request(
        model, "chat", chat, max_new_tokens=4, sampling=SamplingParams(), truncate_prompt_tokens=5
    )
    assert kept.prompt_ids == whole[-5:]
    msg = gateway_pb2.GenerateRequest(max_new_tokens=4, truncate_prompt_tokens=3)
    msg.token_ids.ids.extend(ids[:20])
    assert generation_request(msg, model).prompt_ids == ids[17:20]
    with pytest.raises(InvalidField) as err:  # not truncating: past the context
        build_request(model, "token_ids", ids, max_new_tokens=4, sampling=SamplingParams())
    assert err.value.field == "prompt"


@pytest.mark.parametrize(("k", "session"), [(0, None), (CONTEXT, None), (5, "s")])
def test_refused_naming_it(smollm2_tokenizer, k: int, session: str | None) -> None:
    with pytest.raises(InvalidField) as err:
        build_request(
            _model(smollm2_tokenizer), "text", "Hello there", max_new_tokens=4,
            sampling=SamplingParams(), truncate_prompt_tokens=k, session_id=session,
        )  # fmt: skip
    assert err.value.field == "truncate_prompt_tokens"


def test_special_tokens_text_streams_when_not_skipped(tmp_path: Path, smollm2_tokenizer) -> None:
    """The target made to emit <|im_start|> (id 1, a +100 bias): its text is in the stream with
    skip_special_tokens false, not with the default; a session's turn refuses false."""
    target = save_tiny_llama(tmp_path / "target", seed=0)
    stack = make_stack(target, "ngram", smollm2_tokenizer, SpecParams(0, 1, 0))
    bias = Penalties(bias=((1, 100.0),))
    requests = [
        GenerationRequest([5, 6, 7], 4, ignore_eos=True, penalties=bias, skip_special_tokens=skip)
        for skip in (True, False)
    ]
    skipped, kept = ("".join(c.text for c in chunks) for chunks in generate_all(stack, requests))
    assert kept == "<|im_start|>" * 4 and skipped == ""
    with pytest.raises(InvalidField) as err:
        build_request(
            _model(smollm2_tokenizer), "text", "Hi", max_new_tokens=4, sampling=SamplingParams(),
            session_id="s", skip_special_tokens=False,
        )  # fmt: skip
    assert err.value.field == "skip_special_tokens"
