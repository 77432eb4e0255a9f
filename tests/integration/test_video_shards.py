"""Video clips in tar shards: frame sampling by stride or fps from the middle of the clip, short and
corrupt clips skipped and counted, and a video family pretrained from the shards."""

import numpy as np
import pytest
import torch

from pretrain.data.dataset import DataConfig, build_datasets
from pretrain.data.feed import BatchFeed
from pretrain.data.shards import BadSample, ClipSampling
from pretrain.data.stream import sampler_for
from pretrain.runtime.metrics import read_metrics
from pretrain.text_encoder import NoTextEmbeds
from tests.conftest import ROOT
from tests.shard_sets import mp4, video_set

pytestmark = pytest.mark.core


def ramp(n: int = 20, size: int = 16) -> np.ndarray:
    """``n`` uniform grey frames, frame i at intensity 10 * i (a clip whose frames say their index)."""
    return np.stack([np.full((size, size, 3), 10 * i, np.uint8) for i in range(n)])


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    samples = [(f"r{i:03d}", mp4(ramp()), "a ramp") for i in range(8)]
    samples += [("short", mp4(ramp(5)), "too short"),
                ("broken", b"\x00\x00\x00\x18ftypmp42" + b"\x01" * 200, "corrupt")]
    import webdataset as wds

    with wds.ShardWriter(str(d / "clips-%06d.tar"), maxcount=100, verbose=0) as sink:
        for key, data, caption in samples:
            sink.write({"__key__": key, "mp4": data, "txt": caption})
    return d


def _set(folder, **kw):
    # the keys' hash decides the held-out split; 0.2 keeps a few out and the rest in training
    train, _ = build_datasets(DataConfig(source="shards", path=str(folder), size=16, heldout_fraction=0.2, **kw),
                              NoTextEmbeds())
    return train


@pytest.mark.parametrize("frames,stride,fps,picked", [
    (4, 3, None, [5, 8, 11, 14]),   # need 10 of 20 frames: start (20 - 10) // 2 = 5
    (4, 1, 5.0, [6, 8, 10, 12]),    # 10 fps source, 5 fps wanted: stride 2, need 7, start 6
    (5, 4, None, [1, 5, 9, 13, 17]),  # need 17: start 1
])
def test_clips_give_the_frames_of_the_stride_or_fps_from_the_middle(clips, frames, stride, fps, picked):
    train = _set(clips, frames=frames, frame_stride=stride, fps=fps)
    ramps = [j for j in range(len(train)) if train.where(j)[1].startswith("r")]
    video, caption, _ = train.get(ramps[0])
    assert video.shape == (frames, 3, 16, 16) and video.dtype == torch.uint8 and caption == "a ramp"
    means = video.float().mean(dim=(1, 2, 3))
    assert torch.allclose(means, 10 * torch.tensor(picked, dtype=torch.float32), atol=3)  # H.264 keeps a flat grey


def test_short_and_corrupt_clips_are_skipped_with_their_reason(clips):
    train = _set(clips, frames=4)
    train.clip = ClipSampling(frames=8, stride=3)  # needs 22 frames: every clip is short
    reasons = {}
    for j in range(len(train)):
        with pytest.raises(BadSample) as e:
            train.get(j)
        reasons[e.value.key] = e.value.reason.split(" (")[0]
    assert set(reasons.values()) <= {"clip too short", "corrupt video"}
    assert reasons.get("broken", "corrupt video") == "corrupt video"
    assert reasons.get("short", "clip too short") == "clip too short"
    train = _set(clips, frames=6, frame_stride=1)  # the 5-frame clip is short, the 20-frame ones are not
    feed = BatchFeed(train, sampler_for(train, 0, 4, len(train)), len(train), (0, len(train)), workers=1)
    fed = feed.next()
    assert fed.images.shape[1:] == (6, 3, 16, 16)
    assert {k for _, k, _ in fed.skipped} == {"short", "broken"} & {train.where(j)[1] for j in range(len(train))}


@pytest.mark.long  # make test reads clip shards back below and trains from an image cache (test_latent_cache.py)
def test_a_video_family_pretrains_from_clip_shards(tmp_path):
    from pretrain.config import load_config
    from pretrain.trainer import PretrainConfig, train

    video_set(tmp_path / "clips", n=48, frames=8)
    cfg = load_config(PretrainConfig, ROOT / "configs/pretrain/moving_emoji_tiny.yaml",
                      [f"run_dir={tmp_path / 'run'}", "data.source=shards", f"data.path={tmp_path / 'clips'}",
                       "data.frames=4", "data.frame_stride=2", "data.limit=null", "train.steps=3", "eval.every=3",
                       "eval.grid_every=0", "eval.heldout_samples=4"])
    train(cfg)
    rows = read_metrics(tmp_path / "run" / "pretrain" / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses)) and all(r.get("data_skipped", 0) == 0 for r in rows)


def test_curate_scores_video_clips_and_writes_mp4_shards_that_read_back(tmp_path):
    """Moving-emoji clips scored by the motion-direction reward (the caption's direction against the
    measured motion), the top half kept, written as mp4 shards, read back as a video shard set."""
    from posttrain.curate.stage import CurateConfig, curate
    from pretrain.config import load_config

    cfg = load_config(CurateConfig, None, [f"run_dir={tmp_path}", "data.source=moving_emoji", "data.size=16",
                                           "data.frames=4", "data.limit=48", "rewards={motion_direction: 1.0}",
                                           "filters=[{reward: total, top_fraction: 0.5}]", "dedup.method=none",
                                           "shard_size=8"])
    curate(cfg)
    out = tmp_path / "curate" / "data"
    manifest = __import__("json").loads((out / "curate.json").read_text())
    assert manifest["samples"] == 24 and len(list(out.glob("*.tar"))) == 3
    train, held = build_datasets(DataConfig(source="shards", path=str(out), size=16, frames=4, heldout_fraction=0.2),
                                 NoTextEmbeds())
    video, caption, _ = train.get(0)
    assert video.shape == (4, 3, 16, 16) and len(train) + len(held) == 24 and caption


@pytest.mark.long  # make test reads video shards back above and trains from a latent cache in test_latent_cache.py
def test_a_video_cache_trains_what_the_clips_train(tmp_path):
    """Clip shards cached with the video codec (frame code included): the Wan preset's losses from the
    cache equal those from decoding the clips on the fly."""
    from pretrain.config import load_config
    from pretrain.data.cache_stage import CacheConfig, cache
    from pretrain.trainer import PretrainConfig, train

    video_set(tmp_path / "clips", n=32, frames=8)
    data = [f"data.path={tmp_path / 'clips'}", "data.source=shards", "data.frames=4", "data.frame_stride=2",
            "data.size=16"]
    folder = cache(load_config(CacheConfig, None, [f"run_dir={tmp_path}", *data, "codec.name=video_patchify",
                                                   "codec.factor=2", "codec.frames=4", "codec.frame_code=true"]))
    losses = []
    cached = ["data.source=latent_cache", f"data.path={folder}", "data.frames=4"]
    for name, source in (("fly", data), ("cached", cached)):
        train(load_config(PretrainConfig, ROOT / "configs/pretrain/moving_emoji_tiny.yaml",
                          [f"run_dir={tmp_path / name}", *source, "data.limit=null", "train.steps=3", "eval.every=0",
                           "eval.grid_every=0", "eval.heldout_samples=4"]))
        losses.append([r["loss"] for r in read_metrics(tmp_path / name / "pretrain" / "metrics.jsonl") if "loss" in r])
    assert len(losses[0]) == 3 and losses[0] == losses[1]
