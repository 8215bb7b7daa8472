"""Running an all-reduce plan: stage each bucket, hand it to its transport, give out the results."""

from __future__ import annotations

from typing import Callable

import numpy as np
from mpi4py import MPI

from mpistrat.comm import fusion
from mpistrat.comm.plan import Step
from mpistrat.comm.signature import CAI
from mpistrat.comm.transport.base import NO_AGREEMENT, AgreementHook
from mpistrat.comm.transport.buffers import GrowableBuffers

__all__ = ["run_steps"]


def run_steps(steps: list[Step], arrays: list, op: str, inplace: bool, hook: AgreementHook,
              scratch: GrowableBuffers, compiled: bool = False,
              first_lane: Callable[[np.ndarray, np.ndarray], bool] | None = None) -> list:
    """Reduce ``arrays`` step by step over two or more ranks; the results (``arrays`` when ``inplace``).

    The first step's transport gets the call's agreement ``hook``; with ``compiled``, where ``first_lane``
    (the plan's compiled lane, passed only with ``hook`` that lane's own ``FoldedCheck``, pending) takes the
    call, that lane reduces the first step with the check instead. Later steps get
    :data:`~mpistrat.comm.transport.base.NO_AGREEMENT` (the check is done by then), and with ``compiled``
    a step's compiled reduce-scatter (``Step.lane``) where it has one and can take the call.
    Results are new arrays from each step's pool (never overwritten by a later call; read-only where
    the node's ranks share them), or, in place, the input arrays themselves: a packed bucket is then
    reduced into ``scratch`` (host) or a new device array and copied into them, never via memory a
    transport owns, so no view of it outlives the call.
    """
    results = arrays if inplace else [None] * len(arrays)
    for step in steps:
        b = step.bucket
        transport = step.transport
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
                views = step.pool.get()[1]
                dst = views[0]
                lane = step.lane if hook is NO_AGREEMENT else first_lane
                if not (compiled and lane is not None and lane(src, dst)):
                    transport.allreduce_array(src, dst, op, hook)
                hook = NO_AGREEMENT
                results[b.members[0]] = step.pool.results(views)[0]
                continue
            transport.allreduce_array(src, dst, op, hook)
            hook = NO_AGREEMENT
            if write_back is not None:
                step.xp.copyto(write_back, dst)
            continue
        xp = step.xp
        fusion.pack(arrays, b, transport.pack_buffer(b.count, b.dtype), xp)
        if inplace:
            flat = scratch.get(b.count, b.dtype) if xp is np else xp.empty(b.count, b.dtype)
            transport.allreduce_packed(b.count, b.dtype, op, hook, flat)
            hook = NO_AGREEMENT
            copyto = xp.copyto
            for i, src in zip(b.members, step.source_views(flat)):
                copyto(arrays[i], src)
            continue
        block, views = step.pool.get()
        transport.allreduce_packed(b.count, b.dtype, op, hook, block)
        hook = NO_AGREEMENT
        views = step.pool.results(views)
        if step.whole:  # the call's arrays in order: the pool's views, in a list of the caller's own
            results = list(views)
            continue
        for i, v in zip(b.members, views):
            results[i] = v
    if hook is not NO_AGREEMENT:  # no steps (no arrays): the check still runs
        hook.staged()
    return results
