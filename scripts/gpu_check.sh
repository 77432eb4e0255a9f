#!/usr/bin/env bash
# One prepared command for a GPU machine: a 1-rank NCCL, FSDP2-sharded, bf16 GRPO step of the tiny preset
# (benchmarks/fsdp_grpo_step.py under torchrun), printing step time and peak memory as one JSON line.
# Needs .gpucheck/tokenizer (MiniLM tokenizer files; the encoder itself is random) and, where diffusers /
# omegaconf are missing (the lent machine: Python 3.12, torch 2.11), their wheels in .whl (installed into
# /tmp/site, as scripts/device_bench.sh does). Output also in $OUT/fsdp_grpo_step.json and $OUT/gpu_check.log.
# Usage: bash scripts/gpu_check.sh            # CUDA + NCCL
#        bash scripts/gpu_check.sh cpu        # CPU + gloo dry run of the same path (a machine without CUDA)
set -u
MODE=${1:-cuda}
source "$(dirname "$0")/gpu_env.sh"
if [ "$MODE" = cpu ]; then DEV=(--device cpu --backend gloo); else DEV=(--device cuda --backend nccl); fi
timeout 540 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/fsdp_grpo_step.py \
  --tokenizer .gpucheck/tokenizer --out "$OUT" "${DEV[@]}" > "$OUT/gpu_check.log" 2>&1
rc=$?
if [ "$rc" = 0 ] && [ -f "$OUT/fsdp_grpo_step.json" ]; then cat "$OUT/fsdp_grpo_step.json"; else tail -30 "$OUT/gpu_check.log"; fi
exit $rc
