#!/usr/bin/env bash
# One prepared command for a GPU machine: GRPO iterations at SD3.5-Medium's shapes (random weights, 512 px,
# bf16, FSDP2 on one rank), LoRA and full fine-tuning, and a pretraining step at the same shapes
# (benchmarks/grpo_real_shapes.py under torchrun): samples/s, phase seconds, peak memory, MFU. Where
# diffusers / omegaconf are missing, their wheels in .whl (scripts/gpu_check_prepare.sh writes them).
# Output: $OUT/grpo_real_shapes.json and $OUT/grpo_real_shapes.log.
# Usage: bash scripts/gpu_real_shapes.sh [extra benchmark args, e.g. --compile]
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout 540 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/grpo_real_shapes.py \
  --shape sd3_medium --out "$OUT" "$@" > "$OUT/grpo_real_shapes.log" 2>&1
rc=$?
if [ "$rc" = 0 ]; then cat "$OUT/grpo_real_shapes.json"; else tail -30 "$OUT/grpo_real_shapes.log"; fi
exit $rc
