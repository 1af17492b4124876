"""Python clients for edged: shared memory (fastest, local), MQTT, and HTTP (KServe v2)."""
