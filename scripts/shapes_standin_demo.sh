#!/usr/bin/env bash
# Reward hacking measured on the shapes task (docs/shapes.md): a learned stand-in for the exact judge is
# trained on the judge's scores of renders and of the quickstart model's samples, DiffusionNFT is trained
# on the stand-in while the guard watches the exact judge, and both exports are evaluated by the exact
# judge and by the stand-in on the held-out prompts. Prints, per guard check, the stand-in's score
# against the exact judge's (partial and strict) and which checks the guard failed.
# Usage: bash scripts/shapes_standin_demo.sh   (from the repository root, venv in .venv; reuses the
# quickstart's pretrain export when `make quickstart` has written it)
set -euo pipefail
cd "$(dirname "$0")/.."
POSTTRAIN=${POSTTRAIN:-.venv/bin/posttrain}
PYTHON=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1
EXPORT=runs/quickstart/pretrain/export
if [ ! -f "$EXPORT/posttrain.json" ]; then
  "$POSTTRAIN" pretrain configs/pretrain/shapes_small.yaml run_dir=runs/quickstart  # writes $EXPORT
fi
if [ ! -f runs/reward/shapes_judge/model/model.safetensors ]; then
  "$POSTTRAIN" train-reward configs/reward/shapes_judge.yaml
fi
"$POSTTRAIN" grpo configs/grpo/shapes_learned.yaml
"$POSTTRAIN" eval "$EXPORT" runs/shapes_learned/grpo/export --rewards shapes_strict shapes \
  learned_judge@runs/reward/shapes_judge/model --prompts heldout --num-prompts 192 --samples-per-prompt 2 \
  --out runs/shapes_learned/eval
"$PYTHON" -m posttrain.tools.guard_table runs/shapes_learned/grpo
