"""Helpers for tests/test_ray.py: preprocess hooks the actors and workers import by name."""
