"""Protobuf <-> domain dataclasses for the messages beside the rounds (specsplit/convert.py has
the rounds'): the gateway's hints to the verifier and the services' Truncate."""

from __future__ import annotations

from specsplit.errors import invalid
from specsplit.messages import NextTrees, Truncated, Truncation
from specsplit.v1 import common_pb2, verifier_pb2
from specsplit.wire_columns import TREE_COLUMNS, column_of, fill_outcomes, read_outcomes


def hint_to_proto(hints: list[NextTrees]) -> verifier_pb2.VerifyHint:
    """The hints' columns; an outcome's tree without draft probabilities (greedy rounds)."""
    msg = verifier_pb2.VerifyHint()
    msg.seq_ids.extend([hint.seq_id for hint in hints])
    msg.base.extend([hint.base for hint in hints])
    msg.plain.extend([hint.plain for hint in hints])
    fill_outcomes(msg, [hint.trees for hint in hints], TREE_COLUMNS)
    return msg


def hint_from_proto(msg: verifier_pb2.VerifyHint) -> list[NextTrees]:
    """Unvalidated: the engine checks a round it runs on a hint as any round's."""
    seq_ids = list(msg.seq_ids)
    n = len(seq_ids)
    return [
        NextTrees(seq_id, base, trees, plain)
        for seq_id, base, plain, trees in zip(
            seq_ids,
            column_of(msg.base, n, "base"),
            column_of(msg.plain, n, "plain", default=False),
            read_outcomes(msg, n, TREE_COLUMNS),
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
