"""A request field the gateway refuses (INVALID_ARGUMENT naming it), shared by request
validation (gateway/request.py) and the guides it builds (gateway/guides.py)."""

from __future__ import annotations

from collections.abc import Sequence

from specsplit.errors import Code, ServiceError


class InvalidField(ServiceError):
    """INVALID_ARGUMENT for one request field; `field` is its domain name (max_new_tokens,
    temperature, stop, ...) so each API can report it under its own name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(Code.INVALID_ARGUMENT, message)
        self.field = field


def check_vocab(ids: Sequence[int], field: str, vocab_size: int) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidField(
                field.split(".")[0],
                f"{field}[{i}] = {token} outside the vocabulary [0, {vocab_size})",
            )
