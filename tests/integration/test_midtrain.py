"""`posttrain midtrain` on the tiny preset: it lowers the held-out flow-matching loss of its dataset,
resumes bit for bit, and its LoRA export reproduces the in-memory model's held-out loss."""

import json

import pytest
import torch
from PIL import Image
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from posttrain.midtrain.stage import MidtrainConfig, train
from pretrain.config import ConfigError, load_config
from pretrain.data.builtin import load_openmoji
from pretrain.data.dataset import DataConfig, build_datasets
from pretrain.evaluation import heldout_loss
from pretrain.export import load_exported
from pretrain.objective import FlowConfig
from pretrain.runtime.metrics import read_metrics
from tests.conftest import ROOT

pytestmark = pytest.mark.core

EMOJI = ("red heart", "sun", "blue circle", "fire")
# Each emoji under 8 wordings: the held-out split (by a hash of the caption, a quarter) holds 8 samples
# whose images the train split also holds under other wordings, so fitting the train split must lower it.
WORDINGS = ("{}", "a {}", "{} emoji", "an icon of a {}", "the {}", "{}, flat style", "a small {}", "{} symbol")
HELDOUT_FRACTION = 0.25
HELDOUT_SAMPLES = 32  # more than the held-out split: every held-out sample counts


@pytest.fixture(scope="module")
def few_emoji(tmp_path_factory, _cache_dir):
    """A folder dataset (captions.jsonl + PNGs) of the four ``EMOJI`` rendered at 16 px, 32 samples."""
    raw = load_openmoji(DataConfig(size=16))
    root = tmp_path_factory.mktemp("few_emoji")
    rows = []
    for name in EMOJI:
        image = raw["images"][raw["captions"].index(name)].permute(1, 2, 0).numpy()
        file = name.replace(" ", "_") + ".png"
        Image.fromarray(image).save(root / file)
        rows += [{"file": file, "caption": w.format(name)} for w in WORDINGS]
    (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def midtrain_config(run_dir, export, data, *overrides):
    return load_config(MidtrainConfig, ROOT / "configs/midtrain/emoji_tiny.yaml",
                       [f"run_dir={run_dir}", f"model.pretrained={export}", "data.source=folder", f"data.path={data}",
                        f"data.heldout_fraction={HELDOUT_FRACTION}", f"eval.heldout_samples={HELDOUT_SAMPLES}",
                        *overrides])


def export_heldout_loss(export, data) -> float:
    """Held-out loss of an export folder on ``data``'s held-out split, with the stage's fixed draws."""
    model, encoder, codec, meta = load_exported(export)
    _, held = build_datasets(DataConfig(source="folder", path=str(data), size=meta["image_size"],
                                        heldout_fraction=HELDOUT_FRACTION), encoder)
    assert len(held) == 8 and len(set(held.captions)) == 8
    return heldout_loss(model, codec, held, encoder.encode([""]), FlowConfig(objective=meta["objective"]), seed=0,
                        num_samples=HELDOUT_SAMPLES, device="cpu")


def test_midtrain_lowers_the_heldout_loss_of_its_dataset(tiny_export, few_emoji, tmp_path):
    out = train(midtrain_config(tmp_path, tiny_export, few_emoji, "policy.lora_rank=0", "optim.lr=1e-3",
                                "train.steps=30", "eval.every=10", "checkpoint.every=30"))
    before, after = export_heldout_loss(tiny_export, few_emoji), export_heldout_loss(out, few_emoji)
    print(f"held-out loss: start {before:.4f} -> after 30 steps {after:.4f}")
    assert after < 0.8 * before
    rows = read_metrics(tmp_path / "midtrain/metrics.jsonl")
    assert rows[0] == {"step": 0, "heldout_loss": pytest.approx(before, rel=1e-5)}  # the start, logged first
    assert [r["step"] for r in rows if "heldout_loss" in r] == [0, 10, 20, 30]
    assert all({"loss", "grad_norm", "lr", "samples_per_s"} <= set(r) for r in rows[1:])
    assert rows[-1]["heldout_loss"] == pytest.approx(after, rel=1e-5)
    run = tmp_path / "midtrain"
    assert not (run / "lora").exists()  # full fine-tuning: no adapter
    assert sorted(p.name for p in (run / "samples").glob("*.png")) == [
        "heldout_step_000010.png", "heldout_step_000020.png", "heldout_step_000030.png"]
    assert json.loads((out / "posttrain.json").read_text())["objective"] == "rectified_flow"


def test_midtrain_resume_is_bitwise_identical(tiny_export, few_emoji, tmp_path):
    args = ("train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=5")
    train(midtrain_config(tmp_path / "a", tiny_export, few_emoji, *args))
    train(midtrain_config(tmp_path / "b", tiny_export, few_emoji, "train.steps=2", *args[1:]))
    train(midtrain_config(tmp_path / "b", tiny_export, few_emoji, *args, "checkpoint.resume=true"))
    states = []
    for run in ("a", "b"):
        assert sorted(p.name for p in (tmp_path / run / "midtrain/checkpoints").glob("step_*")) == ["step_2", "step_4"]
        dcp_to_torch_save(tmp_path / run / "midtrain/checkpoints/step_4", tmp_path / f"{run}.pt")
        states.append(torch.load(tmp_path / f"{run}.pt", weights_only=False))
    a, b = states
    assert any("lora_B" in k for k in a["model"]) and not any("base_layer" in k for k in a["model"])
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys()
    for k in a["optim"]["state"]:
        assert all(torch.equal(a["optim"]["state"][k][s], b["optim"]["state"][k][s]) for s in ("exp_avg", "exp_avg_sq"))
    la = [(r["step"], r.get("loss"), r.get("heldout_loss")) for r in read_metrics(tmp_path / "a/midtrain/metrics.jsonl")]
    lb = [(r["step"], r.get("loss"), r.get("heldout_loss")) for r in read_metrics(tmp_path / "b/midtrain/metrics.jsonl")]
    assert la == lb and len(la) == 5  # step 0 (the start's held-out loss) + 4 steps


def test_lora_midtrain_exports_what_it_trained(tiny_export, few_emoji, tmp_path):
    out = train(midtrain_config(tmp_path, tiny_export, few_emoji, "train.steps=4", "eval.every=0"))
    run = tmp_path / "midtrain"
    assert {p.name for p in (run / "lora").iterdir()} >= {"pytorch_lora_weights.safetensors"}
    rows = read_metrics(run / "metrics.jsonl")
    in_memory = rows[-1]["heldout_loss"]  # evaluated on the LoRA model at the last step
    assert rows[-1]["step"] == 4 and in_memory != rows[0]["heldout_loss"]
    assert export_heldout_loss(out, few_emoji) == pytest.approx(in_memory, rel=1e-5, abs=1e-6)


def test_a_flow_objective_other_than_the_exports_is_refused(tiny_export, few_emoji, tmp_path):
    with pytest.raises(ConfigError, match=r"^flow\.objective: 'epsilon' differs from 'rectified_flow'"):
        train(midtrain_config(tmp_path, tiny_export, few_emoji, "flow.objective=epsilon"))
    (tmp_path / "prompts.txt").write_text("a red heart\na sun\n")
    with pytest.raises(ConfigError, match=r"data\.source: 'prompts' has no images"):
        midtrain_config(tmp_path, tiny_export, few_emoji, "data.source=prompts", f"data.path={tmp_path / 'prompts.txt'}")


def test_the_guard_watches_midtraining(tiny_export, few_emoji, tmp_path):
    train(midtrain_config(tmp_path, tiny_export, few_emoji, "train.steps=4", "eval.every=0", "guard.every=2",
                          "guard.rewards=[jpeg_compressibility]", "guard.num_prompts=4", "guard.num_inference_steps=4",
                          f"guard.loss_samples={HELDOUT_SAMPLES}"))
    rows = read_metrics(tmp_path / "midtrain/metrics.jsonl")
    checks = [r for r in rows if "guard/loss" in r]
    assert [r["step"] for r in checks] == [0, 2, 4] and all("guard/jpeg_compressibility" in r for r in checks)
    # the guard's loss probe and the stage's held-out loss are one measurement (same split, seed, objective)
    assert checks[0]["guard/loss"] == pytest.approx(rows[0]["heldout_loss"], rel=1e-6)
    assert checks[-1]["guard/loss"] == pytest.approx(rows[-1]["heldout_loss"], rel=1e-6)
