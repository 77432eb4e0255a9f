"""The shapes task's evaluation: clustered paired SE, per-category table rows, pass/fail grid frames,
per-category guard curves and panels, and the shapes data source."""

import math

import numpy as np
import PIL.Image
import pytest
import torch

from posttrain.base.guard import Guard
from posttrain.eval.evaluate import paired_stats, report_table
from posttrain.eval.plots import panels
from pretrain.data import dataset as ds
from pretrain.data import shapes
from pretrain.grid import FAIL_RGB, PASS_RGB, edit_cells, grid_image
from pretrain.text_encoder import NoTextEmbeds, PromptEmbeds
from rewards.base import build_reward
from rewards.shapes import ShapesReward

pytestmark = pytest.mark.core

NAN = float("nan")


def test_paired_stats_clusters_rows_of_one_prompt_in_the_se():
    base = torch.zeros(4, 2)
    other = torch.tensor([[0.0, 2.0], [3.0, 3.0], [1.0, 3.0], [6.0, 6.0]])  # row diffs 1, 3, 2, 6
    # mean over rows 3; cluster sums of residuals a = -2 + 0, b = -1, c = 3: SE = sqrt(3/2 * 14) / 4
    d, se, n = paired_stats(base, other, ["a", "a", "b", "c"])
    assert (d, se, n) == pytest.approx((3.0, math.sqrt(21) / 4, 3))
    # without clusters: the per-row formula, mean 3, SE = sqrt(14/3) / sqrt(4), 4 rows
    d, se, n = paired_stats(base, other)
    assert (d, se, n) == pytest.approx((3.0, math.sqrt(14 / 3) / 2, 4))
    assert paired_stats(base, other, ["a", "b", "c", "d"]) == pytest.approx(paired_stats(base, other))
    # NaN rows are dropped before clustering: one more "a" row and a lone "e" row change nothing
    base_n, other_n = torch.cat([base, torch.zeros(2, 2)]), torch.cat([other, torch.tensor([[NAN, 9.0], [1.0, NAN]])])
    d, se, n = paired_stats(base_n, other_n, ["a", "a", "b", "c", "a", "e"])
    assert (d, se, n) == pytest.approx((3.0, math.sqrt(21) / 4, 3))


def _cells(table: str, label: str) -> list[str]:
    rows = [line for line in table.splitlines() if line.startswith(f"| {label} |")]
    assert len(rows) == 1, (label, table)
    return [c.strip() for c in rows[0].strip("|").split("|")][1:]


def test_report_table_adds_one_row_per_category():
    t0 = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    t1 = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    results = {"models": ["m0", "m1"], "rewards": {"shapes_strict": [t0, t1], "jpeg": [t0, t0]},
               "guard": [0.1, 0.2], "grids": ["g0", "g1"], "prompts": ["p", "p", "q", "r"],
               "categories": {"shapes_strict": ["counting", "counting", "colors", "counting"]}}
    table = report_table(results)
    cat_rows = [line for line in table.splitlines() if line.startswith("| shapes_strict: ")]
    assert [r.split("|")[1].strip() for r in cat_rows] == ["shapes_strict: counting (2 prompts)",
                                                          "shapes_strict: colors (1 prompts)"]
    assert not any(line.startswith("| jpeg: ") for line in table.splitlines())
    # counting: rows 0, 1, 3; means 3/6 and 5/6; diffs 0.5, 0.5, 0 -> mean 1/3; cluster residual sums
    # p +1/3, r -1/3: SE = sqrt(2 * 2/9) / 3 = 2/9, z 1.5
    assert _cells(table, "shapes_strict: counting (2 prompts)") == ["0.5000", "0.8333", "+0.3333 (0.2222)", "+1.5"]
    assert _cells(table, "shapes_strict: colors (1 prompts)") == ["1.0000", "0.0000", "-1.0000 (nan)", "n/a"]
    # the overall row: the difference of the means shown (0), SE clustered by prompt: residual sums
    # p +1, q -1, r 0 -> sqrt(3/2 * 2) / 4
    assert _cells(table, "shapes_strict (mean)") == ["0.6250", "0.6250", f"+0.0000 ({math.sqrt(3) / 4:.4f})", "+0.0"]


