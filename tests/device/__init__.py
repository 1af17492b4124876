"""Tests of the device wing: engines, daemon, sync and telemetry."""
