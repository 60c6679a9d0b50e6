"""Protobuf <-> domain dataclasses, the only place the two meet (servicers and clients call it).

Tensors cross as raw little-endian bytes + dtype + shape (never pickle). bfloat16 has no numpy
type, so it travels as its bit pattern viewed as int16 and is restored exactly.
Malformed wire data raises ServiceError(INVALID_ARGUMENT) naming the field.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from specsplit.errors import invalid
from specsplit.messages import (
    AheadTree,
    DraftInput,
    DraftOutput,
    NextTrees,
    SpecParams,
    Truncated,
    Truncation,
    VerifyInput,
    VerifyOutput,
)
from specsplit.model.transfer import join_rows
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftProbs, DraftTree
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
T = TypeVar("T")
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
    msg.data = tensor_bytes(_describe(msg, tensor)).tobytes()


def _describe(msg: common_pb2.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """Set `msg`'s dtype and shape (not its data) for `tensor`; the tensor on the CPU,
    contiguous."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype not in _DTYPE_NAMES:
        raise ValueError(f"tensor dtype {tensor.dtype} cannot cross the wire")
    msg.dtype = _DTYPE_NAMES[tensor.dtype]
    msg.shape.extend(tensor.shape)
    return tensor


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as they cross the wire, without a copy (a view that
    keeps the tensor alive)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy().data)


