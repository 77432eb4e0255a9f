import json

import pytest
import torch

from pretrain.data import emoji as E
from pretrain.data.builtin import load_openmoji
from pretrain.data.dataset import DataConfig, build_datasets
from pretrain.data.sampler import EpochSampler
from pretrain.data.folder import DatasetError, load_image_folder

pytestmark = pytest.mark.core


@pytest.fixture(scope="module")
def openmoji32():
    return load_openmoji(DataConfig(size=32))


def test_every_rendered_emoji_is_non_blank(openmoji32):
    images = openmoji32["images"]
    assert images.shape == (4050, 3, 32, 32) and images.dtype == torch.uint8
    assert not E.blank_mask(images).any()
    # and the blank check itself fires on a white image
    assert E.blank_mask(torch.full((1, 3, 8, 8), 255, dtype=torch.uint8)).all()


def test_unnamed_emoji_are_left_out_and_counted(openmoji32):
    assert len(openmoji32["unnamed"]) == 445
    assert len(openmoji32["captions"]) + len(openmoji32["unnamed"]) == 4495
    assert "E000" in openmoji32["unnamed"]  # a private-use OpenMoji extra
    assert "E000" not in openmoji32["codepoints"]
    assert E.cldr_name(chr(0xE000)) is None


def test_zwj_sequences_get_cldr_names_and_render_as_one_glyph(openmoji32):
    i = openmoji32["codepoints"].index("1F468-200D-1F4BB")
    assert openmoji32["captions"][i] == "man technologist"
    # one glyph: the man technologist is not the plain "man" glyph next to a laptop glyph
    man = openmoji32["images"][openmoji32["codepoints"].index("1F468")]
    assert (openmoji32["images"][i].float() - man.float()).abs().mean() > 5
    assert all(c == c.lower() and c.strip() for c in openmoji32["captions"])


def test_base_key_merges_skin_tone_and_gender_variants():
    def key(s):
        return E.base_key([int(x, 16) for x in s.split("-")])

    assert key("1F468-1F3FD-200D-1F4BB") == key("1F469-200D-1F4BB") == key("1F9D1-200D-1F4BB")
    assert key("1F645-1F3FC-200D-2642-FE0F") == key("1F645")
    assert key("1F34E") != key("1F34F")


def test_split_is_by_base_emoji(openmoji32):
    held = {b for b in openmoji32["bases"] if E.is_heldout(b, 0.05)}
    train = {b for b in openmoji32["bases"] if not E.is_heldout(b, 0.05)}
    assert held and train and not held & train
    n_held = sum(b in held for b in openmoji32["bases"])
    assert 0.02 < n_held / 4050 < 0.10


def test_datasets_are_cached_and_encoded(minilm, tmp_path):
    cfg = DataConfig(size=16, limit=64)
    train, held = build_datasets(cfg, minilm)
    assert len(train) == 64 and len(held) == 8
    assert train.embeds.tokens.shape == (64, 24, 384) and train.embeds.pooled.shape == (64, 384)
    assert not set(train.captions) & set(held.captions)
    images, embeds, caps = train.batch([0, 1])
    assert images.dtype == torch.float32 and 0 <= images.min() and images.max() <= 1
    again, _ = build_datasets(cfg, minilm)  # from the cache
    assert torch.equal(again.embeds.tokens, train.embeds.tokens) and again.captions == train.captions


def _write_png(path, color):
    from PIL import Image

    Image.new("RGB", (20, 20), color).save(path)


