"""Baseline pruners for compresskit: ``static-width`` and ``static-depth``."""
