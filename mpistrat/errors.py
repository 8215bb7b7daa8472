"""TensorFlow's error classes (``tf.errors``) that mpistrat raises where TensorFlow would."""

from __future__ import annotations

__all__ = ["OpError", "CancelledError", "UnavailableError"]


class OpError(Exception):
    """The base of TensorFlow's runtime errors (``tf.errors.OpError``); ``message`` is its text."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class CancelledError(OpError):
    """An operation was cancelled (``tf.errors.CancelledError``): a scheduled function dropped after an error."""


class UnavailableError(OpError):
    """A task did not answer in time (``tf.errors.UnavailableError``): a parameter server that stopped answering."""
