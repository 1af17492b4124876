"""Standard-library logging, one line per event, with structured model/version/request fields.

Code attaches fields with ``extra=log_fields(model=..., version=..., request_id=...)`` or a
logger from :func:`bind`. Under systemd the records go to the journal with those fields as
MODEL=, VERSION=, REQUEST_ID= (``journalctl -u edged MODEL=digits``); elsewhere to stderr,
where fields that the text does not already show are appended as ``[model=... version=...]``.
Lines written in the older ``"model=%s version=%s ..."`` style get the same fields from their
first two arguments, so they need no change.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

from edged.journal import record_fields

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_fields(model: str | None = None, version: int | str | None = None,
               request_id: str | None = None) -> dict[str, object]:
    """The ``extra=`` mapping for a record about one model version / request (None values left out)."""
    out: dict[str, object] = {}
    if model is not None:
        out["model"] = model
    if version is not None:
        out["version"] = version
    if request_id is not None:
        out["request_id"] = request_id
    return out


class FieldsAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger that adds fixed fields to every record (a call's own ``extra`` wins)."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **(kwargs.get("extra") or {})}
        return msg, kwargs


def bind(logger: logging.Logger, *, model: str | None = None, version: int | str | None = None,
         request_id: str | None = None) -> FieldsAdapter:
    return FieldsAdapter(logger, log_fields(model, version, request_id))


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = record_fields(record)
        if not fields:
            return text
        head, sep, tail = text.partition("\n")  # keep fields on the first line, before a traceback
        missing = [f"{k}={v}" for k, v in fields.items() if f"{k}={v}" not in head]
        if not missing:
            return text
        return f"{head} [{' '.join(missing)}]{sep}{tail}"


def _mark(handler: logging.Handler) -> logging.Handler:
    handler._edged = True  # type: ignore[attr-defined]
    return handler


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is at each record, not as it was at setup (an embedder may swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup_logging(level: str = "info", *, stream: object = None, journal: bool | None = None) -> str:
    """Route the root logger to the journal (under systemd) or to ``stream``/stderr; returns which.

    ``journal`` None decides automatically; True/False force it (False: always the stream).
    """
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_edged", False):
            root.removeHandler(h)
            h.close()
    handler: logging.Handler | None = None
    if stream is None and journal is not False:
        from edged.journal import JournalHandler, journal_handler_or_none

        handler = JournalHandler() if journal else journal_handler_or_none()
    where = "journal"
    if handler is None:
        handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()  # type: ignore[call-overload]
        handler.setFormatter(_TextFormatter(_FORMAT, datefmt="%Y-%m-%dT%H:%M:%S"))
        where = "stderr"
    root.addHandler(_mark(handler))
    set_level(level)
    return where


def set_level(level: str) -> None:
    """Change the level of edged's logging while running (SIGHUP applies ``[logging] level`` this way)."""
    logging.getLogger().setLevel(level.upper())

