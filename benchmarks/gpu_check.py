"""GPU check of the CUDA code paths, timed, in one call (the CPU tests cover the same paths at tiny size).

Needs no downloads: a random MiniLM-shaped BERT built around the real tokenizer files (``--tokenizer``)
and a generated shapes dataset stand in for the packaged encoder and OpenMoji. Prints one JSON object
and writes it to ``--out/gpu_check.json``:

- pretrain (tiny preset, 32 px) in fp32 / bf16 / fp16 on CUDA: held-out loss first -> last, s/step;
- exact resume on CUDA: 4 steps straight vs 2 + resume + 2, largest weight difference;
- GRPO: rollout vs training-time log-prob difference (fp32 and bf16 autocast), GRPO iteration time;
- small preset: pretraining steps/s at batch 64 in fp32 and bf16.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch


def make_encoder(tokenizer_dir: Path, out: Path) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=384, num_hidden_layers=2, num_attention_heads=6,
                         intermediate_size=768)).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def make_shapes(out: Path, size: int = 32) -> Path:
    from PIL import Image, ImageDraw

    colors = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 60, 220), "yellow": (240, 200, 20),
              "black": (10, 10, 10), "purple": (140, 40, 170), "orange": (250, 130, 20), "cyan": (20, 200, 220)}
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for cname, rgb in colors.items():
        for shape in ("circle", "square", "triangle", "bar"):
            for pos, (cx, cy) in {"left": (9, 16), "right": (23, 16), "top": (16, 9), "bottom": (16, 23)}.items():
                for scale, r in (("small", 5), ("large", 9)):
                    im = Image.new("RGB", (size, size), "white")
                    d = ImageDraw.Draw(im)
                    box = (cx - r, cy - r, cx + r, cy + r)
                    if shape == "circle":
                        d.ellipse(box, fill=rgb)
                    elif shape == "square":
                        d.rectangle(box, fill=rgb)
                    elif shape == "triangle":
                        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=rgb)
                    else:
                        d.rectangle((cx - r, cy - 2, cx + r, cy + 2), fill=rgb)
                    name = f"{cname}_{shape}_{pos}_{scale}.png"
                    im.save(out / name)
                    rows.append({"file": name, "caption": f"a {scale} {cname} {shape} at the {pos}"})
    (out / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/gpu_check")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies step counts (0.05 for a CPU dry run)")
    args = ap.parse_args()
    from pretrain.config import load_config
    from pretrain.runtime.metrics import read_metrics
    from pretrain.trainer import PretrainConfig, train

    work, out = Path(args.work), Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    enc = make_encoder(Path(args.tokenizer), work / "encoder")
    data = make_shapes(work / "shapes")
    dev = args.device
    res: dict = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else dev, "torch": torch.__version__}

    def n(steps: int) -> int:
        return max(2, int(steps * args.scale))
    base = ["data.source=folder", f"data.path={data}", "data.size=32", "data.heldout_fraction=0.2", "data.limit=null",
            f"data.cache_dir={work / 'cache'}", f"text_encoder.path={enc}", f"train.device={dev}", "train.threads=null"]

    def pre(run, *extra):
        cfg = load_config(PretrainConfig, "configs/pretrain/emoji_tiny.yaml", [f"run_dir={work / run}", *base, *extra])
        t0 = time.perf_counter()
        export = train(cfg)
        held = [r["heldout_loss"] for r in read_metrics(work / run / "pretrain/metrics.jsonl") if "heldout_loss" in r]
        return export, held, time.perf_counter() - t0

    for p in ("fp32", "bf16", "fp16"):
        _, held, secs = pre(f"pre_{p}", f"train.precision={p}", f"train.steps={n(150)}", f"eval.every={n(150)}")
        res[f"pretrain_tiny_{p}"] = {"heldout_first": held[0], "heldout_last": held[-1], "wall_s": round(secs, 1)}

    resume = ["train.steps=4", "train.grad_accum=2", "train.ema_decay=0.9", "checkpoint.every=2", "eval.every=0"]
    exp_a, _, _ = pre("resume_a", *resume)
    pre("resume_b", *resume[:-2], "checkpoint.every=2", "eval.every=0", "train.steps=2")
    exp_b, _, _ = pre("resume_b", *resume, "checkpoint.resume=true")
    from safetensors.torch import load_file

    wa, wb = (load_file(Path(e) / "diffusion_pytorch_model.safetensors") for e in (exp_a, exp_b))
    res["resume_max_abs_diff_cuda"] = max(float((wa[k] - wb[k]).abs().max()) for k in wa)

    export = work / "pre_fp32/pretrain/export"
    res.update(grpo_checks(export, base, work, dev, n(4)))

    for p in ("fp32", "bf16"):
        _, _, secs = pre(f"small_{p}", "model.preset=small", "train.batch_size=64", f"train.precision={p}",
                         f"train.steps={n(200)}", "eval.every=0")
        res[f"pretrain_small_{p}_steps_per_s_incl_startup"] = round(n(200) / secs, 2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


def grpo_checks(export: Path, base: list[str], work: Path, device: str, iterations: int) -> dict:
    from posttrain.grpo.stage import GRPOConfig, train as grpo_train
    from posttrain.base.policy import Policy, PolicyConfig
    from pretrain.config import load_config
    from pretrain.data.dataset import DataConfig, build_datasets
    from pretrain.export import load_exported
    from pretrain.runtime.metrics import read_metrics
    from pretrain.schedule import sigma_schedule
    from rollout.config import RolloutConfig
    from rollout.sampler import Sampler, log_prob

    dev = torch.device(device)
    model, encoder, codec, meta = load_exported(export, device=device)
    encoder_path = [b for b in base if b.startswith("text_encoder.path=")][0].split("=", 1)[1]
    from pretrain.text_encoder import MiniLMEncoder

    encoder = MiniLMEncoder(path=encoder_path)
    data_path = [b for b in base if b.startswith("data.path=")][0].split("=", 1)[1]
    train_set, _ = build_datasets(DataConfig(source="folder", path=data_path, size=32, heldout_fraction=0.2,
                                             cache_dir=str(work / "cache")), encoder)
    null = encoder.encode([""]).to(dev)
    torch.manual_seed(0)
    Policy(model, PolicyConfig(lora_rank=4, lora_alpha=8))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    model.eval()
    steps, scale, noise = 10, 4.5, 0.7
    sampler = Sampler(RolloutConfig(noise_level=noise, guidance_scale=scale, group_size=4, batch_size=16),
                      sigma_schedule(steps, 3.0), null)
    traj = sampler.rollout(model, codec, train_set, list(range(8)), latent_shape=(3, 32, 32), seed=0, iteration=0,
                           device=dev)
    model.train()
    out = {}
    for name, ctx in (("fp32", torch.autocast(dev.type, enabled=False)),
                      ("bf16", torch.autocast(dev.type, torch.bfloat16))):
        worst = 0.0
        with torch.no_grad(), ctx:
            for start in (0, 12, 24):
                mb = traj.select(torch.arange(start, start + 8 if start < 24 else 32))
                for t in range(steps):
                    new = log_prob(model, mb, t).log_prob
                    assert torch.isfinite(new).all()
                    worst = max(worst, float((new - mb.log_probs[:, t]).abs().max()))
        out[f"grpo_logprob_max_abs_diff_{name}"] = worst
    out.update(first_ratio_drift(export, base, work))
    run = work / "grpo"
    cfg = load_config(GRPOConfig, "configs/grpo/emoji_tiny.yaml", [
        f"run_dir={run}", f"model.pretrained={export}", *[b for b in base if not b.startswith(("data.size", "text_encoder."))],
        f"train.steps={iterations}", "rollout.num_inference_steps=10", "rollout.prompts_per_step=8", "rollout.group_size=8",
        "rollout.batch_size=64", "train.batch_size=32"])
    t0 = time.perf_counter()
    grpo_train(cfg)
    recs = read_metrics(run / "grpo/metrics.jsonl")
    out["grpo_tiny_iteration_s"] = [round(r["time_rollout_s"] + r["time_decode_s"] + r["time_reward_wait_s"] + r["time_train_s"], 3) for r in recs]
    out["grpo_tiny_wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def first_ratio_drift(export: Path, base: list[str], work: Path) -> dict:
    """bf16 GRPO, one iteration whose every mini-batch comes before the optimizer step (rollout batches
    of 32, training mini-batches of 8, accumulation 4): the largest |ratio - 1| with the rollout's
    log-probs against ``grpo.old_log_prob: recompute``, and the recomputation's cost."""
    from posttrain.grpo.stage import GRPOConfig, GRPORun
    from pretrain.config import load_config

    out = {}
    for old in ("rollout", "recompute"):
        cfg = load_config(GRPOConfig, "configs/grpo/emoji_tiny.yaml", [
            f"run_dir={work / ('drift_' + old)}", f"model.pretrained={export}",
            *[b for b in base if not b.startswith(("data.size", "text_encoder."))], "train.precision=bf16",
            "rollout.num_inference_steps=10", "rollout.prompts_per_step=8", "rollout.group_size=4",
            "rollout.batch_size=32", "train.batch_size=8", "train.grad_accum=4", "perf.reuse_rollout_uncond=false",
            f"grpo.old_log_prob={old}", "train.steps=1", "checkpoint.every=0", "eval.every=0"])
        m = GRPORun(cfg).train_step()
        out[f"grpo_bf16_first_ratio_drift_{old}"] = max(abs(m["ratio_max"] - 1), abs(m["ratio_min"] - 1))
        out[f"grpo_bf16_time_old_log_prob_s_{old}"] = round(m.get("time_old_log_prob_s", 0.0), 4)
        out[f"grpo_bf16_time_train_s_{old}"] = round(m["time_train_s"], 4)
    return out


if __name__ == "__main__":
    main()
