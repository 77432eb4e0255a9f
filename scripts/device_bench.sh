#!/usr/bin/env bash
# One prepared call on a lent GPU machine (16 cores, one GPU, its own torch; wheels for the missing
# packages carried in .whl, the benchmark assets in runs/bench/flowgrpo_tiny_sd3/assets):
#  - benchmarks/grpo_iteration.py, one variant per process, each pinned to its own 2 cores with 2 threads,
#    all at once (a quiet 2-core CPU per variant);
#  - the same benchmark on the GPU (flow_grpo layout vs defaults), then benchmarks/gpu_check.py;
#  - then, on the GPU's core pair, row 7 (VAE decoder compiled, the best CPU row): 8 pairs hold rows 0-6
#    and the GPU run, so this row runs after the others (compare it with them only loosely).
# Logs go to $OUT. Usage: bash scripts/device_bench.sh [iterations]
set -u
ITER=${1:-5}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1 POSTTRAIN_CACHE=/tmp/cache
nproc; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
lscpu | grep -E "Model name|Flags" | cut -c1-200
pids=()
for v in 0 1 2 3 4 5 6; do
  c0=$((2 * v)); c1=$((2 * v + 1))
  POSTTRAIN_CACHE=/tmp/cache_$v OMP_NUM_THREADS=2 timeout 300 taskset -c $c0,$c1 python3 benchmarks/grpo_iteration.py --iterations "$ITER" --warmup 1 \
    --variants $v > "$OUT/cpu_variant_$v.log" 2>&1 &
  pids+=($!)
done
OMP_NUM_THREADS=2 timeout 150 taskset -c 14,15 python3 benchmarks/grpo_iteration.py --iterations "$ITER" --warmup 1 \
  --variants 0,3,4 --device-layouts train.device=cuda train.threads=2 > "$OUT/gpu_bench.log" 2>&1
timeout 120 taskset -c 14,15 python3 benchmarks/gpu_check.py --tokenizer .gpucheck/tokenizer --out "$OUT" > "$OUT/gpu_check.log" 2>&1
for p in "${pids[@]}"; do wait "$p"; done
POSTTRAIN_CACHE=/tmp/cache_7 OMP_NUM_THREADS=2 timeout 240 taskset -c 14,15 python3 benchmarks/grpo_iteration.py \
  --iterations "$ITER" --warmup 1 --variants 7 > "$OUT/cpu_variant_7.log" 2>&1
grep -h -E "samples/s|GFLOP|^\|" "$OUT"/cpu_variant_*.log "$OUT/gpu_bench.log" | grep -v iteration
tail -3 "$OUT/gpu_check.log"
