"""Guided decoding through the whole stack (gateway, drafter, verifier in process): the output
is a whole match of the guide's pattern ended by EOS, and speculative greedy output equals the
target's greedy decoding under the guide (each token the argmax of the target's row among the
tokens that keep the text matchable, one full forward a token), whatever drafts (the drafter
proposes unguided), batched beside an unguided request, in every overlap mode; sampled output
matches too. The gateway's rounds under a guide take one decode step each and carry one mask
per row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from gateway.guides import GuideAsk
from gateway.request import GenerationRequest, InvalidField, ModelInfo, build_request
from gateway.sequence import Sequence
from gateway.servicer import generation_request
from specsplit.errors import Code, ServiceError
from specsplit.guide.bad_words import BadWords, word_variants
from specsplit.guide.tokens import DEAD, ENDED, FixedTokens, TokenAutomaton
from specsplit.logit_rules import NO_MASK
from specsplit.messages import SpecParams
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from specsplit.v1 import gateway_pb2
from tests.support import TINY_VOCAB, generate_all, generated_ids, make_stack
from tests.unit.test_gateway_rules import _Rules
from tests.unit.test_lossless_greedy import _prompts, models  # noqa: F401  (a fixture)
from tests.unit.test_lossless_rules import MODES, Mode, mode_id, mode_stack

EOS = 2  # the tiny models' (and SmolLM2's <|im_end|>)
MAX_NEW_TOKENS = 40
PATTERN = r'\{"ok": (true|false), "n": [0-9]{1,3}, "s": "[a-z ]{0,8}"\}'
ALLOWED = [40, 41, 77, 300, 301, 302, 450]  # (allowed_token_ids; not EOS)
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "tag": {"enum": ["a", "bb", "c c"]}},
    "required": ["id", "tag"],
}


def _model(tokenizer) -> ModelInfo:  # type: ignore[no-untyped-def]
    return ModelInfo(tokenizer, TINY_VOCAB, 4096, (EOS,))


def _guided(tokenizer, prompt: list[int], ask: GuideAsk, **kwargs) -> GenerationRequest:  # type: ignore[no-untyped-def]
    return build_request(
        _model(tokenizer), "token_ids", prompt, max_new_tokens=MAX_NEW_TOKENS,
        sampling=kwargs.pop("sampling", SamplingParams()), guide=ask, **kwargs,
    )  # fmt: skip


def _requests(tokenizer, bad: list[tuple[int, ...]]) -> list[GenerationRequest]:  # type: ignore[no-untyped-def]
    """Guided requests (a regex, a JSON schema, allowed token ids, `bad` words of the unguided
    one's prompt) and an unguided one beside them."""
    prompts = _prompts(4, seed=11)
    return [
        _guided(tokenizer, prompts[0], GuideAsk("guided_regex", "regex", PATTERN)),
        _guided(
            tokenizer,
            prompts[1],
            GuideAsk("guided_json", "json_schema", json.dumps(SCHEMA), whitespace=" ?"),
        ),
        GenerationRequest(prompts[2], 12, ignore_eos=True),
        build_request(
            _model(tokenizer),
            "token_ids",
            prompts[3],
            max_new_tokens=12,
            sampling=SamplingParams(),
            allowed_token_ids=ALLOWED,
        ),
        GenerationRequest(prompts[2], 12, ignore_eos=True, guide=BadWords(bad, TINY_VOCAB)),
    ]


def _reference(target: Path, request: GenerationRequest) -> list[int]:
    """The target's greedy tokens under the guide, a full float64 forward each."""
    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    guide = request.guide
    assert guide is not None
    out: list[int] = []
    state = 0
    while len(out) < request.max_new_tokens and state != ENDED:
        with torch.no_grad():
            row = hf(torch.tensor([request.prompt_ids + out])).logits[0, -1].float()
        words = guide.mask(state)
        assert words is not None
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:TINY_VOCAB]
        token = int(torch.where(torch.from_numpy(bits == 1), row, -torch.inf).argmax())
        out.append(token)
        state = guide.step(state, token)
    return out


def _text(tokenizer, ids: list[int]) -> str:  # type: ignore[no-untyped-def]
    return tokenizer.decode([t for t in ids if t != EOS])


@pytest.fixture(scope="module")
def bad(models: dict[str, Path], smollm2_tokenizer) -> list[tuple[int, ...]]:  # noqa: F811
    """Bad words the unguided request's output holds: its second token, and its fifth and sixth
    (a word of two tokens)."""
    plain = _requests(smollm2_tokenizer, [(3,)])[2]
    stack = make_stack(models["target"], "ngram", smollm2_tokenizer, SpecParams(0, 1, 0))
    out = generated_ids(generate_all(stack, [plain])[0])
    return [(out[1],), (out[4], out[5])]


