"""Reading and agreeing the shared-memory transport's settings (no MPI needed)."""

import dataclasses

import pytest

from mpistrat import config
from mpistrat.comm.transport.shm.settings import NEVER, ShmSettings, agree_settings, read_settings


def test_defaults_and_environment(monkeypatch):
    for name in ("MAX", "BLOCK", "CHUNK", "MIN"):
        monkeypatch.delenv(f"MPISTRAT_SHM_{name}_BYTES", raising=False)
    block, chunk = config.settings().shm_block_bytes, config.default_chunk_bytes()[0]  # from the L2 cache
    assert read_settings() == ShmSettings(64 << 20, block, chunk, None, "counter", chunk_default=True)
    assert not read_settings(chunk_bytes=chunk).chunk_default  # the same size, given
    given = dataclasses.replace(config.settings(), shm_chunk_bytes=chunk // 2)  # in a settings object
    assert read_settings(env=given) == ShmSettings(64 << 20, block, chunk // 2, None, "counter")
    monkeypatch.setenv("MPISTRAT_SHM_CHUNK_BYTES", "auto")  # left to measurement
    assert read_settings().chunk_bytes is None and not read_settings().chunk_default
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "off")
    monkeypatch.setenv("MPISTRAT_SHM_CHUNK_BYTES", "1M")
    monkeypatch.setenv("MPISTRAT_SHM_MAX_BYTES", "32M")
    assert read_settings() == ShmSettings(32 << 20, block, 1 << 20, NEVER, "counter")
    # arguments win over the environment; "auto" leaves the chunk size to measurement
    assert read_settings(max_bytes=4096, chunk_bytes="auto", min_bytes=0, sync="barrier") == ShmSettings(
        4096, block, None, 0, "barrier")


@pytest.mark.parametrize("kwargs, message", [
    ({"max_bytes": -1}, "max_bytes >= 0"),
    ({"block_bytes": 0}, "block_bytes >= 1"),
    ({"chunk_bytes": 2.5}, "chunk_bytes"),
    ({"chunk_bytes": False}, "chunk_bytes"),
    ({"min_bytes": "64K"}, "min_bytes"),
    ({"sync": "spin"}, "sync must be"),
])
def test_bad_values_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        read_settings(**kwargs)


def test_agreement_takes_the_smallest_given_value():
    auto = ShmSettings(64 << 20, 256 << 10, None, None, "counter")
    given = ShmSettings(8 << 20, 128 << 10, 1 << 20, 4096, "counter")
    assert agree_settings([auto, given, auto]) == given
    assert agree_settings([auto, auto]) == auto
    off = ShmSettings(8 << 20, 256 << 10, None, NEVER, "counter")
    assert agree_settings([off, auto]).min_bytes == (8 << 20) + 1  # "off": above the agreed max_bytes
    default = ShmSettings(8 << 20, 256 << 10, 1 << 20, None, "counter", chunk_default=True)
    assert agree_settings([default, default]).chunk_default
    assert not agree_settings([default, default._replace(chunk_default=False)]).chunk_default  # given on one rank


def test_different_sync_kinds_are_refused_naming_the_ranks():
    with pytest.raises(ValueError, match="rank 0: counter, rank 1: barrier"):
        agree_settings([ShmSettings(1, 1, None, None, "counter"), ShmSettings(1, 1, None, None, "barrier")])
