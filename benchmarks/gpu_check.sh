#!/usr/bin/env bash
# GPU check, for a machine with one or more CUDA devices: plain vs wrapped step time, peak CUDA memory and
# weights for the three workloads, every precision and the sharded strategies on one device, ddp and fsdp on
# all of them; refusals listed apart from failures. Stops starting runs after 540 s, so it ends inside 10
# minutes unattended, and rewrites its results after every row.
#   bash benchmarks/gpu_check.sh            (writes benchmarks/results/gpu_check.{md,json}; copies them and the log
#                                            to $OUT when set)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" OMP_NUM_THREADS=4
python3 -m benchmarks.gpu_check "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
cp benchmarks/results/gpu_check.* "${OUT:-/tmp}/" 2>/dev/null || true
