"""An editing folder: ``captions.jsonl`` lines with a ``source`` image. Each row's source is its conditioning
image (the same pixels as the built-in editing set's when that set is written out as PNGs), rows that lack
one are skipped and named, the split keeps every edit of a source on one side (and every row linked to it
through a file that is one row's output and another's input), and an instruction repeated
over several sources is evaluated with each row's own source, not the first."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from pretrain.codec import PatchifyCodec
from pretrain.data.dataset import DataConfig, attach_codec, build_datasets
from pretrain.data.folder import load_image_folder, read_rgb
from pretrain.text_encoder import NoTextEmbeds

pytestmark = pytest.mark.core


def _png(path, rgb, size=(8, 8)):
    Image.new("RGB", size, rgb).save(path)


def test_an_editing_folder_reads_each_rows_source_and_names_what_it_skips(tmp_path, caplog):
    for name, rgb in (("red.png", (220, 30, 30)), ("blue.png", (30, 30, 220)), ("green.png", (30, 200, 30))):
        _png(tmp_path / name, rgb)
    (tmp_path / "bad.png").write_bytes(b"\x89PNG not really")
    rows = [{"file": "blue.png", "source": "red.png", "caption": "make it blue"},
            {"file": "blue.png", "caption": "no source given"},
            {"file": "blue.png", "source": "gone.png", "caption": "missing source"},
            {"file": "blue.png", "source": "bad.png", "caption": "corrupt source"},
            {"file": "blue.png", "source": "../red.png", "caption": "source outside"},
            {"file": "red.png", "source": "green.png", "caption": "make it red"}]
    (tmp_path / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_image_folder(tmp_path, 4)
    assert got.captions == ["make it blue", "make it red"] and got.source_files == ["red.png", "green.png"]
    assert got.images.shape == got.sources.shape == (2, 3, 4, 4) and got.sources.dtype == torch.uint8
    assert got.sources[0, :, 0, 0].tolist() == [220, 30, 30] and got.images[0, :, 0, 0].tolist() == [30, 30, 220]
    assert got.sources[1, :, 0, 0].tolist() == [30, 200, 30]
    assert got.skipped == {"no source": ["captions.jsonl:2"], "missing source image": ["gone.png"],
                           "corrupt source image": ["bad.png"], "path outside the folder": ["captions.jsonl:5"]}
    assert "1 no source (first: captions.jsonl:2)" in caplog.text
    plain = tmp_path / "plain"
    plain.mkdir()
    _png(plain / "a.png", (220, 30, 30))
    (plain / "captions.jsonl").write_text(json.dumps({"file": "a.png", "caption": "a red square"}) + "\n")
    assert load_image_folder(plain, 4).sources is None  # no line names a source: a text-to-image folder


def test_rows_linked_by_a_file_that_is_one_rows_output_and_anothers_input_share_a_split_key(tmp_path):
    for i, name in enumerate(("a", "b", "c", "d", "e", "f", "d2", "x", "g", "h")):
        _png(tmp_path / f"{name}.png", (20 * i, 0, 0))
    # b.png is row 0's output and row 1's input, so rows 0-2 are one group (keyed by its first source, a.png);
    # rows 3-4 share a source (e.png) and row 5's source f.png is row 3's output, so it joins them; row 6 is
    # linked to no other row and keeps its own source
    pairs = [("b", "c"), ("a", "b"), ("c", "d"), ("e", "f"), ("e", "d2"), ("f", "x"), ("g", "h")]
    rows = [{"file": f"{t}.png", "source": f"{s}.png", "caption": f"{s} to {t}"} for s, t in pairs]
    (tmp_path / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_image_folder(tmp_path, 4)
    assert got.files == ["c.png", "b.png", "d.png", "f.png", "d2.png", "x.png", "h.png"]
    want = ["a.png", "a.png", "a.png", "e.png", "e.png", "e.png", "g.png"]
    assert got.split_keys() == want
    # the keys do not depend on the order of the lines
    order = [6, 3, 0, 5, 2, 4, 1]
    (tmp_path / "captions.jsonl").write_text("".join(json.dumps(rows[i]) + "\n" for i in order))
    assert load_image_folder(tmp_path, 4).split_keys() == [want[i] for i in order]
    (tmp_path / "captions.jsonl").write_text(json.dumps({"file": "b.png", "caption": "plain"}) + "\n")
    assert load_image_folder(tmp_path, 4).split_keys() == ["plain"]


def test_the_built_in_editing_set_written_as_a_folder_reads_back_the_same(tmp_path):
    cfg = DataConfig(source="shapes_edit", scenes=24, heldout_per_category=2, heldout_fraction=0.25, size=32,
                     layout="reading", cache_dir=str(tmp_path / "cache"))
    train, _ = build_datasets(cfg, NoTextEmbeds())
    lines = []
    for i, caption in enumerate(train.captions):
        Image.fromarray(train.conditions[i].permute(1, 2, 0).numpy()).save(tmp_path / f"src{i}.png")
        Image.fromarray(train.images[i].permute(1, 2, 0).numpy()).save(tmp_path / f"out{i}.png")
        lines.append(json.dumps({"file": f"out{i}.png", "source": f"src{i}.png", "caption": caption}))
    (tmp_path / "captions.jsonl").write_text("\n".join(lines) + "\n")
    got = load_image_folder(tmp_path, 32)
    assert torch.equal(got.sources, train.conditions) and torch.equal(got.images, train.images)
    assert got.captions == train.captions
    assert np.array_equal(read_rgb(tmp_path / "src0.png", 32, 32), train.conditions[0].permute(1, 2, 0).numpy())


def test_a_repeated_instruction_is_evaluated_with_each_rows_own_source(tmp_path):
    colours = [(220, 30, 30), (30, 30, 220), (30, 200, 30), (240, 200, 20), (200, 30, 200), (20, 200, 200)]
    lines = []
    for i, rgb in enumerate(colours * 4):  # 24 edits: 6 sources x 4, one instruction for all of them
        if i < len(colours):
            _png(tmp_path / f"src{i}.png", rgb)
        lines.append(json.dumps({"file": f"src{i % 6}.png", "source": f"src{i % 6}.png", "caption": "keep it"}))
    (tmp_path / "captions.jsonl").write_text("\n".join(lines) + "\n")
    cfg = DataConfig(source="folder", path=str(tmp_path), size=8, heldout_fraction=0.5)
    train, held = build_datasets(cfg, NoTextEmbeds())
    # the split is by source file: a source's edits are all on one side
    seen, kept_out = ({tuple(x[:, 0, 0].tolist()) for x in s.conditions} for s in (train, held))
    assert not seen & kept_out and len(seen | kept_out) == 6 and len(kept_out) >= 2
    assert len(train) + len(held) == 24 and len(held) == 4 * len(kept_out)
    codec = PatchifyCodec(1)
    attach_codec(codec, train, held)
    rows = list(range(len(held)))
    prompts = [held.captions[r] for r in rows]
    own = held.prompt_embeds(prompts, NoTextEmbeds(), rows)
    assert torch.equal(own.images, codec.encode(held.conditions.float() / 255))
    first = held.prompt_embeds(prompts, NoTextEmbeds())  # a prompt file's prompts: the first row with the text
    assert torch.equal(first.images, codec.encode(held.conditions[[0] * len(held)].float() / 255))
    assert not torch.equal(own.images, first.images)
    # the evaluation lists rows with its prompts, and its paired SE clusters an editing set's rows by row
    from posttrain.eval.evaluate import EvalConfig, eval_prompts, report_table

    listed, listed_rows = eval_prompts(EvalConfig(rewards=[], prompts="heldout", num_prompts=3), held, train)
    assert listed == ["keep it"] * 3 and len(held) == 16 and listed_rows == [0, 8, 15]  # evenly spaced
    base, other = torch.tensor([[0.0], [1.0], [0.0], [1.0]]), torch.tensor([[1.0], [1.0], [1.0], [1.0]])
    results = {"models": ["a", "b"], "rewards": {"r": [base, other]}, "prompts": ["keep it"] * 4, "guard": [0.0, 0.0],
               "grids": []}
    assert "| r (mean) | 0.5000 | 1.0000 | +0.5000 (nan) | n/a |" in report_table(results)  # one cluster
    results["clusters"] = [f"keep it [row {i}]" for i in range(4)]
    results["categories"] = {"r": ["colour", "colour", "colour", "shape"]}
    table = report_table(results)
    assert "| r (mean) | 0.5000 | 1.0000 | +0.5000 (0.2887) | +1.7 |" in table
    assert "| r: colour (3 edits) |" in table and "| r: shape (1 edits) |" in table  # counted by row, not text


def test_curate_and_cache_refuse_an_editing_folder_instead_of_dropping_its_sources(tmp_path, capsys):
    from posttrain.cli import main
    from tests.conftest import ROOT

    folder = tmp_path / "pairs"
    folder.mkdir()
    for i, rgb in enumerate([(220, 30, 30), (30, 30, 220)] * 20):
        _png(folder / f"{i}.png", rgb)
    (folder / "captions.jsonl").write_text("".join(  # 20 unlinked pairs, so both splits have rows
        json.dumps({"file": f"{i}.png", "source": f"{i + 21 if i % 2 == 0 else i + 19}.png",
                    "caption": "swap the colour"}) + "\n" for i in range(20)))
    data = ["data.source=folder", f"data.path={folder}", "data.heldout_fraction=0.2"]
    assert main(["cache", str(ROOT / "configs/cache/emoji_tiny.yaml"), f"run_dir={tmp_path / 'c'}", *data]) == 1
    assert f"the folder '{folder}' is an editing set" in capsys.readouterr().err
    assert main(["curate", str(ROOT / "configs/curate/emoji_learned_clip.yaml"), f"run_dir={tmp_path / 'u'}", *data,
                 "~rewards", "rewards={jpeg_compressibility: 1.0}", "dedup.method=none"]) == 1
    assert "a latent cache" not in (err := capsys.readouterr().err) and "curate's output" in err
