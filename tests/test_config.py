"""Settings: every MPISTRAT_* variable parsed in one place, one boolean rule, warnings for unknown names."""

import os
import warnings

import pytest

from mpistrat import config


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in [v.name for v in config.VARIABLES]:
        monkeypatch.delenv(name, raising=False)


def test_defaults_and_their_sources():
    s = config.settings()
    assert (s.timeout_seconds, s.timeout_grace_seconds, s.stall_warning_seconds, s.stall_shutdown_seconds) == (
        600.0, 0.5, 60.0, 0.0)
    assert (s.shm_min_bytes, s.shm_max_bytes, s.agreement) == ("auto", 64 << 20, "auto")
    assert (s.shm_chunk_bytes, s.sources["shm_chunk_bytes"]) == config.default_chunk_bytes()
    assert (s.pretend_nodes, s.cuda_aware, s.check_numerics, s.timeline, s.no_abort_hook) == (
        None, None, False, None, False)
    assert s.sources["timeout_seconds"] == "default"
    l2 = config.l2_cache_bytes()
    if l2 is None:
        assert (s.shm_block_bytes, s.sources["shm_block_bytes"]) == (256 << 10, "default")
    else:  # a hardware fact read at start-up: an eighth of L2, a power of two
        assert s.sources["shm_block_bytes"] == "hardware"
        assert s.shm_block_bytes <= max(l2 // 8, 16 << 10) < 2 * s.shm_block_bytes


@pytest.mark.parametrize("llc, l2, ranks, want", [
    (32 << 20, 1 << 20, 1, 4 << 20), (32 << 20, 1 << 20, 2, 2 << 20), (32 << 20, 1 << 20, 4, 1 << 20),
    (32 << 20, 1 << 20, 64, 512 << 10),  # never below the floor, half of L2
    (300 << 20, 2 << 20, 2, 16 << 20), (None, 1 << 20, 2, 512 << 10), (None, None, 2, 1 << 20),
])
def test_the_default_chunk_fits_every_ranks_chunks_in_half_the_last_level_cache(monkeypatch, llc, l2, ranks, want):
    sizes = {level: size for level, size in ((2, l2), (3, llc)) if size is not None}
    monkeypatch.setattr(config, "_cache_sizes", lambda: dict(sizes))
    assert config.last_level_cache_bytes() == llc and config.l2_cache_bytes() == l2
    assert config.node_chunk_bytes(ranks) == want
    if llc is not None:
        assert 6 * ranks * want <= llc or want == config.default_chunk_bytes()[0]


def test_the_cache_sizes_are_read_from_sysfs():
    sizes = config._cache_sizes()
    if not sizes:
        pytest.skip("this machine's sysfs has no cache sizes")
    base = "/sys/devices/system/cpu/cpu0/cache"
    by_level = {}
    for entry in os.listdir(base):
        if entry.startswith("index") and open(f"{base}/{entry}/type").read().strip() != "Instruction":
            size = open(f"{base}/{entry}/size").read().strip()
            by_level[int(open(f"{base}/{entry}/level").read())] = config.parse_bytes(size, "size")
    assert sizes == by_level
    assert config.last_level_cache_bytes() == (by_level[max(by_level)] if max(by_level) >= 3 else None)


def test_the_environment_is_read_into_a_frozen_object_once_per_environment(monkeypatch):
    first = config.settings()
    assert config.settings() is first, "parsed once while the environment stays the same"
    with pytest.raises(AttributeError):
        first.timeout_seconds = 1.0  # frozen
    monkeypatch.setenv("MPISTRAT_TIMEOUT_SECONDS", "2.5")
    second = config.settings()
    assert second is not first and second.timeout_seconds == 2.5
    assert second.sources["timeout_seconds"] == "environment"
    assert first.timeout_seconds == 600.0, "an object handed out never changes"


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                         ("0", False), ("False", False), ("no", False), ("OFF", False)])
def test_one_rule_for_booleans(monkeypatch, text, value):
    for name, field in (("MPISTRAT_CHECK_NUMERICS", "check_numerics"), ("MPISTRAT_NO_ABORT_HOOK", "no_abort_hook"),
                        ("MPISTRAT_CUDA_AWARE", "cuda_aware")):
        monkeypatch.setenv(name, text)
        assert getattr(config.settings(), field) is value, name


def test_a_malformed_boolean_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("MPISTRAT_CHECK_NUMERICS", "2")
    with pytest.raises(ValueError, match=r"MPISTRAT_CHECK_NUMERICS must be one of 1/true/yes/on or 0/false/no/off, "
                                         r"got '2'"):
        config.settings()


