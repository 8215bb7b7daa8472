"""``Optional``: a value that may be absent, as returned by ``get_next_as_optional``."""

from __future__ import annotations

from typing import Any

from mpistrat.data.errors import OutOfRangeError

__all__ = ["Optional"]

_NONE = object()


class Optional:
    """A value or nothing, as ``tf.experimental.Optional``."""

    __slots__ = ("_value", "_element_spec")

    def __init__(self, value: Any = _NONE, element_spec: Any = None):
        self._value = value
        self._element_spec = element_spec

    @staticmethod
    def from_value(value: Any) -> "Optional":
        """An Optional holding ``value``."""
        return Optional(value)

    @staticmethod
    def empty(element_spec: Any = None) -> "Optional":
        """An Optional holding nothing."""
        return Optional(_NONE, element_spec)

    def has_value(self) -> bool:
        """Whether a value is present."""
        return self._value is not _NONE

    def get_value(self) -> Any:
        """The value; raises OutOfRangeError when there is none."""
        if self._value is _NONE:
            raise OutOfRangeError("The Optional has no value (end of the distributed dataset)")
        return self._value

    @property
    def element_spec(self) -> Any:
        """The spec of the value, when known."""
        return self._element_spec

    def __repr__(self) -> str:
        return f"Optional({self._value!r})" if self.has_value() else "Optional(<no value>)"
