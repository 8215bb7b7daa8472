"""When a variable's own NumPy array may be written in place: nobody sees it, and no write stops halfway."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["errors_may_raise", "run"]

# References to a variable's array when only the variable holds it: its attribute and getrefcount's argument.
_SOLE_OWNER_REFS = 2
_QUIET = frozenset({"ignore", "warn", "print"})  # NumPy error modes that never raise (unless warnings do)


def _base_refs(array: np.ndarray) -> int:
    """References to ``array``'s base, the memory's owner where ``array`` is a view of it (0: it owns its memory),
    as counted from here."""
    base = array.base
    return 0 if base is None else sys.getrefcount(base)


# The same count for a base that only its view holds, measured by the same code: what a name costs differs
# between Python versions (3.14 borrows a local's reference).
_SOLE_BASE_REFS = _base_refs(np.empty(2)[1:])


def _sole_owner(variable: Any) -> bool:
    """Whether nothing outside ``variable`` (a ``Variable``) refers to its array: no snapshot from
    ``value()``, no view of it, no buffer export. ``value()`` promises a snapshot that later updates
    leave alone, so only then may an update write into the array itself. NumPy points a view's ``base``
    at the array that owns the memory, so where the variable's array is a view, a view of it holds that
    owner instead."""
    if sys.getrefcount(variable._array) > _SOLE_OWNER_REFS:
        return False
    return _base_refs(variable._array) <= _SOLE_BASE_REFS


def errors_may_raise() -> bool:
    """Whether a floating-point error in a NumPy operation may raise: ``np.seterr`` set to raise or call,
    or a warnings filter that makes its RuntimeWarning an error (the first filter for RuntimeWarning that
    matches every message and module decides; a narrower "error" filter before it counts). Then a write
    into the array itself could stop halfway, where assigning a new array leaves the variable as it was:
    updates assign instead. Not covered: a ``warnings.showwarning`` that raises, and an interrupt
    (KeyboardInterrupt) between the blocks of an update."""
    modes = set(np.geterr().values())
    if not modes <= _QUIET:
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


def _writable(arrays: Sequence[np.ndarray]) -> bool:
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


def run(variables: Sequence[Any], check: Callable[[list[np.ndarray]], bool] | None, kernel: Callable[..., None],
        *args: Any) -> bool:
    """``kernel(*arrays, *args)`` on the arrays of ``variables``' copies being written here
    (``_in_place_owner``), writable meanwhile and locked against other threads' updates and reads of
    them (``Variable.value``; a read from this thread meanwhile, a warning or signal handler's, gets a
    copy), when every one may be written in place (each its own copy, held by nobody else, no
    floating-point error can raise) and ``check(arrays)`` holds (None: no check); whether it ran (if
    not, nothing changed: assign instead). The locks are re-entrant: the caller may hold them already."""
    owners: list[Any] = []
    for variable in variables:
        owner = variable._in_place_owner()
        if owner is None or any(owner is o for o in owners):
            return False
        owners.append(owner)
    if errors_may_raise():
        return False
    locked = []
    try:
        for owner in owners:
            owner._update_lock.acquire()
            locked.append(owner._update_lock)
        for owner in owners:
            if not _sole_owner(owner):
                return False
        arrays = [owner._array for owner in owners]
        if (check is not None and not check(arrays)) or not _writable(arrays):
            return False
        for owner in owners:
            owner._writing = True
        try:
            kernel(*arrays, *args)
        finally:
            for owner, array in zip(owners, arrays):
                owner._writing = False
                array.flags.writeable = False
        return True
    finally:
        for lock in locked:
            lock.release()
