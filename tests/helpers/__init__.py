"""Helpers shared by the tests: test checkpoints, reference generation, trained models."""
