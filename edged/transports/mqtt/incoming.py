"""What an incoming MQTT message says beyond its payload: user properties and when it expires."""

from __future__ import annotations

import time
from typing import cast

from paho.mqtt.properties import Properties


def user_property(props: Properties | None, key: str) -> str | None:
    """The value of an MQTT 5 user property (names compared without case), or None."""
    if props is None:
        return None
    for k, v in getattr(props, "UserProperty", None) or ():
        if k.lower() == key.lower():
            return cast(str, v)
    return None


def message_deadline(props: Properties | None) -> float | None:
    """The monotonic time at which an MQTT 5 message expires (the broker sends the time left)."""
    expiry = getattr(props, "MessageExpiryInterval", None) if props is not None else None
    return None if expiry is None else time.monotonic() + float(expiry)
