"""Pipelines: pre/post-processing steps and models wired as a DAG, served like a model."""
