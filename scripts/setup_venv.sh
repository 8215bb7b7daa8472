#!/usr/bin/env bash
# Create ./.venv and install mpistrat with its MPI runtime and test tools.
# Safe to run twice: reinstalls only when pyproject.toml changed. Source it or run it.
set -eu
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MPISTRAT_VENV:-$repo/.venv}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating virtual environment $venv"
  "$py" -m venv "$venv"
fi
stamp="$venv/.mpistrat-installed"
if [ ! -f "$stamp" ] || [ "$repo/pyproject.toml" -nt "$stamp" ]; then
  echo "[setup] installing mpistrat[mpich,test] into $venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$repo[mpich,test]"
  touch "$stamp"
fi
# The venv's mpiexec must come first: another mpiexec on PATH fails with PyPI MPICH.
export PATH="$venv/bin:$PATH"
export VIRTUAL_ENV="$venv"
