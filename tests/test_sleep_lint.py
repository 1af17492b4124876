"""No guessed waits in the suite: a sleep in tests/ is a poll with a deadline or says why it must be a sleep.

A sleep counts as polling when a ``while`` loop around it (in the same function) reads a monotonic clock,
i.e. has a deadline; tests.polling.wait_until is the one shared such loop. Any other sleep (``time.sleep``,
``asyncio.sleep``, a fresh ``threading.Event().wait(t)``) needs ``# sleep-ok: <why>`` on its line: the
time passing is the behaviour under test (an expiry, a slow client, a paced load, "nothing happens for
a while"), not a guess at how long something takes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MARK = re.compile(r"#\s*sleep-ok:\s*\S")


def _sleep_name(call: ast.Call) -> str | None:
    """``time.sleep``/``asyncio.sleep`` (or a bare ``sleep``), or a throwaway ``Event().wait``: None otherwise."""
    f = call.func
    if isinstance(f, ast.Name) and f.id == "sleep":
        return "sleep"
    if (
        isinstance(f, ast.Attribute)
        and f.attr == "sleep"
        and isinstance(f.value, ast.Name)
        and f.value.id in ("time", "asyncio")
    ):
        return f"{f.value.id}.sleep"
    if isinstance(f, ast.Attribute) and f.attr == "wait" and isinstance(f.value, ast.Call):
        made = f.value.func
        if (isinstance(made, ast.Name) and made.id == "Event") or (
            isinstance(made, ast.Attribute) and made.attr == "Event"
        ):
            return "Event().wait"
    return None


def _has_deadline(loop: ast.While) -> bool:
    return any(
        (isinstance(n, ast.Attribute) and n.attr == "monotonic") or (isinstance(n, ast.Name) and n.id == "monotonic")
        for n in ast.walk(loop)
    )


def unmarked_sleeps(source: str, name: str = "<test>") -> list[str]:
    """``name:line: what`` for each sleep neither inside a deadline loop nor marked ``# sleep-ok: <why>``."""
    lines = source.splitlines()
    found: list[str] = []

    def visit(node: ast.AST, polling: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = polling
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = False  # a loop around a function's definition does not poll inside it
            elif isinstance(child, ast.While) and _has_deadline(child):
                inner = True
            if isinstance(child, ast.Call) and not polling and (what := _sleep_name(child)):
                span = lines[child.lineno - 1 : (child.end_lineno or child.lineno)]
                if not any(MARK.search(line) for line in span):
                    found.append(
                        f"{name}:{child.lineno}: {what} outside a polling loop: poll with "
                        "tests.polling.wait_until, or say why on its line: # sleep-ok: <why>"
                    )
            visit(child, inner)

    visit(ast.parse(source, name), False)
    return found


def test_every_sleep_in_the_suite_polls_or_says_why() -> None:
    found = [
        f
        for path in sorted(TESTS.rglob("*.py"))
        for f in unmarked_sleeps(path.read_text(), path.relative_to(TESTS.parent).as_posix())
    ]
    assert found == [], "\n".join(found)


def test_the_check_tells_a_guessed_wait_from_a_poll_and_a_stated_one() -> None:
    src = """
import asyncio, threading, time
def guessed():
    start()
    time.sleep(0.5)
    assert started()
async def guessed_async():
    await asyncio.sleep(0.1)
def hidden():
    threading.Event().wait(0.5)
def polled():
    deadline = time.monotonic() + 10
    while not started():
        assert time.monotonic() < deadline, "never started"
        time.sleep(0.05)
def undeadlined():
    while not started():
        time.sleep(0.05)
def stated():
    time.sleep(2.2)  # sleep-ok: the broker expires the message after 1 s
def unreasoned():
    time.sleep(1)  # sleep-ok:
def defined_in_a_deadline_loop():
    while time.monotonic() < 5:
        def later():
            time.sleep(1)
"""
    assert [f.split(": ", 1)[0] for f in unmarked_sleeps(src, "t.py")] == [
        "t.py:5",
        "t.py:8",
        "t.py:10",
        "t.py:18",
        "t.py:22",
        "t.py:26",
    ]
