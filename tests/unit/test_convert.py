"""Protobuf <-> dataclass conversions: exact round trips, wire defaults, malformed input."""

from __future__ import annotations

import pytest
import torch

from specsplit import convert
from specsplit.errors import Code, ServiceError
from specsplit.messages import DraftInput, DraftOutput, SpecParams, VerifyInput, VerifyOutput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from specsplit.v1 import common_pb2, drafter_pb2, verifier_pb2


def _wire(msg):
    """Serialize and parse again, as the bytes on a real stream would be."""
    return type(msg).FromString(msg.SerializeToString())


@pytest.mark.parametrize("dtype", sorted(convert.DTYPES))
def test_tensor_round_trip_is_bit_exact(dtype: str) -> None:
    torch_dtype = convert.DTYPES[dtype]
    source = torch.randn(3, 5, 7) * 100
    tensor = source > 0 if torch_dtype == torch.bool else source.to(torch_dtype)
    back = convert.tensor_from_proto(_wire(convert.tensor_to_proto(tensor)))
    assert back.dtype == tensor.dtype
    assert back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_bfloat16_keeps_every_bit_pattern() -> None:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)  # all 65536 patterns
    tensor = bits.view(torch.bfloat16).reshape(256, 256)
    msg = convert.tensor_to_proto(tensor)
    assert msg.dtype == "bfloat16"
    assert len(msg.data) == 2 * 65536
    back = convert.tensor_from_proto(_wire(msg))
    assert torch.equal(back.view(torch.int16), tensor.view(torch.int16))  # NaNs included


def test_tensor_non_contiguous_and_scalar_and_empty() -> None:
    strided = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(convert.tensor_from_proto(convert.tensor_to_proto(strided)), strided)
    scalar = torch.tensor(2.5)
    back = convert.tensor_from_proto(convert.tensor_to_proto(scalar))
    assert back.shape == () and back.item() == 2.5
    empty = torch.empty(0, 4, dtype=torch.bfloat16)
    back = convert.tensor_from_proto(convert.tensor_to_proto(empty))
    assert back.shape == (0, 4) and back.dtype == torch.bfloat16


def test_tensor_from_proto_is_writable_copy() -> None:
    msg = convert.tensor_to_proto(torch.zeros(4))
    back = convert.tensor_from_proto(msg)
    back += 1  # must not touch the message's bytes
    assert convert.tensor_from_proto(msg).sum().item() == 0


def test_tensor_bytes_are_little_endian_row_major() -> None:
    msg = convert.tensor_to_proto(torch.tensor([[1, 2]], dtype=torch.int32))
    assert msg.data == b"\x01\x00\x00\x00\x02\x00\x00\x00"
    assert list(msg.shape) == [1, 2]


def test_tensor_wrong_byte_count_names_the_field() -> None:
    msg = common_pb2.Tensor(dtype="float32", shape=[2, 3], data=b"\x00" * 20)
    with pytest.raises(ServiceError) as err:
        convert.tensor_from_proto(msg, "tree.draft_probs")
    assert err.value.code == Code.INVALID_ARGUMENT
    assert "tree.draft_probs.data has 20 bytes" in err.value.message
    assert "needs 24" in err.value.message


def test_tensor_unknown_dtype_is_invalid() -> None:
    msg = common_pb2.Tensor(dtype="complex64", shape=[1], data=b"\x00" * 8)
    with pytest.raises(ServiceError, match=r"hidden_states\.dtype 'complex64' unknown"):
        convert.tensor_from_proto(msg, "hidden_states")


def test_torch_dtype_names() -> None:
    assert convert.torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        convert.torch_dtype("fp8")


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


def test_tree_round_trip_with_probs() -> None:
    probs = torch.softmax(torch.randn(3, 11), dim=-1)
    tree = DraftTree(tokens=[1, 2, 3], parents=[-1, 0, 1], draft_probs=probs)
    back = convert.tree_from_proto(_wire(convert.tree_to_proto(tree)))
    assert back.draft_probs is not None
    assert torch.equal(back.draft_probs, probs)


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


def _assert_same(a: object, b: object) -> None:
    """Dataclass equality that compares tensor fields exactly."""
    assert type(a) is type(b)
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor) and value.dtype == other.dtype
            assert torch.equal(value, other), name
        elif isinstance(value, DraftTree):
            _assert_same(value, other)
        else:
            assert value == other, name


@pytest.mark.parametrize("with_hidden", [False, True])
def test_draft_request_round_trip(with_hidden: bool) -> None:
    hidden = torch.randn(3, 8).to(torch.bfloat16) if with_hidden else None
    inputs = [_draft_input(hidden), DraftInput("s-2", False, 0, [4], SpecParams())]
    msg = _wire(convert.draft_request_to_proto(inputs))
    assert isinstance(msg, drafter_pb2.DraftRequest)
    back = convert.draft_request_from_proto(msg)
    assert len(back) == 2
    for a, b in zip(inputs, back, strict=True):
        _assert_same(a, b)


def test_draft_response_round_trip() -> None:
    outputs = [
        DraftOutput("a", DraftTree([1, 2], [-1, 0], torch.rand(2, 6)), kv_committed_len=12),
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
    assert msg.sequences[0].num_accepted_drafts == 2
    assert msg.sequences[0].num_accepted_tokens == 3
    assert msg.sequences[1].num_accepted_tokens == 1
    assert msg.sequences[0].num_hidden_rows == 3 and list(msg.hidden_states.shape) == [3, 16]
    assert not msg.sequences[1].HasField("num_hidden_rows")
    for a, b in zip(outputs, convert.verify_response_from_proto(msg), strict=True):
        _assert_same(a, b)


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
    msg.sequences[1].num_hidden_rows = 4
    with pytest.raises(ServiceError, match=r"hidden_states has shape \[5, 6\]: want \[6 rows"):
        convert.verify_response_from_proto(msg)
    msg.sequences[1].num_hidden_rows = -1
    with pytest.raises(ServiceError, match="negative"):
        convert.verify_response_from_proto(msg)
    msg.ClearField("hidden_states")
    msg.sequences[1].num_hidden_rows = 3
    with pytest.raises(ServiceError, match=r"hidden_states\.dtype '' unknown"):
        convert.verify_response_from_proto(msg)


def test_verify_output_with_inconsistent_counts_is_rejected() -> None:
    msg = verifier_pb2.SequenceVerifyOutput(
        seq_id="x", accepted_tokens=[1], num_accepted_drafts=2, num_accepted_tokens=3
    )
    with pytest.raises(ServiceError, match="disagree with 1 accepted_tokens"):
        convert.verify_output_from_proto(msg)


def test_verify_input_leaves_an_empty_tree_and_greedy_sampling_unset() -> None:
    """Target-only greedy rounds build and parse two sub-messages fewer per sequence; they read
    back as the same input, and a real tree or sampling still travels."""
    plain = VerifyInput("s", False, 5, [7], DraftTree())
    msg = convert.verify_input_to_proto(plain)
    assert not msg.HasField("tree") and not msg.HasField("sampling")
    assert convert.verify_input_from_proto(msg) == plain
    sampled = VerifyInput(
        "s", True, 0, [1, 2], DraftTree([3, 4], [-1, 0]), SamplingParams(0.7, 0.9, 5, 11)
    )
    msg = convert.verify_input_to_proto(sampled)
    assert msg.HasField("tree") and msg.HasField("sampling")
    back = convert.verify_input_from_proto(msg)
    assert back.tree == sampled.tree and back.sampling.seed == 11 and back.sampling.top_k == 5
