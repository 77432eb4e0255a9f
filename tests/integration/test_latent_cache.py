"""`posttrain cache` and ``data.source: latent_cache``: training from the cache follows the loss curve of
encoding on the fly bit for bit (the patchify codec and the text encoder are deterministic), a cache of
another codec or text encoder is refused naming both, and curate -> cache -> midtrain is one pipeline."""

import json

import pytest
import yaml

from posttrain.cli import main
from pretrain.config import load_config
from pretrain.data.cache_stage import CacheConfig, cache
from pretrain.data.folder import DatasetError
from pretrain.runtime.metrics import read_metrics
from pretrain.trainer import train
from tests.conftest import ROOT, tiny_config
from tests.shard_sets import tar_set

pytestmark = pytest.mark.core


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    d = tmp_path_factory.mktemp("latent_cache")
    tar_set(d / "shards", n=600, per_shard=50)
    cfg = load_config(CacheConfig, ROOT / "configs/cache/emoji_tiny.yaml",
                      [f"run_dir={d}", "data.source=shards", f"data.path={d / 'shards'}", "per_shard=200"])
    return d, cache(cfg)


def _losses(run_dir, *overrides):
    train(tiny_config(run_dir, "data.limit=null", "train.steps=6", "eval.every=3", *overrides))
    rows = read_metrics(run_dir / "pretrain" / "metrics.jsonl")
    return [r["loss"] for r in rows if "loss" in r], [r["heldout_loss"] for r in rows if "heldout_loss" in r], rows


def test_training_from_the_cache_is_training_on_the_fly(cached, capsys):
    d, folder = cached
    manifest = json.loads((folder / "cache.json").read_text())
    assert manifest["codec"] == "patchify-f1" and manifest["text_encoder"].startswith("minilm-")
    assert manifest["rows"] + manifest["heldout"] == 600 and sum(manifest["stream_counts"]) == manifest["rows"]
    fly, fly_held, fly_rows = _losses(d / "fly", "data.source=shards", f"data.path={d / 'shards'}")
    got, got_held, rows = _losses(d / "cached", "data.source=latent_cache", f"data.path={folder}")
    share = [r["data_wait_share"] for r in rows if "data_wait_share" in r]
    fly_share = [r["data_wait_share"] for r in fly_rows if "data_wait_share" in r]
    with capsys.disabled():
        print(f"\nlatent cache: losses {got[:3]}... equal to on the fly: {got == fly}; wait-for-data share of a step "
              f"{sum(fly_share) / len(fly_share):.2f} on the fly, {sum(share) / len(share):.2f} from the cache")
    assert got == fly and got_held == fly_held and len(got) == 6


@pytest.mark.parametrize("override,what", [("codec.factor=2", "codec"), ("text_encoder.max_length=16", "text_encoder")])
def test_a_cache_of_another_encoder_is_refused_naming_both(cached, tmp_path, override, what):
    _, folder = cached
    with pytest.raises(DatasetError, match=f"made by {what} '.+', this run's {what} is '.+'"):
        train(tiny_config(tmp_path, "data.source=latent_cache", f"data.path={folder}", "data.limit=null", override))


def test_curate_writes_shards_that_cache_encodes_for_midtrain(tmp_path):
    run = tmp_path / "run"
    cfg = {"run_dir": str(run), "evaluate": False, "stages": [
        {"command": "pretrain", "config": str(ROOT / "configs/pretrain/emoji_tiny.yaml"),
         "overrides": ["train.steps=2", "eval.every=0"]},
        {"command": "curate", "config": str(ROOT / "configs/curate/emoji_learned_clip.yaml"),
         "overrides": ["rewards.learned_clip.weight=0", "rewards.jpeg_compressibility=1.0", "data.limit=64",
                       "data.size=16", "shard_size=8"]},
        {"command": "cache", "config": str(ROOT / "configs/cache/emoji_tiny.yaml"), "data_from": "curate",
         "overrides": ["data.heldout_fraction=0.3"]},
        {"command": "midtrain", "config": str(ROOT / "configs/midtrain/emoji_tiny.yaml"), "data_from": "cache",
         "overrides": ["train.steps=2"]}]}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", str(path)]) == 0
    shards = sorted((run / "curate/data").glob("*.tar"))
    cache_cfg = yaml.safe_load((run / "cache/config.yaml").read_text())
    mid = yaml.safe_load((run / "midtrain/config.yaml").read_text())
    manifest = json.loads((run / "cache/data/cache.json").read_text())
    assert len(shards) >= 2 and cache_cfg["data"]["source"] == "shards"
    assert mid["data"]["source"] == "latent_cache" and mid["model"]["pretrained"] == str(run / "pretrain/export")
    curated = json.loads((run / "curate/data/curate.json").read_text())["samples"]
    assert manifest["rows"] + manifest["heldout"] == curated and manifest["heldout"] > 0
    assert (run / "midtrain/export/posttrain.json").is_file()
