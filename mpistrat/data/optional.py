"""``Optional``: a value that may be absent, as returned by ``get_next_as_optional``."""

from __future__ import annotations

from typing import Any, Callable

from mpistrat.data.element import normalize_element
from mpistrat.data.errors import InvalidArgumentError
from mpistrat.data.spec import spec_of

__all__ = ["Optional"]

_NONE = object()


class Optional:
    """A value or nothing, as ``tf.experimental.Optional``.

    ``element_spec`` is given for an empty Optional and read off the value
    otherwise (a ``PerReplica`` leaf gets a ``PerReplicaSpec``).
    """

    __slots__ = ("_value", "_element_spec", "_spec_fn")

    def __init__(self, value: Any = _NONE, element_spec: Any = None):
        self._value = value
        self._element_spec = element_spec
        self._spec_fn: Callable[[], Any] | None = None

    @staticmethod
    def from_value(value: Any) -> "Optional":
        """An Optional holding ``value`` converted as a dataset element (Python numbers and lists: float32, int32)."""
        return Optional(normalize_element(value))

    @staticmethod
    def empty(element_spec: Any = None) -> "Optional":
        """An Optional holding nothing, of the given spec."""
        return Optional(_NONE, element_spec)

    @staticmethod
    def _empty_with_spec_from(spec_fn: Callable[[], Any]) -> "Optional":
        """An empty Optional whose spec ``spec_fn`` computes when first asked for (it may read data)."""
        optional = Optional(_NONE)
        optional._spec_fn = spec_fn
        return optional

    def has_value(self, name: str | None = None) -> bool:
        """Whether a value is present."""
        return self._value is not _NONE

    def get_value(self, name: str | None = None) -> Any:
        """The value; raises InvalidArgumentError when there is none (as TF's Optional)."""
        if self._value is _NONE:
            raise InvalidArgumentError("The given optional does not have a value.")
        return self._value

    @property
    def element_spec(self) -> Any:
        """The spec of the value (a nest of TensorSpec / PerReplicaSpec)."""
        if self._element_spec is None:
            if self._value is not _NONE:
                self._element_spec = spec_of(self._value)
            elif self._spec_fn is not None:
                self._element_spec = self._spec_fn()
        return self._element_spec

    def __repr__(self) -> str:
        return f"Optional({self._value!r})" if self.has_value() else "Optional(<no value>)"
