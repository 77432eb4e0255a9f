#!/usr/bin/env bash
# The GRPO family on the emoji pretrain export (from `configs/emoji_jpeg_hack.yaml`): Flow-GRPO-Fast, MixGRPO and DanceGRPO (configs/grpo/
# emoji_{fast,mixgrpo,dance}.yaml), then one paired held-out evaluation (same ODE seeds for every model,
# standard errors clustered by prompt) of the starting export and the three post-trained ones.
# Needs runs/emoji_jpeg_hack/pretrain/export (`posttrain pipeline configs/emoji_jpeg_hack.yaml`). Usage: bash scripts/grpo_variants.sh [VARIANT ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PT=${PT:-.venv/bin/posttrain}
BASE=runs/emoji_jpeg_hack/pretrain/export
test -f "$BASE/posttrain.json" || { echo "missing $BASE: run \`posttrain pipeline configs/emoji_jpeg_hack.yaml\` first" >&2; exit 1; }
variants=("${@:-fast mixgrpo dance}")
read -r -a variants <<< "${variants[*]}"
exports=("$BASE")
for v in "${variants[@]}"; do
  rm -rf "runs/emoji_$v"
  /usr/bin/time -f "emoji_$v: %e s, peak RSS %M KB" "$PT" grpo "configs/grpo/emoji_$v.yaml" "model.pretrained=$BASE"
  exports+=("runs/emoji_$v/grpo/export")
done
"$PT" eval "${exports[@]}" --rewards jpeg_compressibility --prompts heldout --num-prompts 128 \
  --samples-per-prompt 1 --seed 0 --steps 20 --guidance-scale 4.0 --out runs/grpo_variants_eval
