"""A model update, one module per step, driven by the small state machine in :mod:`.machine`."""
