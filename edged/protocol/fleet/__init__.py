"""The contract between a device and the registry: every message the two wings exchange."""
