"""Servers that keep optimizer state for many jobs: the batch-size optimizer server."""
