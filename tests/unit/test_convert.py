"""Protobuf <-> dataclass conversions: exact round trips, wire defaults, malformed input."""

from __future__ import annotations

import math

import pytest
import torch

from specsplit import convert, convert_beside, wire_tensors
from specsplit.errors import Code, ServiceError
from specsplit.logit_rules import Penalties
from specsplit.messages import (
    AheadTree,
    DraftInput,
    DraftOutput,
    DraftRules,
    NextTrees,
    SpecParams,
    VerifyInput,
    VerifyOutput,
)
from specsplit.sampling import SamplingParams
from specsplit.tree import DRAFT_SUPPORT, DraftProbs, DraftTree
from specsplit.v1 import common_pb2, drafter_pb2, verifier_pb2


def _wire(msg):
    """Serialize and parse again, as the bytes on a real stream would be."""
    return type(msg).FromString(msg.SerializeToString())


@pytest.mark.parametrize("dtype", sorted(wire_tensors.DTYPES))
def test_tensor_round_trip_is_bit_exact(dtype: str) -> None:
    torch_dtype = wire_tensors.DTYPES[dtype]
    source = torch.randn(3, 5, 7) * 100
    tensor = source > 0 if torch_dtype == torch.bool else source.to(torch_dtype)
    back = wire_tensors.tensor_from_proto(_wire(wire_tensors.tensor_to_proto(tensor)))
    assert back.dtype == tensor.dtype
    assert back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_bfloat16_keeps_every_bit_pattern() -> None:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)  # all 65536 patterns
    tensor = bits.view(torch.bfloat16).reshape(256, 256)
    msg = wire_tensors.tensor_to_proto(tensor)
    assert msg.dtype == "bfloat16"
    assert len(msg.data) == 2 * 65536
    back = wire_tensors.tensor_from_proto(_wire(msg))
    assert torch.equal(back.view(torch.int16), tensor.view(torch.int16))  # NaNs included


def test_tensor_non_contiguous_and_scalar_and_empty() -> None:
    strided = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(
        wire_tensors.tensor_from_proto(wire_tensors.tensor_to_proto(strided)), strided
    )
    scalar = torch.tensor(2.5)
    back = wire_tensors.tensor_from_proto(wire_tensors.tensor_to_proto(scalar))
    assert back.shape == () and back.item() == 2.5
    empty = torch.empty(0, 4, dtype=torch.bfloat16)
    back = wire_tensors.tensor_from_proto(wire_tensors.tensor_to_proto(empty))
    assert back.shape == (0, 4) and back.dtype == torch.bfloat16


def test_tensor_from_proto_is_writable_copy() -> None:
    msg = wire_tensors.tensor_to_proto(torch.zeros(4))
    back = wire_tensors.tensor_from_proto(msg)
    back += 1  # must not touch the message's bytes
    assert wire_tensors.tensor_from_proto(msg).sum().item() == 0


def test_tensor_bytes_are_little_endian_row_major() -> None:
    msg = wire_tensors.tensor_to_proto(torch.tensor([[1, 2]], dtype=torch.int32))
    assert msg.data == b"\x01\x00\x00\x00\x02\x00\x00\x00"
    assert list(msg.shape) == [1, 2]


def test_tensor_wrong_byte_count_names_the_field() -> None:
    msg = common_pb2.Tensor(dtype="float32", shape=[2, 3], data=b"\x00" * 20)
    with pytest.raises(ServiceError) as err:
        wire_tensors.tensor_from_proto(msg, "tree.draft_probs")
    assert err.value.code == Code.INVALID_ARGUMENT
    assert "tree.draft_probs.data has 20 bytes" in err.value.message
    assert "needs 24" in err.value.message


def test_tensor_unknown_dtype_is_invalid() -> None:
    msg = common_pb2.Tensor(dtype="complex64", shape=[1], data=b"\x00" * 8)
    with pytest.raises(ServiceError, match=r"hidden_states\.dtype 'complex64' unknown"):
        wire_tensors.tensor_from_proto(msg, "hidden_states")


def test_torch_dtype_names() -> None:
    assert wire_tensors.torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        wire_tensors.torch_dtype("fp8")


def test_sampling_round_trip_with_and_without_seed() -> None:
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.5, top_p=0.25, top_k=40, seed=0),
        SamplingParams(temperature=2.0, seed=2**64 - 1),
    ):
        assert convert.sampling_from_proto(_wire(convert.sampling_to_proto(params))) == params


def test_sampling_wire_defaults() -> None:
    params = convert.sampling_from_proto(common_pb2.SamplingParams())
    assert params == SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None)
    assert params.greedy


def test_seed_zero_is_not_unset() -> None:
    msg = _wire(convert.sampling_to_proto(SamplingParams(temperature=1.0, seed=0)))
    assert msg.HasField("seed")
    assert convert.sampling_from_proto(msg).seed == 0


