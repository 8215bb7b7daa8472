"""Reduction operations: ``ReduceOp`` and the one table of what each means on the wire.

:data:`WIRE_OPS` names each wire op's MPI op, NumPy ufunc and NCCL op, and :data:`NCCL_DTYPES` the
NCCL type of each dtype NCCL reduces, so no other module keeps a table. MPI is imported only when an
MPI op is asked for (``import mpistrat`` loads no MPI).
"""

from __future__ import annotations

import enum
import functools
from typing import Any, NamedTuple

import numpy as np

__all__ = ["ReduceOp", "mean_dtype", "WireOp", "WIRE_OPS", "wire_op", "mpi_op", "ufunc", "nccl_op", "nccl_dtype"]


class ReduceOp(enum.Enum):
    """How values from replicas are combined: SUM and MEAN (as TF) plus MIN and MAX.

    A logical op reduces element-wise with a *wire* op (``"sum"``, ``"min"``, ``"max"``,
    :attr:`wire`), the one every transport implements; MEAN is a sum divided afterwards by the
    number of replicas.
    """

    SUM = "SUM"
    MEAN = "MEAN"
    MIN = "MIN"
    MAX = "MAX"

    @staticmethod
    def from_string(op: "str | ReduceOp") -> "ReduceOp":
        """``ReduceOp.from_string("mean")`` -> ``ReduceOp.MEAN`` (case-insensitive)."""
        if type(op) is str:
            found = _OPS_BY_NAME.get(op)  # the exact spellings: one lookup on the hot path
            if found is not None:
                return found
        elif isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return ReduceOp[op.strip().upper()]
            except KeyError:
                pass
        raise ValueError(
            f"Unknown reduce op {op!r}; expected one of SUM, MEAN, MIN, MAX (a ReduceOp or a string)."
        )

    @staticmethod
    def from_variable_aggregation(aggregation: Any) -> "ReduceOp":
        """The reduce op matching a ``VariableAggregation`` (SUM or MEAN)."""
        name = getattr(aggregation, "name", str(aggregation)).upper()
        if name in ("SUM", "MEAN"):
            return ReduceOp[name]
        raise ValueError(
            f"Could not convert from `VariableAggregation` {name} to `ReduceOp` type"
        )

    @property
    def wire(self) -> str:
        """The element-wise op that moves between ranks (MEAN: ``"sum"``, divided afterwards)."""
        return _WIRE_OF[self]


_OPS_BY_NAME = {spelling: op for op in ReduceOp for spelling in (op.value, op.value.lower())}


def mean_dtype(dtype: Any) -> np.dtype:
    """The dtype of a mean of ``dtype`` values: ``dtype`` when floating or complex, else float64."""
    dtype = np.dtype(dtype)
    return dtype if dtype.kind in "fc" else np.dtype(np.float64)


class WireOp(NamedTuple):
    """One element-wise reduction as every transport names it."""

    name: str
    mpi: str  # attribute of mpi4py.MPI
    ufunc: np.ufunc
    nccl: str  # attribute of cupy.cuda.nccl
    complex_ok: bool  # defined for complex dtypes


WIRE_OPS: dict[str, WireOp] = {
    "sum": WireOp("sum", "SUM", np.add, "NCCL_SUM", True),
    "min": WireOp("min", "MIN", np.minimum, "NCCL_MIN", False),
    "max": WireOp("max", "MAX", np.maximum, "NCCL_MAX", False),
}
_WIRE_OF = {ReduceOp.SUM: "sum", ReduceOp.MEAN: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}


def wire_op(op: Any) -> str:
    """``"sum"``, ``"min"`` or ``"max"`` from a wire-op name or a ``ReduceOp`` other than MEAN (ValueError otherwise)."""
    if type(op) is str and op in WIRE_OPS:
        return op
    name = getattr(op, "value", op)
    if isinstance(name, str):
        lower = name.strip().lower()
        if lower in WIRE_OPS:
            return lower
        if lower == "mean":
            raise ValueError(
                "op 'mean' is not a cross-rank all-reduce op: all-reduce with 'sum' and divide by the "
                "number of replicas"
            )
    raise ValueError(f"Unknown all-reduce op {op!r}; expected 'sum', 'min' or 'max' (or a ReduceOp)")


@functools.lru_cache(maxsize=256)
def reduce_dtype_error(dtype: Any, wire: str) -> str | None:
    """Why the wire op ``wire`` cannot reduce values of ``dtype``, or None: the one rule of every reduction,
    within one process (local replicas) and across ranks, so both fail alike.

    Integer, floating-point and complex dtypes reduce. Bool does not (a sum of booleans is a count, not a
    boolean, and TF has no bool kernel for AddN or its collective all-reduce), nor do strings, objects or
    structured dtypes; ``"min"`` and ``"max"`` are not defined for complex values (they have no order). The
    reason reads after the value's name: ``f"{what} {reason}"``.
    """
    dtype = np.dtype(dtype)
    if dtype.kind not in "iufc":
        return f"has dtype {dtype}; supported are integer, float and complex dtypes"
    if dtype.kind == "c" and not WIRE_OPS[wire].complex_ok:
        return f"has dtype {dtype}: op {wire!r} is not defined for complex dtypes"
    return None


@functools.lru_cache(maxsize=None)
def mpi_op(wire: str) -> Any:
    """The ``mpi4py.MPI.Op`` of a wire op (imports MPI)."""
    from mpi4py import MPI  # noqa: PLC0415  (import mpistrat loads no MPI)

    return getattr(MPI, WIRE_OPS[wire].mpi)


def ufunc(wire: str) -> np.ufunc:
    """The NumPy ufunc of a wire op."""
    return WIRE_OPS[wire].ufunc


def nccl_op(op: "ReduceOp | str") -> str:
    """The ``cupy.cuda.nccl`` attribute naming the NCCL op of ``op`` (a ReduceOp or a wire op)."""
    wire = op.wire if isinstance(op, ReduceOp) else wire_op(op)
    return WIRE_OPS[wire].nccl


# NumPy dtype name -> the ``cupy.cuda.nccl`` attribute of its NCCL type (NCCL has no bool or complex).
NCCL_DTYPES: dict[str, str] = {
    "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
    "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
}


def nccl_dtype(dtype: Any) -> "str | None":
    """The ``cupy.cuda.nccl`` attribute naming ``dtype``'s NCCL type, or None where NCCL has none."""
    dt = np.dtype(dtype)
    return NCCL_DTYPES.get(dt.name) if dt.isnative else None
