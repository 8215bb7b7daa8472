"""When a variable's own NumPy array may be written in place: nobody sees it, and no write stops halfway."""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = ["errors_may_raise", "sole_owner", "writable", "writing"]

# References to a variable's array when only the variable holds it: its attribute and getrefcount's argument.
_SOLE_OWNER_REFS = 2
_QUIET = frozenset({"ignore", "warn", "print"})  # NumPy error modes that never raise (unless warnings do)


def sole_owner(variable: Any) -> bool:
    """Whether nothing outside ``variable`` (a ``Variable``) refers to its array: no snapshot from
    ``value()``, no view of it (a view holds its base), no buffer export. ``value()`` promises a snapshot
    that later updates leave alone, so only then may an update write into the array itself."""
    return sys.getrefcount(variable._array) <= _SOLE_OWNER_REFS


def errors_may_raise() -> bool:
    """Whether a floating-point error in a NumPy operation may raise: ``np.seterr`` set to raise or call,
    or a warnings filter that makes its RuntimeWarning an error (the first filter for RuntimeWarning that
    matches every message and module decides; a narrower "error" filter before it counts). Then a write
    into the array itself could stop halfway, where assigning a new array leaves the variable as it was:
    updates assign instead. Not covered: a ``warnings.showwarning`` that raises, and an interrupt
    (KeyboardInterrupt) between the blocks of an update."""
    modes = np.geterr().values()
    if any(mode not in _QUIET for mode in modes):
        return True
    if "warn" not in modes:
        return False
    for action, message, category, module, _lineno in warnings.filters:
        if issubclass(RuntimeWarning, category):
            if action == "error":
                return True
            if message is None and module is None:  # this filter takes every RuntimeWarning
                return False
    return False


def writable(arrays: Sequence[np.ndarray]) -> bool:
    """Make the variables' read-only ``arrays`` writable; False (every one left read-only) when one is
    not its own memory. The caller makes them read-only again."""
    done = []
    try:
        for array in arrays:
            array.flags.writeable = True
            done.append(array)
    except ValueError:  # a view of read-only memory
        for array in done:
            array.flags.writeable = False
        return False
    return True


@contextlib.contextmanager
def writing(variables: Sequence[Any]) -> Iterator[list[np.ndarray] | None]:
    """The arrays of ``variables``' copies being written here (``_in_place_owner``), writable inside the
    block and locked against other updates and reads of them (``Variable.value``), when every one may be
    written in place (each its own copy, held by nobody else, no floating-point error can raise); None
    otherwise, with nothing locked: assign instead."""
    owners = [v._in_place_owner() for v in variables]
    if any(o is None for o in owners) or len({id(o) for o in owners}) < len(owners) or errors_may_raise():
        yield None
        return
    with contextlib.ExitStack() as locks:
        for owner in owners:
            locks.enter_context(owner._update_lock)
        arrays = None
        if all(sole_owner(owner) for owner in owners):
            arrays = [owner._array for owner in owners]
            if not writable(arrays):
                arrays = None
        if arrays is not None:
            try:
                yield arrays
            finally:
                for array in arrays:
                    array.flags.writeable = False
            return
    yield None