def test_spec_round_trip_and_unset_topk_is_a_chain() -> None:
    spec = SpecParams(num_steps=3, topk=4, num_draft_tokens=10)
    assert convert.spec_from_proto(_wire(convert.spec_to_proto(spec))) == spec
    assert convert.spec_from_proto(common_pb2.SpecParams()) == SpecParams(0, 1, 0)
    assert convert.spec_from_proto(common_pb2.SpecParams(num_steps=2, num_draft_tokens=2)).topk == 1


def test_tree_round_trip_without_probs() -> None:
    tree = DraftTree(tokens=[5, 9, 7], parents=[-1, -1, 0])
    back = convert.tree_from_proto(_wire(convert.tree_to_proto(tree)))
    assert back.tokens == tree.tokens and back.parents == tree.parents
    assert back.draft_probs is None


def test_empty_tree_stays_empty() -> None:
    back = convert.tree_from_proto(_wire(convert.tree_to_proto(DraftTree())))
    assert len(back) == 0 and back.draft_probs is None


def _one_wide_row(msg: common_pb2.DraftProbs) -> None:
    """Row 0 4 x DRAFT_SUPPORT entries wide and 9 empty rows: padded, 10 x that."""
    wide = 4 * DRAFT_SUPPORT
    del msg.row_widths[:]
    msg.row_widths.extend([wide] + [0] * 9)
    msg.tokens.CopyFrom(wire_tensors.tensor_to_proto(torch.zeros(wide, dtype=torch.int32)))
    msg.probs.CopyFrom(wire_tensors.tensor_to_proto(torch.zeros(wide)))


def test_tree_round_trip_with_probs() -> None:
    """Draft distributions cross as each row's support at its own width; they read back as
    the same dense distributions (the padding of a shorter support adds nothing)."""
    probs = torch.softmax(torch.randn(3, 11), dim=-1)
    probs[1, 4:] = 0  # a row of a smaller support
    tree = DraftTree(tokens=[1, 2, 3], parents=[-1, 0, 1], draft_probs=DraftProbs.of(probs))
    msg = _wire(convert.tree_to_proto(tree))
    assert msg.draft_probs.vocab_size == 11 and list(msg.draft_probs.row_widths) == [11, 4, 11]
    assert list(msg.draft_probs.tokens.shape) == list(msg.draft_probs.probs.shape) == [26]
    back = convert.tree_from_proto(msg)
    assert back.draft_probs is not None
    assert torch.equal(back.draft_probs.dense(), probs)
    cut = DraftProbs.cat([DraftProbs.of(probs[:1, :]), DraftProbs.of(probs[1:2])])
    assert cut.tokens.shape == (2, 11) and torch.equal(cut.dense(), probs[:2])
    assert torch.equal(DraftProbs.of(probs[1:2]).dense(), probs[1:2])
    assert DraftProbs.of(probs[1:2]).tokens.shape == (1, 4)  # its support only


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda m: setattr(m, "vocab_size", 0), "vocab_size = 0"),
        (
            lambda m: m.tokens.CopyFrom(
                wire_tensors.tensor_to_proto(torch.full((6,), 11, dtype=torch.int32))
            ),
            "outside the vocabulary",
        ),
        (
            lambda m: m.tokens.CopyFrom(wire_tensors.tensor_to_proto(torch.zeros(6).long())),
            "int32",
        ),
        (
            lambda m: m.probs.CopyFrom(wire_tensors.tensor_to_proto(torch.full((6,), -0.5))),
            "finite and >= 0",
        ),
        (
            lambda m: m.probs.CopyFrom(wire_tensors.tensor_to_proto(torch.full((6,), math.nan))),
            "finite and >= 0",
        ),
        (
            lambda m: m.probs.CopyFrom(wire_tensors.tensor_to_proto(torch.zeros(4))),
            "must both be [6], the row_widths' sum",
        ),
        (lambda m: m.row_widths.__setitem__(0, 4), "must both be [7], the row_widths' sum"),
        (lambda m: m.row_widths.__setitem__(0, -1), "row_widths must be >= 0"),
        (lambda m: _one_wide_row(m), f"pad to 10 x {4 * DRAFT_SUPPORT} entries"),
    ],
    ids=[
        "no-vocab", "token-outside", "token-dtype", "negative", "nan", "short", "widths",
        "negative-width", "padding-past-the-data",
    ],
)  # fmt: skip
def test_malformed_draft_probs_are_refused_naming_the_field(damage, message) -> None:  # type: ignore[no-untyped-def]
    probs = DraftProbs.of(torch.softmax(torch.randn(2, 11), dim=-1)[:, :3].contiguous())
    probs = DraftProbs(probs.tokens, probs.probs, 11)
    msg = convert.tree_to_proto(DraftTree([1, 2], [-1, 0], probs))
    damage(msg.draft_probs)
    with pytest.raises(ServiceError, match=r"tree\.draft_probs") as err:
        convert.tree_from_proto(msg)
    assert err.value.code == Code.INVALID_ARGUMENT and message in err.value.message


