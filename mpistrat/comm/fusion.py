"""Fusion: pack many arrays into flat per-dtype buckets, and pool the result arrays that view them.

:func:`plan_buckets` cuts a call's arrays into buckets, :func:`pack` fills one, and :class:`ResultPool`
hands out a bucket's results without allocating per call.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from mpistrat.comm.arraylist import loops as _arraylist

__all__ = ["Bucket", "plan_buckets", "pack", "ResultPool"]


@dataclass(frozen=True)
class Bucket:
    """Arrays ``members`` (indices into the call's list) packed back to back."""

    dtype: np.dtype
    count: int
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the packed bucket."""
        return self.count * self.dtype.itemsize


def plan_buckets(entries: Sequence[tuple[tuple[int, ...], Any]], pack_bytes: int,
                 alone_bytes: int | None = None) -> list[Bucket]:
    """Buckets for arrays described by ``(shape, dtype)``, per dtype, ``pack_bytes`` at most.

    Groups the arrays by dtype (first-appearance order) and fills buckets of up to ``pack_bytes``
    greedily, keeping the arrays' order; an array larger than a bucket gets a bucket of its own (it is
    never split), and so does an array of at least ``alone_bytes`` (None: no such limit). A plan is
    computed once per call signature and cached by the caller.
    """
    if pack_bytes <= 0:
        raise ValueError(f"pack_bytes must be positive, got {pack_bytes}")
    groups: dict[np.dtype, list[int]] = {}
    for i, (_, dtype) in enumerate(entries):
        groups.setdefault(np.dtype(dtype), []).append(i)
    buckets: list[Bucket] = []
    for dtype, indices in groups.items():
        members: list[int] = []
        sizes: list[int] = []
        count = 0
        for i in indices:
            shape = tuple(entries[i][0])
            size = int(np.prod(shape, dtype=np.int64))
            if alone_bytes is not None and size * dtype.itemsize >= alone_bytes:
                buckets.append(_bucket(dtype, [i], [size], entries))
                continue
            if members and (count + size) * dtype.itemsize > pack_bytes:
                buckets.append(_bucket(dtype, members, sizes, entries))
                members, sizes, count = [], [], 0
            members.append(i)
            sizes.append(size)
            count += size
        if members:
            buckets.append(_bucket(dtype, members, sizes, entries))
    return buckets


def _bucket(dtype: np.dtype, members: list[int], sizes: list[int], entries: Sequence) -> Bucket:
    offsets = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]).astype(int).tolist()
    return Bucket(
        dtype=dtype,
        count=int(sum(sizes)),
        members=tuple(members),
        offsets=tuple(offsets),
        sizes=tuple(sizes),
        shapes=tuple(tuple(entries[i][0]) for i in members),
    )


def pack(arrays: Sequence[Any], bucket: Bucket, out: Any, xp: Any = np) -> None:
    """Copy the bucket's member arrays, flattened, into the 1-D ``out``."""
    members = bucket.members
    if len(members) == 1:
        xp.copyto(out.reshape(bucket.shapes[0]), arrays[members[0]])
    elif xp is np:
        # One C loop where every member is C-contiguous (a memcpy each), else NumPy's generic copies.
        packed = _arraylist is not None and type(arrays) is list and _arraylist.pack(arrays, np.ndarray, members, out)
        if not packed:
            np.concatenate([arrays[i] for i in members], axis=None, out=out)
    else:
        xp.concatenate([arrays[i].ravel() for i in members], out=out)


# References a pooled view has when only the pool holds it (measured, as it depends on the
# interpreter), counted as ResultPool.get counts them: max(map(getrefcount, views)), a C loop (a fused
# bucket has hundreds of views), over the views in a list.
_POOLED_REFS = max(map(sys.getrefcount, [np.empty(1)]))


