"""The latency histogram's bucket bounds, in seconds (Prometheus convention).

A leaf both wings read: the core's statistics count into these buckets and the fleet telemetry
contract (protocol.fleet.telemetry) carries the counts, so neither has to import the other.
"""

from __future__ import annotations

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
