"""Engine libraries' own stderr into the daemon's log, one record per line, without colour codes.

ONNX Runtime, OpenVINO and TensorRT write from C++ straight to file descriptor 2: ONNX Runtime
wraps its lines in ANSI colour escapes, which end up raw in the journal or a log file, outside
the daemon's format and level. :func:`capture` points descriptor 2 at a pipe that a thread reads,
strips the escapes from and logs through ``edged.engine`` (errors as errors, warnings as
warnings); Python's own writes (the log handler, tracebacks) keep going to the original stderr
through a duplicate of it, so nothing loops.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading

log = logging.getLogger("edged.engine")

_ANSI = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]")
_MAX_LINE = 16 << 10  # a longer line is logged in pieces: the reader never holds more than this
# ONNX Runtime: "2026-11-29 03:54:58.88 [E:onnxruntime:, sequential_executor.cc:677 ...]";
# OpenVINO and others: "[ WARNING ] ...", "[ERROR] ...".
_ORT_LEVEL = re.compile(r"\[([VIWEF]):onnxruntime")
_LEVELS = {"V": logging.DEBUG, "I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
_WORDS = re.compile(r"\[\s*(ERROR|FATAL|CRITICAL|WARNING|WARN|INFO|DEBUG)\s*\]", re.IGNORECASE)
_WORD_LEVELS = {"ERROR": logging.ERROR, "FATAL": logging.CRITICAL, "CRITICAL": logging.CRITICAL,
                "WARNING": logging.WARNING, "WARN": logging.WARNING, "INFO": logging.INFO, "DEBUG": logging.DEBUG}


def clean(raw: bytes) -> str:
    """One line as the log shows it: escapes removed, undecodable bytes replaced, no trailing blanks."""
    return _ANSI.sub(b"", raw).decode("utf-8", "replace").rstrip()


def level_of(line: str) -> int:
    m = _ORT_LEVEL.search(line)
    if m:
        return _LEVELS[m.group(1)]
    m = _WORDS.search(line)
    return _WORD_LEVELS[m.group(1).upper()] if m else logging.WARNING  # unlabelled library output


class NativeStderr:
    """Descriptor 2 redirected into the log while active; :meth:`close` puts it back."""

    def __init__(self) -> None:
        sys.stderr.flush()
        read_fd, write_fd = os.pipe()
        try:
            self._saved = os.dup(2)
        except OSError:
            os.close(read_fd)
            os.close(write_fd)
            raise
        self._old = sys.stderr
        self._read = read_fd
        # Python writes where stderr went before; C++ libraries (and child processes) write to the pipe.
        sys.stderr = io.TextIOWrapper(io.FileIO(self._saved, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._thread = threading.Thread(target=self._pump, name="edged-engine-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self._read, 65536)
            except OSError:
                break
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            while len(pending) > _MAX_LINE:
                lines.append(pending[:_MAX_LINE])
                pending = pending[_MAX_LINE:]
            for raw in lines:
                self._emit(raw)
        if pending:
            self._emit(pending)

    @staticmethod
    def _emit(raw: bytes) -> None:
        text = clean(raw)
        if text.strip():
            log.log(level_of(text), "%s", text)

    def close(self, timeout: float = 2.0) -> None:
        """Descriptor 2 back to the original stderr; what was written before is logged first."""
        try:
            self._old.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self._saved, 2)  # closes the pipe's write end held by descriptor 2: the reader sees EOF
        self._thread.join(timeout)  # (not when a child process still holds it: the thread is a daemon)
        sys.stderr.flush()
        sys.stderr = self._old
        os.close(self._saved)
        if not self._thread.is_alive():
            os.close(self._read)


def capture() -> NativeStderr | None:
    """Start capturing; None where descriptor 2 cannot be redirected (then libraries write as before)."""
    try:
        return NativeStderr()
    except OSError as e:
        log.warning("engine libraries' stderr is not captured into the log: %s", e)
        return None
