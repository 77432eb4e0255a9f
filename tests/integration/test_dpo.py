"""Diffusion-DPO on the tiny preset: reference frozen, online and offline pairs, resume, bad rows."""

import io
import json

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from posttrain.dpo import step as dpo_mod
from posttrain.dpo.stage import train as dpo_train
from posttrain.dpo.data import load_preference_pairs
from posttrain.eval.evaluate import EvalConfig, evaluate, paired_stats
from posttrain.base.policy import Policy
from pretrain.data.builtin import load_openmoji
from pretrain.data.dataset import DataConfig
from pretrain.data.folder import DatasetError
from pretrain.runtime.metrics import read_metrics
from rewards.base import REGISTRY, register
from tests.conftest import dpo_config

pytestmark = pytest.mark.core

if "test_brightness" not in REGISTRY:
    @register("test_brightness")
    def _brightness():
        return lambda images, prompts=None, metadata=None: images.float().mean(dim=(1, 2, 3))


def test_reference_never_changes_during_training(tiny_export, tmp_path, monkeypatch):
    outputs = []
    probe = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    orig_init = Policy.__init__

    def init(self, model, cfg):
        orig_init(self, model, cfg)
        outputs.append(self)

    monkeypatch.setattr(Policy, "__init__", init)
    orig_step = dpo_mod.Runtime.optimizer_step
    refs = []

    def step(self, loss_value):
        out = orig_step(self, loss_value)
        pol = outputs[0]
        from pretrain.text_encoder import PromptEmbeds

        e = PromptEmbeds(torch.zeros(2, 24, 384), torch.zeros(2, 384))
        with torch.no_grad(), pol.reference() as ref:
            refs.append(ref(probe, torch.tensor([0.5, 0.9]), e).clone())
        with torch.no_grad():
            refs.append(pol.model(probe, torch.tensor([0.5, 0.9]), e).clone())
        return out

    monkeypatch.setattr(dpo_mod.Runtime, "optimizer_step", step)
    for rank in (4, 0):  # LoRA (adapters disabled) and full fine-tune (frozen copy)
        refs.clear()
        outputs.clear()
        dpo_train(dpo_config(tmp_path / f"r{rank}", tiny_export, "train.steps=3", f"policy.lora_rank={rank}",
                             "online.resample_every=3", "checkpoint.every=3"))
        ref_outs, pol_outs = refs[0::2], refs[1::2]
        assert all(torch.equal(ref_outs[0], r) for r in ref_outs[1:]), rank
        assert not torch.equal(pol_outs[0], pol_outs[-1])  # the policy did move


def test_online_dpo_raises_a_deterministic_reward_on_heldout_prompts(tiny_export, tmp_path):
    cfg = dpo_config(tmp_path, tiny_export, "rewards.jpeg_compressibility=0", "rewards.test_brightness=1.0",
                     "train.steps=20", "online.resample_every=5", "checkpoint.every=10", "optim.lr=5e-3",
                     "online.guidance_scale=1.0", "online.samples_per_prompt=6", "dpo.beta=750")
    export = dpo_train(cfg)
    res = evaluate([str(tiny_export), str(export)], EvalConfig(rewards=["test_brightness"], num_prompts=24,
                   samples_per_prompt=2, num_inference_steps=6, guidance_scale=1.0, guard_samples=0,
                   grid_prompts=4), tmp_path / "eval", data=DataConfig(limit=256))
    before, after = res["rewards"]["test_brightness"]
    diff, se, _ = paired_stats(before, after)
    print(f"\nonline DPO, brightness on held-out prompts: {before.mean():.4f} -> {after.mean():.4f} "
          f"(paired {diff:+.4f} +/- {se:.4f})")
    assert diff > 3 * se and diff > 0.005


def _png(array) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _emoji_pairs(n: int, seed: int = 0) -> list[dict]:
    """Pick-a-Pic rows from rendered emoji; rule: the clean emoji beats its colour-inverted copy."""
    raw = load_openmoji(DataConfig(size=16))
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in torch.randperm(len(raw["captions"]), generator=g)[:n].tolist():
        img = raw["images"][i].permute(1, 2, 0).numpy()
        clean, bad = _png(img), _png(255 - img)
        first = bool(torch.rand((), generator=g) < 0.5)
        rows.append({"caption": raw["captions"][i], "jpg_0": clean if first else bad,
                     "jpg_1": bad if first else clean, "label_0": 1.0 if first else 0.0})
    return rows


