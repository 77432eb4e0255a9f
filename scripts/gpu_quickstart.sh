#!/usr/bin/env bash
# One prepared command for a lent GPU machine: the quickstart with the larger `base` preset
# (configs/quickstart_gpu.yaml: pretrain, DiffusionNFT, paired evaluation on the held-out prompts), timed.
# Needs the folders scripts/gpu_quickstart_prepare.sh writes here (.gpuqs: the text encoder; .whl: wheels
# the GPU image lacks), carried with the working tree. Output under $OUT: quickstart_gpu.log (time-stamped,
# with the guard table), both grids, the report's plots, nvidia-smi's memory readings and run_text.tgz (configs,
# metrics, the evaluation's JSON and reports).
# Usage: bash scripts/gpu_quickstart.sh [pipeline overrides]   (a CPU dry run: device=cpu and small sizes)
set -u
source "$(dirname "$0")/gpu_env.sh"
"$PY" - <<'PYEOF' || exit 1
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

src, dst = Path(".gpuqs/minilm"), Path("/tmp/minilm")
shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("model_fp16.safetensors"))
weights = load_file(src / "model_fp16.safetensors")
save_file({k: v.float() if v.is_floating_point() else v for k, v in weights.items()}, dst / "model.safetensors")
PYEOF
# Each output line (progress bars' carriage returns count as line ends) with the wall-clock time it arrived.
stamp() { "$PY" -u -c '
import re, sys, time
rest = b""
for chunk in iter(lambda: sys.stdin.buffer.read1(65536), b""):
    *lines, rest = re.split(rb"[\r\n]", rest + chunk)
    for line in filter(None, lines):
        sys.stdout.write(time.strftime("%T ") + line.decode(errors="replace") + "\n")
'; }
smi=
command -v nvidia-smi >/dev/null && { nvidia-smi --query-gpu=name,memory.used --format=csv -l 5 > "$OUT/nvidia_smi.csv" & smi=$!; }
start=$(date +%s)
timeout 520 "$PY" -m posttrain pipeline configs/quickstart_gpu.yaml \
  "stages.0.overrides=[text_encoder.path=/tmp/minilm]" "$@" 2>&1 | stamp > "$OUT/quickstart_gpu.log"
rc=${PIPESTATUS[0]}
[ -n "$smi" ] && kill "$smi" 2>/dev/null
echo "pipeline exit $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/quickstart_gpu.log"
run=runs/quickstart_gpu
[ -d "$run/grpo" ] && "$PY" -m posttrain.tools.guard_table "$run/grpo" | tee -a "$OUT/quickstart_gpu.log"
for f in eval/grid_model0.png eval/grid_model1.png report_grpo.png report_pretrain.png; do
  [ -f "$run/$f" ] && cp "$run/$f" "$OUT/"
done
tar -czf "$OUT/run_text.tgz" $(cd . && ls -d $run/*.md $run/*/*.md $run/*.yaml $run/*/*.yaml $run/*/metrics.jsonl $run/eval/eval.json 2>/dev/null)
grep -v "it/s\]$\|s/it\]$" "$OUT/quickstart_gpu.log" | tail -60
exit "$rc"
