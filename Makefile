# Everything a fresh machine needs: `make quickstart` (the main job) and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
DEB_PACKAGES := tesseract-ocr fonts-dejavu-core
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: quickstart test test-all system venv clean-runs

# Debian packages, installed only when run as root and missing (CI runs as root).
system:
	@if [ -n "$(DEB_PACKAGES)" ] && [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	  missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi; \
	fi

# torch/torchvision first and pinned, so no dependency can pull another torch.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[all,dev]'
	@touch $@

venv: $(VENV)/.installed

quickstart: system venv
	$(VENV)/bin/posttrain pipeline configs/quickstart.yaml

# make test: every test of the core tier (tests/conftest.py); make test-all adds the long end-to-end runs.
TEST_ENV := WANDB_MODE=offline POSTTRAIN_REQUIRE_EXTRAS=1
test: system venv
	$(TEST_ENV) $(PY) -m pytest -q --durations=10 -m "not long" tests

test-all: system venv
	$(TEST_ENV) $(PY) -m pytest -q --durations=10 tests

clean-runs:
	rm -rf runs
