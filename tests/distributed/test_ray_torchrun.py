"""A 2-rank ``torchrun`` GRPO trainer with 2 Ray rollout workers, end to end: rank 0 drives the actors,
every rank trains its share, and the first iteration's rewards are those of a one-process colocated run
(sync mode samples exactly what the colocated path samples)."""

import pytest
import json

from tests.conftest import grpo_config, require_extra

pytestmark = pytest.mark.long

require_extra("ray", "ray")

from posttrain.grpo.stage import train as grpo_train  # noqa: E402
from tests.distributed.test_grpo_torchrun import _launch  # noqa: E402


def test_two_torchrun_ranks_train_on_two_ray_workers(tiny_export, tmp_path):
    run = tmp_path / "ray"
    proc = _launch(["grpo", "configs/grpo/emoji_tiny.yaml", f"model.pretrained={tiny_export}", f"run_dir={run}",
                    "train.steps=2", "train.threads=1", "eval.grid_prompts=4", "checkpoint.every=0",
                    "engine.name=ray", "engine.workers=2"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert "ranks: world 2" in out and "rollout engine: ray, 2 workers" in out
    records = [json.loads(line) for line in (run / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["staleness_max"] == 0 and r["worker_restarts"] == 0 for r in records)
    assert (run / "grpo" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    grpo_train(grpo_config(tmp_path / "one", tiny_export, "train.steps=1", "train.threads=1", "eval.grid_prompts=4",
                           "checkpoint.every=0"))
    one = json.loads((tmp_path / "one" / "grpo" / "metrics.jsonl").read_text().splitlines()[0])
    assert records[0]["reward_mean"] == one["reward_mean"]
