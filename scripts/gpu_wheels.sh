#!/usr/bin/env bash
# Download, here, the wheels that scripts/gpu_check.sh installs on the GPU test node (which has no network):
# the PyPI MPICH runtime, mpi4py and the MPI test plugin, for CPython 3.12 on x86-64 Linux.
# The node already has CuPy (cupy-cuda13x), NCCL, NumPy, pytest and pytest-timeout.
# Usage: bash scripts/gpu_wheels.sh [DIR]   (default .whl, which git ignores)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$repo/.whl}"
mkdir -p "$dir"
py="${PYTHON:-python3}"
platforms=()
for n in 2_28 2_27 2_24 2_17 2014 1; do
  case $n in 2014) platforms+=(--platform manylinux2014_x86_64);; 1) platforms+=(--platform manylinux1_x86_64);;
  *) platforms+=(--platform "manylinux_${n}_x86_64");; esac
done
# Exact versions: the ones CI runs with (pyproject.toml's [mpich] and [test] extras).
"$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dir" mpich==5.0.2 mpi4py==4.1.2 pytest-mpi==0.6 google-crc32c==1.9.0
ls -l "$dir"