def test_grid_image_marks_frame_cells_inside():
    colours = torch.tensor([[0.2, 0.4, 0.6], [0.9, 0.1, 0.5], [0.3, 0.7, 0.1]])
    images = colours[:, :, None, None].expand(3, 3, 4, 4).contiguous()
    caps = ["a", "b", "c"]
    plain = np.asarray(grid_image(images, caps, cols=3, scale=3))
    marked = np.asarray(grid_image(images, caps, cols=3, scale=3, marks=[True, False, None]))
    own = [tuple(int(v) for v in (c * 255).round()) for c in colours]
    cw = 12  # 4 px x scale 3
    assert tuple(marked[0, 0]) == PASS_RGB and tuple(marked[cw - 1, cw - 1]) == PASS_RGB  # inside cell 0
    assert tuple(marked[0, cw]) == FAIL_RGB and tuple(marked[cw - 1, 2 * cw - 1]) == FAIL_RGB
    assert tuple(marked[0, 2 * cw]) == own[2] == tuple(plain[0, 2 * cw])
    assert tuple(marked[cw // 2, cw // 2]) == own[0]  # the cell's middle is the image
    assert np.array_equal(np.asarray(grid_image(images, caps, cols=3, scale=3, marks=None)), plain)
    assert np.array_equal(np.asarray(grid_image(images, caps, cols=3, scale=3, marks=[None] * 3)), plain)
    assert not np.array_equal(marked, plain)


def test_an_edit_grid_shows_each_source_beside_its_output_under_one_caption():
    outputs, sources = torch.full((2, 3, 4, 4), 0.2), torch.full((4, 3, 4, 4), 0.8)  # sources: k = 2 samples x 2
    sources[1] = 0.5
    prompts = ["a red circle; make the red circle blue", "no separator"]
    cells, captions, marks, span = edit_cells(outputs, prompts, [True, False], sources)
    assert span == 2 and captions == ["make the red circle blue", "no separator"] and marks == [None, True, None, False]
    assert [float(c.mean()) for c in cells] == pytest.approx([0.8, 0.2, 0.5, 0.2])  # source 0, output 0, source 1, ...
    assert edit_cells(outputs, prompts, None, None) == (outputs, prompts, None, 1)
    grid = np.asarray(grid_image(cells, captions, cols=3, scale=3, marks=marks, span=2))  # 3 columns -> 2
    cw, label = 12, 12
    assert grid.shape[:2] == (2 * (cw + label), 2 * cw)  # two pairs, one per row
    assert tuple(grid[0, 0]) == (204, 204, 204) and tuple(grid[0, cw]) == PASS_RGB  # the source is not framed
    under_first, under_second = grid[cw:cw + label, :cw], grid[cw:cw + label, cw:]
    assert (under_first < 128).any() and (under_second < 128).any()  # one caption written across both cells
    with pytest.raises(ValueError, match="4 images for 3 captions of 2 cell"):
        grid_image(cells, captions + ["x"], span=2)


def test_an_edit_grid_of_videos_holds_each_source_still_at_the_clips_size(tmp_path):
    from pretrain.sampling import save_grid

    videos = torch.rand(2, 3, 3, 4, 4)  # 2 clips of 3 frames, 4 x 4
    sources = torch.full((2, 3, 8, 8), 0.25)  # a first frame at another size (e.g. Wan image-to-video)
    cells, captions, _, span = edit_cells(videos, ["a; first", "b; second"], None, sources)
    assert cells.shape == (4, 3, 3, 4, 4) and captions == ["first", "second"] and span == 2
    assert torch.allclose(cells[0], torch.full((3, 3, 4, 4), 0.25)) and torch.equal(cells[1], videos[0])
    png = np.asarray(PIL.Image.open(save_grid(videos, ["a; first", "b; second"], tmp_path / "grid.png",
                                              sources=sources)).convert("RGB"))
    assert png.shape[1] == 4 * (3 * 4 * 3)  # 4 cells of 3-frame strips, upscaled 3x
    assert (tmp_path / "grid.gif").is_file() and (tmp_path / "grid.mp4").is_file()


def test_guard_per_category_means_of_registered_shapes_strict():
    by_cat = {}
    for s in shapes.all_specs():
        by_cat.setdefault(s.category, []).append(s.caption)
    prompts = [by_cat["counting"][0], by_cat["colors"][0], by_cat["counting"][5], by_cat["position"][0],
               by_cat["counting"][9]]
    guard = Guard.__new__(Guard)
    guard.fns = {"shapes_strict": build_reward("shapes_strict"), "plain": lambda images, prompts, metadata=None: 0}
    out = guard.per_category({"shapes_strict": [1.0, 0.0, 0.0, NAN, 1.0], "plain": [0.0] * 5}, prompts)
    assert set(out) == {"guard/shapes_strict/counting", "guard/shapes_strict/colors", "guard/shapes_strict/position"}
    assert out["guard/shapes_strict/counting"] == pytest.approx(2 / 3)
    assert out["guard/shapes_strict/colors"] == 0.0
    assert math.isnan(out["guard/shapes_strict/position"])


def test_panels_put_the_per_category_panel_after_its_guard():
    xy = (np.arange(3.0), np.zeros(3))
    series = {k: xy for k in ("guard/shapes_strict", "guard/shapes_strict/counting", "guard/shapes_strict/colors",
                              "guard/trained", "loss")}
    out = panels(series)
    i = out.index(("guard/shapes_strict", ["guard/shapes_strict"]))
    assert out[i + 1] == ("guard/shapes_strict per category",
                          ["guard/shapes_strict/colors", "guard/shapes_strict/counting"])
    assert ("guard/trained", ["guard/trained"]) in out
    titles = [t for t, _ in out]
    assert "guard/trained per category" not in titles
    assert not any(t.startswith("guard/shapes_strict/") for t in titles)


class _LengthEncoder:
    cache_key = "fake-length-1"

    def encode(self, prompts) -> PromptEmbeds:
        n = torch.tensor([float(len(p)) for p in prompts])
        o = torch.tensor([float(sum(map(ord, p)) % 997) for p in prompts])
        return PromptEmbeds(torch.stack([n, o], 1)[:, None, :], torch.stack([o, n, -n], 1))


def test_shapes_source_through_build_datasets(tmp_path, monkeypatch):
    cfg = ds.DataConfig(source="shapes", scenes=64, heldout_per_category=4, heldout_fraction=0.25,
                        cache_dir=str(tmp_path))
    train, held = ds.build_datasets(cfg, NoTextEmbeds())
    assert len(train) == 64 and len(held) == 24
    assert train.images.shape == (64, 3, 32, 32) and train.images.dtype == torch.uint8
    assert ShapesReward.categories(held.captions[:6]) == list(shapes.CATEGORIES)
    novel = [c for c, k in zip(held.captions, ShapesReward.categories(held.captions))
             if k in shapes.NOVEL_CATEGORIES]
    assert len(novel) == 12 and not set(novel) & set(train.captions)
    images, embeds, caps = train.batch([0, 5, 63])
    assert images.dtype == torch.float32 and 0 <= float(images.min()) and float(images.max()) <= 1
    assert torch.equal(images, train.images[[0, 5, 63]].float() / 255) and float(images.min()) < 1
    assert caps == [train.captions[i] for i in (0, 5, 63)] and embeds.tokens.shape == (3, 1, 1)

    def boom(*a, **k):
        raise AssertionError("re-rendered instead of reading the cache")

    monkeypatch.setattr(shapes, "render_spec", boom)
    train2, held2 = ds.build_datasets(cfg, _LengthEncoder())
    assert torch.equal(train2.images, train.images) and torch.equal(held2.images, held.images)
    assert train2.captions == train.captions and held2.captions == held.captions

    enc = _LengthEncoder()
    for s in (train2, held2):
        assert isinstance(s.embeds, ds.IndexedEmbeds) and len(s.embeds) == len(s)
        assert s.embeds.unique.tokens.shape[0] == len(set(s.captions)) < len(s)
        idx = list(range(len(s)))
        got, want = s.embeds[idx], enc.encode(s.captions)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.pooled, want.pooled)
        got = s.embeds[torch.tensor([3, 1])]
        assert torch.equal(got.pooled, enc.encode([s.captions[3], s.captions[1]]).pooled)


def test_shapes_config_validation_names_scenes():
    with pytest.raises(ValueError, match=r"data\.scenes"):
        ds.DataConfig(source="shapes", scenes=0).validate("data.")
    ds.DataConfig(source="shapes", scenes=1).validate("data.")
