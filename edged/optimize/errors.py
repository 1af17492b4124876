"""Typed errors of ``edged optimize``; each says what was wrong and in which file or argument."""

from __future__ import annotations

from edged.errors import EdgedError, ErrorCode


class OptimizeInputError(EdgedError):
    """An argument, the model or a data file does not fit (shape, datatype, count, path)."""

    code = ErrorCode.INVALID_ARGUMENT


class VersionExistsError(EdgedError):
    """The target version folder exists and ``--force`` was not given: a version is never changed in place."""

    code = ErrorCode.FAILED_PRECONDITION
