"""Run a module's collective tests once per host transport layout.

Import the fixture into a test module (``from backend_variants import
backend_variant  # noqa: F401``): it is autouse, so every test of that module
runs, at 2 and 4 ranks, with the node shared-memory transport

* ``auto``: as configured by default (the size threshold's rule);
* ``shm-forced``: taken for every bucket size (``MPISTRAT_SHM_MIN_BYTES=0``);
* ``shm-off``: never taken, plain MPI only (``MPISTRAT_SHM_MIN_BYTES=off``);
* ``pretend-2-nodes``: forced on, the ranks cut into two pretend nodes
  (``MPISTRAT_PRETEND_NODES=2``), so the hierarchical path runs.

The environment is read when a communicator is created, so it applies to
every communicator and strategy the test builds. On one rank there is no
transport to vary: only ``auto`` runs.
"""

from __future__ import annotations

import pytest
from mpi4py import MPI

__all__ = ["VARIANTS", "backend_variant"]

VARIANTS: dict[str, dict[str, str]] = {
    "auto": {},
    "shm-forced": {"MPISTRAT_SHM_MIN_BYTES": "0"},
    "shm-off": {"MPISTRAT_SHM_MIN_BYTES": "off"},
    "pretend-2-nodes": {"MPISTRAT_SHM_MIN_BYTES": "0", "MPISTRAT_PRETEND_NODES": "2"},
}
_NAMES = list(VARIANTS) if MPI.COMM_WORLD.Get_size() > 1 else ["auto"]


@pytest.fixture(autouse=True, params=_NAMES)
def backend_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The variant's name; its environment is set for the test's duration."""
    for name in ("MPISTRAT_SHM_MIN_BYTES", "MPISTRAT_PRETEND_NODES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in VARIANTS[request.param].items():
        monkeypatch.setenv(name, value)
    return request.param
