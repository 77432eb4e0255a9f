#!/usr/bin/env bash
# One prepared call on a lent GPU machine (after `bash scripts/gpu_check_prepare.sh` here; carry .whl):
#  - `posttrain doctor` on the GPU (one rank: the burn-in hash, its stability and time; with more GPUs
#    run it under torchrun --nproc_per_node N), timed;
#  - benchmarks/low_precision_step.py at SD3.5-Medium's shapes: bf16 against FP8 row-wise and tensor-wise,
#    eager and with torch.compile per block (step time, peak memory, MFU against the H200's 989 TFLOPS).
# Logs and JSON go to $OUT. Usage: bash scripts/gpu_health_lowp.sh [batch]
set -u
BATCH=${1:-8}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
start=$(date +%s.%N)
timeout 120 python3 -m posttrain doctor --out "$OUT/doctor" > "$OUT/doctor.log" 2>&1
echo "doctor exit $? in $(echo "$(date +%s.%N) - $start" | bc) s"; cat "$OUT/doctor.log" | tail -12
timeout 240 python3 benchmarks/low_precision_step.py --shape sd3_medium --batch "$BATCH" \
  --recipes bf16,fp8_rowwise,fp8_tensorwise --json "$OUT/lowp_eager.json" 2>&1 | tail -5
timeout 240 python3 benchmarks/low_precision_step.py --shape sd3_medium --batch "$BATCH" --compile \
  --recipes bf16,fp8_rowwise,fp8_tensorwise --json "$OUT/lowp_compile.json" 2>&1 | tail -5
