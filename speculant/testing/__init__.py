"""Helpers for tests and plugin authors: tiny real checkpoints in the published formats."""
