"""Transports only decode, call the one inference service, and encode."""
