"""Optimizers: spend less energy for the same work."""
