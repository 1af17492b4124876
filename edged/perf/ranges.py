"""Parse ``--concurrency-range`` / ``--request-rate-range`` the way perf_analyzer does.

``start[:end[:step]]`` walks from start to end (inclusive) adding step, so ``1:16:2``
is 1, 3, 5, ... 15. A comma list (``1,2,4,8``) is accepted too, since doubling is the
sweep people usually want and perf_analyzer has no syntax for it.
"""

from __future__ import annotations

from edged.errors import InvalidInputError

MAX_LEVELS = 1000


def _numbers(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")] if "," in text else [float(x) for x in text.split(":")]
    except ValueError:
        raise InvalidInputError(f"{what} {text!r}: expected start[:end[:step]] or a comma list of numbers") from None


def _expand(text: str, what: str) -> list[float]:
    text = text.strip()
    nums = _numbers(text, what)
    if "," in text:
        levels = nums
    else:
        if len(nums) > 3:
            raise InvalidInputError(f"{what} {text!r}: at most start:end:step")
        start = nums[0]
        end = nums[1] if len(nums) > 1 else start
        step = nums[2] if len(nums) > 2 else 1.0
        if step <= 0:
            raise InvalidInputError(f"{what} {text!r}: step must be > 0")
        if end < start:
            raise InvalidInputError(f"{what} {text!r}: end must be >= start")
        if (end - start) / step + 1 > MAX_LEVELS:
            raise InvalidInputError(f"{what} {text!r}: more than {MAX_LEVELS} levels")
        levels, k = [], 0
        while start + k * step <= end + 1e-9:
            levels.append(start + k * step)
            k += 1
    if not levels or any(x <= 0 for x in levels):
        raise InvalidInputError(f"{what} {text!r}: every level must be > 0")
    return levels


def concurrency_levels(text: str) -> list[int]:
    levels = _expand(text, "--concurrency-range")
    if any(x != int(x) for x in levels):
        raise InvalidInputError(f"--concurrency-range {text!r}: concurrency levels are whole numbers")
    return [int(x) for x in levels]


def rate_levels(text: str) -> list[float]:
    return _expand(text, "--request-rate-range")
