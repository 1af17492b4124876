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
        self.errors = f"{self.base}/errors"  # refusals that cannot go to the requester's own reply topic
        self.reply_root = f"{self.base}/reply/"
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


DEFAULT_REPLY_TOPICS = ("{prefix}/{device}/reply/#",)
# Topics of any device under the prefix that carry requests, state or control: never a reply target.
_DEVICE_TOPICS = ("+/infer/#", "+/status", "+/models/#", "+/telemetry", "+/sync-nudge", "+/errors", "+/results/#")


def render_reply_pattern(pattern: str, prefix: str, device: str) -> str:
    """A configured reply pattern with ``{prefix}`` and ``{device}`` filled in."""
    return pattern.replace("{prefix}", prefix.rstrip("/")).replace("{device}", device)


class ReplyPolicy:
    """Where the daemon may publish a reply on a requester's word (issue 36, attack 2).

    A response topic (MQTT 5) or ``reply_to`` (3.1.1) must match one of the configured reply
    patterns (default ``{prefix}/{device}/reply/#``) and none of the reserved topics: the daemon's
    own namespace outside ``reply/`` (status, model status, errors, telemetry, binding outputs),
    the request, state and control topics of every device under the prefix, the fleet's topics,
    the stream bindings' input filters, and ``$`` topics. So a broker account that may publish
    widely still never lets a client steer the daemon onto someone else's topic.
    """

    CACHE_MAX = 4096

    def __init__(self, prefix: str, device: str, patterns: list[str] | tuple[str, ...] = DEFAULT_REPLY_TOPICS,
                 also_reserved: list[str] | tuple[str, ...] = ()) -> None:
        p = prefix.rstrip("/")
        self.topics = Topics(prefix, device)
        self.allowed = [render_reply_pattern(x, prefix, device) for x in patterns]
        self.reserved = [f"{p}/{t}" for t in _DEVICE_TOPICS] + [f"{p}/fleet/#", *also_reserved]
        self._cache: dict[str, str | None] = {}

    def refusal(self, topic: str) -> str | None:
        """None when ``topic`` may carry a reply, else why not (for the error note and the log)."""
        hit = self._cache.get(topic, "")
        if hit != "":
            return hit
        why = self._judge(topic)
        if len(self._cache) >= self.CACHE_MAX:
            self._cache.clear()
        self._cache[topic] = why
        return why

    def _judge(self, topic: str) -> str | None:
        if not valid_publish_topic(topic):
            return "it is not a valid topic name"
        if topic.startswith("$"):
            return "'$' topics belong to the broker"
        base = self.topics.base + "/"
        if topic.startswith(base) and not topic.startswith(self.topics.reply_root):
            return "it is one of the daemon's own topics"
        for r in self.reserved:
            if topic_matches(r, topic):
                return f"it is a reserved topic ({r})"
        if not any(topic_matches(a, topic) for a in self.allowed):
            return f"it is outside the reply namespace ({', '.join(self.allowed)}; [mqtt] reply_topics)"
        return None
