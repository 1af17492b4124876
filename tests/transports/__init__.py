"""Tests of the transports and their wire formats."""
