"""Telemetry: device and model metrics, ``/metrics``, the periodic MQTT message, store-and-forward upload.

Nothing here runs at import time; readers of optional libraries (NVML) import them on first use.
"""
