"""A config error under `torchrun --nproc_per_node 2`: every rank exits 2 (torchrun's summary says so and
shows the error), and the message is printed once, by rank 0.

The launcher stops the other ranks (SIGTERM, exit code -15) as soon as it sees one rank fail, so a rank
that exits a moment after the first may be reported as terminated rather than as 2; what cannot happen
is a rank exiting 1 (a traceback) or none exiting 2."""

import pytest
import re

from tests.distributed.test_grpo_torchrun import _launch

pytestmark = pytest.mark.core


def test_a_config_error_exits_2_on_every_rank_and_is_printed_once(tmp_path):
    proc = _launch(["pretrain", "configs/pretrain/emoji_tiny.yaml", f"run_dir={tmp_path}", "train.stepz=1"],
                   timeout=120)
    line = "config error: command line: key 'train.stepz': Key 'stepz' not in 'RuntimeConfig'"
    full = f"{line}. Did you mean: 'steps'? (in 'train.stepz=1')"
    assert proc.stderr.splitlines().count(full) == 1, proc.stderr[-3000:]  # rank 0's line; rank 1 is silent
    codes = re.findall(r"exitcode\s*: (-?\d+)", proc.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, proc.stderr[-3000:]
    assert f"traceback : {full}" in proc.stderr  # the launcher's summary shows the error, not a link
