"""The inference core: loaded models, the one inference service, scheduling and statistics."""
