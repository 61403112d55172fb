#!/usr/bin/env bash
# GPU check of the Triton kernels (one H200, under 8 minutes):
#   1. the GPU-only kernel tests (bf16 D=64 and fp16 D=128, N=1000, every pattern; bf16 decode) against the
#      fp64 reference (the CPU-interpreter tests cover fp32/fp16 at tiny sizes; run them with plain pytest)
#   2. bench/gpu_bench.py: correctness at N=4096 and timings vs FlexAttention and dense SDPA, decode bandwidth
# Usage: bash bench/gpu_check.sh [extra gpu_bench.py flags]      (CPU smoke test: python bench/gpu_bench.py --dry-run)
set -uo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh needs CUDA; use python bench/gpu_bench.py --dry-run on CPU')" || exit 2
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
start=$(date +%s)
echo "== kernel tests (GPU)"
timeout 200 python -m pytest -q -m gpu tests/test_kernels.py -p no:cacheprovider
tests_rc=$?
echo "== benchmark"
timeout 260 python bench/gpu_bench.py --budget 190 "$@"
bench_rc=$?
echo "== gpu_check: tests rc=$tests_rc bench rc=$bench_rc ($(( $(date +%s) - start ))s)"
exit $(( tests_rc != 0 || bench_rc != 0 ))
