"""The data path's throughput against what the model step consumes, measured in one run.

Builds a shard set (OpenMoji renders as WebDataset tar shards, 32 px PNGs) and its latent cache
(`posttrain cache`), then prints:

1. the loader alone (``BatchFeed.next`` without a model: decode, resize, caption embeddings) in
   samples/s, from shards on the fly and from the cache, with 0 and 2 DataLoader workers;
2. pretraining steps of the tiny and small presets fed each way: the model's samples/s and the share
   of the step spent waiting for data, median over the steps after ``--warm``;
3. SD3.5-M's shapes, computed (no such model runs here): the samples/s one GPU consumes (from the
   transformer's FLOPs at a stated utilisation), and what feeding it costs on the fly (JPEG decode and
   resize of a 1024 px image, measured here) and from a cache (bytes read per sample).

    python benchmarks/data_loader.py [--samples 4000] [--steps 30] [--warm 5]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from pretrain.config import load_config  # noqa: E402
from pretrain.data.cache_stage import CacheConfig, cache  # noqa: E402
from pretrain.data.dataset import DataConfig, build_datasets  # noqa: E402
from pretrain.data.feed import BatchFeed  # noqa: E402
from pretrain.data.stream import sampler_for  # noqa: E402
from pretrain.text_encoder import MiniLMEncoder  # noqa: E402
from pretrain.trainer import PretrainConfig, PretrainRun  # noqa: E402
from pretrain.runtime.loop import run_stage  # noqa: E402
from tests.shard_sets import tar_set  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# SD3.5-Medium (arXiv 2403.03206; the released config): 2.5 B transformer parameters; a 1024 px image is
# 128 x 128 latents, patch 2 -> 4096 image tokens, plus 333 text tokens (CLIP-L/G 77 + T5 256).
SD35M = {"params": 2.5e9, "tokens": 4096 + 333, "latent_bytes": 16 * 128 * 128 * 2,
         "text_bytes": (333 * 4096 + 2048) * 2}  # bf16 latents and T5/CLIP states


def loader_rate(data, batch: int, workers: int, batches: int) -> float:
    feed = BatchFeed(data, sampler_for(data, 0, 1000, batch), batch, (0, batch), workers=workers)
    feed.next()  # start-up (workers, first reads) is not throughput
    t0 = time.perf_counter()
    n = sum(len(feed.next().positions) for _ in range(batches))
    return n / (time.perf_counter() - t0)


def pretrain_rates(run_dir: Path, preset_config: str, data: list[str], steps: int, warm: int) -> tuple[float, float]:
    cfg = load_config(PretrainConfig, ROOT / preset_config, [f"run_dir={run_dir}", f"train.steps={steps}",
                                                             "eval.every=0", "eval.grid_every=0", *data])
    run_stage(PretrainRun(cfg))
    rows = [json.loads(line) for line in (run_dir / "pretrain" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "data_wait_share" in r][warm:]
    return statistics.median(r["samples_per_s"] for r in rows), statistics.median(r["data_wait_share"] for r in rows)


def decode_1024_seconds(repeats: int = 5) -> float:
    """Seconds to decode a 1024 px JPEG (quality 95, noise-textured) and resize it to 1024 x 1024."""
    rng = np.random.default_rng(0)
    arr = (rng.random((1152, 1152, 3)) * 64 + np.linspace(0, 190, 1152)[:, None, None]).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=95)
    data = buf.getvalue()
    t0 = time.perf_counter()
    for _ in range(repeats):
        with Image.open(io.BytesIO(data)) as im:
            im.convert("RGB").resize((1024, 1024), Image.BICUBIC)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation for SD3.5-M")
    ap.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s of the GPU (H100 SXM)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        tar_set(d / "shards", n=a.samples, per_shard=100, size=32)
        cfg = load_config(CacheConfig, ROOT / "configs/cache/emoji_tiny.yaml",
                          [f"run_dir={d}", "data.source=shards", f"data.path={d / 'shards'}", "data.size=32"])
        t0 = time.perf_counter()
        folder = cache(cfg)
        cache_s = time.perf_counter() - t0
        encoder = MiniLMEncoder(max_length=24)
        shards, _ = build_datasets(DataConfig(source="shards", path=str(d / "shards"), size=32), encoder)
        cached, _ = build_datasets(DataConfig(source="latent_cache", path=str(folder), size=32), encoder)
        print(f"\n{a.samples} samples in {a.samples // 100} tar shards (32 px PNG); cache written in {cache_s:.1f} s\n")
        print("| loader alone (batch 32) | workers | samples/s |\n|---|---:|---:|")
        for name, data in (("shards on the fly", shards), ("latent cache", cached)):
            for workers in (0, 2):
                print(f"| {name} | {workers} | {loader_rate(data, 32, workers, 20):.0f} |")
        print("\n| pretraining step | fed from | workers | model samples/s | wait-for-data share |\n"
              "|---|---|---:|---:|---:|")
        for preset, config in (("tiny", "configs/pretrain/emoji_tiny.yaml"), ("small", "configs/pretrain/emoji_small.yaml")):
            for name, data in (("shards", ["data.source=shards", f"data.path={d / 'shards'}"]),
                               ("cache", ["data.source=latent_cache", f"data.path={folder}"])):
                for workers in (0, 2):
                    rate, share = pretrain_rates(d / f"{preset}_{name}_{workers}", config,
                                                 [*data, "data.size=32", "data.limit=null", f"data.workers={workers}"],
                                                 a.steps, a.warm)
                    print(f"| {preset} | {name} | {workers} | {rate:.0f} | {share:.1%} |")
    flops = 6 * SD35M["params"] * SD35M["tokens"]  # forward + backward per sample
    per_gpu = a.gpu_tflops * 1e12 * a.mfu / flops
    decode = decode_1024_seconds()
    print(f"\nSD3.5-M at 1024 px, computed: {flops / 1e12:.0f} TFLOP per training sample -> {per_gpu:.1f} samples/s "
          f"per GPU at {a.mfu:.0%} of {a.gpu_tflops:.0f} TFLOP/s. On the fly: JPEG decode + resize "
          f"{decode * 1e3:.0f} ms "
          f"per sample on this CPU -> {per_gpu * decode:.2f} cores per GPU (plus the VAE and text encoders on "
          f"the GPU); from a cache: {(SD35M['latent_bytes'] + SD35M['text_bytes']) / 1e6:.1f} MB per sample -> "
          f"{per_gpu * (SD35M['latent_bytes'] + SD35M['text_bytes']) / 1e6:.0f} MB/s per GPU.")


if __name__ == "__main__":
    main()
