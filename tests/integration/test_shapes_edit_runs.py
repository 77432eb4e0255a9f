"""The editing task end to end at its cheapest: a tiny editing model (3 + 3 input channels) pretrained on
the shapes edits, one GRPO iteration whose rollouts carry the source images (its reward, the guard and the
evaluation read them: ``preserve`` refuses to score without them), an online DPO step whose pairs are
scored with them too, and `posttrain eval` with the edit judge per edit kind, each stage through the CLI
a user runs."""

import json
from pathlib import Path

import numpy as np
import pytest

from posttrain.cli import main
from posttrain.eval.report import write_report
from tests.conftest import ROOT

pytestmark = pytest.mark.core

DATA = ["data.scenes=64", "data.heldout_per_category=2"]


def test_pretrain_grpo_and_eval_on_the_editing_task(tmp_path, capsys):
    run = tmp_path / "edit"
    assert main(["pretrain", str(ROOT / "configs/pretrain/shapes_edit_small.yaml"), f"run_dir={run}",
                 "model.preset=tiny", "train.steps=2", "train.batch_size=8", "eval.every=2", "eval.heldout_samples=4",
                 "eval.grid_every=2",
                 "checkpoint.every=2", "train.threads=1", *DATA]) == 0
    export = run / "pretrain" / "export"
    assert json.loads((export / "config.json").read_text())["in_channels"] == 6
    assert main(["grpo", str(ROOT / "configs/grpo/shapes_edit.yaml"), f"run_dir={run}", f"model.pretrained={export}",
                 "train.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.batch_size=4",
                 "rollout.num_inference_steps=3", "train.batch_size=4", "guard.every=1", "guard.num_prompts=2",
                 "guard.loss_samples=4", "checkpoint.every=1", "train.threads=1", "~rewards",
                 "rewards={shapes_edit: {weight: 1.0, preserve: 0.25}}", "guard.rewards=[shapes_edit_preserved]",
                 *DATA]) == 0
    rows = [json.loads(x) for x in (run / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert any(0.0 <= r.get("guard/shapes_edit_preserved", -1) <= 1.0 for r in rows)
    # online DPO scores its samples with their sources too (the preserve term refuses to score without them)
    assert main(["dpo", str(ROOT / "configs/dpo/emoji_jpeg.yaml"), f"run_dir={run}", f"model.pretrained={export}",
                 "data.source=shapes_edit", "data.layout=reading", "train.steps=1", "train.batch_size=2",
                 "online.prompts_per_round=2", "online.samples_per_prompt=2", "online.num_inference_steps=3",
                 "online.resample_every=1", "checkpoint.every=1", "train.threads=1", "~rewards",
                 "rewards={shapes_edit: {weight: 1.0, preserve: 0.25}}",
                 "eval.grid_prompts=2", "eval.num_inference_steps=2", *DATA]) == 0
    dpo = [json.loads(x) for x in (run / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= dpo[0]["online_reward_mean"] <= 1.25
    capsys.readouterr()
    assert main(["eval", str(export), str(run / "grpo" / "export"), "--rewards", "shapes_edit_strict", "shapes_edit",
                 "shapes_edit_preserved",
                 "--prompts", "heldout", "--num-prompts", "6", "--steps", "3", "--out", str(run / "eval"),
                 "--data", "heldout_per_category=3"]) == 0  # one more held-out edit per kind than pretraining listed
    table = (run / "eval" / "report.md").read_text()
    assert "| shapes_edit_strict: colour (3 edits) |" in table and "| shapes_edit: shape (3 edits) |" in table
    assert "| shapes_edit_preserved (mean) |" in table
    # each grid shows every edit's source beside its output; the run report puts the source first in each group
    assert json.loads((run / "eval" / "eval.json").read_text())["grid_span"] == 2
    report = Path(write_report(run)["report"]).read_text()
    assert "each prompt's source image, then its models left to right" in report
    assert (run / "report_eval_grids.png").is_file()
    # `posttrain sample` edits a source image given on the command line: the grid shows it beside the output
    from PIL import Image

    source = np.zeros((20, 24, 3), np.uint8)  # another size than the export's 32 px: resized
    source[:, :12] = (215, 40, 40)
    Image.fromarray(source).save(tmp_path / "source.png")
    prompts = ["a red circle; make the red circle blue", "a red circle; turn the red circle into a square"]
    assert main(["sample", str(export), "--prompts", *prompts, "--images", str(tmp_path / "source.png"), "--steps", "2",
                 "--out", str(tmp_path / "edit.png")]) == 0
    grid = np.asarray(Image.open(tmp_path / "edit.png").convert("RGB"))
    assert grid.shape[:2] == (32 * 3 + 12, 4 * 32 * 3)  # (source, output) x 2 in one row, 3x, caption strip
    assert tuple(grid[5, 5]) == (215, 40, 40) and tuple(grid[5, 32 * 3 - 5]) == (0, 0, 0)  # the source, left half red
    capsys.readouterr()
    assert main(["sample", str(export), "--prompts", "a", "b", "c", "--images", str(tmp_path / "source.png"),
                 str(tmp_path / "source.png")]) == 2
    assert "--images: 2 files for 3 prompts" in capsys.readouterr().err
    assert main(["sample", str(export), "--prompts", prompts[0], "--steps", "2"]) == 2
    assert "give each prompt its source with --images" in capsys.readouterr().err


def test_an_editing_folder_pretrains_post_trains_and_evaluates_with_its_sources(tmp_path):
    """The same task from a user's folder (``captions.jsonl`` lines with a ``source``): pretraining reads the
    sources as conditioning images, GRPO's rollouts carry them (``preserve`` refuses to score without), and
    the evaluation scores each held-out row with its own source."""
    from PIL import Image

    from pretrain.data.dataset import DataConfig, build_datasets
    from pretrain.text_encoder import NoTextEmbeds

    train, held = build_datasets(DataConfig(source="shapes_edit", scenes=32, heldout_per_category=4, size=32,
                                            heldout_fraction=0.25, layout="reading",
                                            cache_dir=str(tmp_path / "cache")), NoTextEmbeds())
    folder, lines = tmp_path / "pairs", []
    (folder / "img").mkdir(parents=True)
    for i, (out, src, caption) in enumerate(zip([*train.images, *held.images], [*train.conditions, *held.conditions],
                                                [*train.captions, *held.captions])):
        Image.fromarray(src.permute(1, 2, 0).numpy()).save(folder / "img" / f"{i}_in.png")
        Image.fromarray(out.permute(1, 2, 0).numpy()).save(folder / "img" / f"{i}_out.png")
        lines.append(json.dumps({"file": f"img/{i}_out.png", "source": f"img/{i}_in.png", "caption": caption}))
    (folder / "captions.jsonl").write_text("\n".join(lines) + "\n")
    data = ["data.source=folder", f"data.path={folder}", "data.heldout_fraction=0.25"]
    run = tmp_path / "run"
    assert main(["pretrain", str(ROOT / "configs/pretrain/shapes_edit_small.yaml"), f"run_dir={run}",
                 "model.preset=tiny", "train.steps=2", "train.batch_size=8", "eval.every=2", "eval.heldout_samples=4",
                 "eval.grid_every=0", "checkpoint.every=2", "train.threads=1", *data]) == 0
    export = run / "pretrain" / "export"
    assert main(["grpo", str(ROOT / "configs/grpo/shapes_edit.yaml"), f"run_dir={run}", f"model.pretrained={export}",
                 "train.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.batch_size=4",
                 "rollout.num_inference_steps=3", "train.batch_size=4", "guard.every=0", "checkpoint.every=1",
                 "train.threads=1", "~rewards", "rewards={shapes_edit: {weight: 1.0, preserve: 0.25}}", *data]) == 0
    rewards = [json.loads(x) for x in (run / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert any(0.0 <= r.get("reward/shapes_edit_mean", -1) <= 1.0 for r in rewards)
    assert main(["eval", str(export), "--rewards", "shapes_edit_preserved", "--prompts", "heldout",
                 "--num-prompts", "4", "--steps", "2", "--out", str(run / "eval")]) == 0
    assert "| shapes_edit_preserved (mean) |" in (run / "eval" / "report.md").read_text()
