"""The steps of one all-reduce plan and running them: fusion buckets, direct single arrays, results.

A plan (made by ``RankCommunicator._plan``) is a list of :class:`Step`, one
per bucket, each with the backend that reduces it. :func:`run_steps` stages
each bucket (packing it, or handing a single array to the backend), reduces
it and hands out the results. A repeated call may overlap its agreement check
with staging its first bucket (:func:`overlaps_check`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from mpistrat.comm.transport.table import DeviceMpiAllreduceBackend, GrowableBuffers, MpiAllreduceBackend, stages_locally
from mpistrat.comm.errors import CollectiveMismatchError
from mpistrat.comm.fusion import Bucket, ResultPool, pack

__all__ = [
    "HOST", "CUPY", "CAI", "OVERLAP_MAX_BYTES", "STAGED_FIRST", "Step", "check_aux", "folds_sync", "overlaps_check",
    "require_same_pack", "run_steps",
]

HOST, CUPY, CAI = 0, 1, 2  # the kinds of arrays: NumPy, CuPy, __cuda_array_interface__ buffers


class Step:
    """One bucket of an all-reduce plan and how it is reduced."""

    __slots__ = ("bucket", "kind", "backend", "xp", "direct", "pool", "members", "_src", "_src_views")

    def __init__(self, bucket: Bucket, kind: int, backend: Any, xp: Any) -> None:
        self.bucket = bucket
        self.kind = kind
        self.backend = backend
        self.xp = xp
        self.members = bucket.members
        self.direct = len(bucket.members) == 1 and hasattr(backend, "allreduce_array")
        # Results of one array may go straight into blocks the backend shares (shm_results).
        shared = getattr(backend, "result_blocks", None) if self.direct and kind == HOST else None
        self.pool = ResultPool(bucket, xp, shared=shared) if kind != CAI else None
        self._src: Any = None
        self._src_views: list = []

    def source_views(self, flat: Any) -> list:
        """The members' views of ``flat`` (a reduced bucket starting at offset 0 of
        its buffer), cached while the buffer stays the same."""
        base = flat.base if flat.base is not None else flat
        if base is not self._src:
            b = self.bucket
            self._src = base
            self._src_views = [flat[o : o + n].reshape(s) for o, n, s in zip(b.offsets, b.sizes, b.shapes)]
        return self._src_views


# A repeated call overlaps its agreement check with staging only for host buckets up to this size:
# while it stages, a rank makes no MPI progress and answers no peer's query, so staging must stay far
# shorter than the grace period a timed-out peer waits (0.5 s by default; a 4 MiB copy takes about
# 1 ms here). Device buckets never overlap (their staging waits for the GPU, for as long as it takes).
OVERLAP_MAX_BYTES = 4 << 20


# The all-reduce's agreement-check aux: the bucket size (bytes_per_pack) shifted left by one, and
# this bit when the rank posted its check only after staging its first bucket (see folds_sync).
STAGED_FIRST = 1


def check_aux(pack_bytes: int, staged_first: bool = False) -> int:
    """The ``aux`` an all-reduce's agreement check carries (see :data:`STAGED_FIRST`)."""
    return pack_bytes << 1 | (STAGED_FIRST if staged_first else 0)


def require_same_pack(aux: np.ndarray, call: str = "allreduce") -> bool:
    """Raise (on every rank: all see the same values) unless every rank fuses with the same bucket size;
    whether every rank staged its first bucket before its check (:data:`STAGED_FIRST`).

    Buckets cut at different sizes mean different collective calls: the bucket size travels in
    the agreement check's ``aux`` (:func:`check_aux`).
    """
    lo, hi = int(aux.min()), int(aux.max())
    if lo >> 1 != hi >> 1:
        detail = "; ".join(f"rank {r}: {int(p) >> 1}" for r, p in enumerate(aux))
        raise CollectiveMismatchError(
            f"Mismatched {call} bytes_per_pack ({detail}): the ranks would fuse different buckets; "
            "pass the same CommunicationOptions on every rank"
        )
    return bool(lo & STAGED_FIRST)


