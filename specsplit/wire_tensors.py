"""Tensors on the wire (specsplit/convert.py's messages carry them): raw little-endian bytes +
dtype + shape (never pickle). bfloat16 has no numpy type, so it travels as its bit pattern and
is restored exactly. A round's per-sequence feature rows travel as one tensor message, or beside
the message on the round lane (`Beside`). Malformed data raises ServiceError(INVALID_ARGUMENT)
naming the field."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from specsplit.errors import invalid
from specsplit.model.transfer import join_rows
from specsplit.v1 import common_pb2

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


def tensor_to_proto(tensor: torch.Tensor) -> common_pb2.Tensor:
    msg = common_pb2.Tensor()
    fill_tensor(msg, tensor)
    return msg


def fill_tensor(msg: common_pb2.Tensor, tensor: torch.Tensor) -> None:
    """Write `tensor` into `msg` in place. The builders below fill sub-messages where they
    are (`.add()`, a field's own message): a message built apart and then assigned or
    `CopyFrom`-ed is copied again, tensor bytes included."""
    msg.data = tensor_bytes(describe(msg, tensor)).tobytes()


def describe(msg: common_pb2.Tensor, tensor: torch.Tensor) -> torch.Tensor:
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


def fill_rows(
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
        fill_tensor(msg, join_rows(parts))
    else:
        beside.rows = describe(msg, join_rows(parts))


def split_rows(
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