@pytest.fixture(scope="module")
def expected(
    models: dict[str, Path],  # noqa: F811
    smollm2_tokenizer,
    bad: list[tuple[int, ...]],
) -> list[list[int]]:
    requests = _requests(smollm2_tokenizer, bad)
    stack = make_stack(models["target"], "ngram", smollm2_tokenizer, SpecParams(0, 1, 0))
    out = [generated_ids(chunks) for chunks in generate_all(stack, requests)]
    assert out[4] == _reference(models["target"], requests[4]) and out[4] != out[2]
    assert bad[0][0] not in out[4] and bad[1] not in set(zip(out[4], out[4][1:], strict=False))
    for request, ids in zip(requests[:2], out[:2], strict=True):
        assert ids == _reference(models["target"], request)
        assert ids[-1] == EOS  # (the match ended, not max_new_tokens)
    assert out[3] == _reference(models["target"], requests[3]) and set(out[3]) <= set(ALLOWED)
    assert len(out[3]) == 12  # (EOS not allowed)
    assert re.fullmatch(PATTERN, _text(smollm2_tokenizer, out[0]))
    value = json.loads(_text(smollm2_tokenizer, out[1]))
    assert isinstance(value["id"], int) and value["tag"] in SCHEMA["properties"]["tag"]["enum"]  # type: ignore[index]
    return out


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_speculative_greedy_under_a_guide_equals_target_greedy_under_it(
    models: dict[str, Path],  # noqa: F811
    smollm2_tokenizer,
    bad: list[tuple[int, ...]],
    expected: list[list[int]],
    mode: Mode,
) -> None:
    """(The guided requests take one decode step a round; no round of theirs is launched on a
    draft-ahead hint.)"""
    stack = mode_stack(models, smollm2_tokenizer, mode)
    out = generate_all(stack, _requests(smollm2_tokenizer, bad))
    assert [generated_ids(chunks) for chunks in out] == expected
    if mode[0] == "self":  # (the target's own drafts: the guide keeps many)
        accepted = [chunks[-1].stats.num_accepted_drafts for chunks in out[:2]]  # type: ignore[union-attr]
        assert sum(accepted) > 0, accepted