def folds_sync(first: Step) -> bool:
    """Whether a call whose first step is ``first``, one that :func:`overlaps_check` (asked first,
    not again here), may post its agreement check after staging and let the check stand for the
    backend's first node synchronisation (``folds_sync`` backends: their ``ready`` may return True,
    and then they skip it)."""
    return getattr(first.backend, "folds_sync", False)


def overlaps_check(first: Step) -> bool:
    """Whether a call whose first step is ``first`` may overlap its check with staging that step."""
    return (first.kind == HOST and first.bucket.nbytes <= OVERLAP_MAX_BYTES
            and stages_locally(first.backend))


# Keyword arguments of a packed reduce: only folds_sync backends ever get synced=True.
_SYNCED: dict = {"synced": True}
_NOT_SYNCED: dict = {}


def run_steps(
    steps: list[Step], arrays: list, opname: str, inplace: bool, scratch: GrowableBuffers,
    ready: Callable[[], Any] | None = None,
) -> list:
    """Run the planned steps of an all-reduce over two or more ranks; the results (``arrays`` when
    ``inplace``). ``scratch`` holds in-place buckets of backends that return pieces. ``ready`` (the
    second half of a started agreement check, or the whole check) is called once this rank has
    staged its first step's data, before anything that needs the other ranks: by the backend for a
    single array (``allreduce_array``'s ``ready``), here after packing. When it returns True (only
    for ``folds_sync`` backends) every rank has staged: the backend skips its first synchronisation."""
    results = arrays if inplace else [None] * len(arrays)
    for step in steps:
        b = step.bucket
        backend = step.backend
        if step.direct:
            a = arrays[b.members[0]]
            write_back = None
            if step.kind == CAI:
                src, dst = MPI.IN_PLACE, a
            elif inplace:
                # Every rank takes this path whatever its array's memory layout (the ranks agree on
                # shapes and dtypes, not on strides), so all make the same collective calls: a strided
                # array goes through a contiguous copy.
                src, dst = MPI.IN_PLACE, a if a.flags.c_contiguous else step.xp.ascontiguousarray(a)
                write_back = None if dst is a else a
            else:
                src = a if a.flags.c_contiguous else step.xp.ascontiguousarray(a)
                dst = results[b.members[0]] = step.pool.get()[1][0]
            if ready is None:
                backend.allreduce_array(src, dst, opname)
            else:  # only backends that stage locally (backends.stages_locally) get it
                backend.allreduce_array(src, dst, opname, ready)
                ready = None
            if write_back is not None:
                step.xp.copyto(write_back, dst)
            continue
        xp = step.xp
        buf = backend.pack_buffer(b.count, b.dtype)
        pack(arrays, b, buf, xp)
        synced = _NOT_SYNCED
        if ready is not None:
            if ready():
                synced = _SYNCED
            ready = None
        to = getattr(backend, "allreduce_packed_to", None)
        if inplace:
            if type(backend) is MpiAllreduceBackend or type(backend) is DeviceMpiAllreduceBackend:
                # offset 0 of the backend's own per-dtype buffer, reduced in place
                flat = backend.allreduce_packed(b.count, b.dtype, opname)[0][1]
            else:  # reduce into one scratch bucket first: one copy per piece, not per array
                flat = scratch.get(b.count, b.dtype) if xp is np else xp.empty(b.count, b.dtype)
                if to is not None:
                    to(b.count, b.dtype, opname, flat, **synced)
                else:
                    for start, piece in backend.allreduce_packed(b.count, b.dtype, opname, **synced):
                        flat[start : start + piece.shape[0]] = piece
            copyto = xp.copyto
            for i, src in zip(b.members, step.source_views(flat)):
                copyto(arrays[i], src)
            continue
        block, views = step.pool.get()
        if to is not None:
            to(b.count, b.dtype, opname, block, **synced)
        else:
            # The result views lie in ``block`` laid out as the bucket: copy pieces whole.
            for start, piece in backend.allreduce_packed(b.count, b.dtype, opname, **synced):
                block[start : start + piece.shape[0]] = piece
        for i, v in zip(b.members, views):
            results[i] = v
    if ready is not None:  # no steps (no arrays)
        ready()
    return results
