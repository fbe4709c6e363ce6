#!/usr/bin/env bash
# Everything that needs a GPU, as resumable steps (benchmarks/gpu_suite.py): each step has its own time budget
# (under 8 minutes on an H100), writes its own JSON into the results directory (benchmarks/results/gpu by
# default; also copied to $OUT when set) and is skipped once it has succeeded, so repeated calls resume.
#
# On a GPU machine that already has a CUDA build of torch, triton, transformers, tokenizers, tiktoken,
# safetensors, tqdm, matplotlib (and maybe no network), install only this package:
#     python3 -m pip install --no-deps --no-build-isolation --no-index -e .
# Then, within commands limited to 10 minutes each, repeat until nothing is pending:
#     bash benchmarks/gpu_suite.sh --next 540     # pending steps whose budgets fit in 540 s
#     bash benchmarks/gpu_suite.sh --list         # steps, budgets, done/pending
#     bash benchmarks/gpu_suite.sh --step warm    # one step
# Without arguments: every pending step, in order (about an hour in all).
set -u
PY=${PY:-python3}
unset TRITON_INTERPRET
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then
    exec "$PY" benchmarks/gpu_suite.py --all
fi
exec "$PY" benchmarks/gpu_suite.py "$@"
