#!/usr/bin/env bash
# DDPO and Flow-GRPO on the tiny pixel-space UNet (epsilon prediction, DDPM schedule), then one paired
# held-out evaluation (same ODE seeds for every model) of the starting export and the two post-trained ones.
# Needs runs/emoji_unet/pretrain/export (`posttrain pretrain configs/pretrain/emoji_unet.yaml`).
# Usage: bash scripts/unet_variants.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PT=${PT:-.venv/bin/posttrain}
BASE=runs/emoji_unet/pretrain/export
test -f "$BASE/posttrain.json" || { echo "missing $BASE: run \`posttrain pretrain configs/pretrain/emoji_unet.yaml\` first" >&2; exit 1; }
exports=("$BASE")
for cfg in ddpo/emoji_jpeg grpo/emoji_unet_jpeg; do
  run="runs/unet_$(dirname "$cfg")_full"
  rm -rf "$run"
  /usr/bin/time -f "$cfg: %e s, peak RSS %M KB" "$PT" grpo "configs/$cfg.yaml" "model.pretrained=$BASE" "run_dir=$run"
  exports+=("$run/grpo/export")
done
"$PT" eval "${exports[@]}" --rewards jpeg_compressibility --prompts heldout --num-prompts 128 \
  --samples-per-prompt 1 --seed 0 --steps 20 --guidance-scale 4.0 --out runs/unet_variants_eval