def _draft_input(hidden: torch.Tensor | None) -> DraftInput:
    return DraftInput(
        seq_id="s-1",
        begin=True,
        start=3,
        new_tokens=[10, 11, 12],
        spec=SpecParams(num_steps=2, topk=2, num_draft_tokens=4),
        sampling=SamplingParams(temperature=0.75, top_p=0.5, top_k=3, seed=7),
        target_kv_committed_len=5,
        target_hidden_states=hidden,
    )


SAMPLED = SamplingParams(temperature=0.7, seed=3)


def _assert_same(a: object, b: object) -> None:
    """Dataclass equality that compares tensor fields exactly."""
    assert type(a) is type(b)
    if isinstance(a, DraftProbs):  # held ragged or padded: compare them padded
        assert isinstance(b, DraftProbs) and a.vocab_size == b.vocab_size
        for name in ("tokens", "probs"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        return
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor) and value.dtype == other.dtype
            assert torch.equal(value, other), name
        elif isinstance(value, (DraftTree, DraftProbs)):
            _assert_same(value, other)
        else:
            assert value == other, name


@pytest.mark.parametrize("with_hidden", [False, True])
def test_draft_request_round_trip(with_hidden: bool) -> None:
    hidden = torch.randn(3, 8).to(torch.bfloat16) if with_hidden else None
    penalties = Penalties(((3, -2.5), (9, 4.0)), 0.5, 0.25, 1.2, min_tokens=4, stop_ids=(2, 7))
    inputs = [
        _draft_input(hidden),
        DraftInput("s-2", False, 0, [4], SpecParams()),
        DraftInput("s-3", True, 0, [7], SpecParams(), rules=DraftRules(penalties, 5)),
        DraftInput("s-4", False, 0, [7], SpecParams(), rules=DraftRules(Penalties(), 3)),
        DraftInput("s-5", False, 0, [7], SpecParams(), root_allowed=bytes(range(8))),
    ]
    msg = _wire(convert.draft_request_to_proto(inputs))
    assert isinstance(msg, drafter_pb2.DraftRequest)
    back = convert.draft_request_from_proto(msg)
    assert len(back) == 5
    for a, b in zip(inputs, back, strict=True):
        _assert_same(a, b)


def test_draft_response_round_trip() -> None:
    outputs = [
        DraftOutput(
            "a", DraftTree([1, 2], [-1, 0], DraftProbs.of(torch.rand(2, 6))), kv_committed_len=12
        ),
        DraftOutput("b", DraftTree(), kv_committed_len=0),
    ]
    msg = _wire(convert.draft_response_to_proto(outputs, draft_ns=1234))
    assert msg.draft_ns == 1234
    for a, b in zip(outputs, convert.draft_response_from_proto(msg), strict=True):
        _assert_same(a, b)


def test_verify_request_round_trip() -> None:
    inputs = [
        VerifyInput(
            seq_id="v",
            begin=False,
            kv_committed_len=17,
            pending_tokens=[99],
            tree=DraftTree([3, 4, 5], [-1, 0, 0]),
            sampling=SamplingParams(temperature=1.0, seed=3),
            hidden_state_layers=(2, 15, 28),
        ),
        VerifyInput("p", True, 0, [1, 2, 3, 4], DraftTree()),
    ]
    msg = _wire(convert.verify_request_to_proto(inputs))
    assert isinstance(msg, verifier_pb2.VerifyRequest)
    for a, b in zip(inputs, convert.verify_request_from_proto(msg), strict=True):
        _assert_same(a, b)


def test_verify_response_round_trip_and_counts_on_the_wire() -> None:
    hidden = torch.randn(3, 16).to(torch.bfloat16)
    outputs = [
        VerifyOutput(
            "v", accepted_tokens=[3, 4], bonus_token=8, kv_committed_len=20, hidden_states=hidden
        ),
        VerifyOutput("w", accepted_tokens=[], bonus_token=0, kv_committed_len=4),
    ]
    msg = _wire(convert.verify_response_to_proto(outputs, verify_ns=99))
    assert msg.verify_ns == 99
    assert list(msg.seq_ids) == ["v", "w"]
    assert list(msg.num_accepted_drafts) == [2, 0]
    assert list(msg.num_accepted_tokens) == [3, 1]
    assert list(msg.accepted_tokens) == [3, 4] and list(msg.bonus_token) == [8, 0]
    assert list(msg.num_hidden_rows) == [3, -1] and list(msg.hidden_states.shape) == [3, 16]
    assert not msg.num_decoded_tokens and not msg.decoded_tokens  # no decode steps: empty
    for a, b in zip(outputs, convert.verify_response_from_proto(msg), strict=True):
        _assert_same(a, b)


