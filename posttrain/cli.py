"""The `posttrain` command: `posttrain pretrain CONFIG [key=value ...]`, `posttrain sample MODEL ...`.

Exit codes: 0 success, 2 config/usage error (message names the file and key), 1 run failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _pretrain(args) -> int:
    from pretrain.config import load_config
    from pretrain.trainer import PretrainConfig, train

    overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
    cfg = load_config(PretrainConfig, args.config, overrides)
    out = train(cfg)
    print(f"export: {out}")
    return 0


def _sample(args) -> int:
    import torch

    from pretrain.export import load_exported
    from pretrain.runtime.runtime import resolve_device
    from pretrain.sampling import initial_noise, sample_latents, save_grid

    device = resolve_device(args.device)
    model, encoder, codec, meta = load_exported(args.model, device=str(device))
    s = meta["sampling"]
    steps = args.steps or s["num_inference_steps"]
    scale = args.guidance_scale if args.guidance_scale is not None else s["guidance_scale"]
    embeds, null = encoder.encode(args.prompts), encoder.encode([""])
    size = meta["image_size"] // codec.downsample
    noise = initial_noise(len(args.prompts), codec.channels, size, args.seed, device=device)
    with torch.no_grad():
        latents = sample_latents(model, embeds.to(device), null.to(device), noise, steps, scale, s["shift"])
    out = args.out or os.path.join(args.model, "..", "samples", f"sample_seed{args.seed}.png")
    print(f"grid: {save_grid(codec.decode(latents), args.prompts, out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("pretrain", help="flow-matching pretraining from a YAML config")
    pre.add_argument("config")
    pre.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
    pre.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    pre.set_defaults(func=_pretrain)
    smp = sub.add_parser("sample", help="ODE-sample an exported model into a PNG grid")
    smp.add_argument("model", help="export folder written by `posttrain pretrain`")
    smp.add_argument("--prompts", nargs="+", required=True)
    smp.add_argument("--seed", type=int, default=0)
    smp.add_argument("--steps", type=int, default=None)
    smp.add_argument("--guidance-scale", type=float, default=None)
    smp.add_argument("--device", default="auto")
    smp.add_argument("--out", default=None)
    smp.set_defaults(func=_sample)
    return p


def main(argv: list[str] | None = None) -> int:
    from pretrain.config import ConfigError
    from pretrain.data.folder import DatasetError
    from pretrain.runtime.guard import NonFiniteError

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (DatasetError, FileNotFoundError, NonFiniteError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
