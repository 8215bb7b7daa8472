#!/usr/bin/env bash
# mpistrat on one machine without Slurm: mpiexec starts the ranks (a workstation, a cloud VM, or
# inside an allocation: salloc -N1 -n4 bash jobs/mpiexec_one_node.sh).
# Usage: bash jobs/mpiexec_one_node.sh [train.py flags]     e.g. NP=2 bash jobs/mpiexec_one_node.sh --epochs 3
# ---- edit for your run ------------------------------------------------------------------------------
: "${NP:=4}"                                              # MPI ranks (workers)
: "${MPISTRAT_REPO:=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
: "${MPISTRAT_VENV:=$MPISTRAT_REPO/.venv}"
: "${DATA_DIR:=$MPISTRAT_REPO/examples/data}"
: "${EPOCHS:=10}"
: "${GLOBAL_BATCH:=64}"
: "${CKPT_DIR:=}"                                         # set to checkpoint (and resume) there
: "${MPIEXEC_ARGS:=}"                                     # Open MPI on few cores: --oversubscribe
# -----------------------------------------------------------------------------------------------------
set -euo pipefail
source "$MPISTRAT_VENV/bin/activate"                      # the venv's mpiexec comes first on PATH
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
ckpt=()
if [ -n "$CKPT_DIR" ]; then ckpt=(--checkpoint-dir "$CKPT_DIR" --resume); fi
progress=()
if [ -t 2 ]; then progress=(--progress); fi               # ranks write to mpiexec's pipes: rank 0's bar on request
# shellcheck disable=SC2086  # MPIEXEC_ARGS is a list of options
exec mpiexec -n "$NP" $MPIEXEC_ARGS python "$MPISTRAT_REPO/examples/train.py" \
  --epochs "$EPOCHS" --global-batch-size "$GLOBAL_BATCH" --data-dir "$DATA_DIR" \
  "${ckpt[@]}" "${progress[@]}" "$@"
