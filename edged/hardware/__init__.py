"""Hardware discovery: what this machine is, so a device profile can be chosen for it."""

from edged.hardware.facts import HardwareFacts, fact_keys, facts_as_dict
from edged.hardware.probe import probe

__all__ = ["HardwareFacts", "fact_keys", "facts_as_dict", "probe"]
