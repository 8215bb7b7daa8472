"""A repeated ``all_reduce`` of a list of arrays: matched against its plan in C, every check, result and error kept."""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.comm import CollectiveMismatchError
from mpistrat.comm import fusion
from mpistrat.comm.arraylist import loops as _arraylist
from mpistrat.comm.signature import ListSignature, allreduce_signature

from helpers import run_all_reduce

needs_loops = pytest.mark.skipif(_arraylist is None, reason="mpistrat.comm._arraylist not built (no C compiler)")


def test_the_list_loops_are_built_by_the_install():
    # pip builds the extension wherever a C compiler is (this machine has one): without it the tests
    # below skip and every call takes the general path, which the rest of the suite covers.
    assert _arraylist is not None, "mpistrat.comm._arraylist was not built: pip install -e . with a C compiler"


class _Sub(np.ndarray):
    pass


def _read_only(a):
    a.flags.writeable = False
    return a


def _planned():
    return [np.zeros(3, np.float32), np.ones((2, 4), np.float32), np.float64(2.0) * np.ones((4, 1)),
            np.arange(6, dtype=np.int64).reshape(3, 2), np.zeros((), np.float32)]


def _variants():
    """Lists a later call could pass, each against ``_planned()``."""
    base = _planned()

    def swap(i, value):
        out = list(base)
        out[i] = value
        return out

    yield "same arrays", list(base), True
    yield "equal copies", [a.copy() for a in base], True
    yield "read-only copies", [_read_only(a.copy()) for a in base], True
    yield "other shape", swap(1, np.ones((4, 2), np.float32)), False
    yield "other size", swap(0, np.zeros(4, np.float32)), False
    yield "other ndim", swap(0, np.zeros((3, 1), np.float32)), False
    yield "other dtype", swap(0, np.zeros(3, np.float64)), False
    yield "big-endian", swap(0, np.zeros(3, ">f4")), False
    yield "a contiguous view", swap(0, np.zeros(8, np.float32)[2:5]), True
    yield "a non-contiguous view", swap(1, np.ones((2, 8), np.float32)[:, ::2]), False
    yield "Fortran order", swap(1, np.asfortranarray(np.ones((2, 4), np.float32))), False
    yield "a subclass", swap(0, np.zeros(3, np.float32).view(_Sub)), False
    yield "a Python number", swap(4, 0.0), False
    yield "a NumPy scalar", swap(4, np.float32(0)), False
    yield "one more array", base + [np.zeros(1)], False
    yield "one less array", base[:-1], False


@needs_loops
@pytest.mark.parametrize("name, call, expected", list(_variants()), ids=[v[0] for v in _variants()])
def test_a_list_matches_its_plan_exactly_when_its_signature_is_the_plans(name, call, expected):
    planned = _planned()
    sig, kinds, error = allreduce_signature(list(planned), False, lambda: False)
    assert kinds is None and error is None
    matched = ListSignature(planned).matches(call)
    assert matched is expected
    if matched:  # the C match stands for the signature the general path builds
        assert allreduce_signature(list(call), False, lambda: False)[0] == sig
        assert all(type(a) is np.ndarray and a.flags.c_contiguous for a in call)


@needs_loops
def test_the_compiled_pack_copies_like_concatenate_or_leaves_the_bucket_to_it():
    arrays = [np.arange(5, dtype=np.float32), np.full((2, 3), 7, np.float32), np.ones((4, 1), np.float32)]
    out = np.empty(15, np.float32)
    assert _arraylist.pack(arrays, np.ndarray, (0, 1, 2), out)
    assert np.array_equal(out, np.concatenate(arrays, axis=None))
    assert _arraylist.pack(arrays, np.ndarray, (2, 0), out[:9])
    assert np.array_equal(out[:9], np.concatenate([arrays[2], arrays[0]], axis=None))
    before = np.full(15, -1, np.float32)
    for members, arrays_, target in [((0, 1, 2), arrays, before[:14]),  # bytes not exactly out's
                                     ((0, 3), arrays, before[:11]),  # no such member
                                     ((0, 1), [arrays[0], np.ones((2, 6), np.float32)[:, ::2]], before[:11]),
                                     ((0, 1), [arrays[0], arrays[1].view(_Sub)], before[:11])]:  # a subclass
        snapshot = target.copy()
        assert not _arraylist.pack(arrays_, np.ndarray, members, target)
        assert np.array_equal(target, snapshot)  # nothing written
    # fusion.pack falls back to NumPy for what the loop refuses: the bucket is filled either way
    bucket = fusion.plan_buckets([((2, 3), "<f4"), ((2, 3), "<f4")], 1 << 20)[0]
    strided = [np.ones((2, 6), np.float32)[:, ::2], np.full((2, 3), 3, np.float32)]
    out = np.empty(12, np.float32)
    fusion.pack(strided, bucket, out)
    assert np.array_equal(out, np.concatenate(strided, axis=None))


