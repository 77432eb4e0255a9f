"""The core install runs without the optional packages; a feature that needs one names its extra."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ["wandb", "pytesseract", "open_clip", "imageio", "datasets"]

PROBE = f"""
import sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None  # importing it now raises ImportError, as when it is not installed
import posttrain.cli, posttrain.grpo.stage, posttrain.dpo.stage, pretrain.trainer, posttrain.eval.evaluate
from rewards.base import CompositeReward
CompositeReward({{"jpeg_compressibility": 1.0}})
from pretrain.extras import MissingExtra, require
for module, feature in (("pytesseract", "the ocr reward"), ("wandb", "wandb.mode: offline")):
    try:
        require(module, feature)
    except MissingExtra as e:
        print(e)
from pretrain.runtime.config import WandbConfig
try:
    WandbConfig(mode="offline").validate("wandb.")
except ValueError as e:
    print(e)
"""


def test_core_imports_without_optional_packages_and_names_the_extra():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "the ocr reward needs the package pytesseract, which is not installed: pip install 'posttrain[ocr]'",
        "wandb.mode: offline needs the package wandb, which is not installed: pip install 'posttrain[wandb]'",
        "wandb.mode: 'offline' needs the package wandb, which is not installed: pip install 'posttrain[wandb]'",
    ]


def test_a_missing_extra_fails_under_make_test_and_skips_elsewhere(monkeypatch):
    """``make test`` installs every extra, so a missing one is a failure naming it, not a silent skip."""
    from tests.conftest import require_extra

    monkeypatch.setenv("POSTTRAIN_REQUIRE_EXTRAS", "1")
    with pytest.raises(pytest.fail.Exception, match=r"the 'nope' extra is not installed .*pip install -e '\.\[nope\]'"):
        require_extra("no_such_module_xyz", "nope")
    monkeypatch.delenv("POSTTRAIN_REQUIRE_EXTRAS")
    with pytest.raises(pytest.skip.Exception, match="the 'nope' extra is not installed"):
        require_extra("no_such_module_xyz", "nope")
    assert require_extra("json", "core").dumps([1]) == "[1]"
