#!/usr/bin/env bash
# The learned-reward demo on 2 CPU cores (11.6 min measured): trains the reward models, then runs
# configs/quickstart_learned_clip.yaml (pretrain -> Flow-GRPO on the A ensemble -> evaluation judged by B).
#   A: five learned_clip models on half 0 of the train emoji (seeds 0, 2, 3, 4, 5): the policy's reward.
#   B: one on half 1 (seed 1): the judge, which never saw A's half, nor the held-out prompts.
# Usage: bash scripts/learned_clip_demo.sh [--resume]   (from the repository root, venv in .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
POSTTRAIN=${POSTTRAIN:-.venv/bin/posttrain}
export HF_HUB_OFFLINE=1
for cfg in learned_clip_a learned_clip_a_seed2 learned_clip_a_seed3 learned_clip_a_seed4 learned_clip_a_seed5 learned_clip_b; do
  out=runs/reward/$cfg/model
  if [ -f "$out/model.safetensors" ]; then echo "reward model $out exists"; continue; fi
  "$POSTTRAIN" train-reward "configs/reward/$cfg.yaml"
done
"$POSTTRAIN" pipeline configs/quickstart_learned_clip.yaml "$@"
