"""A request's logit bias and penalties on the gateway: the gRPC fields become its Penalties
(checked, each named when out of range; at their neutral values none), and each round's Verify
carries them with the output so far, the prompt's distinct tokens beside them where the
repetition penalty reads them."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.request import GenerationRequest, ModelInfo
from gateway.sequence import Sequence
from gateway.servicer import generation_request
from specsplit.errors import Code, ServiceError
from specsplit.guide.tokens import FixedTokens
from specsplit.logit_rules import LogitRules, Penalties, unpack_mask
from specsplit.messages import DraftRules, SpecParams, VerifyOutput
from specsplit.tree import DraftTree
from specsplit.v1 import common_pb2, gateway_pb2


def _model(tokenizer) -> ModelInfo:  # type: ignore[no-untyped-def]
    return ModelInfo(tokenizer, tokenizer.vocab_size, 2048)


def test_grpc_fields_become_the_requests_penalties(smollm2_tokenizer) -> None:
    msg = gateway_pb2.GenerateRequest(
        text="Hi", max_new_tokens=4, presence_penalty=0.5, frequency_penalty=-1.0,
        repetition_penalty=1.25, logit_bias={9: -100.0, 7: 2.5}, min_tokens=2, stop_token_ids=[5],
        min_p=0.1, sampling=common_pb2.SamplingParams(temperature=0.5),
        include_stop_str_in_output=True,
    )  # fmt: skip
    request = generation_request(msg, _model(smollm2_tokenizer))
    eos = tuple(sorted({*_model(smollm2_tokenizer).eos_token_ids, 5}))
    want = Penalties(((7, 2.5), (9, -100.0)), 0.5, -1.0, 1.25, 2, eos, 0.1)
    assert request.penalties == want
    assert request.min_tokens == 2 and request.include_stop_str
    neutral = gateway_pb2.GenerateRequest(text="Hi", max_new_tokens=4, repetition_penalty=1.0)
    assert generation_request(neutral, _model(smollm2_tokenizer)).penalties is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("nan")),
        ("logit_bias", {3: 100.5}),
        ("logit_bias", {10**7: 1.0}),
        ("logit_bias", {-1: 1.0}),
    ],
    ids=str,
)
def test_grpc_out_of_range_is_invalid_argument_naming_the_field(
    smollm2_tokenizer, field: str, value: object
) -> None:
    msg = gateway_pb2.GenerateRequest(text="Hi", max_new_tokens=4, **{field: value})
    with pytest.raises(ServiceError) as err:
        generation_request(msg, _model(smollm2_tokenizer))
    assert err.value.code == Code.INVALID_ARGUMENT and field in err.value.message


def test_each_round_carries_the_rules_with_the_output_so_far_until_the_verifier_keeps_them() -> (
    None
):
    """The first round sends the rules with their context (the prompt's distinct tokens where
    the repetition penalty reads them); once a round committed, the verifier keeps the context
    and the rounds say so with the output's length (verifier/kept_rules.py); a re-prefill or a
    truncation sends it again, through the output so far."""
    penalties = Penalties(presence=0.5, repetition=1.1)
    request = GenerationRequest([5, 6, 5, 9], max_new_tokens=8, penalties=penalties)
    seq = Sequence("s", request, SpecParams(), stop_checker=_Rules())  # type: ignore[arg-type]
    assert seq.verify_input(DraftTree()).rules == LogitRules(penalties, (), (), (5, 6, 9))
    seq.commit(VerifyOutput("s", [], 6, 4))
    assert seq.verify_input(DraftTree()).rules == LogitRules(Penalties(), kept=1)
    seq.commit(VerifyOutput("s", [6, 2], 6, 7))
    whole = LogitRules(penalties, (2, 6), (1, 3), (5, 6, 9))
    assert seq.rules_context == whole
    assert seq.verify_input(DraftTree()).rules == LogitRules(Penalties(), kept=4)
    seq.keep_verifier_kv(5)
    assert seq.verify_input(DraftTree()).rules == whole
    seq.forget_verifier()
    assert seq.verify_input(DraftTree()).rules == whole
    plain = Sequence("p", GenerationRequest([5], 8), SpecParams(), stop_checker=_Rules())  # type: ignore[arg-type]
    assert plain.verify_input(DraftTree()).rules is None


def test_the_drafter_gets_the_rules_with_a_sequences_first_draft_and_after_it_lost_them() -> None:
    """The drafter bends its drafts by the request's rules (drafter/draft_rules.py) and keeps
    them: they go with the first Draft, not the next ones, again once the gateway starts the
    drafter over; a session's later turn without rules clears any an earlier turn left."""
    penalties = Penalties(((7, -2.0),), presence=0.5, repetition=1.1)
    request = GenerationRequest([5, 6, 5, 9], max_new_tokens=8, penalties=penalties)
    seq = Sequence("s", request, SpecParams(2, 1, 2), stop_checker=_Rules())  # type: ignore[arg-type]
    first = seq.draft_input()
    assert first.begin and first.rules == DraftRules(penalties, 4)
    seq.commit(VerifyOutput("s", [], 6, 4))
    assert seq.draft_input().rules is None
    seq.forget_drafter()
    again = seq.draft_input()
    assert again.begin and again.rules == DraftRules(penalties, 4)
    plain = Sequence("p", GenerationRequest([5], 8), SpecParams(2, 1, 2), stop_checker=_Rules())  # type: ignore[arg-type]
    assert plain.draft_input().rules is None  # (a new sequence: none held)
    turn = Sequence("t", GenerationRequest([5, 6], 8), SpecParams(2, 1, 2), stop_checker=_Rules())  # type: ignore[arg-type]
    turn.drafter_begun = True  # (a session's later turn: the drafter holds the sequence)
    assert turn.draft_input().rules == DraftRules(Penalties(), 2)


def test_a_guided_sequences_draft_carries_the_guides_root_mask() -> None:
    """Each Draft of a guided sequence carries the tokens its guide allows at the root (the
    drafter's first drafts keep to them); a plain sequence's, and a round without drafts, none."""
    guide = FixedTokens((3, 40, 41), 64)
    request = GenerationRequest([5, 6], max_new_tokens=8, guide=guide)
    seq = Sequence("g", request, SpecParams(2, 1, 2), stop_checker=_Rules())  # type: ignore[arg-type]
    words = seq.draft_input().root_allowed
    assert words == guide.mask(0).tobytes()  # type: ignore[union-attr]
    allowed = np.flatnonzero(unpack_mask(np.frombuffer(words, dtype=np.uint32), 64))
    assert allowed.tolist() == [3, 40, 41]
    seq.spec = SpecParams()
    assert seq.draft_input().root_allowed == b""
    plain = Sequence("p", GenerationRequest([5], 8), SpecParams(2, 1, 2), stop_checker=_Rules())  # type: ignore[arg-type]
    assert plain.draft_input().root_allowed == b""


class _Rules:
    """Stop rules that keep every token and never stop."""

    reads_text = False

    def commit_tokens(self, new: list[int]) -> object:
        return type("Kept", (), {"num_kept_tokens": len(new), "finish_reason": None,
                                 "num_text_tokens": len(new)})()  # fmt: skip
