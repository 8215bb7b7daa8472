"""The compiled loops over an all-reduce call's list of NumPy arrays (``_arraylist.c``), or None where not built.

pip builds the extension where a C compiler is (``setup.py``); without it, ``loops`` is None and the
callers (``signature.ListSignature``, ``fusion.pack``) take their Python paths.
"""

from __future__ import annotations

from types import ModuleType

try:
    from mpistrat.comm import _arraylist as _loops
except ImportError:  # pragma: no cover - depends on the install
    _loops = None

__all__ = ["loops"]

loops: ModuleType | None = _loops
