"""The on-disk model repository: ``<repo>/<model>/<version>/model.toml`` plus artifacts."""
