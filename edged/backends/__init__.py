"""Inference engines behind one small contract: load, infer on numpy arrays, describe, unload."""
