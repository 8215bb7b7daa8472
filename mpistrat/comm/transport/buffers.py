"""Reusable flat buffers, one per dtype, grown on demand so the hot path allocates nothing."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["GrowableBuffers"]


class GrowableBuffers:
    """One flat buffer per dtype, grown (doubling) on demand; ``get`` returns views of ``count`` items."""

    def __init__(self, empty: Callable[[int, np.dtype], Any]) -> None:
        self._empty = empty
        self._buffers: dict[np.dtype, Any] = {}

    def get(self, count: int, dtype: np.dtype) -> Any:
        """A view of ``count`` items of this dtype's buffer."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.shape[0] < count:
            size = count if buf is None else max(count, 2 * buf.shape[0])
            buf = self._buffers[dtype] = self._empty(size, dtype)
        return buf[:count]

    def clear(self) -> None:
        """Drop the buffers."""
        self._buffers.clear()