def test_verify_request_columns_on_the_wire() -> None:
    """Each per-sequence column has one entry a sequence; the flat ones hold the lists back to
    back by their counts."""
    inputs = [
        VerifyInput("a", False, 17, [99], DraftTree([3, 4, 5], [-1, 0, 0]),
                    hidden_state_layers=(2, 5)),
        VerifyInput("b", True, 0, [1, 2, 3], DraftTree()),
        VerifyInput("c", False, 8, [7], DraftTree([6], [-1]), hidden_state_layers=(2, 5)),
    ]  # fmt: skip
    msg = _wire(convert.verify_request_to_proto(inputs))
    assert list(msg.seq_ids) == ["a", "b", "c"] and list(msg.begin) == [False, True, False]
    assert list(msg.num_pending_tokens) == [1, 3, 1]
    assert list(msg.pending_tokens) == [99, 1, 2, 3, 7]
    assert list(msg.num_tree_nodes) == [3, 0, 1]
    assert list(msg.tree_tokens) == [3, 4, 5, 6] and list(msg.tree_parents) == [-1, 0, 0, -1]
    assert list(msg.hidden_state_layers) == [2, 5]
    assert list(msg.wants_hidden_states) == [True, False, True]
    assert not msg.decode_steps and not msg.sampled  # every default: nothing on the wire
    assert not msg.unhinted
    for a, b in zip(inputs, convert.verify_request_from_proto(msg), strict=True):
        _assert_same(a, b)


def test_a_round_the_gateway_sends_no_hint_for_says_so_per_sequence() -> None:
    """VerifyInput.unhinted (the overlap gate's draft-ahead rounds without hints) travels as a
    column, one entry a sequence, once any sequence has it; a wrong count is refused."""
    inputs = [VerifyInput(s, False, 5, [7], DraftTree([1], [-1])) for s in "ab"]
    inputs[1].unhinted = True
    msg = _wire(convert.verify_request_to_proto(inputs))
    assert list(msg.unhinted) == [False, True]
    assert [item.unhinted for item in convert.verify_request_from_proto(msg)] == [False, True]
    msg.unhinted.append(True)
    with pytest.raises(ServiceError, match="unhinted has 3 entries for 2 sequences"):
        convert.verify_request_from_proto(msg)


def test_a_round_with_two_sets_of_hidden_state_layers_cannot_travel() -> None:
    inputs = [
        VerifyInput("a", False, 1, [9], DraftTree(), hidden_state_layers=(1,)),
        VerifyInput("b", False, 1, [9], DraftTree(), hidden_state_layers=(2,)),
    ]
    with pytest.raises(ServiceError, match="the same for every sequence"):
        convert.verify_request_to_proto(inputs)


def _greedy_round() -> verifier_pb2.VerifyRequest:
    inputs = [VerifyInput(s, False, 5, [7, 8], DraftTree([1, 2], [-1, 0])) for s in "ab"]
    return _wire(convert.verify_request_to_proto(inputs))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda m: m.begin.append(True), "begin has 3 entries for 2 sequences"),
        (lambda m: m.kv_committed_len.pop(), "kv_committed_len has 1 entries for 2 sequences"),
        (lambda m: m.pending_tokens.append(3), "pending_tokens has 5 entries, num_pending_tokens"),
        (lambda m: m.num_tree_nodes.__setitem__(0, -1), "num_tree_nodes: a sequence's count is"),
        (lambda m: m.tree_parents.pop(), "tree_parents has 3 entries, num_tree_nodes sums to 4"),
        (lambda m: m.decode_steps.append(2), "decode_steps has 1 entries for 2 sequences"),
        (lambda m: m.wants_hidden_states.extend([True, False]), "wants_hidden_states set with"),
        (lambda m: m.sampled.add(index=2), r"sampled: index 2 out of order or outside \[0, 2\)"),
        (lambda m: [m.sampled.add(index=1), m.sampled.add(index=0)], "out of order"),
    ],
)
def test_malformed_columns_are_refused_naming_the_field(damage, message: str) -> None:
    msg = _greedy_round()
    damage(msg)
    with pytest.raises(ServiceError, match=message) as err:
        convert.verify_request_from_proto(msg)
    assert err.value.code == Code.INVALID_ARGUMENT


def _rows_of(sizes: list[int | None], width: int = 6) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(len(sizes))
    return [
        None if n is None else torch.randn(n, width, generator=gen).to(torch.bfloat16)
        for n in sizes
    ]