def _write_parquet(rows, path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def test_offline_dpo_raises_heldout_implicit_accuracy(tiny_export, tmp_path, capsys):
    _write_parquet(_emoji_pairs(160), tmp_path / "pairs.parquet")
    export = dpo_train(dpo_config(tmp_path, tiny_export, "source=offline", f"offline.path={tmp_path / 'pairs.parquet'}",
                                  "offline.heldout_fraction=0.25", "train.steps=30", "train.batch_size=16",
                                  "checkpoint.every=0", "optim.lr=5e-3"))
    recs = [r for r in read_metrics(tmp_path / "dpo/metrics.jsonl") if "heldout_implicit_acc" in r]
    first, last = recs[0]["heldout_implicit_acc"], recs[-1]["heldout_implicit_acc"]
    with capsys.disabled():
        print(f"\noffline DPO held-out implicit accuracy: {first:.3f} -> {last:.3f}")
    assert first == 0.5  # policy == reference: every inside term is 0, a tie
    assert last >= 0.75
    assert (export / "posttrain.json").is_file() and (tmp_path / "dpo/lora/pytorch_lora_weights.safetensors").is_file()


def test_winner_equal_to_loser_gives_zero_inside_term(tiny_export, tmp_path):
    """Winner and loser share noise, sigma and prompt: identical images give inside == 0 exactly,
    even for a policy that differs from its reference."""
    from posttrain.dpo.stage import DPOLossConfig
    from posttrain.dpo.step import pair_errors
    from posttrain.dpo.data import PairSet
    from posttrain.objectives.dpo_loss import dpo_inside_term
    from posttrain.base.policy import PolicyConfig
    from pretrain.export import load_exported

    model, encoder, codec, _ = load_exported(tiny_export)
    policy = Policy(model, PolicyConfig(lora_rank=4, lora_alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    imgs = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    caps = ["a", "b", "c", "d"]
    pairs = PairSet(imgs, imgs.clone(), caps, encoder.encode(caps), torch.ones(4))
    null = encoder.encode([""])
    with torch.no_grad():
        draw = dict(seed=0, step=3, offset=0, device="cpu")
        (ew, el), = pair_errors(model, codec, pairs, DPOLossConfig(), null, **draw)
        with policy.reference() as ref:
            (rw, rl), = pair_errors(ref, codec, pairs, DPOLossConfig(), null, **draw)
    assert not torch.equal(ew, rw)  # the policy differs from the reference
    assert torch.equal(dpo_inside_term(ew, el, rw, rl, 750.0), torch.zeros(4))


def test_malformed_rows_are_skipped_and_ties_configurable(tmp_path, caplog):
    rows = _emoji_pairs(4)
    rows[1]["jpg_0"] = b"not an image"
    rows[2]["label_0"] = 2.0
    rows.append({"caption": "", "jpg_0": rows[0]["jpg_0"], "jpg_1": rows[0]["jpg_1"], "label_0": 1.0})
    rows.append({"caption": "a tie", "jpg_0": rows[0]["jpg_0"], "jpg_1": rows[0]["jpg_1"], "label_0": 0.5})
    _write_parquet(rows, tmp_path / "p.parquet")
    w, lo, caps, pref, skipped = load_preference_pairs(tmp_path / "p.parquet", 16, ties="drop")
    assert len(caps) == 2 and pref.tolist() == [1.0, 1.0]
    assert skipped == {"missing or unreadable image": ["row 1"], "label_0 not in {0, 0.5, 1}": ["row 2"],
                       "empty caption": ["row 4"], "tie (offline.ties=drop)": ["row 5"]}
    assert "unreadable" in caplog.text
    # winners are the clean emoji (lighter than their inverted copies on a white background)
    assert (w.float().mean(dim=(1, 2, 3)) > lo.float().mean(dim=(1, 2, 3))).all()
    _, _, caps, pref, _ = load_preference_pairs(tmp_path / "p.parquet", 16, ties="half")
    assert caps[-1] == "a tie" and pref[-1].item() == 0.5
    # jsonl with image paths relative to the file
    (tmp_path / "a.png").write_bytes(rows[0]["jpg_0"])
    (tmp_path / "b.png").write_bytes(rows[0]["jpg_1"])
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"caption": "x", "jpg_0": "a.png", "jpg_1": "b.png",
                                                      "label_0": 0}) + "\n")
    (tmp_path / "p.parquet").unlink()
    w2, lo2, _, _, _ = load_preference_pairs(tmp_path, 16)
    # label_0 = 0: b.png (rows[0]["jpg_1"]) wins
    assert torch.equal(w2[0], lo[0] if rows[0]["label_0"] == 1.0 else w[0])
    _write_parquet([rows[1]], tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match="no usable"):
        load_preference_pairs(tmp_path / "bad.parquet", 16)


def test_offline_dpo_resume_is_bitwise_identical(tiny_export, tmp_path):
    _write_parquet(_emoji_pairs(32), tmp_path / "pairs.parquet")
    args = ("source=offline", f"offline.path={tmp_path / 'pairs.parquet'}", "train.steps=4", "checkpoint.every=2",
            "checkpoint.keep_last=5", "train.batch_size=4")
    dpo_train(dpo_config(tmp_path / "a", tiny_export, *args))
    dpo_train(dpo_config(tmp_path / "b", tiny_export, *args[:2], "train.steps=2", *args[3:]))
    dpo_train(dpo_config(tmp_path / "b", tiny_export, *args, "checkpoint.resume=true"))
    states = []
    for run in ("a", "b"):
        dcp_to_torch_save(tmp_path / run / "dpo/checkpoints/step_4", tmp_path / f"{run}.pt")
        states.append(torch.load(tmp_path / f"{run}.pt", weights_only=False))
    a, b = states
    assert a["model"].keys() == b["model"].keys() and len(a["model"]) > 0
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["stateful"]["pairs"] == b["stateful"]["pairs"]
