"""The MQTT transport: connection, bindings, topics and replies."""