@pytest.mark.parametrize("sizes", [[3, None, 0, 2], [None, None], [1], [0, 0], [None, 4, 1]])
def test_a_rounds_rows_travel_as_one_tensor_and_come_back_per_sequence(
    sizes: list[int | None],
) -> None:
    """Verify answers and Draft requests carry every sequence's rows in one tensor message, with
    a row count per sequence: each comes back with its own rows, an empty tensor as empty and
    none as None."""
    rows = _rows_of(sizes)
    outputs = [VerifyOutput(f"s{i}", [], 5, 9, hidden_states=r) for i, r in enumerate(rows)]
    msg = _wire(convert.verify_response_to_proto(outputs, verify_ns=1))
    asked = [n for n in sizes if n is not None]
    assert msg.HasField("hidden_states") == bool(asked)
    if asked:
        assert list(msg.hidden_states.shape) == [sum(asked), 6]
    for a, b in zip(outputs, convert.verify_response_from_proto(msg), strict=True):
        _assert_same(a, b)
    inputs = [
        DraftInput(f"s{i}", False, 4, [1, 2], SpecParams(), target_hidden_states=r)
        for i, r in enumerate(rows)
    ]
    msg = _wire(convert.draft_request_to_proto(inputs))
    for a, b in zip(inputs, convert.draft_request_from_proto(msg), strict=True):
        _assert_same(a, b)


def test_rows_whose_counts_disagree_with_the_tensor_are_refused() -> None:
    outputs = [
        VerifyOutput(f"s{i}", [], 5, 9, hidden_states=r) for i, r in enumerate(_rows_of([2, 3]))
    ]
    msg = _wire(convert.verify_response_to_proto(outputs, verify_ns=1))
    msg.num_hidden_rows[1] = 4
    with pytest.raises(ServiceError, match=r"hidden_states has shape \[5, 6\]: want \[6 rows"):
        convert.verify_response_from_proto(msg)
    msg.num_hidden_rows[1] = -2
    with pytest.raises(ServiceError, match="negative"):
        convert.verify_response_from_proto(msg)
    msg.ClearField("hidden_states")
    msg.num_hidden_rows[1] = 3
    with pytest.raises(ServiceError, match=r"hidden_states\.dtype '' unknown"):
        convert.verify_response_from_proto(msg)


def test_verify_output_with_inconsistent_counts_is_rejected() -> None:
    msg = verifier_pb2.VerifyResponse(
        seq_ids=["x"], accepted_tokens=[1], num_accepted_drafts=[1], num_accepted_tokens=[3],
        bonus_token=[2], kv_committed_len=[4],
    )  # fmt: skip
    with pytest.raises(ServiceError, match="num_accepted_tokens must be num_accepted_drafts"):
        convert.verify_response_from_proto(msg)
    msg.num_accepted_tokens[0], msg.num_accepted_drafts[0] = 3, 2
    with pytest.raises(ServiceError, match="accepted_tokens has 1 entries, num_accepted_drafts"):
        convert.verify_response_from_proto(msg)


def test_verify_input_leaves_greedy_sampling_and_defaults_unset() -> None:
    """Target-only greedy rounds carry no side message per sequence; they read back as the same
    input, and sampling or draft probabilities still travel, for their sequence only."""
    plain = VerifyInput("s", False, 5, [7], DraftTree())
    msg = convert.verify_request_to_proto([plain])
    assert not msg.sampled and not msg.decode_steps and not msg.wants_hidden_states
    assert convert.verify_request_from_proto(msg) == [plain]
    probs = DraftProbs.of(torch.softmax(torch.randn(2, 9), dim=-1))
    sampled = VerifyInput(
        "t", True, 0, [1, 2], DraftTree([3, 4], [-1, 0], probs), SamplingParams(0.7, 0.9, 5, 11)
    )
    msg = _wire(convert.verify_request_to_proto([plain, sampled]))
    assert [entry.index for entry in msg.sampled] == [1]
    first, back = convert.verify_request_from_proto(msg)
    assert first == plain
    _assert_same(back.tree, sampled.tree)
    assert back.sampling.seed == 11 and back.sampling.top_k == 5


def test_rows_beside_a_message_are_its_tensor_and_must_fit_it() -> None:
    """The round lane's rows beside a Verify answer (wire_tensors.Beside): the message keeps dtype
    and shape, the rows come back as each sequence's own; rows that miss the shape, that
    come twice, or that come beside an answer without rows are refused."""
    rows = torch.randn(5, 6).to(torch.bfloat16)
    outputs = [
        VerifyOutput("a", [1], 2, 3, rows[:2]),
        VerifyOutput("b", [], 4, 5),
        VerifyOutput("c", [7, 8], 9, 10, rows[2:]),
    ]
    beside = wire_tensors.Beside()
    msg = _wire(convert.verify_response_to_proto(outputs, 1, beside))
    assert not msg.hidden_states.data and list(msg.hidden_states.shape) == [5, 6]
    data = bytearray(beside.data())
    a, b, c = convert.verify_response_from_proto(msg, data)
    assert b.hidden_states is None
    assert torch.equal(a.hidden_states, rows[:2]) and torch.equal(c.hidden_states, rows[2:])  # type: ignore[arg-type]
    with pytest.raises(ServiceError, match=r"hidden_states\.data has 58 bytes"):
        convert.verify_response_from_proto(msg, data[:-2])
    inline = _wire(convert.verify_response_to_proto(outputs, 1))
    with pytest.raises(ServiceError, match="both in its data and beside"):
        convert.verify_response_from_proto(inline, data)
    rowless = _wire(convert.verify_response_to_proto([VerifyOutput("d", [], 1, 2)], 1))
    with pytest.raises(ServiceError, match="beside a round that has none"):
        convert.verify_response_from_proto(rowless, bytearray(4))


