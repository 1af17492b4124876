"""Tests of the registry server and rollouts."""
