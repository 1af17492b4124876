"""The device side of the registry: poll, download, verify, prepare, activate, trial, commit or roll back."""