def test_rows_beside_in_a_buffer_of_the_lanes_are_read_in_place() -> None:
    """A Draft's rows read by the round lane into a buffer it was given (the drafter's
    page-locked memory on a GPU, a memoryview): each sequence's rows are views of that
    buffer's memory, not a copy."""
    rows = torch.randn(5, 6).to(torch.bfloat16)
    inputs = [
        DraftInput("a", True, 0, [1, 2, 3], SpecParams(3, 1, 3), target_hidden_states=rows[:2]),
        DraftInput("b", True, 0, [4, 5, 6, 7], SpecParams(3, 1, 3), target_hidden_states=rows[2:]),
    ]
    beside = wire_tensors.Beside()
    msg = _wire(convert.draft_request_to_proto(inputs, beside))
    landed = torch.zeros(rows.numel() * rows.element_size(), dtype=torch.uint8)
    landed.copy_(rows.reshape(-1).view(torch.uint8))
    buffer = memoryview(landed.numpy().data)
    a, b = convert.draft_request_from_proto(msg, buffer)
    assert torch.equal(a.target_hidden_states, rows[:2])  # type: ignore[arg-type]
    assert torch.equal(b.target_hidden_states, rows[2:])  # type: ignore[arg-type]
    assert a.target_hidden_states.data_ptr() == landed.data_ptr()  # type: ignore[union-attr]
    landed.zero_()  # the same memory
    assert not a.target_hidden_states.any() and not b.target_hidden_states.any()  # type: ignore[union-attr]


def test_a_rounds_draft_probabilities_travel_as_one_message_each_tree_its_rows() -> None:
    """Sequences with sampled chains of different lengths and supports, between greedy ones:
    their rows back to back in one DraftProbs (each row at its own width), each read back as
    its own distributions, in both the Draft answer and the Verify request."""
    supports = [torch.softmax(torch.randn(n, 13), dim=-1) for n in (3, 1, 2)]
    supports[1][:, 5:] = 0  # a narrower support
    trees = [DraftTree(list(range(1, n + 1)), list(range(-1, n - 1))) for n in (3, 1, 2)]
    for tree, q in zip(trees, supports, strict=True):
        tree.draft_probs = DraftProbs.of(q)
    plain = DraftTree([4], [-1])
    order = [plain, trees[0], trees[1], plain, trees[2]]
    outputs = [DraftOutput(f"s{i}", t, 3) for i, t in enumerate(order)]
    answer = _wire(convert.draft_response_to_proto(outputs, draft_ns=1))
    widths = [13, 13, 13, 5, 13, 13]
    assert list(answer.draft_probs.row_widths) == widths and len(answer.extras) == 3
    inputs = [VerifyInput(f"s{i}", False, 3, [2], t, SAMPLED) for i, t in enumerate(order)]
    request = _wire(convert.verify_request_to_proto(inputs))
    assert list(request.draft_probs.row_widths) == widths
    assert list(request.draft_probs.tokens.shape) == [sum(widths)]
    for back in (
        [out.tree for out in convert.draft_response_from_proto(answer)],
        [item.tree for item in convert.verify_request_from_proto(request)],
    ):
        assert back[0].draft_probs is None and back[3].draft_probs is None
        for got, q in zip([back[1], back[2], back[4]], supports, strict=True):
            assert got.draft_probs is not None and torch.equal(got.draft_probs.dense(), q)


def test_draft_probabilities_that_miss_their_trees_are_refused() -> None:
    tree = DraftTree([1, 2], [-1, 0], DraftProbs.of(torch.softmax(torch.randn(2, 7), -1)))
    request = _wire(
        convert.verify_request_to_proto([VerifyInput("a", False, 3, [2], tree, SAMPLED)])
    )
    short = verifier_pb2.VerifyRequest()
    short.CopyFrom(request)
    short.num_tree_nodes[0] = 3
    short.tree_tokens.append(5)
    short.tree_parents.append(1)
    with pytest.raises(ServiceError, match=r"draft_probs has 2 rows; .* have 3 nodes"):
        convert.verify_request_from_proto(short)
    unset = verifier_pb2.VerifyRequest()
    unset.CopyFrom(request)
    unset.ClearField("draft_probs")
    with pytest.raises(ServiceError, match="draft_probs unset"):
        convert.verify_request_from_proto(unset)


