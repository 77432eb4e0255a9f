"""`posttrain curate`: planted near-duplicates are dropped (the better-scored copy stays), score rules keep
exactly the closed-form set, NaN is "not applicable", the output reads back as a folder dataset, the
report and its images are written, and config errors name the key."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from posttrain.curate.stage import CurateConfig, FilterRule, apply_filters, curate, near_pairs
from pretrain.text_encoder import NoTextEmbeds
from pretrain.config import ConfigError, load_config
from pretrain.data.dataset import DataConfig, build_datasets
from pretrain.data.emoji import is_heldout
from rewards.base import REGISTRY, register
from tests.conftest import ROOT

pytestmark = pytest.mark.core

HELDOUT = 1e-4  # the source's held-out fraction: only the filler sample below is held out

if "test_curate_brightness" not in REGISTRY:
    @register("test_curate_brightness")
    def _brightness():
        return lambda images, prompts=None, metadata=None: images.float().mean(dim=(1, 2, 3))

if "test_curate_value" not in REGISTRY:
    @register("test_curate_value")
    def _value():
        """The number after "v" in the caption ("v 3 ...", "v nan ...")."""
        return lambda images, prompts, metadata=None: torch.tensor([float(p.split()[1]) for p in prompts])


def patterns(n: int, seed: int = 0) -> np.ndarray:
    """``n`` distinct uint8 ``[32, 32, 3]`` images: random 6 x 6 colour blocks (pairwise phash distance >= 18)."""
    blocks = np.random.default_rng(seed).integers(30, 226, size=(n, 6, 6, 3)).astype(np.uint8)
    return np.stack([np.asarray(Image.fromarray(b).resize((32, 32), Image.NEAREST)) for b in blocks])


def jpeg(a: np.ndarray, quality: int = 95) -> np.ndarray:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=quality)
    return np.asarray(Image.open(buf).convert("RGB"))


def write_folder(root, images: np.ndarray, captions: list[str]) -> str:
    """A folder dataset of ``images`` (uint8 ``[N, H, W, 3]``) plus one filler sample whose caption
    falls in the held-out split (build_datasets needs one); every given caption is in the train split."""
    assert not any(is_heldout(c, HELDOUT) for c in captions)
    filler = next(f"held-out filler {s}" for s in range(10**6) if is_heldout(f"held-out filler {s}", HELDOUT))
    root.mkdir(parents=True)
    rows = []
    for k, (a, c) in enumerate(zip([*images, images[0]], [*captions, filler])):
        Image.fromarray(a).save(root / f"{k}.png")
        rows.append({"file": f"{k}.png", "caption": c})
    (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(root)


def config(tmp_path, path: str, *overrides: str) -> CurateConfig:
    return load_config(CurateConfig, None, [f"run_dir={tmp_path / 'run'}", "data.source=folder", f"data.path={path}",
                                            "data.size=32", f"data.heldout_fraction={HELDOUT}", *overrides])


def read_captions(data) -> list[dict]:
    return [json.loads(line) for line in (data / "captions.jsonl").read_text().splitlines()]


def test_dedup_drops_exactly_the_planted_copies_and_keeps_the_better_scored(tmp_path):
    base = patterns(12)
    planted = {12: (0, base[0].copy()),  # exact copy: same score, the lower index (0) stays
               13: (1, np.clip(base[1].astype(int) + 3, 0, 255).astype(np.uint8)),  # brighter: the copy stays
               14: (2, np.clip(base[2].astype(int) - 3, 0, 255).astype(np.uint8)),  # darker: the original stays
               15: (3, jpeg(base[3]))}  # JPEG re-encoded at quality 95
    images = np.concatenate([base, np.stack([a for _, a in planted.values()])])
    captions = [f"pattern {k}" for k in range(12)] + [f"copy {k} of pattern {o}" for k, (o, _) in planted.items()]
    path = write_folder(tmp_path / "src", images, captions)
    out = curate(config(tmp_path, path, "rewards={test_curate_brightness: 1.0}", "dedup.method=phash"))

    brightness = images.astype(np.float64).mean(axis=(1, 2, 3))
    # of each pair the lower score goes (ties: the higher index)
    expect_dropped = {max((o, k), key=lambda i: (-brightness[i], i)) for k, (o, _) in planted.items()}
    assert expect_dropped == {12, 1, 14, 3 if brightness[3] < brightness[15] else 15}
    rows = read_captions(out)
    assert out == tmp_path / "run/curate/data"
    assert {r["source_index"] for r in rows} == set(range(16)) - expect_dropped
    assert [r["caption"] for r in rows] == [captions[i] for i in sorted(set(range(16)) - expect_dropped)]
    manifest = json.loads((out / "curate.json").read_text())
    assert manifest["duplicates_dropped"] == 4 and manifest["samples"] == 12 and manifest["heldout_left_out"] == 1
    report = (tmp_path / "run/curate/report.md").read_text()
    assert "dup of #13 (d=0)" in report  # pattern 1 (darker) gave way to its brighter copy


def test_near_pairs_is_the_pairwise_hamming_distance():
    bits = np.random.default_rng(1).random((300, 64)) < 0.5
    bits[7], bits[200] = bits[3], bits[3]
    bits[9] = bits[4]
    bits[9, :3] ^= True  # distance 3
    dist = (bits[:, None] != bits[None]).sum(-1)
    ii, jj = np.nonzero(np.triu(dist <= 5, k=1))
    for block in (1 << 22, 999):  # one block, and blocks of a few rows
        i, j, d = near_pairs(bits, 5, block_elems=block)
        assert list(zip(i, j)) == list(zip(ii, jj)) and np.array_equal(d, dist[ii, jj])
    assert {(3, 7), (3, 200), (7, 200), (4, 9)} <= set(zip(*near_pairs(bits, 3)[:2]))


def test_rules_keep_the_closed_form_set_and_nan_is_not_applicable(tmp_path):
    values = [*range(20), "nan", "nan"]
    captions = [f"v {v} sample {k}" for k, v in enumerate(values)]
    path = write_folder(tmp_path / "src", patterns(len(values)), captions)
    rules = ("filters=[{reward: test_curate_value, min: 3}, {reward: total, max: 30}, "
             "{reward: total, top_fraction: 0.5}]")
    out = curate(config(tmp_path, path, "rewards={test_curate_value: 2.0}", rules, "dedup.method=none"))
    # r1: 3..19 stay (0, 1, 2 dropped; the two NaN not applicable); r2: total = 2 v <= 30 -> 3..15;
    # r3: the ceil(0.5 * 13) = 7 highest -> 9..15
    assert [r["caption"] for r in read_captions(out)] == [captions[v] for v in range(9, 16)]
    assert read_captions(out)[0]["scores"] == {"total": 18.0, "test_curate_value": 9.0}
    rules_out = json.loads((out / "curate.json").read_text())["rules"]
    assert [(r["reached"], r["kept"], r["dropped"], r["not_applicable"]) for r in rules_out] == \
        [(22, 17, 3, 2), (17, 13, 4, 0), (13, 7, 6, 0)]

    with pytest.raises(ValueError, match="^filters: no sample is left of 22"):
        curate(config(tmp_path / "none", path, "rewards={test_curate_value: 1.0}", "filters=[{reward: total, min: 99}]"))
    assert (tmp_path / "none/run/curate/report.md").is_file() and not (tmp_path / "none/run/curate/data").exists()

    # the same rules as a function; top_fraction 1 keeps all, a tiny one keeps one; a NaN total is n/a too
    s = np.array([5.0, np.nan, 1.0, 7.0, 3.0, 7.0])
    kept, reasons, counts = apply_filters({"total": s}, [FilterRule(top_fraction=1.0), FilterRule(top_fraction=1e-6)])
    assert kept.tolist() == [False, False, False, True, False, False]  # ties: the lower index
    assert reasons == ["r2 not top 1e-06", "r1 n/a", "r2 not top 1e-06", None, "r2 not top 1e-06", "r2 not top 1e-06"]
    assert [c["not_applicable"] for c in counts] == [1, 0]


def test_the_output_reads_back_as_a_folder_dataset_with_the_report(tmp_path, capsys):
    values = list(range(24))
    captions = [f"v {v} sample {k}" for k, v in enumerate(values)]
    images = patterns(len(values))
    path = write_folder(tmp_path / "src", images, captions)
    overrides = ["rewards={test_curate_value: 1.0}", "filters=[{reward: total, min: 8}]",
                 "model.pretrained=some/export"]
    cfg = config(tmp_path, path, *overrides)
    assert curate(cfg).as_posix() == "some/export"  # passed through for the next stage of a pipeline
    root = tmp_path / "run/curate"
    for name in ("report.md", "hist_total.png", "hist_test_curate_value.png", "grid_kept.png", "grid_dropped.png",
                 "grid_duplicates.png", "config.yaml"):
        assert (root / name).is_file(), name
    assert Image.open(root / "grid_kept.png").size[0] == 8 * 128  # 8 columns of 128 px cells
    report = (root / "report.md").read_text()
    assert "| r1 | total >= 8 | 24 | 16 | 8 | 0 |" in report and "held-out split (1 samples) was left out" in report

    train, held = build_datasets(DataConfig(source="folder", path=str(root / "data"), size=32, heldout_fraction=0.3),
                                 NoTextEmbeds())
    back = dict(zip(train.captions + held.captions, torch.cat([train.images, held.images])))
    assert sorted(back) == sorted(captions[8:]) and len(held) > 0
    for k in range(8, 24):
        assert torch.equal(back[captions[k]], torch.from_numpy(images[k]).permute(2, 0, 1))

    # a second run with the same config and source reuses the folder; another config is refused
    assert curate(cfg).as_posix() == "some/export" and "reusing" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"^overwrite: .* another config \(differs in: filters\)"):
        curate(config(tmp_path, path, *overrides[:1], "filters=[{reward: total, min: 9}]"))
    curate(config(tmp_path, path, *overrides[:1], "filters=[{reward: total, min: 9}]", "overwrite=true"))
    assert len(read_captions(root / "data")) == 15 and not (root / "data.tmp").exists()


@pytest.mark.parametrize("override,key", [
    ("filters=[{reward: clip_score, min: 0}]", "filters.0.reward"),
    ("filters=[{reward: total, top_fraction: 1.5}]", "filters.0.top_fraction"),
    ("filters=[{reward: total, top_fraction: 0}]", "filters.0.top_fraction"),
    ("filters=[{reward: total}]", "filters.0: a rule needs"),
    ("data.source=moving_emoji", "shard_size: video clips are written as tar shards"),
    ("data.source=shapes", "data.source"),
    ("dedup.method=dhash", "dedup.method"),
    ("dedup.max_distance=65", "dedup.max_distance"),
    ("rewards={no_such_reward: 1.0}", "rewards"),
])
def test_config_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=f"command line: {key}"):
        load_config(CurateConfig, None, ["rewards={jpeg_compressibility: 1.0}", override])


def test_the_shipped_config_loads_and_prompt_sources_are_refused(tmp_path):
    shipped = ROOT / "configs/curate/emoji_learned_clip.yaml"
    cfg = load_config(CurateConfig, shipped)
    assert cfg.rewards["learned_clip"]["path"] == "runs/reward/learned_clip_a/model" and cfg.data.size == 32
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    with pytest.raises(ConfigError, match="data.source: curate scores images; 'prompts'"):
        load_config(CurateConfig, shipped, ["data.source=prompts", f"data.path={prompts}"])
