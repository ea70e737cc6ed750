"""Typed exceptions for the API's error codes ({code, message, field} with an HTTP status)."""

from __future__ import annotations

from typing import Optional


class GroveError(Exception):
    """Any error answered by groved (or on the way to it)."""

    def __init__(self, message: str, *, status: Optional[int] = None, code: Optional[str] = None,
                 field: Optional[str] = None, retry_after: Optional[float] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.field = field
        self.retry_after = retry_after

    def __str__(self) -> str:
        where = f" (field {self.field})" if self.field else ""
        code = f"{self.code}: " if self.code else ""
        return f"{code}{self.message}{where}"


class InvalidRequest(GroveError):
    """400/422: the request is malformed or a value is invalid; `field` names it."""


class Unauthorized(GroveError):
    """401: missing or wrong API key."""


class NotFound(GroveError):
    """404: no such sandbox, image, snapshot or file."""


class Conflict(GroveError):
    """409: the sandbox is in the wrong state for this (e.g. exec while paused)."""


class CapacityExceeded(GroveError):
    """429: the node is full; retried with backoff before this is raised."""


class Unsupported(GroveError):
    """501: not available on this node (e.g. snapshots without CRIU)."""


class Unavailable(GroveError):
    """503: groved is shutting down or overloaded; retried before this is raised."""


class ServerError(GroveError):
    """Any other 5xx."""


class ConnectionFailed(GroveError):
    """groved could not be reached (after retries); the message names the socket or URL."""


class ConnectionLost(ConnectionFailed):
    """The connection broke while a call that is not idempotent was under way: it was not sent again, and it
    may or may not have taken effect (a command ends in the sandbox once its client is gone)."""


class RequestTimeout(GroveError):
    """A client-side deadline passed (the call's own `timeout`, or the client's for short calls)."""


class StorageFull(GroveError):
    """507: the sandbox's disk quota or the node's store is full."""


class ForkError(GroveError):
    """Some branches of a fork failed. `sandboxes` holds the ones that were made (still running)."""

    def __init__(self, message: str, *, sandboxes: list, errors: list):
        super().__init__(message, code="fork_partial")
        self.sandboxes = sandboxes
        self.errors = errors


def from_response(status: int, body: dict, retry_after: Optional[float] = None) -> GroveError:
    code = body.get("code") if isinstance(body, dict) else None
    message = body.get("message", "") if isinstance(body, dict) else str(body)
    field = body.get("field") if isinstance(body, dict) else None
    cls = {
        400: InvalidRequest,
        422: InvalidRequest,
        401: Unauthorized,
        404: NotFound,
        409: Conflict,
        429: CapacityExceeded,
        501: Unsupported,
        503: Unavailable,
        507: StorageFull,
    }.get(status, ServerError if status >= 500 else GroveError)
    return cls(message or f"HTTP {status}", status=status, code=code, field=field, retry_after=retry_after)