def test_every_malformed_variable_is_named_at_once(monkeypatch):
    monkeypatch.setenv("MPISTRAT_SHM_MAX_BYTES", "lots")
    monkeypatch.setenv("MPISTRAT_PRETEND_NODES", "0")
    monkeypatch.setenv("MPISTRAT_AGREEMENT", "nvlink")
    with pytest.raises(ValueError) as info:
        config.settings()
    text = str(info.value)
    assert "MPISTRAT_SHM_MAX_BYTES must be a byte count" in text
    assert "MPISTRAT_PRETEND_NODES must be a positive integer, got '0'" in text
    assert "MPISTRAT_AGREEMENT must be one of auto, mpi, got 'nvlink'" in text
    # One setting read on its own (at import) fails only for itself.
    assert config.get("timeline") is None
    with pytest.raises(ValueError, match="MPISTRAT_AGREEMENT"):
        config.get("agreement")


def test_sizes_and_their_words(monkeypatch):
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "64K")
    monkeypatch.setenv("MPISTRAT_SHM_CHUNK_BYTES", "auto")
    monkeypatch.setenv("MPISTRAT_SHM_BLOCK_BYTES", "4KiB")
    s = config.settings()
    assert (s.shm_min_bytes, s.shm_chunk_bytes, s.shm_block_bytes) == (65536, "auto", 4096)
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "OFF")
    assert config.settings().shm_min_bytes == "off"
    assert config.parse_bytes("1g", "x") == 1 << 30 and config.parse_bytes("64MiB", "x") == 64 << 20


def test_seconds_are_checked(monkeypatch):
    monkeypatch.setenv("MPISTRAT_TIMEOUT_GRACE_SECONDS", "0.001")
    assert config.settings().timeout_grace_seconds == 0.05, "at least 0.05 s"
    for bad in ("-1", "inf", "nan", "soon"):
        monkeypatch.setenv("MPISTRAT_STALL_WARNING_SECONDS", bad)
        with pytest.raises(ValueError, match="MPISTRAT_STALL_WARNING_SECONDS must be a finite number of seconds"):
            config.settings()
    monkeypatch.setenv("MPISTRAT_STALL_WARNING_SECONDS", "0")
    monkeypatch.setenv("MPISTRAT_TIMEOUT_SECONDS", "0")
    with pytest.raises(ValueError, match=r"MPISTRAT_TIMEOUT_SECONDS must be a finite number of seconds > 0"):
        config.settings()


def test_an_unknown_name_warns_once_naming_the_closest_known_one(monkeypatch):
    monkeypatch.setenv("MPISTRAT_TIMEOUT_SECOND", "5")  # a typo
    monkeypatch.setattr(config, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.settings()
        monkeypatch.setenv("MPISTRAT_TIMEOUT_SECONDS", "7")  # a new environment: parsed again, no new warning
        assert config.settings().timeout_seconds == 7.0
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert messages == ["unknown mpistrat setting MPISTRAT_TIMEOUT_SECOND in the environment (ignored); "
                        "did you mean MPISTRAT_TIMEOUT_SECONDS?"]


def test_a_removed_setting_says_so(monkeypatch):
    monkeypatch.setenv("MPISTRAT_SHM_SYNC", "barrier")
    monkeypatch.setattr(config, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.settings()
    assert [str(w.message) for w in caught] == [
        "mpistrat setting MPISTRAT_SHM_SYNC is ignored: " + config.REMOVED["MPISTRAT_SHM_SYNC"]]


def test_the_scripts_variables_are_known(monkeypatch):
    monkeypatch.setattr(config, "_warned", set())
    for name in config.SCRIPT_VARIABLES:
        monkeypatch.setenv(name, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.settings()


def test_describe_lists_every_variable_with_its_source(monkeypatch):
    monkeypatch.setenv("MPISTRAT_PRETEND_NODES", "2")
    monkeypatch.setenv("MPISTRAT_SHM_MAX_BYTES", "huge")
    rows = {name: (value, source) for name, value, source in config.describe()}
    assert list(rows) == [v.name for v in config.VARIABLES]
    assert rows["MPISTRAT_PRETEND_NODES"] == ("2", "environment")
    assert rows["MPISTRAT_TIMELINE"] == ("unset", "default")
    assert rows["MPISTRAT_SHM_MAX_BYTES"][0].startswith("error: MPISTRAT_SHM_MAX_BYTES must be a byte count")
