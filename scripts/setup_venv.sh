#!/usr/bin/env bash
# Create ./.venv and install mpistrat with its MPI runtime and test tools.
# Safe to run twice: reinstalls only when pyproject.toml changed. Source it or run it.
# Sourced, it leaves the caller's shell options alone, exports PATH and VIRTUAL_ENV, and
# ends the caller with exit status 1 when the setup fails.
_mpistrat_setup_venv() {
  local repo venv py stamp
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
  venv="${MPISTRAT_VENV:-$repo/.venv}"
  py="${PYTHON:-python3}"
  if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating virtual environment $venv"
    "$py" -m venv "$venv" || return 1
  fi
  stamp="$venv/.mpistrat-installed"
  if [ ! -f "$stamp" ] || [ "$repo/pyproject.toml" -nt "$stamp" ]; then
    echo "[setup] installing mpistrat[mpich,test] into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$repo[mpich,test]" || return 1
    touch "$stamp" || return 1
  fi
  # The venv's mpiexec must come first: another mpiexec on PATH fails with PyPI MPICH.
  export PATH="$venv/bin:$PATH"
  export VIRTUAL_ENV="$venv"
}
_mpistrat_setup_venv || { echo "[setup] setting up the virtual environment failed" >&2; exit 1; }