# -- across ranks ---------------------------------------------------------------------------------
@pytest.fixture
def strategy(comm, monkeypatch):
    monkeypatch.delenv("MPISTRAT_SHM_MIN_BYTES", raising=False)
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    return ms.MultiWorkerMirroredStrategy()


def _count_repeats(monkeypatch, rc):
    """The calls the list fast path took (``ListSignature.matches`` true in ``allreduce_repeat_list``)."""
    matched = []
    match = ListSignature.matches

    def counted(self, arrays):
        out = match(self, arrays)
        if out:
            matched.append(len(arrays))
        return out

    monkeypatch.setattr(ListSignature, "matches", counted)
    return matched


@needs_loops
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count, size", [(3, 300), (100, 1024), (5, 200_000)])
def test_repeated_lists_take_the_matched_path_with_new_results_kept(strategy, comm, monkeypatch, count, size):
    rc = strategy.extended._communicator
    served = _count_repeats(monkeypatch, rc)
    xs = [np.full(size, comm.rank + j, np.float32) for j in range(count)]
    held = []
    for k in range(4):
        for j, x in enumerate(xs):
            x[:] = comm.rank + j + k
        out = run_all_reduce(strategy, "sum", xs)
        assert type(out) is list and len(out) == count
        for j, (x, r) in enumerate(zip(xs, out)):
            assert r is not x and np.all(x == comm.rank + j + k)  # inputs untouched
            assert np.all(r == comm.size * (comm.size - 1) / 2 + comm.size * (j + k))
        held.append(out)
    for k, out in enumerate(held):  # no later call wrote into results the caller holds
        assert all(np.all(r == comm.size * (comm.size - 1) / 2 + comm.size * (j + k)) for j, r in enumerate(out))
    assert len(served) == 3  # the first call planned; the three repeats were matched
    assert np.array_equal(rc.allreduce(xs, "max")[1], np.full(size, comm.size + 3.0, np.float32))


@needs_loops
@pytest.mark.mpi(min_size=2)
def test_a_list_mismatch_against_a_matched_repeat_raises_on_every_rank(strategy, comm, monkeypatch):
    rc = strategy.extended._communicator
    served = _count_repeats(monkeypatch, rc)
    xs = [np.ones(100, np.float32) for _ in range(4)]
    for _ in range(3):
        run_all_reduce(strategy, "sum", xs)
    odd = comm.rank == comm.size - 1
    wrong = xs[:3] + [np.ones(101, np.float32)]
    before = len(served)
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce shapes"):
        run_all_reduce(strategy, "sum", wrong if odd else xs)  # the others are matched: the check still compares
    assert len(served) == before + (0 if odd else 1)
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce"):
        run_all_reduce(strategy, "sum", [x.astype(np.float64) for x in xs] if odd else xs)
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce op"):
        run_all_reduce(strategy, "max" if odd else "sum", xs)
    out = run_all_reduce(strategy, "sum", xs)
    assert all(np.all(r == comm.size) for r in out)


@needs_loops
@pytest.mark.mpi(min_size=2)
def test_variables_and_numbers_in_a_repeated_list_are_read_before_any_match(strategy, comm, monkeypatch):
    rc = strategy.extended._communicator
    served = _count_repeats(monkeypatch, rc)
    with strategy.scope():
        v = ms.Variable(np.full(3, 2.0, np.float32))
    xs = [np.ones(3, np.float32), np.ones(3, np.float32)]
    for _ in range(2):
        assert all(np.all(r == comm.size) for r in run_all_reduce(strategy, "sum", xs))
    assert len(served) == 1
    out = run_all_reduce(strategy, "sum", [xs[0], v])  # a variable reads as its value
    assert np.all(out[0] == comm.size) and np.all(out[1] == 2.0 * comm.size)
    # Not matched at the strategy (a variable is no array); its value, read there, is a plain array of the
    # planned shape and dtype, so the list the communicator gets matches.
    assert len(served) == 2
    out = run_all_reduce(strategy, "sum", [xs[0], np.float32(1.0)])
    assert np.all(out[1] == comm.size) and np.ndim(out[1]) == 0
