"""Errors shared by every component."""


class ModelError(RuntimeError):
    """Weights are missing, damaged or unloadable; the message says what to do about it."""
