"""CommunicationOptions / CommunicationImplementation (serial)."""

import pytest

from mpistrat.comm.options import DEFAULT_BYTES_PER_PACK, CommunicationImplementation, CommunicationOptions


def test_defaults_and_effective_values(monkeypatch):
    monkeypatch.delenv("MPISTRAT_TIMEOUT_SECONDS", raising=False)
    o = CommunicationOptions()
    assert (o.bytes_per_pack, o.timeout_seconds, o.implementation) == (0, None, CommunicationImplementation.AUTO)
    assert o.pack_bytes() == DEFAULT_BYTES_PER_PACK
    assert o.timeout() == 600.0


def test_timeout_env_fallback(monkeypatch):
    monkeypatch.setenv("MPISTRAT_TIMEOUT_SECONDS", "2.5")
    assert CommunicationOptions().timeout() == 2.5
    assert CommunicationOptions(timeout_seconds=7).timeout() == 7.0
    monkeypatch.setenv("MPISTRAT_TIMEOUT_SECONDS", "soon")
    with pytest.raises(ValueError, match="MPISTRAT_TIMEOUT_SECONDS"):
        CommunicationOptions().timeout()
    monkeypatch.setenv("MPISTRAT_TIMEOUT_SECONDS", "-1")
    with pytest.raises(ValueError, match="MPISTRAT_TIMEOUT_SECONDS"):
        CommunicationOptions().timeout()


@pytest.mark.parametrize("bad", [-1, 1.5, "4", True])
def test_bad_bytes_per_pack(bad):
    with pytest.raises(ValueError, match="bytes_per_pack"):
        CommunicationOptions(bytes_per_pack=bad)


@pytest.mark.parametrize("bad", [0, -3, float("inf"), "10", float("nan")])
def test_bad_timeout(bad):
    with pytest.raises(ValueError, match="timeout_seconds"):
        CommunicationOptions(timeout_seconds=bad)


def test_implementation_by_name_and_bad():
    assert CommunicationOptions(implementation="ring").implementation is CommunicationImplementation.RING
    assert CommunicationOptions(implementation="SHM").implementation is CommunicationImplementation.SHM
    with pytest.raises(ValueError, match="implementation"):
        CommunicationOptions(implementation="gloo")
    with pytest.raises(ValueError, match="implementation"):
        CommunicationOptions(implementation=3)
    assert {m.name for m in CommunicationImplementation} == {"AUTO", "RING", "NCCL", "MPI", "SHM"}


def test_merge_per_call_overrides_non_defaults():
    base = CommunicationOptions(bytes_per_pack=1024, timeout_seconds=10, implementation="NCCL")
    assert base.merge(None) == base and base.merge(None) is not base
    assert base.merge(CommunicationOptions()) == base
    merged = base.merge(CommunicationOptions(bytes_per_pack=64))
    assert merged == CommunicationOptions(64, 10, CommunicationImplementation.NCCL)
    merged = base.merge(CommunicationOptions(timeout_seconds=3, implementation="MPI"))
    assert merged == CommunicationOptions(1024, 3, CommunicationImplementation.MPI)
    assert base == CommunicationOptions(1024, 10, "NCCL")  # unchanged
    with pytest.raises(TypeError):
        base.merge({"bytes_per_pack": 1})
