"""``edged perf``: a load generator for a running daemon, over shared memory, HTTP or MQTT.

Closed-loop (a fixed number of requests in flight) and open-loop (a fixed request
rate) modes, measurement windows repeated until three in a row agree, client-side
latency percentiles next to the daemon's own queue/compute split, CSV/JSON and a PNG
plot. Modelled on Triton's perf_analyzer so its users find the same knobs.
"""
