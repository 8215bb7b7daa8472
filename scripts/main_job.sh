#!/usr/bin/env bash
# The README's main command: set up ./.venv (scripts/setup_venv.sh, skipped when up to date) and
# train the digits MLP data-parallel on 4 MPI ranks (examples/train.py). Safe to run twice: the data
# shards are written once into examples/data/, and each run trains from scratch.
# Usage: bash scripts/main_job.sh [train.py flags, e.g. --epochs 5 --optimizer adam]
# Environment: MPISTRAT_NP (ranks, default 4), MPISTRAT_TIMEOUT (seconds, default 900).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
. scripts/setup_venv.sh
np="${MPISTRAT_NP:-4}"
progress=()
if [ -t 2 ]; then progress=(--progress); fi  # the ranks write to mpiexec's pipes: ask rank 0 for its bar
echo "[main job] mpiexec -n $np python examples/train.py${progress[*]:+ ${progress[*]}}${*:+ $*}"
exec timeout -k 10 "${MPISTRAT_TIMEOUT:-900}" mpiexec -n "$np" python examples/train.py "${progress[@]}" "$@"
