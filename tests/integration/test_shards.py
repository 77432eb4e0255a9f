"""The ``shards`` data source: the stream order, hostile shards, parquet, DataLoader workers, and a
resumed pretraining run that sees exactly the samples (and trains exactly the weights) of the
uninterrupted one."""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pretrain.data.dataset import DataConfig, build_datasets
from pretrain.data.feed import BatchFeed
from pretrain.data.shards import BadSample, build_index, list_shards
from pretrain.data.stream import StreamSampler, sampler_for, stream_order
from pretrain.runtime.runtime import Runtime
from pretrain.text_encoder import NoTextEmbeds
from tests.conftest import tiny_config
from tests.shard_sets import hostile_set, parquet_set, record_keys, tar_set

pytestmark = pytest.mark.core


@pytest.fixture(scope="module")
def tars(tmp_path_factory):
    return tmp_path_factory.mktemp("tars")


@pytest.fixture(scope="module")
def tar_folder(tars):
    tar_set(tars / "emoji", n=2000, per_shard=100)
    return tars / "emoji"


def test_stream_order_is_a_seeded_permutation_local_to_the_buffer():
    counts = [100] * 20
    a, b = stream_order(counts, 0, 0, 64), stream_order(counts, 0, 0, 64)
    assert np.array_equal(a, b) and sorted(a.tolist()) == list(range(2000))
    assert not np.array_equal(a, stream_order(counts, 0, 1, 64))  # a new order each epoch
    assert not np.array_equal(a, stream_order(counts, 1, 0, 64))
    # a sample leaves the buffer a geometric wait (mean 64) after it enters: reads stay within a few
    # hundred samples of the file order of the shuffled shards, yet the order is not the file order
    plain = stream_order(counts, 0, 0, 1)  # the same shard order (drawn first), no buffer
    entered = np.empty(2000, dtype=np.int64)
    entered[plain] = np.arange(2000)
    lag = np.abs(np.arange(2000) - entered[a])
    assert np.quantile(lag, 0.99) <= 5 * 64 and lag.mean() > 10
    # buffer 1 keeps the file order inside a shard, in a shuffled shard order
    assert all(np.array_equal(plain[i:i + 100], np.arange(plain[i], plain[i] + 100)) for i in range(0, 2000, 100))


def test_the_stream_sampler_resumes_mid_epoch_and_runs_across_epochs():
    s = StreamSampler([7, 5, 9], seed=3, buffer=4)
    straight = [s.next(6) for _ in range(8)]  # 48 draws over 21 samples: three epochs
    assert sorted(sum(straight[:4], [])[:21]) == list(range(21))
    r = StreamSampler([7, 5, 9], seed=3, buffer=4)
    [r.next(6) for _ in range(4)]
    fresh = StreamSampler([7, 5, 9], seed=3, buffer=4)
    fresh.load_state_dict(r.state_dict())
    assert [fresh.next(6) for _ in range(4)] == straight[4:]


def test_tar_and_parquet_shards_give_the_same_samples(tar_folder, tmp_path):
    parquet_set(tmp_path / "pq", n=600, per_shard=200)
    tar = build_index(list_shards(tar_folder), tmp_path)
    pq = build_index(list_shards(tmp_path / "pq"), tmp_path)
    assert len(tar) == 2000 and len(pq) == 600 and pq.key[:600] == tar.key[:600]
    assert tar.counts() == [100] * 20 and pq.counts() == [200] * 3 and tar.size[0] == [16, 16]
    cfg = dict(source="shards", size=16, heldout_fraction=0.1, cache_dir=str(tmp_path))
    t_train, t_held = build_datasets(DataConfig(path=str(tar_folder), limit=None, **cfg), NoTextEmbeds())
    p_train, p_held = build_datasets(DataConfig(path=str(tmp_path / "pq"), **cfg), NoTextEmbeds())
    for j in (0, 17, len(p_train) - 1):  # the same key decodes to the same pixels and caption
        image, caption, (_, key) = p_train.get(j)
        k = t_train.index.key.index(key)
        ti, tc, _ = t_train.get(int(np.flatnonzero(t_train.ids == k)[0]))
        assert caption == tc and torch.equal(image, ti)
    assert 0.05 < len(t_held) / 2000 < 0.15 and torch.equal(t_held.images[:len(p_held)], p_held.images)