def test_image_folder_skips_and_counts_bad_samples(tmp_path, caplog):
    _write_png(tmp_path / "a.png", "red")
    _write_png(tmp_path / "b.png", "blue")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG not really")
    rows = [{"file": "a.png", "caption": "a red square"}, {"file": "corrupt.png", "caption": "broken"},
            {"file": "missing.png", "caption": "gone"}, {"file": "b.png", "caption": "  "},
            {"file": "b.png", "caption": "a blue square"}]
    (tmp_path / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    got = load_image_folder(tmp_path, 8)
    images, captions, skipped = got.images, got.captions, got.skipped
    assert captions == ["a red square", "a blue square"]
    assert images.shape == (2, 3, 8, 8)
    assert images[0, 0].float().mean() > 250 and images[0, 2].float().mean() < 5
    assert skipped == {"corrupt image": ["corrupt.png"], "missing image": ["missing.png"],
                       "empty caption": ["b.png"], "bad line": ["captions.jsonl:6"]}
    assert "corrupt.png" in caplog.text


def test_empty_folder_dataset_is_an_error(tmp_path):
    (tmp_path / "captions.jsonl").write_text(json.dumps({"file": "x.png", "caption": "x"}) + "\n")
    with pytest.raises(DatasetError, match="no usable"):
        load_image_folder(tmp_path, 8)
    with pytest.raises(DatasetError, match="captions.jsonl"):
        load_image_folder(tmp_path / "nowhere", 8)


def test_image_folder_skips_undecodable_lines_and_names_them(tmp_path, caplog):
    _write_png(tmp_path / "a.png", "red")
    _write_png(tmp_path / "b.png", "blue")
    (tmp_path / "captions.jsonl").write_bytes(b'{"file": "a.png", "caption": "a red square"}\n'
                                              b'{"file": "b.png", "caption": "caf\xe9 au lait"}\n'  # Latin-1
                                              b'{"file": "b.png", "caption": "a blue square \xe2\x80\xa8 too"}\n')
    got = load_image_folder(tmp_path, 8)
    images, captions, skipped = got.images, got.captions, got.skipped
    assert captions == ["a red square", "a blue square \u2028 too"]  # U+2028 inside a caption is no line break
    assert images.shape == (2, 3, 8, 8)
    assert skipped == {"undecodable line": ["captions.jsonl:2"]}
    assert "1 undecodable line (first: captions.jsonl:2)" in caplog.text


def test_image_folder_refuses_files_outside_it(tmp_path, caplog):
    root = tmp_path / "data"
    root.mkdir()
    _write_png(root / "a.png", "red")
    _write_png(tmp_path / "x.png", "blue")  # a real image next to the folder
    (root / "link.png").symlink_to(tmp_path / "x.png")
    (root / "sub").mkdir()
    rows = [{"file": "/etc/hostname", "caption": "absolute"}, {"file": "../x.png", "caption": "up"},
            {"file": "link.png", "caption": "a link out"}, {"file": "sub/../a.png", "caption": "a red square"},
            {"file": str(root / "a.png"), "caption": "absolute, even inside"}]
    (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_image_folder(root, 8)
    images, captions, skipped = got.images, got.captions, got.skipped
    assert captions == ["a red square"] and images.shape == (1, 3, 8, 8)
    assert skipped == {"path outside the folder": ["captions.jsonl:1", "captions.jsonl:2", "captions.jsonl:3",
                                                   "captions.jsonl:5"]}
    assert "4 path outside the folder (first: captions.jsonl:1, captions.jsonl:2" in caplog.text


class _Plant:
    """Unpickling this creates ``marker``: what a hostile cache file could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_pickled_caches_are_never_loaded(tmp_path, monkeypatch, caplog):
    import pickle

    records, unnamed = E.list_emoji()
    monkeypatch.setattr(E, "list_emoji", lambda: (records[:12], unnamed))
    cfg = DataConfig(size=8, cache_dir=str(tmp_path))
    key = E.emoji_cache_key(8)
    marker = tmp_path / "pwned"
    torch.save({"images": torch.zeros(1), "evil": _Plant(marker)}, tmp_path / f"{key}.pt")  # an old cache
    caplog.set_level("INFO")
    raw = load_openmoji(cfg)
    assert not marker.exists()
    assert f"{key}.pt: old pickle cache, not loaded" in caplog.text
    assert raw["images"].shape == (12, 3, 8, 8) and raw["captions"] == [r.caption for r in records[:12]]
    assert raw["unnamed"] == unnamed

    new = tmp_path / f"{key}.v2.safetensors"  # a pickle under the new name: unreadable, rebuilt
    new.write_bytes(pickle.dumps(_Plant(marker)))
    again = load_openmoji(cfg)
    assert not marker.exists() and "unreadable cache" in caplog.text
    assert torch.equal(again["images"], raw["images"]) and again["bases"] == raw["bases"]
    monkeypatch.setattr(E, "list_emoji", lambda: pytest.fail("rendered again instead of read from the cache"))
    cached = load_openmoji(cfg)
    assert torch.equal(cached["images"], raw["images"])
    assert {k: cached[k] for k in ("captions", "bases", "codepoints", "unnamed")} == \
        {k: raw[k] for k in ("captions", "bases", "codepoints", "unnamed")}


def test_epoch_sampler_resumes_exactly():
    a = EpochSampler(10, seed=3)
    first = [a.next(4) for _ in range(3)]  # crosses an epoch boundary
    assert sorted(first[0] + first[1] + first[2][:2]) == list(range(10))
    state = a.state_dict()
    b = EpochSampler(10, seed=3)
    b.load_state_dict(state)
    assert [a.next(4) for _ in range(4)] == [b.next(4) for _ in range(4)]


def test_prompt_file_is_split_and_encoded_per_batch(minilm, tmp_path):
    prompts = [f"a photo of {n} red apples" for n in range(40)]
    (tmp_path / "p.txt").write_text("\n".join(prompts[:20]) + "\n\n  \n" + "\n".join(prompts[20:]) + "\n")
    train, held = build_datasets(DataConfig(source="prompts", path=str(tmp_path / "p.txt"), size=24,
                                            heldout_fraction=0.2, cache_dir=str(tmp_path)), minilm)
    assert sorted(train.captions + held.captions) == sorted(prompts)  # blank lines skipped, nothing lost
    assert not set(train.captions) & set(held.captions) and len(held) > 0
    images, embeds, caps = train.batch([3, 0])
    assert images.shape == (2, 3, 24, 24) and images.abs().sum() == 0  # prompt-only: blank images
    direct = minilm.encode([train.captions[3], train.captions[0]])
    assert caps == [train.captions[3], train.captions[0]]
    torch.testing.assert_close(embeds.tokens, direct.tokens, rtol=0, atol=0)
    torch.testing.assert_close(embeds.pooled, direct.pooled, rtol=0, atol=0)
    assert not list(tmp_path.glob("embeds_*"))  # nothing encoded up front or cached


def test_prompt_folder_uses_its_test_split_and_bad_paths_are_named(minilm, tmp_path):
    (tmp_path / "train.txt").write_text("a cat\na dog\n")
    (tmp_path / "test.txt").write_text("a red flag\n")
    train, held = build_datasets(DataConfig(source="prompts", path=str(tmp_path)), minilm)
    assert train.captions == ["a cat", "a dog"] and held.captions == ["a red flag"]
    with pytest.raises(DatasetError, match="missing.txt"):
        build_datasets(DataConfig(source="prompts", path=str(tmp_path / "missing.txt")), minilm)
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(DatasetError, match="empty.txt.*no prompt"):
        build_datasets(DataConfig(source="prompts", path=str(tmp_path / "empty.txt")), minilm)
