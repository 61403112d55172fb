#!/usr/bin/env bash
# GPU acceptance check of imggen's sparse attention, sized for a short slot: at most
# 4 minutes on one H200, compiles included. Results land under $OUT when it is set, else bench/results/:
#   gpu_check.md    tables, the targets (PASS/FAIL) first        gpu_check.json  every number and error
#   gpu_check.log   this output, with timestamps                 smoke.log       train.py / sample.py output
#   samples.png     4 images from the training smoke's checkpoint
#
# Run it in one call, from the repository root (device tool: command `bash bench/gpu/gpu_check.sh`, timeout_s 300):
#     bash bench/gpu/gpu_check.sh
# CPU plumbing test, tiny sizes under the Triton interpreter (tests/test_gpu_check.py runs it; 70 s measured on
# 2 busy cores, 45 s of CPU):
#     bash bench/gpu/gpu_check.sh --dry-run
# What did not fit (rows listed as 'not run' in gpu_check.md), in a longer slot (timeout_s 600):
#     bash bench/gpu/gpu_check.sh --parts grid,selfcheck --budget 540
# Other flags: python3 bench/gpu/gpu_bench.py --help. Exit code: 0 every target PASS; 1 a target FAIL or
# NOT RUN; 2 no CUDA (one line, at once); 124/137 stopped by the hard timeout (results so far are on disk).
#
# What runs, in priority order, with seconds measured on an H200 with cold compile caches (2026-11-30,
# torch 2.11 / Triton 3.6; gpu_check.md's Timeline has every unit's seconds). The default call took 219 s
# and a 25 s machine start. A unit starts only if the budget (default 220 s from Python's start; hard
# timeout 12 s later) still holds its minimum slot, and is stopped at the end of its slot; an error or
# a timeout is that unit's FAIL, never the end of the run.
#   ~5   startup: nvidia-smi, import torch / triton / imggen, device-to-device copy bandwidth (1 GiB)
#   ~20  TARGET band w=256, N=16384, B*H=8*16, bf16, D=64: ours forward and forward+backward (the first
#        call compiles ~3 Triton kernels), fp32 reference on 4 (batch, head) slices, dense causal SDPA
#        (flash); then FlexAttention through imggen's flex backend (torch.compile of forward+backward,
#        ~8 s) and ours vs flex on the full tensors
#   ~40  TARGET diffuser K=5, N=16384: ours vs one softmax attention on the same graph, both vs fp32 references
#   ~4   TARGET decode at cache lengths 4k..64k (B*H=16*16) in CUDA graphs, vs the reference
#   ~1   one profiler pass per target row: per-kernel breakdown (forward, dQ, dK/dV, delta, diffuser steps)
#   ~55  training smoke: train.py --preset cifar on generated images (2 layers, batch 16, 100 steps) with
#        IMGGEN_BACKEND=triton (18 s) and =flex (25 s: flex compiles per layer; slot 60 s each),
#        then sample.py --num 4 (11 s)
#   rest grid rows at N=16384 (band w=1024/4096, local2d 128x128 r=3, bigbird): ours + SDPA + references
#        (1-7 s each); triton_selfcheck per pattern kind (7 kinds, bf16, D=64, ~4 s each); the N=65536 rows
#        (band x3, local2d 256x256, bigbird: 1-13 s each); flex per row (5-8 s each, the diffuser's 48-56 s:
#        one compile per shape); self-checks at D=32 (~3 s each); last, the diffuser at N=65536 (its
#        fp32 reference outlasted a 45 s slot on the H200). The default 4-minute slot ends somewhere in
#        here: the rest is listed under 'Not run' in gpu_check.md, for the longer call above.
set -uo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || PY=python
DRY=0
BUDGET=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --dry-run) DRY=1 ;;
        --budget) BUDGET="${args[i + 1]:-}" ;;
        --budget=*) BUDGET="${args[i]#--budget=}" ;;
        -h | --help) exec "$PY" bench/gpu/gpu_bench.py --help ;;
    esac
done

if [ "$DRY" = 0 ] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
    echo "gpu_check.sh: no CUDA GPU here (nvidia-smi missing or failing); run it on an H200, or run 'bash bench/gpu/gpu_check.sh --dry-run' for the CPU plumbing test"
    exit 2
fi

OUTDIR=${OUT:-bench/results}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
rm -f "$OUTDIR/smoke.log" "$OUTDIR/samples.png"
: >"$LOG"
start=$(date +%s)
if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1 TORCH_COMPILE_DISABLE=1 TORCHDYNAMO_DISABLE=1 CUDA_VISIBLE_DEVICES=
    HARD=$(( ${BUDGET%.*} + 0 > 0 ? ${BUDGET%.*} + 20 : 170 ))
else
    HARD=$(( ${BUDGET%.*} + 0 > 0 ? ${BUDGET%.*} + 12 : 232 ))
fi
{
    echo "gpu_check.sh $(date '+%F %T') args: $* (hard timeout ${HARD}s, results in $OUTDIR)"
    if [ "$DRY" = 0 ]; then
        nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
            --format=csv,noheader 2>&1 || true
    fi
} | tee -a "$LOG"

export PYTHONUNBUFFERED=1 OUT="$OUTDIR"
if command -v timeout >/dev/null 2>&1; then
    timeout -k 5 "$HARD" "$PY" bench/gpu/gpu_bench.py "$@" 2>&1 | tee -a "$LOG"
else
    "$PY" bench/gpu/gpu_bench.py "$@" 2>&1 | tee -a "$LOG"
fi
rc=${PIPESTATUS[0]}

{
    if [ -f "$OUTDIR/gpu_check.md" ]; then
        echo
        cat "$OUTDIR/gpu_check.md"
        echo
        echo "---- summary (from the top of gpu_check.md) ----"
        sed -n '1,/^## /p' "$OUTDIR/gpu_check.md" | sed '$d'
    fi
    case $rc in
        124 | 137) echo "gpu_check.sh: stopped by the hard timeout (${HARD}s); results so far are in $OUTDIR" ;;
    esac
    echo "gpu_check.sh: exit $rc after $(( $(date +%s) - start ))s; results in $OUTDIR"
} | tee -a "$LOG"
exit "$rc"
