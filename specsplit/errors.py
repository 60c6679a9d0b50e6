"""Domain errors that map one-to-one onto gRPC status codes at the servicer boundary."""

from __future__ import annotations

import enum
from collections.abc import Container, Iterable
from typing import Protocol


class Code(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class ServiceError(Exception):
    """A request the service refuses; the message names the offending field."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# a backend's refusals the gateway passes on as they are; anything else means the backend is down
PASSED_THROUGH = frozenset(
    {Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION, Code.RESOURCE_EXHAUSTED}
)


def backend_error(service: str, code_name: str, message: str) -> ServiceError:
    """A drafter's or verifier's error as the gateway raises it (over gRPC or the round lane):
    PASSED_THROUGH codes with the service's message, anything else (down, stream broken,
    internal error) as UNAVAILABLE naming the service. code_name: the status's name."""
    code = next((c for c in PASSED_THROUGH if c.value == code_name), None)
    if code is not None:
        return ServiceError(code, message or code_name)
    return ServiceError(Code.UNAVAILABLE, f"{service}: {code_name}: {message or 'no details'}")


# what a service answers (UNAVAILABLE) before its model is loaded and warm
STILL_LOADING = "is still loading its model"


def still_loading(error: ServiceError) -> bool:
    """Whether `error` is a service's answer before it is warm (its message passed on)."""
    return error.code == Code.UNAVAILABLE and STILL_LOADING in error.message


def invalid(message: str) -> ServiceError:
    return ServiceError(Code.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServiceError:
    return ServiceError(Code.NOT_FOUND, message)


class _Keyed(Protocol):
    seq_id: str
    begin: bool


def check_seq_ids(items: Iterable[_Keyed], known: Container[str], service: str) -> None:
    """A round names each sequence once; `begin` only for new ids, all others must exist."""
    seen: set[str] = set()
    for item in items:
        if item.seq_id in seen:
            raise invalid(f"seq_id {item.seq_id!r} appears twice in one round")
        seen.add(item.seq_id)
        if item.begin and item.seq_id in known:
            raise invalid(f"seq_id {item.seq_id!r}: begin on a sequence that exists")
        if not item.begin and item.seq_id not in known:
            raise not_found(f"seq_id {item.seq_id!r} unknown to the {service}")