def test_sampled_guided_output_is_a_whole_match(
    models: dict[str, Path],  # noqa: F811
    smollm2_tokenizer,
) -> None:
    stack = make_stack(models["target"], "model", smollm2_tokenizer, SpecParams(3, 2, 6))
    prompts = _prompts(6, seed=4)
    requests = [
        _guided(smollm2_tokenizer, p, GuideAsk("guided_regex", "regex", PATTERN),
                sampling=SamplingParams(temperature=1.0, seed=i))
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    outs = [generated_ids(chunks) for chunks in generate_all(stack, requests)]
    ended = [ids for ids in outs if ids[-1] == EOS]
    assert len(ended) >= 4  # (the rest ran out of tokens: each a prefix of a match)
    for ids in ended:
        assert re.fullmatch(PATTERN, _text(smollm2_tokenizer, ids)), ids
    assert len({tuple(ids) for ids in outs}) > 1


def test_choice_gives_exactly_one_of_the_choices(
    models: dict[str, Path],  # noqa: F811
    smollm2_tokenizer,
) -> None:
    choices = ("yes", "no", "maybe so", "a.b*")
    stack = make_stack(models["target"], "model", smollm2_tokenizer, SpecParams(2, 1, 2))
    requests = [
        _guided(smollm2_tokenizer, p, GuideAsk("guided_choice", "choice", choices),
                sampling=SamplingParams(temperature=1.0, seed=i))
        for i, p in enumerate(_prompts(4, seed=8))
    ]  # fmt: skip
    for chunks in generate_all(stack, requests):
        assert "".join(c.text for c in chunks) in choices
        assert chunks[-1].finish_reason == "stop"


def test_a_guided_rounds_masks_follow_the_tree(smollm2_tokenizer) -> None:
    """The root's row and each node's carry the mask of the guide's state after the node's path;
    a node past a token the guide refuses carries none; plain rounds stay one step."""
    request = _guided(smollm2_tokenizer, [5, 6], GuideAsk("guided_regex", "regex", "ab|ac"))
    guide = request.guide
    assert isinstance(guide, TokenAutomaton)
    a, b, c, z = (smollm2_tokenizer.convert_tokens_to_ids(x) for x in "abcz")
    seq = Sequence("s", request, SpecParams(2, 2, 4), stop_checker=_Rules())  # type: ignore[arg-type]
    tree = DraftTree([a, z, b, c], [-1, -1, 0, 0])
    rules = seq.verify_input(tree).rules
    assert rules is not None and rules.allowed is not None
    rows = rules.allowed.rows
    assert rows[2] == NO_MASK and len({rows[0], rows[1], rows[3]}) == 3 and rows[3] == rows[4]
    masks = rules.allowed.masks(TINY_VOCAB)
    allows = [
        bool(masks[rows[r]][t // 32] >> (t % 32) & 1)
        for r, t in ((0, a), (0, z), (1, b), (1, c), (3, EOS))
    ]
    assert allows == [True, False, True, True, True]
    seq.verifier_begun = True
    assert seq.verify_input(DraftTree(), decode_steps=4).decode_steps == 1


@pytest.mark.parametrize(
    ("ask", "kwargs", "field"),
    [
        (GuideAsk("guided_regex", "regex", "(?=a)b"), {}, "guided_regex"),
        (GuideAsk("guided_regex", "regex", "a"), {"ignore_eos": True}, "ignore_eos"),
        (GuideAsk("guided_regex", "regex", "a"), {"min_tokens": 2}, "min_tokens"),
        (GuideAsk("guided_json", "json_schema", "{not json"), {}, "guided_json"),
        (
            GuideAsk("response_format", "json_schema", '{"type": "object", "not": {}}'),
            {},
            "response_format",
        ),
        (GuideAsk("guided_choice", "choice", ()), {}, "guided_choice"),
    ],
    ids=[
        "lookahead",
        "ignore-eos",
        "min-tokens",
        "schema-not-json",
        "unsupported-keyword",
        "no-choices",
    ],
)
def test_a_guide_it_cannot_hold_is_refused_naming_the_parameter(
    smollm2_tokenizer, ask: GuideAsk, kwargs: dict, field: str
) -> None:
    with pytest.raises(InvalidField) as err:
        _guided(smollm2_tokenizer, [5, 6], ask, **kwargs)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("guide", "good", "bad"),
    [
        ({"regex": "[0-9]+"}, "42", "4a"),
        ({"json_schema": json.dumps(SCHEMA)}, '{"id": 1, "tag": "bb"}', '{"id": 1}'),
        ({"json_object": True}, '{"a": 1}', "[]"),
        ({"choice": {"choices": ["up", "down"]}}, "down", "left"),
    ],
    ids=["regex", "json-schema", "json-object", "choice"],
)
def test_grpc_guide_becomes_the_requests_automaton(
    smollm2_tokenizer, guide: dict, good: str, bad: str
) -> None:
    msg = gateway_pb2.GenerateRequest(text="Hi", max_new_tokens=8, guide=gateway_pb2.Guide(**guide))
    request = generation_request(msg, _model(smollm2_tokenizer))
    assert isinstance(request.guide, TokenAutomaton)
    assert request.guide.dfa.matches(good) and not request.guide.dfa.matches(bad)


@pytest.mark.parametrize(
    "guide",
    [gateway_pb2.Guide(), gateway_pb2.Guide(json_object=False), gateway_pb2.Guide(regex="(?<=a)")],
    ids=["unset", "json-object-false", "lookbehind"],
)
def test_a_grpc_guide_it_cannot_hold_is_invalid_argument(smollm2_tokenizer, guide) -> None:
    msg = gateway_pb2.GenerateRequest(text="Hi", max_new_tokens=8, guide=guide)
    with pytest.raises(ServiceError) as err:
        generation_request(msg, _model(smollm2_tokenizer))
    assert err.value.code == Code.INVALID_ARGUMENT and "guide" in err.value.message


def test_grpc_allowed_token_ids_become_fixed_tokens(smollm2_tokenizer) -> None:
    msg = gateway_pb2.GenerateRequest(text="Hi", max_new_tokens=8, allowed_token_ids=[9, 5])
    request = generation_request(msg, _model(smollm2_tokenizer))
    assert isinstance(request.guide, FixedTokens) and request.guide.allowed == {5, 9}
    assert (
        generation_request(
            gateway_pb2.GenerateRequest(text="Hi", max_new_tokens=8), _model(smollm2_tokenizer)
        ).guide
        is None
    )


def test_grpc_bad_words_become_the_requests_words(smollm2_tokenizer) -> None:
    msg = gateway_pb2.GenerateRequest(text="Hi", max_new_tokens=8, bad_words=["hello world"])
    model = ModelInfo(smollm2_tokenizer, smollm2_tokenizer.vocab_size, 4096, (EOS,))
    request = generation_request(msg, model)
    assert isinstance(request.guide, BadWords)
    words = word_variants(smollm2_tokenizer, ["hello world"])
    assert request.guide.step(request.guide.walk(0, list(words[0][:-1])), words[0][-1]) == DEAD
