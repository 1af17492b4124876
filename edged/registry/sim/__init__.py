"""The fleet simulator: many lightweight devices against a real registry."""