def test_hostile_shards_are_skipped_counted_and_never_repeated(tars, tmp_path):
    bad = hostile_set(tars / "hostile", n=400, per_shard=50)
    train, _ = build_datasets(DataConfig(source="shards", path=str(tars / "hostile"), size=16, heldout_fraction=0.05,
                                         cache_dir=str(tmp_path)), NoTextEmbeds())
    index, cut = train.index, train.index.truncated
    assert list(cut) == ["shard-000007.tar"] and 20 <= cut["shard-000007.tar"] < 25  # the cut shard's whole samples
    assert len(index) == 350 + cut["shard-000007.tar"]  # every sample of the other shards is indexed
    keys = {index.key[i] for i in train.ids}
    bad = {k: r for k, r in bad.items() if k in keys}  # those the hash did not hold out
    assert len(bad) >= 3
    n = len(train) // 10 * 10
    feed = BatchFeed(train, sampler_for(train, 0, 32, 10), 10, (0, 10), workers=2)
    seen, skipped = [], []
    for _ in range(n // 10):  # one epoch
        fed = feed.next()
        assert fed.images.shape[1:] == (3, 16, 16) and len(fed.captions) == len(fed.positions)
        seen += fed.keys
        skipped += fed.skipped
    assert {k: r.split(" (")[0] for _, k, r in skipped} == bad
    assert all(s == "shard-000001.tar" for s, _, _ in skipped)
    assert len(seen) == len(set(seen)) == n - len(bad)  # nothing repeats to fill a batch


def test_workers_read_what_one_process_reads(tar_folder, tmp_path):
    cfg = DataConfig(source="shards", path=str(tar_folder), size=16, cache_dir=str(tmp_path))
    train, _ = build_datasets(cfg, NoTextEmbeds())
    got = []
    for workers in (0, 2):
        feed = BatchFeed(train, sampler_for(train, 5, 100, 16), 16, (4, 12), workers=workers, prefetch=3)
        batches = [feed.next() for _ in range(5)]
        assert all(b.positions == list(range(4, 12)) for b in batches)
        got.append(([b.keys for b in batches], torch.cat([b.images for b in batches])))
        state = feed.sampler.state_dict()
        assert (state["epoch"], state["offset"]) == (0, 80)  # what was read ahead is not counted
    assert got[0][0] == got[1][0] and torch.equal(got[0][1], got[1][1])


class _Stop(Exception):
    pass


def _run(run_dir, folder, *extra):
    from pretrain.trainer import PretrainRun
    from pretrain.runtime.loop import run_stage

    run = PretrainRun(tiny_config(run_dir, "data.source=shards", f"data.path={folder}", "data.limit=64",
                                  "data.workers=2", "train.steps=6", "checkpoint.every=3", "eval.every=0",
                                  "eval.heldout_samples=8", *extra))
    keys = record_keys(run)
    run_stage(run)
    return keys, load_file(str(Path(run_dir) / "pretrain" / "export" / "diffusion_pytorch_model.safetensors"))


def test_a_resumed_run_sees_and_trains_exactly_what_the_uninterrupted_run_does(tar_folder, tmp_path):
    """64 train samples, batch 16: 4 steps per epoch; stopped after the step-3 checkpoint (mid-epoch),
    resumed to step 6 (across the epoch boundary)."""
    keys, weights = _run(tmp_path / "straight", tar_folder)
    save = Runtime.save

    def save_then_stop(self):
        path = save(self)
        if self.step == 3:
            raise _Stop
        return path

    Runtime.save = save_then_stop
    try:
        with pytest.raises(_Stop):
            _run(tmp_path / "resumed", tar_folder)
    finally:
        Runtime.save = save
    resumed_keys, resumed = _run(tmp_path / "resumed", tar_folder, "checkpoint.resume=true")
    assert len(keys) == 6 and resumed_keys == keys[3:]
    assert sorted(sum(keys[:4], [])) == sorted(set(sum(keys[:4], [])))  # an epoch has no repeat
    assert set(weights) == set(resumed) and all(torch.equal(weights[k], resumed[k]) for k in weights)


def test_aspect_ratio_buckets_batch_one_shape_and_the_export_samples_at_each(tars, tmp_path, capsys):
    """Tall, square and wide images in one shard set, three buckets at data.size 32: every micro-batch is
    of one bucket, the per-bucket counts are logged, and the export samples at each bucket's size."""
    import io

    from PIL import Image

    from posttrain.cli import main
    from pretrain.data.shards import write_tar_shards
    from pretrain.runtime.metrics import read_metrics
    from tests.shard_sets import emoji_samples

    buckets = {(32, 32): (32, 32), (16, 32): (32, 16), (32, 16): (16, 32)}  # bucket (H, W): image (W, H)

    def samples():
        for i, (key, data, caption) in enumerate(emoji_samples(300, size=32)):
            w, h = list(buckets.values())[i % 3]
            buf = io.BytesIO()
            Image.open(io.BytesIO(data)).resize((w, h)).save(buf, "PNG")
            yield key, buf.getvalue(), caption

    write_tar_shards(samples(), tars / "aspect", 50)
    spec = "[" + ",".join(f"[{h},{w}]" for h, w in buckets) + "]"
    run = PretrainRun_of(tmp_path, tars / "aspect", spec)
    keys = record_keys(run)
    shapes = []
    feed_next = run.feed.next

    def shape():
        fed = feed_next()
        shapes.append((fed.shape, tuple(fed.images.shape[-2:])))
        return fed

    run.feed.next = shape
    from pretrain.runtime.loop import run_stage

    run_stage(run)
    assert all(s == i for s, i in shapes) and len({s for s, _ in shapes}) == 3  # one shape per batch, all three seen
    inverse = {image: f"{h}x{w}" for (h, w), image in buckets.items()}
    sizes = [tuple(run.train_set.index.size[i]) for i in run.train_set.ids]
    assert run.train_set.bucket_counts() == {b: sizes.count(image) for image, b in inverse.items()}
    index = {k: i for i, k in enumerate(run.train_set.index.key)}
    for batch, (s, _) in zip(keys, shapes):  # each sample sits in the bucket of its own aspect ratio
        w, h = run.train_set.index.size[index[batch[0].split(":")[1]]]
        assert buckets[s] == (w, h)
    rows = read_metrics(tmp_path / "pretrain" / "metrics.jsonl")
    logged = {k for r in rows for k in r if k.startswith("samples_") and k != "samples_per_s"}
    assert logged == {"samples_32x32", "samples_16x32", "samples_32x16"}
    export, grids = tmp_path / "pretrain" / "export", set()
    for h, w in buckets:
        out = tmp_path / f"sample_{h}x{w}.png"
        assert main(["sample", str(export), "--prompts", "a cat", "--steps", "2", "--height", str(h), "--width", str(w),
                     "--out", str(out)]) == 0
        grids.add(Image.open(out).size)
    assert len(grids) == 3  # three grid shapes: the cells are the buckets' sizes


def PretrainRun_of(run_dir, folder, buckets):
    from pretrain.trainer import PretrainRun

    return PretrainRun(tiny_config(run_dir, "data.source=shards", f"data.path={folder}", "data.size=32",
                                   f"data.buckets={buckets}", "data.limit=null", "train.steps=12", "eval.every=0",
                                   "eval.heldout_samples=8", "data.heldout_fraction=0.05"))


def test_a_share_with_no_usable_sample_trains_a_null_sample_at_weight_zero():
    from pretrain.codec import PatchifyCodec
    from pretrain.data.feed import Fed
    from pretrain.text_encoder import PromptEmbeds
    from pretrain.trainer import _inputs

    null = PromptEmbeds(torch.ones(1, 3, 4), torch.ones(1, 4))
    fed = Fed(None, None, None, [], [], [], skipped=[("a.tar", "k", "corrupt image")], shape=(16, 24))
    x0, embeds, weight = _inputs(fed, PatchifyCodec(2), null, "cpu")
    assert x0.shape == (1, 12, 8, 12) and not x0.any() and embeds is null and weight == 0.0


@pytest.mark.parametrize("key,reason", [("s000060", "corrupt image"), ("s000061", "missing caption"),
                                        ("s000062", "image too large"), ("s000063", "no image")])
def test_each_hostile_sample_is_refused_with_its_shard_key_and_reason(tars, tmp_path, key, reason):
    folder = tars / "hostile_each"
    if not folder.exists():
        hostile_set(folder, n=400, per_shard=50)
    from pretrain.data.sharded_set import ShardSet
    from pretrain.data.shards import ParquetColumns

    index = build_index(list_shards(folder), tmp_path)
    train = ShardSet(index, np.arange(len(index)), (16, 16), NoTextEmbeds(), ParquetColumns(), 89_478_485)
    j = index.key.index(key)
    with pytest.raises(BadSample) as e:
        train.get(j)
    assert (e.value.shard, e.value.key, e.value.reason.split(" (")[0]) == ("shard-000001.tar", key, reason)
    neighbour = train.get(j + 4)  # the samples around it read as usual
    assert neighbour[0].shape == (3, 16, 16)


def test_a_tar_cut_at_a_header_is_seen_and_its_last_sample_dropped(tmp_path):
    """tarfile ends quietly when a tar is cut at (or inside) a header: the missing end-of-archive
    marker gives it away, and the last sample read (which may have lost members) is dropped."""
    import tarfile

    from pretrain.data.shards import write_tar_shards
    from tests.shard_sets import emoji_samples

    (path,) = write_tar_shards(emoji_samples(6), tmp_path / "t", 100)
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    third_caption = [m for m in members if m.name == "s000002.txt"][0]
    raw = path.read_bytes()
    for cut in (third_caption.offset, third_caption.offset + 100):  # at the header, inside it
        path.write_bytes(raw[:cut])
        (tmp_path / f"index{cut}").mkdir()
        index = build_index([path], tmp_path / f"index{cut}")
        assert index.key == ["s000000", "s000001"] and index.truncated == {path.name: 2}


def test_a_json_caption_that_is_not_an_object_is_a_missing_caption(tmp_path):
    import webdataset as wds

    from pretrain.data.shards import ParquetColumns, ShardReader
    from tests.shard_sets import emoji_samples

    (key, png, _), = list(emoji_samples(1))
    with wds.ShardWriter(str(tmp_path / "j-%06d.tar"), maxcount=10, verbose=0) as sink:
        sink.write({"__key__": key, "png": png, "json": b"[1, 2]"})
    reader = ShardReader(build_index(list_shards(tmp_path), tmp_path), ParquetColumns())
    with pytest.raises(BadSample, match="missing caption"):
        reader.read(0)


def test_resuming_on_another_stream_is_refused(tar_folder, tmp_path):
    train, _ = build_datasets(DataConfig(source="shards", path=str(tar_folder), size=16, cache_dir=str(tmp_path)),
                              NoTextEmbeds())
    state = sampler_for(train, 0, 100, 16).state_dict()
    sampler_for(train, 0, 100, 16).load_state_dict(state)  # the same stream resumes
    with pytest.raises(ValueError, match="data.shuffle_buffer"):
        sampler_for(train, 0, 50, 16).load_state_dict(state)