def test_draft_ahead_and_sampling_travel_beside_the_columns_for_their_sequences_only() -> None:
    """A Draft's sampling and draft-ahead fields ride an indexed side message of the sequences
    that have them; its answer's draft probabilities likewise, and its trees drafted ahead
    travel in outcome columns (a count per sequence, none for those that drafted none)."""
    verifying = DraftTree([5, 6], [-1, 0])
    inputs = [
        DraftInput("a", False, 4, [1, 2], SpecParams(2, 1, 2)),
        DraftInput("b", False, 7, [3], SpecParams(2, 1, 2), verifying=verifying, ahead_guesses=2),
        DraftInput("c", True, 0, [4, 5, 6], SpecParams(3, 2, 5), SamplingParams(1.0, seed=4)),
    ]
    msg = _wire(convert.draft_request_to_proto(inputs))
    assert [entry.index for entry in msg.options] == [1, 2]
    assert list(msg.num_new_tokens) == [2, 1, 3] and list(msg.topk) == [1, 1, 2]
    for a, b in zip(inputs, convert.draft_request_from_proto(msg), strict=True):
        _assert_same(a, b)
    ahead = [AheadTree([5, 9], DraftTree([7, 8], [-1, 0])), AheadTree([4], DraftTree())]
    outputs = [
        DraftOutput("a", DraftTree([1, 2], [-1, 0]), 5, (3, 8)),
        DraftOutput("b", DraftTree(), 7, (3, 8), ahead),
        DraftOutput("c", DraftTree([3], [-1], DraftProbs.of(torch.rand(1, 6))), 3, (3, 8)),
    ]
    msg = _wire(convert.draft_response_to_proto(outputs, draft_ns=1))
    assert [entry.index for entry in msg.extras] == [2]
    assert list(msg.num_outcomes) == [0, 2, 0] and list(msg.num_outcome_tokens) == [2, 1]
    assert list(msg.num_ahead_nodes) == [2, 0] and list(msg.ahead_tokens) == [7, 8]
    assert list(msg.hidden_state_layers) == [3, 8] and list(msg.num_tree_nodes) == [2, 0, 1]
    back = convert.draft_response_from_proto(msg)
    for a, b in zip(outputs, back, strict=True):
        assert [x.tokens for x in a.ahead] == [x.tokens for x in b.ahead]
        assert [x.tree for x in a.ahead] == [x.tree for x in b.ahead]
        a.ahead = b.ahead = []
        _assert_same(a, b)
    none_ahead = _wire(convert.draft_response_to_proto(outputs[:1], draft_ns=1))
    assert not none_ahead.num_outcomes and not none_ahead.outcome_tokens
    assert convert.draft_response_from_proto(none_ahead)[0].ahead == []


def test_supports_cross_at_each_rows_own_width() -> None:
    """Each draft support row crosses the wire cut after its own last nonzero column (rows hold
    their kept tokens first, 0 past the tail, top-p and top-k cuts): the same distributions
    come back, padded to the widest row's; rows every column of which is kept cross whole."""
    probs = torch.zeros(3, 8)
    probs[0, :2], probs[1, :5], probs[2, :1] = 0.5, 0.2, 1.0
    cut = DraftProbs(torch.arange(24).reshape(3, 8), probs, 40)
    whole = DraftProbs(torch.arange(24).reshape(3, 8), torch.full((3, 8), 0.125), 40)
    for sent, widths in [(cut, [2, 5, 1]), (whole, [8, 8, 8])]:
        tree = DraftTree([1, 2, 3], [-1, 0, 1], sent)
        msg = _wire(
            convert.verify_request_to_proto([VerifyInput("a", False, 3, [2], tree, SAMPLED)])
        )
        assert list(msg.draft_probs.row_widths) == widths
        assert list(msg.draft_probs.tokens.shape) == [sum(widths)]
        back = convert.verify_request_from_proto(msg)[0].tree.draft_probs
        assert back is not None and back.probs.shape == (3, max(widths))
        torch.testing.assert_close(back.dense(), sent.dense())


