#!/usr/bin/env bash
# GPU check, for a machine with one CUDA device: every strategy x precision for the three workloads'
# models, a few steps each, printing step time and peak memory. Finishes well inside 8 minutes.
#   bash benchmarks/gpu_check.sh            (writes benchmarks/results/gpu_check.{md,json} and $OUT if set)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" OMP_NUM_THREADS=4
python3 -m benchmarks.gpu_check "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
cp benchmarks/results/gpu_check.* "${OUT:-/tmp}/" 2>/dev/null || true