def tensor_from_proto(
    msg: common_pb2.Tensor, field: str = "tensor", beside: bytearray | memoryview | None = None
) -> torch.Tensor:
    """A new (writable, CPU) tensor with the message's contents. beside: its contents as they
    came beside the message (the round lane; the message's own data then empty), taken as the
    tensor's storage without a copy."""
    if msg.dtype not in DTYPES:
        raise invalid(f"{field}.dtype {msg.dtype!r} unknown; expected one of {sorted(DTYPES)}")
    dtype = DTYPES[msg.dtype]
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise invalid(f"{field}.shape {list(shape)} has a negative dimension")
    expected = math.prod(shape) * _ITEMSIZES[dtype]
    if beside and msg.data:
        raise invalid(f"{field}: contents both in its data and beside the message")
    data = beside or msg.data
    if len(data) != expected:
        raise invalid(
            f"{field}.data has {len(data)} bytes, shape {list(shape)} of {msg.dtype} "
            f"needs {expected}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # a lane's buffer is taken as it is (writable; page-locked where the drafter is on a GPU)
    storage = data if isinstance(data, bytearray | memoryview) else bytearray(data)
    return torch.frombuffer(storage, dtype=dtype).reshape(shape)


def _fill_rows(
    msg: common_pb2.Tensor, per_sequence: list[torch.Tensor | None], beside: Beside | None
) -> None:
    """A round's per-sequence rows ([n_i, width] each, None: none asked) as one tensor message:
    per sequence a tensor message costs ~50 us to build and read (at 32 sequences more than the
    rest of the round's messages together); one answer's rows sent on in its order are joined
    without a copy (join_rows). With `beside` the rows go there and the message keeps only
    their dtype and shape."""
    parts = [rows for rows in per_sequence if rows is not None]
    if not parts:
        return
    if beside is None:
        _fill_tensor(msg, join_rows(parts))
    else:
        beside.rows = _describe(msg, join_rows(parts))


def _split_rows(
    msg: common_pb2.Tensor,
    counts: list[int | None],
    field: str,
    beside: bytearray | memoryview | None,
) -> list[torch.Tensor | None]:
    """Each sequence's rows of a round's one tensor message (views of one copy), by the row
    counts its sequences carry (None: the sequence has none, not even an empty tensor)."""
    wanted = [n for n in counts if n is not None]
    if not wanted:
        if beside:
            raise invalid(f"{field}: {len(beside)} bytes of rows beside a round that has none")
        return [None] * len(counts)
    if any(n < 0 for n in wanted):
        raise invalid(f"{field}: a sequence's row count is negative ({min(wanted)})")
    rows = tensor_from_proto(msg, field, beside)
    if rows.dim() != 2 or rows.shape[0] != sum(wanted):
        raise invalid(
            f"{field} has shape {list(rows.shape)}: want [{sum(wanted)} rows (the sequences' "
            "counts), width]"
        )
    if len(counts) == 1:  # one sequence: its rows are the tensor
        return [rows]
    parts = iter(rows.split(wanted))
    return [None if n is None else next(parts) for n in counts]


@dataclass
class Beside:
    """A round message's feature rows set aside by its builder, to travel beside the
    message's bytes instead of in its tensor field (the round lane: sent from the tensor's own
    memory and read straight into the receiver's, where the field costs ~5 copies a hop of up
    to 3 MB a round). The field keeps the rows' dtype and shape; a parser is given the bytes
    that came beside (a writable buffer, taken as the tensor's storage)."""

    rows: torch.Tensor | None = None  # None: the message has no rows

    def data(self) -> memoryview | bytes:
        """The rows' bytes as they go (a view of the tensor's memory; empty for none)."""
        return b"" if self.rows is None else tensor_bytes(self.rows)


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
        _fill_probs(msg.draft_probs, tree.draft_probs)


def tree_from_proto(msg: common_pb2.DraftTree, field: str = "tree") -> DraftTree:
    probs = (
        probs_from_proto(msg.draft_probs, f"{field}.draft_probs")
        if msg.HasField("draft_probs")
        else None
    )
    return DraftTree(tokens=list(msg.tokens), parents=list(msg.parents), draft_probs=probs)


def _fill_probs(msg: common_pb2.DraftProbs, probs: DraftProbs) -> None:
    msg.vocab_size = probs.vocab_size
    _fill_tensor(msg.tokens, probs.tokens.to(torch.int32))
    _fill_tensor(msg.probs, probs.probs.float())


def probs_from_proto(msg: common_pb2.DraftProbs, field: str) -> DraftProbs:
    """Draft distributions' supports, checked: [n, k] int32 tokens inside the vocabulary and
    [n, k] float32 finite, non-negative probabilities."""
    tokens = tensor_from_proto(msg.tokens, f"{field}.tokens")
    probs = tensor_from_proto(msg.probs, f"{field}.probs")
    if msg.vocab_size <= 0:
        raise invalid(f"{field}.vocab_size = {msg.vocab_size}: must be > 0")
    if tokens.dtype != torch.int32 or probs.dtype != torch.float32:
        raise invalid(f"{field}: tokens must be int32 and probs float32")
    if tokens.dim() != 2 or tokens.shape != probs.shape:
        raise invalid(
            f"{field}: tokens {list(tokens.shape)} and probs {list(probs.shape)} must be one "
            "[n, k] shape"
        )
    ids, values = tokens.numpy(), probs.numpy()  # numpy: a few us a check, where torch's ~5
    if ids.size and not (ids.min() >= 0 and ids.max() < msg.vocab_size):
        raise invalid(f"{field}.tokens outside the vocabulary [0, {msg.vocab_size})")
    if values.size and not ((values >= 0).all() and values.max() < math.inf):  # nan fails >= 0
        raise invalid(f"{field}.probs must be finite and >= 0")
    return DraftProbs(tokens.long(), probs, msg.vocab_size)


def _fill_round_probs(msg: common_pb2.DraftProbs, trees: list[DraftTree]) -> None:
    """The draft probabilities of a round's trees that have them, as one message: their rows
    back to back in order (a message per sequence cost ~40 us a sequence to build and read)."""
    parts = [tree.draft_probs for tree in trees if tree.draft_probs is not None]
    if parts:
        _fill_probs(msg, DraftProbs.cat(parts))


def _read_round_probs(
    msg: verifier_pb2.VerifyRequest | drafter_pb2.DraftResponse, trees: list[DraftTree]
) -> None:
    """Give each of `trees` (those said to have draft probabilities, in order) its rows of the
    round's message: views of one checked copy."""
    counts = [len(tree) for tree in trees]
    if not msg.HasField("draft_probs"):
        if trees:
            raise invalid(f"{len(trees)} sequences have draft probabilities; draft_probs unset")
        return
    probs = probs_from_proto(msg.draft_probs, "draft_probs")
    if len(probs) != sum(counts):
        raise invalid(
            f"draft_probs has {len(probs)} rows; the trees said to have them have {sum(counts)}"
            " nodes"
        )
    parts = [probs] if len(trees) == 1 else probs.split(counts)
    for tree, part in zip(trees, parts, strict=True):
        tree.draft_probs = part


# -- columns ---------------------------------------------------------------------------------
# A round's request and response carry their sequences in columns (the .proto files): entry i
# of a per-sequence column is sequence i's; a flat column holds the sequences' lists back to
# back by a count column. Each column is read with one call; what few sequences carry (sampling,
# draft probabilities, draft-ahead) travels as an indexed message beside the columns.


def _column(values: Any, num_seqs: int, field: str, default: Any = None) -> list[Any]:
    """A per-sequence column as a list: `num_seqs` entries, or none when it may be left empty
    (`default` for every sequence)."""
    column = list(values)
    if not column and default is not None:
        return [default] * num_seqs
    if len(column) != num_seqs:
        raise invalid(f"{field} has {len(column)} entries for {num_seqs} sequences")
    return column


def _split(flat: Iterable[T], counts: list[int], field: str, count_field: str) -> list[list[T]]:
    """Each sequence's list of a flat column (or of items made from columns), `counts[i]`
    entries for sequence i."""
    values = list(flat)
    if len(counts) == 1 and counts[0] == len(values):  # one sequence: its list is the column
        return [values]
    if counts and min(counts) < 0:
        raise invalid(f"{count_field}: a sequence's count is negative ({min(counts)})")
    if sum(counts) != len(values):
        raise invalid(f"{field} has {len(values)} entries, {count_field} sums to {sum(counts)}")
    lists, end = [], 0
    for n in counts:  # (half the time of slicing at itertools.accumulate's ends)
        lists.append(values[end : end + n])
        end += n
    return lists


def _lists(msg: Any, num_seqs: int, counts: str, flat: str, default: Any = None) -> list[Any]:
    """Each sequence's list of the flat column `flat`, by the count column `counts`."""
    column = _column(getattr(msg, counts), num_seqs, counts, default)
    return _split(getattr(msg, flat), column, flat, counts)


def _indexed(entries: Any, num_seqs: int, field: str) -> dict[int, Any]:
    """An indexed side message per sequence that has one, by index (in order, each once)."""
    by_index: dict[int, Any] = {}
    last = -1
    for entry in entries:
        if not last < entry.index < num_seqs:
            raise invalid(f"{field}: index {entry.index} out of order or outside [0, {num_seqs})")
        by_index[entry.index] = entry
        last = entry.index
    return by_index


TREE_COLUMNS = ("num_tree_nodes", "tree_tokens", "tree_parents")  # a round's trees
AHEAD_COLUMNS = ("num_ahead_nodes", "ahead_tokens", "ahead_parents")  # DraftResponse's ahead


def _fill_trees(msg: Any, trees: list[DraftTree], columns: tuple[str, ...] = TREE_COLUMNS) -> None:
    """Each tree into the message's three tree columns (`columns`: the node counts, the flat
    tokens, the flat parents); draft probabilities go in the side messages."""
    counts, tokens, parents = (getattr(msg, name) for name in columns)
    counts.extend([len(tree) for tree in trees])
    tokens.extend([t for tree in trees for t in tree.tokens])
    parents.extend([p for tree in trees for p in tree.parents])


def _read_trees(
    msg: Any, num_trees: int, columns: tuple[str, ...] = TREE_COLUMNS
) -> list[DraftTree]:
    """Each tree from the three tree columns (no draft probabilities: see _indexed)."""
    counts_name, tokens_name, parents_name = columns
    counts = _column(getattr(msg, counts_name), num_trees, counts_name, default=0)
    tokens, parents = getattr(msg, tokens_name), getattr(msg, parents_name)
    if not any(counts) and not tokens and not parents:
        return [DraftTree() for _ in counts]  # no drafts: target-only rounds
    token_lists = _split(tokens, counts, tokens_name, counts_name)
    parent_lists = _split(parents, counts, parents_name, counts_name)
    return [DraftTree(t, p) for t, p in zip(token_lists, parent_lists, strict=True)]


def _fill_outcomes(
    msg: drafter_pb2.DraftResponse | verifier_pb2.VerifyHint,
    per_seq: list[list[AheadTree]],
    columns: tuple[str, ...],
) -> None:
    """Each sequence's outcomes and the trees drafted for them into the outcome columns (the
    counts, each outcome's tokens) and the tree columns `columns`."""
    msg.num_outcomes.extend([len(aheads) for aheads in per_seq])
    outcomes = [ahead for aheads in per_seq for ahead in aheads]
    msg.num_outcome_tokens.extend([len(ahead.tokens) for ahead in outcomes])
    msg.outcome_tokens.extend([t for ahead in outcomes for t in ahead.tokens])
    _fill_trees(msg, [ahead.tree for ahead in outcomes], columns)


def _read_outcomes(
    msg: drafter_pb2.DraftResponse | verifier_pb2.VerifyHint,
    num_seqs: int,
    columns: tuple[str, ...],
) -> list[list[AheadTree]]:
    """Each sequence's outcomes with their trees, from the columns _fill_outcomes fills."""
    counts = _column(msg.num_outcomes, num_seqs, "num_outcomes", default=0)
    num_outcomes = sum(counts)
    outcomes = _lists(msg, num_outcomes, "num_outcome_tokens", "outcome_tokens", default=0)
    trees = _read_trees(msg, num_outcomes, columns)
    aheads = [AheadTree(t, tree) for t, tree in zip(outcomes, trees, strict=True)]
    return _split(aheads, counts, "outcomes", "num_outcomes")


def _row_counts(per_sequence: list[torch.Tensor | None]) -> list[int]:
    """A rows column: each sequence's row count, -1 for none; empty when no sequence has rows."""
    if all(rows is None for rows in per_sequence):
        return []
    return [-1 if rows is None else rows.shape[0] for rows in per_sequence]


def _rows_of(
    msg: Any,
    counts: Any,
    num_seqs: int,
    field: str,
    count_field: str,
    beside: bytearray | memoryview | None,
) -> list[Any]:
    column = _column(counts, num_seqs, count_field, default=-1)
    return _split_rows(msg, [None if n == -1 else n for n in column], field, beside)


def _nothing_beside(beside: bytearray | memoryview | None, message: str) -> None:
    """A message that carries no rows: refuse bytes that came beside it."""
    if beside:
        raise invalid(f"{len(beside)} bytes beside a {message}, which carries no rows")


# -- drafter ---------------------------------------------------------------------------------

GREEDY = SamplingParams()  # travels as an unset field


def draft_request_to_proto(
    inputs: list[DraftInput], beside: Beside | None = None
) -> drafter_pb2.DraftRequest:
    """beside: the target's feature rows go there (`Beside`), not in the message."""
    msg = drafter_pb2.DraftRequest()
    msg.seq_ids.extend([item.seq_id for item in inputs])
    msg.begin.extend([item.begin for item in inputs])
    msg.start.extend([item.start for item in inputs])
    msg.num_new_tokens.extend([len(item.new_tokens) for item in inputs])
    msg.new_tokens.extend([t for item in inputs for t in item.new_tokens])
    msg.target_kv_committed_len.extend([item.target_kv_committed_len for item in inputs])
    msg.num_steps.extend([item.spec.num_steps for item in inputs])
    msg.topk.extend([item.spec.topk for item in inputs])
    msg.num_draft_tokens.extend([item.spec.num_draft_tokens for item in inputs])
    hidden = [item.target_hidden_states for item in inputs]
    msg.num_target_rows.extend(_row_counts(hidden))
    _fill_rows(msg.target_hidden_states, hidden, beside)
    for i, item in enumerate(inputs):
        if item.sampling != GREEDY or item.ahead_guesses:
            options = msg.options.add(index=i)
            if item.sampling != GREEDY:
                options.sampling.CopyFrom(sampling_to_proto(item.sampling))
            if item.ahead_guesses:
                _fill_tree(options.verifying, item.verifying)
                options.ahead_guesses = item.ahead_guesses
    return msg


def draft_request_from_proto(
    msg: drafter_pb2.DraftRequest, beside: bytearray | memoryview | None = None
) -> list[DraftInput]:
    """beside: the feature rows' bytes that came beside the message (`Beside`)."""
    seq_ids = list(msg.seq_ids)
    n = len(seq_ids)
    new_tokens = _lists(msg, n, "num_new_tokens", "new_tokens")
    rows = _rows_of(
        msg.target_hidden_states,
        msg.num_target_rows,
        n,
        "target_hidden_states",
        "num_target_rows",
        beside,
    )
    inputs = [
        DraftInput(seq_id, begin, start, tokens, SpecParams(steps, topk or 1, nodes),
                   GREEDY, committed, hidden)
        for seq_id, begin, start, tokens, steps, topk, nodes, committed, hidden in zip(
            seq_ids,
            _column(msg.begin, n, "begin"),
            _column(msg.start, n, "start"),
            new_tokens,
            _column(msg.num_steps, n, "num_steps"),
            _column(msg.topk, n, "topk"),
            _column(msg.num_draft_tokens, n, "num_draft_tokens"),
            _column(msg.target_kv_committed_len, n, "target_kv_committed_len"),
            rows,
            strict=True,
        )
    ]  # fmt: skip
    for i, options in _indexed(msg.options, n, "options").items():
        item = inputs[i]
        if options.HasField("sampling"):
            item.sampling = sampling_from_proto(options.sampling)
        if options.HasField("verifying"):
            item.verifying = tree_from_proto(options.verifying, f"{item.seq_id}.verifying")
        item.ahead_guesses = options.ahead_guesses
    return inputs


def draft_response_to_proto(
    outputs: list[DraftOutput], draft_ns: int, beside: Beside | None = None
) -> drafter_pb2.DraftResponse:
    """beside: unused (a draft answer carries no rows); as the other builders take it."""
    msg = drafter_pb2.DraftResponse(draft_ns=draft_ns)
    msg.seq_ids.extend([item.seq_id for item in outputs])
    _fill_trees(msg, [item.tree for item in outputs])
    msg.kv_committed_len.extend([item.kv_committed_len for item in outputs])
    layers = {item.hidden_state_layers for item in outputs}
    if len(layers) > 1:
        raise ValueError(f"a drafter's outputs name different hidden_state_layers: {layers}")
    msg.hidden_state_layers.extend(layers.pop() if layers else ())
    _fill_round_probs(msg.draft_probs, [item.tree for item in outputs])
    for i, item in enumerate(outputs):
        if item.tree.draft_probs is not None:
            msg.extras.add(index=i, has_draft_probs=True)
    if any(item.ahead for item in outputs):
        _fill_outcomes(msg, [item.ahead for item in outputs], AHEAD_COLUMNS)
    return msg


def draft_response_from_proto(
    msg: drafter_pb2.DraftResponse, beside: bytearray | memoryview | None = None
) -> list[DraftOutput]:
    _nothing_beside(beside, "DraftResponse")
    seq_ids = list(msg.seq_ids)
    n = len(seq_ids)
    layers = tuple(msg.hidden_state_layers)
    trees = _read_trees(msg, n)
    outputs = [
        DraftOutput(seq_id, tree, committed, layers)
        for seq_id, tree, committed in zip(
            seq_ids, trees, _column(msg.kv_committed_len, n, "kv_committed_len"), strict=True
        )
    ]
    extras_of = _indexed(msg.extras, n, "extras")
    with_probs = [i for i, extras in extras_of.items() if extras.has_draft_probs]
    _read_round_probs(msg, [outputs[i].tree for i in with_probs])
    if msg.num_outcomes:
        for item, ahead in zip(outputs, _read_outcomes(msg, n, AHEAD_COLUMNS), strict=True):
            item.ahead = ahead
    return outputs


# -- verifier --------------------------------------------------------------------------------


def verify_request_to_proto(
    inputs: list[VerifyInput], beside: Beside | None = None
) -> verifier_pb2.VerifyRequest:
    """Greedy sampling and no draft probabilities travel as no `sampled` entry; decode_steps,
    wants_hidden_states and unhinted as empty columns when every sequence has the default. beside:
    unused (a Verify request carries no rows)."""
    msg = verifier_pb2.VerifyRequest()
    msg.seq_ids.extend([item.seq_id for item in inputs])
    msg.begin.extend([item.begin for item in inputs])
    msg.kv_committed_len.extend([item.kv_committed_len for item in inputs])
    msg.num_pending_tokens.extend([len(item.pending_tokens) for item in inputs])
    msg.pending_tokens.extend([t for item in inputs for t in item.pending_tokens])
    _fill_trees(msg, [item.tree for item in inputs])
    steps = [item.decode_steps for item in inputs]
    if any(n != 1 for n in steps):
        msg.decode_steps.extend(steps)
    if any(item.unhinted for item in inputs):
        msg.unhinted.extend([item.unhinted for item in inputs])
    layers = {item.hidden_state_layers for item in inputs} - {()}
    if layers:
        if len(layers) > 1:  # the verifier refuses it; the wire cannot carry it
            raise invalid(
                "hidden_state_layers must be the same for every sequence of a round that asks"
                " for hidden states"
            )
        msg.hidden_state_layers.extend(layers.pop())
        msg.wants_hidden_states.extend([bool(item.hidden_state_layers) for item in inputs])
    for i, item in enumerate(inputs):
        has_probs = item.tree.draft_probs is not None
        if item.sampling != GREEDY or has_probs:
            sampled = msg.sampled.add(index=i, has_draft_probs=has_probs)
            if item.sampling != GREEDY:
                sampled.sampling.CopyFrom(sampling_to_proto(item.sampling))
    _fill_round_probs(msg.draft_probs, [item.tree for item in inputs])
    return msg


def verify_request_from_proto(
    msg: verifier_pb2.VerifyRequest, beside: bytearray | memoryview | None = None
) -> list[VerifyInput]:
    _nothing_beside(beside, "VerifyRequest")
    seq_ids = list(msg.seq_ids)
    n = len(seq_ids)
    pending = _lists(msg, n, "num_pending_tokens", "pending_tokens")
    layers = tuple(msg.hidden_state_layers)
    wants = _column(msg.wants_hidden_states, n, "wants_hidden_states", default=False)
    if any(wants) and not layers:
        raise invalid("wants_hidden_states set with no hidden_state_layers")
    inputs = [
        VerifyInput(seq_id, begin, committed, tokens, tree, GREEDY,
                    layers if wanted else (), steps or 1)
        for seq_id, begin, committed, tokens, tree, wanted, steps in zip(
            seq_ids,
            _column(msg.begin, n, "begin"),
            _column(msg.kv_committed_len, n, "kv_committed_len"),
            pending,
            _read_trees(msg, n),
            wants,
            _column(msg.decode_steps, n, "decode_steps", default=1),
            strict=True,
        )
    ]  # fmt: skip
    for item, unhinted in zip(inputs, _column(msg.unhinted, n, "unhinted", default=False),
                              strict=True):  # fmt: skip
        item.unhinted = unhinted
    with_probs = []
    for i, sampled in _indexed(msg.sampled, n, "sampled").items():
        if sampled.HasField("sampling"):
            inputs[i].sampling = sampling_from_proto(sampled.sampling)
        if sampled.has_draft_probs:
            with_probs.append(i)
    _read_round_probs(msg, [inputs[i].tree for i in with_probs])
    return inputs


def verify_response_to_proto(
    outputs: list[VerifyOutput], verify_ns: int, beside: Beside | None = None
) -> verifier_pb2.VerifyResponse:
    """beside: the hidden-state rows go there (`Beside`), not in the message."""
    msg = verifier_pb2.VerifyResponse(verify_ns=verify_ns)
    msg.seq_ids.extend([item.seq_id for item in outputs])
    msg.num_accepted_drafts.extend([len(item.accepted_tokens) for item in outputs])
    msg.num_accepted_tokens.extend([len(item.accepted_tokens) + 1 for item in outputs])
    msg.accepted_tokens.extend([t for item in outputs for t in item.accepted_tokens])
    msg.bonus_token.extend([item.bonus_token for item in outputs])
    msg.kv_committed_len.extend([item.kv_committed_len for item in outputs])
    if any(item.decoded_tokens for item in outputs):
        msg.num_decoded_tokens.extend([len(item.decoded_tokens) for item in outputs])
        msg.decoded_tokens.extend([t for item in outputs for t in item.decoded_tokens])
    hidden = [item.hidden_states for item in outputs]
    msg.num_hidden_rows.extend(_row_counts(hidden))
    _fill_rows(msg.hidden_states, hidden, beside)
    return msg


def verify_response_from_proto(
    msg: verifier_pb2.VerifyResponse, beside: bytearray | memoryview | None = None
) -> list[VerifyOutput]:
    """beside: the hidden-state rows' bytes that came beside the message (`Beside`)."""
    seq_ids = list(msg.seq_ids)
    n = len(seq_ids)
    drafts = _column(msg.num_accepted_drafts, n, "num_accepted_drafts")
    tokens = _column(msg.num_accepted_tokens, n, "num_accepted_tokens")
    if any(t != d + 1 for d, t in zip(drafts, tokens, strict=True)):
        raise invalid("num_accepted_tokens must be num_accepted_drafts + 1 for every sequence")
    accepted = _split(msg.accepted_tokens, drafts, "accepted_tokens", "num_accepted_drafts")
    decoded = _lists(msg, n, "num_decoded_tokens", "decoded_tokens", default=0)
    rows = _rows_of(
        msg.hidden_states, msg.num_hidden_rows, n, "hidden_states", "num_hidden_rows", beside
    )
    return [
        VerifyOutput(seq_id, drafted, bonus, committed, hidden, steps)
        for seq_id, drafted, bonus, committed, hidden, steps in zip(
            seq_ids,
            accepted,
            _column(msg.bonus_token, n, "bonus_token"),
            _column(msg.kv_committed_len, n, "kv_committed_len"),
            rows,
            decoded,
            strict=True,
        )
    ]


def hint_to_proto(hints: list[NextTrees]) -> verifier_pb2.VerifyHint:
    """The hints' columns; an outcome's tree without draft probabilities (greedy rounds)."""
    msg = verifier_pb2.VerifyHint()
    msg.seq_ids.extend([hint.seq_id for hint in hints])
    msg.base.extend([hint.base for hint in hints])
    msg.plain.extend([hint.plain for hint in hints])
    _fill_outcomes(msg, [hint.trees for hint in hints], TREE_COLUMNS)
    return msg


def hint_from_proto(msg: verifier_pb2.VerifyHint) -> list[NextTrees]:
    """Unvalidated: the engine checks a round it runs on a hint as any round's."""
    seq_ids = list(msg.seq_ids)
    n = len(seq_ids)
    return [
        NextTrees(seq_id, base, trees, plain)
        for seq_id, base, plain, trees in zip(
            seq_ids,
            _column(msg.base, n, "base"),
            _column(msg.plain, n, "plain", default=False),
            _read_outcomes(msg, n, TREE_COLUMNS),
            strict=True,
        )
    ]


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