def test_trees_drafted_ahead_for_a_sampled_chain_carry_their_draft_probabilities() -> None:
    """A sampled chain's trees drafted ahead travel with their draft distributions, in one
    message beside the outcome columns, marked on the sequence's extras entry; a greedy
    sequence's beside them carry none. Rows that do not add up are refused."""

    def sampled(tokens: list[int]) -> DraftTree:
        probs = DraftProbs.of(torch.softmax(torch.randn(len(tokens), 9), -1))
        return DraftTree(tokens, list(range(-1, len(tokens) - 1)), probs)

    ahead = [AheadTree([5, 9], sampled([7, 8])), AheadTree([4], sampled([2, 3]))]
    greedy = [AheadTree([6], DraftTree([1], [-1]))]
    outputs = [
        DraftOutput("a", DraftTree(), 7, (), greedy),
        DraftOutput("b", DraftTree(), 7, (), ahead),
    ]
    msg = _wire(convert.draft_response_to_proto(outputs, draft_ns=1))
    assert [(e.index, e.has_draft_probs, e.ahead_draft_probs) for e in msg.extras] == [
        (1, False, True)
    ]
    back = convert.draft_response_from_proto(msg)
    assert back[0].ahead[0].tree.draft_probs is None
    for a, b in zip(ahead, back[1].ahead, strict=True):
        assert a.tokens == b.tokens and a.tree.tokens == b.tree.tokens
        assert a.tree.draft_probs is not None and b.tree.draft_probs is not None
        torch.testing.assert_close(b.tree.draft_probs.dense(), a.tree.draft_probs.dense())
    short = drafter_pb2.DraftResponse()
    short.CopyFrom(msg)
    short.num_ahead_nodes[1] = 3  # one more node in a sampled tree than the rows sent
    short.ahead_tokens.insert(1, 1)
    short.ahead_parents.insert(1, -1)
    with pytest.raises(ServiceError, match=r"ahead_draft_probs has 4 rows; .* have 5 nodes"):
        convert.draft_response_from_proto(short)
    unset = drafter_pb2.DraftResponse()
    unset.CopyFrom(msg)
    unset.ClearField("ahead_draft_probs")
    with pytest.raises(ServiceError, match="ahead_draft_probs unset"):
        convert.draft_response_from_proto(unset)


def test_a_draft_answer_whose_outcome_columns_do_not_add_up_is_refused() -> None:
    ahead = [AheadTree([5, 9], DraftTree([7, 8], [-1, 0]))]
    msg = _wire(convert.draft_response_to_proto([DraftOutput("a", DraftTree(), 7, (), ahead)], 1))
    short = drafter_pb2.DraftResponse()
    short.CopyFrom(msg)
    short.ahead_parents.pop()
    with pytest.raises(ServiceError, match="ahead_parents has 1 entries, num_ahead_nodes sums"):
        convert.draft_response_from_proto(short)
    wide = drafter_pb2.DraftResponse()
    wide.CopyFrom(msg)
    wide.num_outcomes.append(0)
    with pytest.raises(ServiceError, match="num_outcomes has 2 entries for 1 sequences"):
        convert.draft_response_from_proto(wide)
    two = [DraftOutput(s, DraftTree(), 7, (), ahead) for s in "ab"]
    negative = _wire(convert.draft_response_to_proto(two, 1))
    negative.num_outcomes[:] = [-1, 3]  # sums to the outcomes there are
    with pytest.raises(ServiceError, match="num_outcomes: a sequence's count is negative"):
        convert.draft_response_from_proto(negative)


def test_a_draft_answer_names_one_set_of_hidden_state_layers() -> None:
    outputs = [DraftOutput("a", DraftTree(), 1, (1,)), DraftOutput("b", DraftTree(), 1, (2,))]
    with pytest.raises(ValueError, match="different hidden_state_layers"):
        convert.draft_response_to_proto(outputs, draft_ns=1)


def test_a_draft_request_whose_row_counts_miss_a_sequence_is_refused() -> None:
    rows = torch.zeros(2, 4, dtype=torch.bfloat16)
    inputs = [
        DraftInput("a", False, 4, [1, 2], SpecParams(), target_hidden_states=rows),
        DraftInput("b", False, 4, [1], SpecParams()),
    ]
    msg = _wire(convert.draft_request_to_proto(inputs))
    assert list(msg.num_target_rows) == [2, -1]
    msg.num_target_rows.pop()
    with pytest.raises(ServiceError, match="num_target_rows has 1 entries for 2 sequences"):
        convert.draft_request_from_proto(msg)


def test_hints_round_trip_in_columns() -> None:
    """The verifier's Hint: per sequence its round's base, plain flag and outcomes (tokens and
    tree each), none at all, and no hints."""
    hints = [
        NextTrees(
            "a", 17, [AheadTree([4, 9], DraftTree([1, 2], [-1, 0])), AheadTree([5], DraftTree())]
        ),
        NextTrees("b", 3, [], plain=True),
        NextTrees("c", 40, [AheadTree([7, 8, 9], DraftTree([3, 4, 5], [-1, -1, 0]))], plain=True),
    ]
    wire = convert_beside.hint_to_proto(hints).SerializeToString()
    got = convert_beside.hint_from_proto(verifier_pb2.VerifyHint.FromString(wire))
    assert got == hints
    assert convert_beside.hint_from_proto(convert_beside.hint_to_proto([])) == []
