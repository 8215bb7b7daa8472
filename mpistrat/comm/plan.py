"""All-reduce plans: a call's arrays grouped into buckets, each with the transport that reduces it.

A plan is made once per call signature and cached, so a repeated call allocates nothing.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np

from mpistrat.comm.fusion import Bucket, ResultPool, plan_buckets
from mpistrat.comm.signature import CAI, CUPY, HOST, ListSignature, list_signature
from mpistrat.comm.transport.base import Transport
from mpistrat.comm.transport.mpi import mpi_datatype
from mpistrat.ops import reduce_dtype_error

__all__ = ["Step", "Plan", "Planner"]

PLAN_CACHE_MAX = 512
# A host array of at least this many bytes is reduced on its own, never packed with others: packing
# copies all of it once more, while on its own the shared-memory path copies only the slices other
# ranks sum and reads this rank's slice from the array itself (benchmarks/README.md, "unfused large
# arrays"). A rule on sizes, the same on every rank: no timing decides which arrays are packed.
UNFUSED_MIN_BYTES = 1 << 20


class Step:
    """One bucket of an all-reduce plan and the transport that reduces it."""

    __slots__ = ("bucket", "kind", "transport", "xp", "direct", "whole", "pool", "members", "lane", "_src",
                 "_src_views")

    def __init__(self, bucket: Bucket, kind: int, transport: Transport, xp: Any) -> None:
        self.bucket = bucket
        self.kind = kind
        self.transport = transport
        self.xp = xp
        self.members = bucket.members
        self.direct = len(bucket.members) == 1  # one array: reduced without packing
        self.whole = False  # the plan's only step, its members the call's arrays in order (Planner.plan)
        # Host results may go straight into blocks the transport shares (shm/results.py).
        shared = transport.result_blocks if kind == HOST else None
        self.pool = ResultPool(bucket, xp, shared=shared) if kind != CAI else None
        # A direct host step's compiled reduce-scatter for calls whose check is done (agreement/lane.py's
        # StepScatter): lane(src, dst) reduces and returns True, or does nothing and returns False.
        self.lane: Callable[[np.ndarray, np.ndarray], bool] | None = None
        self._src: Any = None
        self._src_views: list = []

    def source_views(self, flat: Any) -> list:
        """The members' views of ``flat``, a reduced bucket at the start of the communicator's scratch
        buffer, cached while that buffer stays the same."""
        base = flat.base if flat.base is not None else flat
        if base is not self._src:
            b = self.bucket
            self._src = base
            self._src_views = [flat[o : o + n].reshape(s) for o, n, s in zip(b.offsets, b.sizes, b.shapes)]
        return self._src_views


class Plan:
    """The steps of one call signature, its agreement key and fingerprint, and where the agreement
    check of a repeated call runs.

    ``key``, ``h`` and ``repeat_mode`` are set by the communicator when it makes the plan (``h`` is
    ``fingerprint(key)``; the mode: agreement/call.py, ``choose_mode``), so a repeated call hashes
    nothing and chooses nothing.
    """

    __slots__ = ("steps", "nbytes", "op", "key", "h", "repeat_mode", "folded", "prepared", "lane")

    def __init__(self, steps: list[Step], op: str) -> None:
        self.steps = steps
        self.op = op  # the wire op
        self.nbytes = sum(s.bucket.nbytes for s in steps)
        self.key: tuple = ()
        self.h = 0
        self.repeat_mode = 0
        # A FOLD plan, not in place, whose first step is one host array: the FoldedCheck of its repeated calls
        # (communicator.allreduce_repeat, allreduce_repeat_list), what the first step's transport prepared
        # where it is a RepeatTransport, and the first step's compiled lane (agreement/lane.py) where one applies.
        self.folded: Any = None
        self.prepared: Any = None
        self.lane: Any = None


class Planner:
    """Makes and caches the plans of one communicator.

    A plan is made once per call signature (op and MEAN's divisor, shapes, dtypes, kinds, bucket size,
    in place or not):
    a list of :class:`Step`, each a bucket, its transport and the results pool. Host arrays and CuPy
    arrays are packed into buckets by dtype (:func:`~mpistrat.comm.fusion.plan_buckets`); buffers
    exposing only ``__cuda_array_interface__`` are reduced one by one, in place.

    ``host`` is the host transports in the order to try them; ``device()``
    returns the device transports, made on first use.
    """

    def __init__(self, host: list[Transport], device: Callable[[], list[Transport]]) -> None:
        self._host = host
        self._device = device
        self._plans: dict[Any, Plan] = {}
        # The same plans, for a call of one NumPy array with the communicator's own options, filed by what
        # such a call is made of (:meth:`file_single`): its signature needs no building.
        self.singles: dict[tuple, Plan] = {}
        # And for a call of a list of NumPy arrays: the latest plan per op, divisor and length, with the
        # signature a later list is matched against in one C loop (:meth:`file_list`).
        self.lists: dict[tuple, tuple[ListSignature, Plan]] = {}

    def cached(self, key: Any) -> Plan | None:
        """The plan filed under ``key``, if any."""
        return self._plans.get(key)

    def file_single(self, op: Any, divisor: int | None, array: Any, plan: Plan) -> None:
        """File ``plan`` under ``(op, divisor, array.shape, array.dtype, type(array))`` too: the plan of a
        call of this one NumPy or CuPy array (not in place, the communicator's options), op and divisor
        spelled as given."""
        if len(self.singles) >= PLAN_CACHE_MAX:
            self.singles.clear()
        self.singles[(op, divisor, array.shape, array.dtype, type(array))] = plan

    def file_list(self, op: Any, divisor: int | None, arrays: list, plan: Plan) -> None:
        """File ``plan`` as the plan of a call of the list ``arrays`` of NumPy arrays (exactly
        ``numpy.ndarray``; not in place, the communicator's options), op and divisor spelled as given,
        where the compiled loops are built; it replaces the latest such plan of as many arrays."""
        key = (op, divisor, len(arrays))
        filed = self.lists.get(key)
        if filed is not None and filed[1] is plan:
            return
        signature = list_signature(arrays)
        if signature is None:
            return
        if len(self.lists) >= PLAN_CACHE_MAX:
            self.lists.clear()
        self.lists[key] = (signature, plan)

    @staticmethod
    def invalid(sig: tuple, op: str) -> Exception | None:
        """Why no rank could reduce arrays of this signature with ``op`` (a dtype MPI or the op does
        not support), or None; found before anything collective, so the check carries it."""
        for i, entry in enumerate(sig):
            dtype = np.dtype(entry[1])
            reason = reduce_dtype_error(dtype, op)  # the rule a reduction within one process applies too
            if reason is not None:
                return TypeError(f"allreduce: array #{i} {reason}")
            try:
                mpi_datatype(dtype)
            except ValueError as exc:  # MPI has no such type
                return exc
        return None

    def plan(self, key: Any, sig: tuple, kinds: tuple | None, op: str, pack_bytes: int) -> Plan:
        """The plan of a call not planned before, all ranks having agreed on it and :meth:`invalid`
        having found nothing, filed under ``key`` (collective: transports may be made)."""
        kinds_list = kinds if kinds is not None else (HOST,) * len(sig)
        steps = []
        for kind in (HOST, CUPY, CAI):
            index = [i for i, k in enumerate(kinds_list) if k == kind]
            if not index:
                continue
            if kind == CAI:  # one direct call per buffer: nothing to pack them with
                buckets = [_single_bucket(i, sig[i][:2]) for i in index]
            else:
                buckets = [
                    Bucket(b.dtype, b.count, tuple(index[m] for m in b.members), b.offsets, b.sizes, b.shapes)
                    for b in plan_buckets([sig[i][:2] for i in index], pack_bytes,
                                            UNFUSED_MIN_BYTES if kind == HOST else None)
                ]
            transports = self._host if kind == HOST else self._device()
            xp = np if kind == HOST else sys.modules.get("cupy") if kind == CUPY else None
            for b in buckets:
                transport = next(t for t in transports if t.enabled(b.nbytes, b.dtype, op))
                steps.append(Step(b, kind, transport, xp))
        if len(steps) == 1 and steps[0].members == tuple(range(len(sig))):
            steps[0].whole = True
        if len(self._plans) >= PLAN_CACHE_MAX:
            self._plans.clear()
            self.singles.clear()
            self.lists.clear()
        plan = self._plans[key] = Plan(steps, op)
        return plan

    def clear(self) -> None:
        """Forget every plan."""
        self._plans.clear()
        self.singles.clear()
        self.lists.clear()


def _single_bucket(i: int, entry: tuple) -> Bucket:
    shape, code = entry
    size = int(np.prod(shape, dtype=np.int64))
    return Bucket(np.dtype(code), size, (i,), (0,), (size,), (tuple(shape),))
