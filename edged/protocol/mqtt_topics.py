"""The daemon's MQTT topic names and topic filter matching (no I/O, cheap to import)."""

from __future__ import annotations

from edged.errors import InvalidInputError


def valid_publish_topic(topic: str) -> bool:
    return 0 < len(topic.encode()) <= 65535 and not any(c in topic for c in "+#\0")


class Topics:
    """The daemon's topic names under ``{prefix}/{device}``."""

    def __init__(self, prefix: str, device: str) -> None:
        self.base = f"{prefix.rstrip('/')}/{device}"
        self.infer_root = f"{self.base}/infer/"
        self.status = f"{self.base}/status"
        self.infer_filters = [f"{self.base}/infer/+", f"{self.base}/infer/+/+"]

    def model_status(self, model: str) -> str:
        return f"{self.base}/models/{model}/status"

    def parse_infer(self, topic: str) -> tuple[str, int | None]:
        """``(model, version)`` of a request topic; raises InvalidInputError for a bad version segment."""
        parts = topic[len(self.infer_root):].split("/")
        if not parts[0] or len(parts) > 2:
            raise InvalidInputError("request topic must be <prefix>/<device>/infer/<model>[/<version>]")
        if len(parts) == 1:
            return parts[0], None
        seg = parts[1]
        if not seg.isdigit() or int(seg) < 1:
            raise InvalidInputError(f"version segment {seg[:32]!r} is not a positive integer")
        return parts[0], int(seg)


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT topic filter matching (``+`` one level, ``#`` the rest); ``$`` topics need an explicit filter."""
    p, t = pattern.split("/"), topic.split("/")
    if t[0].startswith("$") and p[0] in ("+", "#"):
        return False
    for i, seg in enumerate(p):
        if seg == "#":
            return True
        if i >= len(t) or (seg != "+" and seg != t[i]):
            return False
    return len(p) == len(t)
