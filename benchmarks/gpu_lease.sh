#!/usr/bin/env bash
# One GPU lease, one command (benchmarks/gpu_lease.py): the answers first, every step capped by the time left,
# each step's JSON and one running log (flushed line by line) in $OUT, at most 8 files. No network, no install:
# the package runs from src/ (PYTHONPATH) with the machine's own python3.
#
#   bash benchmarks/gpu_lease.sh 570             # part 1, inside a command of 600 s (the run tool's timeout_s)
#   bash benchmarks/gpu_lease.sh 150 --part 2    # part 2, right after part 1 on the same machine
#   bash benchmarks/gpu_lease.sh 300 --dry-run   # the same steps on the CPU, tiny shapes (what CI runs)
#   bash benchmarks/gpu_lease.sh --plan          # the steps' predicted seconds on an H100 (counted compiles)
set -u
cd "$(dirname "$0")/.." || exit 2
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/gpu_lease.py "$@"
