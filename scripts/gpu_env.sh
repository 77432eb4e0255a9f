# Sourced by the prepared GPU scripts: $OUT and $PY set, the project's missing dependencies installed from the
# wheels in .whl (scripts/gpu_check_prepare.sh writes them) into /tmp/site, the offline environment exported.
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if ! "$PY" -c "import diffusers, omegaconf" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} HF_HUB_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export POSTTRAIN_CACHE=${POSTTRAIN_CACHE:-/tmp/cache}