class ResultPool:
    """Reusable result arrays (views of one flat block) for one bucket.

    Each entry is one flat block plus the views that are the results
    (``block[offset:offset + size].reshape(shape)``), so a reduction can write
    straight into the block. An entry is reused only when ``sys.getrefcount``
    shows that neither a result view nor anything derived from one (a view
    of a result refers to the block) is held outside the pool, so results handed
    to a caller are never overwritten by a later call; otherwise a new entry is
    made (kept for reuse up to ``max_entries``).

    ``shared``, a transport's ``result_blocks`` (:mod:`~mpistrat.comm.transport.shm.results`):
    blocks of the node's ranks that the transport writes the result into directly. With every
    private entry :meth:`get` gives, it offers the blocks nobody on this rank holds; where every rank
    offered one, the call puts the result there, and :meth:`results` hands out that block's read-only
    views instead of the entry's. A bucket of several arrays keeps its views of each block (made
    once, as an entry's), and a block is free while nothing but those views refers to it and nothing
    outside holds one; those views pin the blocks for this pool, so another pool of the same size (a
    bucket of one array or of several) never offers a block this pool may hand out.
    """

    def __init__(self, bucket: Bucket, xp: Any = np, max_entries: int = 4, shared: Any = None) -> None:
        self.bucket = bucket
        self.xp = xp
        self.max_entries = max_entries
        self._entries: list[list] = []
        self._result_blocks = shared  # asked for a SharedResults until it has one or never will
        self._shared: Any = None  # SharedResults
        self._shared_views: list[list] = []  # per shared block, a bucket of several arrays' views of it

    def get(self) -> tuple[Any, list]:
        """A ``(block, views)`` entry whose views nobody outside holds (private memory), offered to the
        shared blocks with the free ones among them; after the call, :meth:`results` says which views
        hold the result."""
        if self._result_blocks is not None:
            self._take_shared()
        getrefcount = sys.getrefcount  # counted in this frame, as at the entry's making below
        for entry in self._entries:
            # Views a caller made of a result refer to the block, not the view.
            if max(map(getrefcount, entry[1])) <= _POOLED_REFS and getrefcount(entry[0]) <= entry[2]:
                break
        else:
            block = self.xp.empty(self.bucket.count, dtype=self.bucket.dtype)
            entry = [block, self._views(block), 0]
            del block
            entry[2] = getrefcount(entry[0])  # the block's references while only the pool holds it
            if len(self._entries) < self.max_entries:
                self._entries.append(entry)
        shared = self._shared
        if shared is not None:
            slots = 0
            if not self._shared_views:  # one array: a new view of the block each time
                for k in shared.free_slots():
                    slots |= 1 << k
            else:
                for k in shared.free_slots(len(self.bucket.members)):
                    if max(map(getrefcount, self._shared_views[k])) <= _POOLED_REFS:
                        slots |= 1 << k
            shared.offer(slots, entry[0])
        return entry[0], entry[1]

    def results(self, views: list) -> list:
        """The results of the call :meth:`get`'s entry (``views``) was offered with: the views of the shared
        block the call put them in (read-only), or ``views``."""
        shared = self._shared
        if shared is None:
            return views
        slot = shared.chosen
        if slot < 0:
            return views
        if not self._shared_views:
            return [shared.blocks[slot].reshape(self.bucket.shapes[0])]
        return self._shared_views[slot]

    def _take_shared(self) -> None:
        b = self.bucket
        self._shared = shared = self._result_blocks.shared_results(b.count, b.dtype)
        if shared is not None and len(b.members) > 1:
            self._shared_views = [self._views(block) for block in shared.blocks]
        if shared is not None or not self._result_blocks.may_share(b.count, b.dtype):
            self._result_blocks = None

    def _views(self, block: Any) -> list:
        """The members' results: views of ``block``, each referring to it."""
        b = self.bucket
        return [block[o : o + n].reshape(s) for o, n, s in zip(b.offsets, b.sizes, b.shapes)]
