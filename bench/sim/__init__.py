"""The fleet simulator: many lightweight devices, running the device's own sync decisions, against a real
registry. It lives with the benchmarks so that the registry server and its CLI import no device code."""
