"""A first round's prompt log-probabilities (VerifyInput.prompt_logprobs, vLLM's
`prompt_logprobs`, OpenAI's `echo` with `logprobs`): each prompt token's but the first's under the
target at the row before it, with the most likely tokens there, as one full forward gives them;
asking changes no token of the round; only the asking sequence gets them; a round that is not
a sequence's first, or asks out of range, is refused; they cross the wire."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from specsplit.convert import (
    verify_request_from_proto,
    verify_request_to_proto,
    verify_response_from_proto,
    verify_response_to_proto,
)
from specsplit.errors import Code, ServiceError
from specsplit.messages import NO_LOGPROBS, TokenLogprobs, VerifyInput, VerifyOutput
from specsplit.tree import DraftTree
from tests.unit.test_verify_logprobs import (  # noqa: F401  (fixtures)
    PROMPT,
    _assert_close,
    _engine,
    _expected,
    device,
    reference,
    target_dir,
)


@pytest.mark.parametrize(("page_size", "width"), [(1, 3), (4, 0), (4, 5)])
def test_prompt_logprobs_are_the_full_forwards(
    target_dir: Path,  # noqa: F811
    reference: LlamaForCausalLM,  # noqa: F811
    device: str,  # noqa: F811
    page_size: int,
    width: int,
) -> None:
    """Two first rounds in one batch, the asking one with a tree (its root's and nodes' rows
    after the prompt's) and asking for its new tokens' too, beside one that asks for neither:
    the asker's prompt entries are the full forward's, its new tokens and the other's are those
    of the same batch without the asks."""
    runs = []
    for ask in (NO_LOGPROBS, width):
        engine = _engine(target_dir, device, page_size)
        tree = DraftTree(tokens=[3, 11, 40], parents=[-1, 0, -1])
        outs = engine.verify(
            [
                VerifyInput("a", True, 0, PROMPT, tree, logprobs=ask, prompt_logprobs=ask),
                VerifyInput("b", True, 0, PROMPT[2:], DraftTree()),
            ]
        )
        runs.append(outs)
        engine.release(["a", "b"])
        assert engine.num_pages_used == 0
    plain, asked = runs
    assert [o.new_tokens for o in plain] == [o.new_tokens for o in asked]
    assert plain[0].prompt_logprobs is None and asked[1].prompt_logprobs is None
    _assert_close(asked[0].prompt_logprobs, _expected(reference, PROMPT, 1, width), device)
    tokens = [*PROMPT, *asked[0].new_tokens]
    _assert_close(asked[0].logprobs, _expected(reference, tokens, len(PROMPT), width), device)


def test_a_one_token_prompt_has_no_entries(target_dir: Path, device: str) -> None:  # noqa: F811
    engine = _engine(target_dir, device)
    out = engine.verify([VerifyInput("s", True, 0, PROMPT[:1], DraftTree(), prompt_logprobs=2)])
    assert out[0].prompt_logprobs == TokenLogprobs()
    engine.release(["s"])


@pytest.mark.parametrize("ask", [-2, 21])
def test_prompt_logprobs_out_of_range_or_past_the_first_round_refused(
    target_dir: Path,  # noqa: F811
    device: str,  # noqa: F811
    ask: int,
) -> None:
    engine = _engine(target_dir, device)
    with pytest.raises(ServiceError) as err:
        engine.verify([VerifyInput("s", True, 0, PROMPT, DraftTree(), prompt_logprobs=ask)])
    assert err.value.code == Code.INVALID_ARGUMENT
    first = engine.verify([VerifyInput("s", True, 0, PROMPT, DraftTree())])[0]
    later = VerifyInput("s", False, len(PROMPT), [first.bonus_token], DraftTree())
    later.prompt_logprobs = 1
    with pytest.raises(ServiceError) as err:
        engine.verify([later])
    assert err.value.code == Code.INVALID_ARGUMENT and "first round" in err.value.message
    engine.release(["s"])
    assert engine.num_pages_used == 0


def test_prompt_logprobs_cross_the_wire() -> None:
    inputs = [
        VerifyInput("a", True, 0, [4, 5, 6], DraftTree(), prompt_logprobs=2),
        VerifyInput("b", True, 0, [6, 7], DraftTree(), logprobs=1),
    ]
    back = verify_request_from_proto(verify_request_to_proto(inputs))
    assert [item.prompt_logprobs for item in back] == [2, NO_LOGPROBS]
    assert [item.logprobs for item in back] == [NO_LOGPROBS, 1]
    assert not verify_request_to_proto(inputs[1:]).prompt_logprobs
    prompt = TokenLogprobs([-0.5, -1.25], [[3, 4], [5, 6]], [[-0.25, -2.0], [-0.5, -3.0]])
    outputs = [
        VerifyOutput("a", [], 10, 3, prompt_logprobs=prompt),
        VerifyOutput("b", [], 11, 2, logprobs=TokenLogprobs([-0.5], [[]], [[]])),
    ]
    read = verify_response_from_proto(verify_response_to_proto(outputs, verify_ns=1))
    assert read[0].prompt_logprobs == prompt and read[0].logprobs is None
    assert read[1].prompt_logprobs is None and read[1].logprobs == outputs[1].logprobs
    plain = verify_response_to_proto(outputs[1:], verify_ns=1)
    assert not plain.HasField("prompt_logprobs")
