"""Domain errors that map one-to-one onto gRPC status codes at the servicer boundary."""

from __future__ import annotations

import enum


class Code(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"


class ServiceError(Exception):
    """A request the service refuses; the message names the offending field."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ServiceError:
    return ServiceError(Code.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServiceError:
    return ServiceError(Code.NOT_FOUND, message)
