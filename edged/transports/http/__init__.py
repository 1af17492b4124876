"""The HTTP transport: routes, server, config and metrics."""
