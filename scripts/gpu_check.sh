#!/usr/bin/env bash
# The GPU test node's check (issue 27), one prepared run that ends within 5 minutes:
#   timeout 330 bash scripts/gpu_check.sh RESULTS_DIR [WHEEL_DIR]
# Installs the wheels brought along (scripts/gpu_wheels.sh downloads them here: the node has no network),
# prints nvidia-smi, the CuPy and NCCL versions and `python -m mpistrat info`, then runs, each step under
# `timeout` with its own log in RESULTS_DIR: the `gpu` tests serially; the MPI `gpu` tests under
# mpiexec -n 2 with both ranks on the one GPU; the training example on CPU, on /gpu:0 and under
# mpiexec -n 2 (same seed); benchmarks/gpu_allreduce.py at 1 and 2 ranks. RESULTS_DIR/summary.txt
# has one line per step.
set -u
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:?usage: gpu_check.sh RESULTS_DIR [WHEEL_DIR]}"
whl="${2:-$repo/.whl}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$repo"
py="${PYTHON:-python3}"
summary="$out/summary.txt"
: >"$summary"

# MPICH and mpi4py under a prefix of their own (the node's Python is a virtual environment we leave alone):
# libmpi in $prefix/lib, mpiexec in $prefix/bin, the packages ahead of the node's on PYTHONPATH.
prefix=/tmp/mpistrat-gpu
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --prefix "$prefix" "$whl"/*.whl \
  || { echo "wheel install failed" | tee -a "$summary"; exit 1; }
site="$("$py" -c "import sysconfig; print(sysconfig.get_path('purelib', vars={'base': '$prefix', 'platbase': '$prefix'}))")"
export PATH="$prefix/bin:$PATH" PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
export MPI4PY_LIBMPI="$prefix/lib/libmpi.so.12" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export MPIEXEC_ALLOW_ROOT=1 HYDRA_LAUNCHER=fork  # the node runs commands as root, on one host

step() {  # step NAME SECONDS COMMAND...: run under timeout, log to $out/NAME.log, one summary line
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $* ==="
  timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  local last
  last=$(grep -E "passed|failed|error|accuracy|Error" "$out/$name.log" | tail -n 1)
  echo "$name: exit $rc in $((SECONDS - t0)) s; ${last:-}" | tee -a "$summary"
}

{
  nvidia-smi
  "$py" - <<'PY'
import cupy, mpi4py, numpy
from cupy.cuda import nccl
print("cupy", cupy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
      "driver", cupy.cuda.runtime.driverGetVersion(), "NCCL", nccl.get_version(), "mpi4py", mpi4py.__version__,
      "numpy", numpy.__version__, "devices", cupy.cuda.runtime.getDeviceCount())
PY
  "$py" -m mpistrat info
} >"$out/info.log" 2>&1
cat "$out/info.log"

pytest_args=(-q -rA -p no:cacheprovider -m gpu -o addopts="" --timeout=60)
step tests-serial 70 "$py" -m pytest --with-mpi "${pytest_args[@]}" --junitxml="$out/serial.xml" tests
step tests-n2 60 mpiexec -n 2 "$py" -m pytest --only-mpi "${pytest_args[@]}" tests
train=(examples/train.py --epochs 5 --seed 0 --no-progress --data-dir /tmp/mpistrat-digits)
step train-cpu 30 "$py" "${train[@]}" --devices /cpu:0
step train-gpu 30 "$py" "${train[@]}" --devices /gpu:0
step train-gpu-n2 30 mpiexec -n 2 "$py" "${train[@]}"
step train-gpu-mirrored 30 "$py" "${train[@]}" --strategy mirrored --devices /gpu:0
step train-cpu-n2 30 mpiexec -n 2 "$py" "${train[@]}" --devices /cpu:0
step bench-n1 25 "$py" benchmarks/gpu_allreduce.py --max-size 64M --budget 0.15
step bench-n2 50 mpiexec -n 2 "$py" benchmarks/gpu_allreduce.py --budget 0.2
step profile-n2 30 mpiexec -n 2 "$py" benchmarks/gpu_allreduce.py --profile 64K
echo "=== summary ==="
cat "$summary"
