"""One error root for the whole daemon.

Every error carries a transport-neutral :class:`ErrorCode`; the HTTP, MQTT and
shared-memory transports map that code to their own form (status code, error
response field, completion status) and never inspect the subclass.
"""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from pydantic import ValidationError


class ErrorCode(str, enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    UNAVAILABLE = "unavailable"
    OVERLOADED = "overloaded"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"
    INTERNAL = "internal"
    UNAUTHENTICATED = "unauthenticated"  # no (valid) credential for an action that needs one
    PERMISSION_DENIED = "permission_denied"  # known caller, or disabled action: not allowed


class EdgedError(Exception):
    """Root of every error edged raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: ErrorCode | None = None, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        # Structured context (model, version, key path, file...) for logs; never shown raw to clients.
        self.context = context

    def __str__(self) -> str:
        return self.message


class ConfigError(EdgedError):
    """The configuration file is missing, unreadable or invalid."""

    code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, message: str, problems: list[str] | None = None, **context: Any) -> None:
        super().__init__(message, **context)
        self.problems = problems or [message]


class ManifestError(EdgedError):
    """A model version's manifest or files are wrong; the model is skipped, the rest still serve."""

    code = ErrorCode.FAILED_PRECONDITION


class EngineUnavailableError(EdgedError):
    """An inference engine's library is missing or cannot run here."""

    code = ErrorCode.UNAVAILABLE


class MissingDependencyError(EdgedError):
    """The configuration asks for a feature whose optional libraries (a pip extra) are not installed."""

    code = ErrorCode.UNAVAILABLE


class ModelLoadError(EdgedError):
    """An engine failed to load or warm up a model variant."""

    code = ErrorCode.UNAVAILABLE


class InvalidInputError(EdgedError):
    """A request does not match the model's inputs (name, datatype, shape, size)."""

    code = ErrorCode.INVALID_ARGUMENT


class EngineInputError(InvalidInputError):
    """The engine refused the input itself (its library said invalid argument): a shape the model
    cannot take or a value out of range. The scheduler names the input before a client sees it."""


class ModelNotFoundError(EdgedError):
    code = ErrorCode.NOT_FOUND


class ModelNotReadyError(EdgedError):
    code = ErrorCode.UNAVAILABLE


class OverloadedError(EdgedError):
    code = ErrorCode.OVERLOADED


class DeadlineExceededError(EdgedError):
    code = ErrorCode.DEADLINE_EXCEEDED


class ResourceExhaustedError(EdgedError):
    """Admitting the work would exceed a memory or size budget."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class UnauthenticatedError(EdgedError):
    """A state-changing action came without the management credential (or a trusted peer)."""

    code = ErrorCode.UNAUTHENTICATED


class PermissionDeniedError(EdgedError):
    """The caller is known but may not do this (or the action is disabled by configuration)."""

    code = ErrorCode.PERMISSION_DENIED


class UnsafePathError(EdgedError):
    """A directory the daemon would put sockets in could be changed by someone else: refuse to use it."""

    code = ErrorCode.FAILED_PRECONDITION


class InternalError(EdgedError):
    code = ErrorCode.INTERNAL


# Triton's fixed wording for a model it cannot serve, which its clients' examples and users' scripts
# match on ("Request for unknown model"); edged's own detail follows in parentheses.
def unknown_model(name: str, version: int | None = None, detail: str = "") -> ModelNotFoundError:
    what = f"'{name}'" + (f" version {version}" if version is not None else "")
    return ModelNotFoundError(f"Request for unknown model: {what} is not found" + (f" ({detail})" if detail else ""))


def model_not_ready(name: str, version: int, detail: str) -> ModelNotReadyError:
    return ModelNotReadyError(f"Request for unknown model: '{name}' version {version} is not at ready state ({detail})")


def exit_status(err: EdgedError, stream: TextIO | None = None) -> int:
    """Print an entry point's final error and return its exit status, alike in every CLI.

    A config error lists each problem on its own ``config:`` line, prefixed with the file it is in when
    the error knows it (as ``config check`` prints them), and exits 2; any other error is one ``error:``
    line and exits 1.
    """
    out = stream or sys.stderr
    if isinstance(err, ConfigError):
        file = str(err.context.get("file") or "")
        for problem in err.problems:
            print(f"config: {problem if not file or problem.startswith(file) else f'{file}: {problem}'}", file=out)
        return 2
    print(f"error: {err}", file=out)
    return 1


def format_validation_error(err: ValidationError, prefix: str = "") -> list[str]:
    """One ``key.path: message`` line per pydantic problem (paths under ``prefix``, e.g. ``mqtt.bindings[2]``)."""
    out = []
    for e in err.errors():
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"])
        loc = (prefix + path).lstrip(".") or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        out.append(f"{loc}: {msg}")
    return out
