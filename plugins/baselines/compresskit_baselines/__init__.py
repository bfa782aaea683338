"""Baseline pruners for compresskit: ``static-width``, ``static-depth`` and ``dynamic-depth``."""
