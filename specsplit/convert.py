"""Protobuf <-> domain dataclasses, the only place the two meet (servicers and clients call it).

Tensors cross as raw little-endian bytes + dtype + shape (never pickle). bfloat16 has no numpy
type, so it travels as its bit pattern viewed as int16 and is restored exactly.
Malformed wire data raises ServiceError(INVALID_ARGUMENT) naming the field.
"""

from __future__ import annotations

import math
import sys

import torch

from specsplit.errors import invalid
from specsplit.messages import (
    AheadTree,
    DraftInput,
    DraftOutput,
    SpecParams,
    Truncated,
    Truncation,
    VerifyInput,
    VerifyOutput,
)
from specsplit.model.batch import join_rows
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from specsplit.v1 import common_pb2, drafter_pb2, verifier_pb2

assert sys.byteorder == "little", "tensor bytes on the wire are little-endian"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ITEMSIZES = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in DTYPES.values()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype spelled `name` ("float32", "bfloat16", ...); ValueError if unknown."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


# -- tensors ---------------------------------------------------------------------------------


def tensor_to_proto(tensor: torch.Tensor) -> common_pb2.Tensor:
    msg = common_pb2.Tensor()
    _fill_tensor(msg, tensor)
    return msg


def _fill_tensor(msg: common_pb2.Tensor, tensor: torch.Tensor) -> None:
    """Write `tensor` into `msg` in place. The builders below fill sub-messages where they
    are (`.add()`, a field's own message): a message built apart and then assigned or
    `CopyFrom`-ed is copied again, tensor bytes included."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype not in _DTYPE_NAMES:
        raise ValueError(f"tensor dtype {tensor.dtype} cannot cross the wire")
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    msg.dtype = _DTYPE_NAMES[tensor.dtype]
    msg.shape.extend(tensor.shape)
    msg.data = raw.numpy().tobytes()


def tensor_from_proto(msg: common_pb2.Tensor, field: str = "tensor") -> torch.Tensor:
    """A new (writable, CPU) tensor with the message's contents."""
    if msg.dtype not in DTYPES:
        raise invalid(f"{field}.dtype {msg.dtype!r} unknown; expected one of {sorted(DTYPES)}")
    dtype = DTYPES[msg.dtype]
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise invalid(f"{field}.shape {list(shape)} has a negative dimension")
    expected = math.prod(shape) * _ITEMSIZES[dtype]
    if len(msg.data) != expected:
        raise invalid(
            f"{field}.data has {len(msg.data)} bytes, shape {list(shape)} of {msg.dtype} "
            f"needs {expected}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)


def _fill_rows(msg: common_pb2.Tensor, per_sequence: list[torch.Tensor | None]) -> None:
    """A round's per-sequence rows ([n_i, width] each, None: none asked) as one tensor message:
    per sequence a tensor message costs ~50 us to build and read (at 32 sequences more than the
    rest of the round's messages together); one answer's rows sent on in its order are joined
    without a copy (join_rows)."""
    parts = [rows for rows in per_sequence if rows is not None]
    if parts:
        _fill_tensor(msg, join_rows(parts))


def _split_rows(
    msg: common_pb2.Tensor, counts: list[int | None], field: str
) -> list[torch.Tensor | None]:
    """Each sequence's rows of a round's one tensor message (views of one copy), by the row
    counts its sequences carry (None: the sequence has none, not even an empty tensor)."""
    wanted = [n for n in counts if n is not None]
    if not wanted:
        return [None] * len(counts)
    if any(n < 0 for n in wanted):
        raise invalid(f"{field}: a sequence's row count is negative ({min(wanted)})")
    rows = tensor_from_proto(msg, field)
    if rows.dim() != 2 or rows.shape[0] != sum(wanted):
        raise invalid(
            f"{field} has shape {list(rows.shape)}: want [{sum(wanted)} rows (the sequences' "
            "counts), width]"
        )
    parts = iter(rows.split(wanted))
    return [None if n is None else next(parts) for n in counts]


# -- small messages --------------------------------------------------------------------------


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unvalidated (callers validate): top_p 0 on the wire means 1 (off); seed optional.

    Floats are float32 on the wire: 0.7 comes back as 0.699999988079071.
    """
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p != 0.0 else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
    )


def spec_to_proto(spec: SpecParams) -> common_pb2.SpecParams:
    return common_pb2.SpecParams(
        num_steps=spec.num_steps, topk=spec.topk, num_draft_tokens=spec.num_draft_tokens
    )


def spec_from_proto(msg: common_pb2.SpecParams) -> SpecParams:
    """Unvalidated. topk 0 on the wire (unset) means 1, a chain."""
    return SpecParams(
        num_steps=msg.num_steps, topk=msg.topk or 1, num_draft_tokens=msg.num_draft_tokens
    )


def tree_to_proto(tree: DraftTree) -> common_pb2.DraftTree:
    msg = common_pb2.DraftTree()
    _fill_tree(msg, tree)
    return msg


def _fill_tree(msg: common_pb2.DraftTree, tree: DraftTree) -> None:
    msg.tokens.extend(tree.tokens)
    msg.parents.extend(tree.parents)
    if tree.draft_probs is not None:
        _fill_tensor(msg.draft_probs, tree.draft_probs)


def tree_from_proto(msg: common_pb2.DraftTree, field: str = "tree") -> DraftTree:
    probs = (
        tensor_from_proto(msg.draft_probs, f"{field}.draft_probs")
        if msg.HasField("draft_probs")
        else None
    )
    return DraftTree(tokens=list(msg.tokens), parents=list(msg.parents), draft_probs=probs)


# -- drafter ---------------------------------------------------------------------------------

GREEDY = SamplingParams()  # travels as an unset field


def draft_input_to_proto(item: DraftInput) -> drafter_pb2.SequenceDraftInput:
    msg = drafter_pb2.SequenceDraftInput()
    _fill_draft_input(msg, item)
    return msg


def _fill_draft_input(msg: drafter_pb2.SequenceDraftInput, item: DraftInput) -> None:
    msg.seq_id = item.seq_id
    msg.begin = item.begin
    msg.start = item.start
    msg.new_tokens.extend(item.new_tokens)
    msg.target_kv_committed_len = item.target_kv_committed_len
    spec = msg.spec  # filled in place: a message built apart and copied in is built twice
    spec.num_steps, spec.topk, spec.num_draft_tokens = (
        item.spec.num_steps,
        item.spec.topk,
        item.spec.num_draft_tokens,
    )
    if item.sampling != GREEDY:  # greedy travels unset, as in a Verify
        msg.sampling.CopyFrom(sampling_to_proto(item.sampling))
    if item.target_hidden_states is not None:  # the rows go in the request's one tensor
        msg.num_target_rows = item.target_hidden_states.shape[0]
    if item.ahead_guesses:
        _fill_tree(msg.verifying, item.verifying)
        msg.ahead_guesses = item.ahead_guesses


def draft_input_from_proto(
    msg: drafter_pb2.SequenceDraftInput, hidden: torch.Tensor | None = None
) -> DraftInput:
    """`hidden`: its rows of the request's target_hidden_states (draft_request_from_proto)."""
    return DraftInput(
        seq_id=msg.seq_id,
        begin=msg.begin,
        start=msg.start,
        new_tokens=list(msg.new_tokens),
        spec=spec_from_proto(msg.spec),
        sampling=sampling_from_proto(msg.sampling) if msg.HasField("sampling") else GREEDY,
        target_kv_committed_len=msg.target_kv_committed_len,
        target_hidden_states=hidden,
        verifying=tree_from_proto(msg.verifying, f"{msg.seq_id}.verifying")
        if msg.HasField("verifying")
        else DraftTree(),
        ahead_guesses=msg.ahead_guesses,
    )


def draft_output_to_proto(item: DraftOutput) -> drafter_pb2.SequenceDraftOutput:
    msg = drafter_pb2.SequenceDraftOutput()
    _fill_draft_output(msg, item)
    return msg


def _fill_draft_output(msg: drafter_pb2.SequenceDraftOutput, item: DraftOutput) -> None:
    msg.seq_id = item.seq_id
    _fill_tree(msg.tree, item.tree)
    msg.kv_committed_len = item.kv_committed_len
    msg.hidden_state_layers.extend(item.hidden_state_layers)
    for ahead in item.ahead:
        entry = msg.ahead.add()
        entry.tokens.extend(ahead.tokens)
        _fill_tree(entry.tree, ahead.tree)


def draft_output_from_proto(msg: drafter_pb2.SequenceDraftOutput) -> DraftOutput:
    return DraftOutput(
        seq_id=msg.seq_id,
        tree=tree_from_proto(msg.tree, f"{msg.seq_id}.tree"),
        kv_committed_len=msg.kv_committed_len,
        hidden_state_layers=tuple(msg.hidden_state_layers),
        ahead=[
            AheadTree(list(a.tokens), tree_from_proto(a.tree, f"{msg.seq_id}.ahead"))
            for a in msg.ahead
        ],
    )


def draft_request_to_proto(inputs: list[DraftInput]) -> drafter_pb2.DraftRequest:
    msg = drafter_pb2.DraftRequest()
    for item in inputs:
        _fill_draft_input(msg.sequences.add(), item)
    _fill_rows(msg.target_hidden_states, [item.target_hidden_states for item in inputs])
    return msg


def draft_request_from_proto(msg: drafter_pb2.DraftRequest) -> list[DraftInput]:
    counts = [s.num_target_rows if s.HasField("num_target_rows") else None for s in msg.sequences]
    rows = _split_rows(msg.target_hidden_states, counts, "target_hidden_states")
    return [draft_input_from_proto(s, r) for s, r in zip(msg.sequences, rows, strict=True)]


def draft_response_to_proto(outputs: list[DraftOutput], draft_ns: int) -> drafter_pb2.DraftResponse:
    msg = drafter_pb2.DraftResponse(draft_ns=draft_ns)
    for item in outputs:
        _fill_draft_output(msg.sequences.add(), item)
    return msg


def draft_response_from_proto(msg: drafter_pb2.DraftResponse) -> list[DraftOutput]:
    return [draft_output_from_proto(s) for s in msg.sequences]


# -- verifier --------------------------------------------------------------------------------


def verify_input_to_proto(item: VerifyInput) -> verifier_pb2.SequenceVerifyInput:
    msg = verifier_pb2.SequenceVerifyInput()
    _fill_verify_input(msg, item)
    return msg


def _fill_verify_input(msg: verifier_pb2.SequenceVerifyInput, item: VerifyInput) -> None:
    """An empty tree and greedy sampling travel as unset fields (they read back as such): per
    sequence and round, two sub-messages fewer to build and parse."""
    msg.seq_id = item.seq_id
    msg.begin = item.begin
    msg.kv_committed_len = item.kv_committed_len
    msg.pending_tokens.extend(item.pending_tokens)
    msg.hidden_state_layers.extend(item.hidden_state_layers)
    if item.decode_steps != 1:
        msg.decode_steps = item.decode_steps
    if item.tree.tokens:
        _fill_tree(msg.tree, item.tree)
    if item.sampling != GREEDY:
        msg.sampling.CopyFrom(sampling_to_proto(item.sampling))


def verify_input_from_proto(msg: verifier_pb2.SequenceVerifyInput) -> VerifyInput:
    return VerifyInput(
        seq_id=msg.seq_id,
        begin=msg.begin,
        kv_committed_len=msg.kv_committed_len,
        pending_tokens=list(msg.pending_tokens),
        tree=tree_from_proto(msg.tree, f"{msg.seq_id}.tree")
        if msg.HasField("tree")
        else DraftTree(),
        sampling=sampling_from_proto(msg.sampling) if msg.HasField("sampling") else GREEDY,
        hidden_state_layers=tuple(msg.hidden_state_layers),
        decode_steps=msg.decode_steps or 1,
    )


def verify_output_to_proto(item: VerifyOutput) -> verifier_pb2.SequenceVerifyOutput:
    msg = verifier_pb2.SequenceVerifyOutput()
    _fill_verify_output(msg, item)
    return msg


def _fill_verify_output(msg: verifier_pb2.SequenceVerifyOutput, item: VerifyOutput) -> None:
    msg.seq_id = item.seq_id
    msg.accepted_tokens.extend(item.accepted_tokens)
    msg.bonus_token = item.bonus_token
    msg.num_accepted_drafts = item.num_accepted_drafts
    msg.num_accepted_tokens = item.num_accepted_tokens
    msg.kv_committed_len = item.kv_committed_len
    msg.decoded_tokens.extend(item.decoded_tokens)
    if item.hidden_states is not None:  # the rows go in the response's one tensor
        msg.num_hidden_rows = item.hidden_states.shape[0]


def verify_output_from_proto(
    msg: verifier_pb2.SequenceVerifyOutput, hidden: torch.Tensor | None = None
) -> VerifyOutput:
    """`hidden`: its rows of the response's hidden_states (verify_response_from_proto)."""
    accepted = list(msg.accepted_tokens)
    if msg.num_accepted_drafts != len(accepted) or msg.num_accepted_tokens != len(accepted) + 1:
        raise invalid(
            f"{msg.seq_id}: num_accepted_drafts = {msg.num_accepted_drafts}, num_accepted_tokens"
            f" = {msg.num_accepted_tokens} disagree with {len(accepted)} accepted_tokens"
        )
    return VerifyOutput(
        seq_id=msg.seq_id,
        accepted_tokens=accepted,
        bonus_token=msg.bonus_token,
        kv_committed_len=msg.kv_committed_len,
        hidden_states=hidden,
        decoded_tokens=list(msg.decoded_tokens),
    )


def verify_request_to_proto(inputs: list[VerifyInput]) -> verifier_pb2.VerifyRequest:
    msg = verifier_pb2.VerifyRequest()
    for item in inputs:
        _fill_verify_input(msg.sequences.add(), item)
    return msg


def verify_request_from_proto(msg: verifier_pb2.VerifyRequest) -> list[VerifyInput]:
    return [verify_input_from_proto(s) for s in msg.sequences]


def verify_response_to_proto(
    outputs: list[VerifyOutput], verify_ns: int
) -> verifier_pb2.VerifyResponse:
    msg = verifier_pb2.VerifyResponse(verify_ns=verify_ns)
    for item in outputs:
        _fill_verify_output(msg.sequences.add(), item)
    _fill_rows(msg.hidden_states, [item.hidden_states for item in outputs])
    return msg


def verify_response_from_proto(msg: verifier_pb2.VerifyResponse) -> list[VerifyOutput]:
    counts = [s.num_hidden_rows if s.HasField("num_hidden_rows") else None for s in msg.sequences]
    rows = _split_rows(msg.hidden_states, counts, "hidden_states")
    return [verify_output_from_proto(s, r) for s, r in zip(msg.sequences, rows, strict=True)]


def truncate_request_to_proto(items: list[Truncation]) -> common_pb2.TruncateRequest:
    return common_pb2.TruncateRequest(
        sequences=[common_pb2.SequenceTruncation(seq_id=t.seq_id, max_len=t.max_len) for t in items]
    )


def truncate_request_from_proto(msg: common_pb2.TruncateRequest) -> list[Truncation]:
    items = [Truncation(t.seq_id, t.max_len) for t in msg.sequences]
    for item in items:
        if item.max_len < 0:
            raise invalid(f"max_len = {item.max_len} for {item.seq_id!r}: must be >= 0")
    return items


def truncate_response_to_proto(
    items: list[Truncated], num_pages_used: int
) -> common_pb2.TruncateResponse:
    return common_pb2.TruncateResponse(
        sequences=[
            common_pb2.SequenceTruncated(
                seq_id=t.seq_id,
                found=t.found,
                kv_committed_len=t.kv_committed_len,
                num_pages=t.num_pages,
            )
            for t in items
        ],
        num_pages_used=num_pages_used,
    )


def truncate_response_from_proto(msg: common_pb2.TruncateResponse) -> list[Truncated]:
    return [Truncated(t.seq_id, t.found, t.kv_committed_len, t.num_pages) for t in msg.sequences]
