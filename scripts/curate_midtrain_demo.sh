#!/usr/bin/env bash
# Data and safety stages on 2 CPU cores: trains learned_clip reward model A (if missing), then runs
# configs/pipeline_curate_midtrain.yaml (pretrain -> curate -> midtrain -> Flow-GRPO with the guard ->
# evaluation). Usage: bash scripts/curate_midtrain_demo.sh [--resume]   (repository root, venv in .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
POSTTRAIN=${POSTTRAIN:-.venv/bin/posttrain}
export HF_HUB_OFFLINE=1
if [ ! -f runs/reward/learned_clip_a/model/model.safetensors ]; then
  "$POSTTRAIN" train-reward configs/reward/learned_clip_a.yaml
fi
"$POSTTRAIN" pipeline configs/pipeline_curate_midtrain.yaml "$@"
