#!/usr/bin/env bash
# One GPU node, the plan's GPU checks in stages (each fits one 10-minute call; a stage after the
# first reuses what the machine kept: artifacts/, the compile cache):
#   bash benchmarks/gpu_session.sh kernels   # every attention x packing choice (6 took ~50 s each on an H100)
#   bash benchmarks/gpu_session.sh product   # product vs bench at two shapes, each half in its own process
#   bash benchmarks/gpu_session.sh plan      # configs/gpu.yaml's `all` (continues a stopped plan), its record
#   bash benchmarks/gpu_session.sh faults    # kill -9 and resume, one-process torchrun, a real CUDA OOM
# Dependencies the node lacks come as wheels in .whl/ (pip install --no-index --no-deps --target);
# results go to $OUT (default benchmarks/results/gpu-session).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu-session}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import pydantic, tenacity" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export DRAFTPORT_COMPILE_CACHE=$PWD/.draftport/compile-cache
# why a graph recompiles goes to each step's log (an H100 run recompiled at steps 19 and 26)
export TORCH_LOGS=${TORCH_LOGS:-recompiles}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" | tee -a "$OUT/gpu.txt"
case "${1:-kernels}" in
kernels)
    timeout "${SMOKE_S:-560}" python3 benchmarks/bench_train_product.py smoke ${ONLY:+--only "$ONLY"} --out "$OUT/smoke.json" > "$OUT/smoke.log" 2>&1
    grep -E "^(flash|cudnn|fa4) " "$OUT/smoke.log"
    ;;
product)
    timeout "${PRODUCT_S:-560}" python3 benchmarks/bench_train_product.py product --shapes "${SHAPES:-gpu,kimi}" \
        --steps "${STEPS:-30}" --out "$OUT/product.json" > "$OUT/product.log" 2>&1
    grep -E "^\[" "$OUT/product.log"
    ;;
plan)
    timeout "${PLAN_S:-560}" python3 benchmarks/bench_pipeline_gpu.py --runner local --no-tracking \
        --plan-timeout-s "${PLAN_TIMEOUT_S:-500}" --bench-s 40 --json "$OUT/pipeline.json" > "$OUT/plan.log" 2>&1
    tail -40 "$OUT/plan.log"
    tar czf "$OUT/logs.tgz" logs artifacts/*/metrics.json artifacts/decision 2>/dev/null  # the figures; weights stay
    ;;
faults)
    # a real CUDA OOM: Phase 2's step sized far past the card; one line naming the knob, exit 2
    printf 'phase2:\n  train: {tokens_per_step: 4000000}\n' > /tmp/oom.yaml
    python3 -m draftport.pipeline.local train_phase2 --force train_phase2 --configfile configs/gpu.yaml --configfile /tmp/oom.yaml \
        --no-tracking > "$OUT/oom.log" 2>&1
    echo "oom rc $? (2: refused in one line)"; grep -E "^error|out of GPU memory" "$OUT/oom.log" | head -3
    timeout "${FAULTS_S:-480}" python3 benchmarks/bench_gpu_resume.py --configfile configs/gpu.yaml \
        --json "$OUT/resume.json" > "$OUT/faults.log" 2>&1
    tail -30 "$OUT/faults.log"
    ;;
esac
