"""One exception root for fleetrl and its single mapping to gRPC status codes.

Each subclass also inherits the builtin it stands for, so callers that catch
`ValueError` or `KeyError` keep working. `grpc_code()` is the only place that
knows which status a domain error becomes; servicers never pick codes by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request, by dotted path (e.g. `algorithm.clip_eps`)."""

    field: str
    description: str


def clip(text: str, chars: int) -> str:
    """text, or its first `chars` characters and its length when it is longer (user input quoted in errors)."""
    return text if len(text) <= chars else f"{text[:chars]}... ({len(text)} characters)"


class FleetError(Exception):
    """Root of every error fleetrl raises on purpose."""


class ConfigError(FleetError, ValueError):
    """A spec or setting is invalid; lists every bad field."""

    violations: list[FieldViolation]

    def __init__(self, message: str, violations: list[FieldViolation] | None = None) -> None:
        self.violations = list(violations or [])
        detail = "; ".join(f"{v.field}: {v.description}" for v in self.violations)
        super().__init__(f"{message}: {detail}" if detail else message)


class InvalidArgument(FleetError, ValueError):
    """A request is malformed (empty group, length mismatch, ...)."""

    violations: list[FieldViolation]

    def __init__(self, message: str, violations: list[FieldViolation] | None = None) -> None:
        self.violations = list(violations or [])
        super().__init__(message)


class NotFound(FleetError, KeyError):
    """The named job, lease or object does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "not found"


class AlreadyExists(FleetError):
    """The thing to create exists already."""


class FailedPrecondition(FleetError, RuntimeError):
    """The system is not in a state that allows the call (e.g. unsafe Redis policy)."""


class Fenced(FailedPrecondition):
    """A write carried a job-lease epoch older than the job's newest: another learner holds the job."""


class ResourceExhausted(FleetError, RuntimeError):
    """A size or memory limit was hit; the caller may retry later or send less."""


class Unavailable(FleetError, ConnectionError):
    """A dependency (NATS, Redis, another service) cannot be reached now; retry."""


class PermissionDenied(FleetError, PermissionError):
    """The caller is authenticated but may not touch this resource."""


class Unauthenticated(FleetError, PermissionError):
    """The caller presented no valid credentials."""


class DeadlineExceeded(FleetError, TimeoutError):
    """An operation ran past its deadline."""


class Cancelled(FleetError):
    """The operation was cancelled (e.g. its job was cancelled)."""


class WeightsCorrupt(FleetError, ValueError):
    """Pulled weights differ from what their publisher recorded: an object's size or sha256, a delta
    that does not apply to the weights it is applied to, or a reconstruction whose sha256 differs from
    the pointer's."""


_CODES: dict[type[FleetError], grpc.StatusCode] = {
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Cancelled: grpc.StatusCode.CANCELLED,
}

_FROM_CODES: dict[grpc.StatusCode, type[FleetError]] = {code: cls for cls, code in _CODES.items()}
_FROM_CODES[grpc.StatusCode.INVALID_ARGUMENT] = InvalidArgument

RETRYABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
)


def grpc_code(error: BaseException) -> grpc.StatusCode:
    """The status code a domain error maps to; INTERNAL for anything unplanned."""
    for cls in type(error).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return grpc.StatusCode.INTERNAL


def from_grpc(error: grpc.RpcError) -> FleetError:
    """Turn a failed call's status back into the matching domain error."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    cls = _FROM_CODES.get(code, Unavailable if code == grpc.StatusCode.UNKNOWN else FleetError)
    return cls(details or code.name)
