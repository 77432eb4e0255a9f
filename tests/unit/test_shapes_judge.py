"""The shapes task's exact judge (rewards/shapes.py) on fresh renders, perturbed renders and hand-made
hard cases, and the grammar's guarantees (pretrain/data/shapes.py)."""

import math

import numpy as np
import pytest
import torch

from pretrain.data import shapes as g
from rewards.base import build_reward
from rewards.shapes import ShapesJudge

pytestmark = pytest.mark.core

FRESH_SEED = 7_000_000  # the data source renders train scenes from seed 0 up, held-out ones from 1e9 up
N_SCENES = 2000


def perturb(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """What a sample looks like next to a render: a 3x3 binomial blur, Gaussian pixel noise (sd 8), a
    per-image colour shift per channel (sd 12) and a jitter of up to 1 px in each direction."""
    x = torch.from_numpy(img).float()[None]
    k = torch.tensor([[1.0, 2, 1], [2, 4, 2], [1, 2, 1]]) / 16
    x = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (1, 1, 1, 1), mode="replicate"),
                                   k[None, None].repeat(3, 1, 1, 1), groups=3)
    dy, dx = (int(v) for v in rng.integers(-1, 2, size=2))
    x = torch.roll(x, (dy, dx), (2, 3))
    x = x + torch.from_numpy(rng.normal(0, 8, x.shape)).float() + torch.from_numpy(rng.normal(0, 12, (1, 3, 1, 1))).float()
    return x[0].clamp(0, 255).numpy()


@pytest.fixture(scope="module")
def scenes():
    specs = g.draw_specs(list(g.all_specs()), N_SCENES, seed=99)
    return [(s, g.render_spec(s, 32, FRESH_SEED + i)) for i, s in enumerate(specs)]


def test_judge_is_exact_on_fresh_and_perturbed_renders(scenes):
    judge, rng = ShapesJudge(), np.random.default_rng(0)
    clean = [judge.judge(img, s.caption).strict for s, (img, _) in scenes]
    noisy = [judge.judge(perturb(img, rng), s.caption).strict for s, (img, _) in scenes]
    assert {s.category for s, _ in scenes} == set(g.CATEGORIES)
    assert np.mean(clean) >= 0.995, np.mean(clean)
    assert np.mean(noisy) >= 0.98, np.mean(noisy)


def _scene(*objects: g.Placed) -> np.ndarray:
    return g.render(list(objects), 32)


def _judge(img, caption):
    return ShapesJudge().judge(img, caption)


def test_touching_objects_of_two_colours_are_both_read():
    img = _scene(g.Placed("square", "red", 10, 4, 10), g.Placed("circle", "blue", 10, 14, 10))  # no gap
    v = _judge(img, "a red square to the left of a blue circle")
    assert v.strict == 1.0 and sorted(o.shape for o in v.objects) == ["circle", "square"]


def test_touching_objects_of_one_colour_merge_and_fail_a_count():
    img = _scene(g.Placed("square", "red", 10, 4, 10), g.Placed("square", "red", 10, 14, 10))
    v = _judge(img, "two red squares")
    assert v.strict == 0.0 and len(v.objects) == 1


def test_off_palette_colour_is_no_object():
    img = _scene(g.Placed("circle", "red", 10, 10, 12)).astype(np.float32)
    mask = (img != 255).any(0)
    img[:, mask] = np.array([150.0, 40, 200])[:, None]  # purple: no palette colour
    v = _judge(img, "a red circle")
    assert v.strict == 0.0 and v.partial == 0.0


def test_count_off_by_one_fails_strict_with_partial_credit():
    three = _scene(*(g.Placed("triangle", "green", 3 + 14 * (i // 2), 3 + 14 * (i % 2), 9) for i in range(3)))
    v = _judge(three, "four green triangles")
    assert v.strict == 0.0
    assert v.items == {"0:shape": 0.75, "0:colour": 0.75, "0:count": 0.75}
    assert _judge(three, "three green triangles").strict == 1.0
    assert _judge(three, "two green triangles").strict == 0.0  # exact, not at least


def test_swapped_relation_fails_only_the_relation():
    img = _scene(g.Placed("circle", "red", 11, 2, 10), g.Placed("square", "blue", 11, 20, 10))
    assert _judge(img, "a red circle to the left of a blue square").strict == 1.0
    v = _judge(img, "a red circle to the right of a blue square")
    assert v.strict == 0.0 and v.items["relation"] == 0.0 and v.partial == pytest.approx(4 / 5)
    assert _judge(img, "a blue square to the right of a red circle").strict == 1.0


def test_swapped_binding_fails_the_colours():
    img = _scene(g.Placed("square", "red", 4, 4, 11), g.Placed("circle", "green", 17, 17, 11))
    assert _judge(img, "a red square and a green circle").strict == 1.0
    v = _judge(img, "a green square and a red circle")
    assert v.strict == 0.0 and v.items == {"0:shape": 1.0, "0:colour": 0.0, "1:shape": 1.0, "1:colour": 0.0}


def test_ragged_squares_stay_squares_and_ragged_discs_stay_circles():
    """Samples draw shapes with ragged outlines and speckle inside: a square with three corners chipped
    off and holes inside (fill 0.89 of its box) still fills most of its box's corners; a disc with a one-pixel bump leaves them
    nearly empty."""
    square = _scene(g.Placed("square", "blue", 10, 10, 12)).astype(np.float32)
    square[:, 10:12, 10:12] = 255  # the top-left corner chipped off (2 x 2 px)
    square[:, 20:22, 20:22] = 255  # and the bottom-right and top-right ones
    square[:, 10:12, 20:22] = 255
    square[:, 14, 13] = square[:, 17, 18] = square[:, 15, 16] = square[:, 18, 14] = 255  # speckle inside
    v = _judge(square, "a blue square")
    assert v.strict == 1.0 and [o.shape for o in v.objects] == ["square"]
    disc = _scene(g.Placed("circle", "red", 10, 10, 12)).astype(np.float32)
    disc[:, 11, 15:17] = np.array(g.COLOURS["red"], np.float32)[:, None]  # a bump on the top edge
    disc[:, 16, 15] = 255
    v = _judge(disc, "a red circle")
    assert v.strict == 1.0 and [o.shape for o in v.objects] == ["circle"]
    assert _judge(disc, "a red square").strict == 0.0 and _judge(square, "a blue circle").strict == 0.0


@pytest.mark.parametrize("kind", ["blank", "noise", "one colour", "black", "nan"])
def test_degenerate_images_score_zero_never_nan(kind):
    rng = np.random.default_rng(1)
    images = {"blank": torch.ones(1, 3, 32, 32), "noise": torch.from_numpy(rng.random((1, 3, 32, 32))).float(),
              "one colour": torch.tensor(g.COLOURS["red"]).float().view(1, 3, 1, 1).expand(1, 3, 32, 32) / 255,
              "black": torch.zeros(1, 3, 32, 32), "nan": torch.full((1, 3, 32, 32), float("nan"))}[kind]
    for metric in ("partial", "strict"):
        r = build_reward("shapes", metric=metric)(images, ["a red square"])
        assert r.tolist() == [0.0]


def test_rewards_and_categories():
    specs = [s for s in g.all_specs() if s.category == "color_attr"][:2] + [g.all_specs()[0]]
    imgs = torch.stack([torch.from_numpy(g.render_spec(s, 32, 5)[0]) for s in specs]).float() / 255
    caps = [s.caption for s in specs]
    assert build_reward("shapes_strict")(imgs, caps).tolist() == [1.0, 1.0, 1.0]
    wrong = [caps[1], caps[0], "a triangle" if caps[2] != "a triangle" else "a square"]
    partial = build_reward("shapes")(imgs, wrong)
    assert all(0 <= p < 1 for p in partial.tolist())
    assert build_reward("shapes").categories(caps) == ["color_attr", "color_attr", "single_object"]
    with pytest.raises(KeyError, match="a purple circle"):
        build_reward("shapes")(imgs[:1], ["a purple circle"])


def test_grammar_captions_are_unique_and_held_out_compositions_are_novel():
    specs = g.all_specs()
    assert len({s.caption for s in specs}) == len(specs) == 3 + 6 + 36 + 12 + 528 + 72
    assert all(g.spec_for_caption(s.caption) == s for s in specs)
    seen, novel = g.split_specs(0.25)
    assert {s.category for s in novel} == set(g.NOVEL_CATEGORIES)
    assert not {s.caption for s in seen} & {s.caption for s in novel}
    # every part of a novel composition is seen elsewhere: its colour-shape pairs and its relation
    seen_pairs = {(o.colour, o.shape) for s in seen for o in s.objects}
    seen_rel = {s.relation for s in seen}
    for s in novel:
        assert all((o.colour, o.shape) in seen_pairs for o in s.objects) and (s.relation in seen_rel | {None})
    held = g.heldout_specs(novel, seen, 8)
    assert [s.category for s in held[:6]] == list(g.CATEGORIES)
    assert all(s in novel for s in held if s.category in g.NOVEL_CATEGORIES)


def test_render_is_deterministic_and_layouts_keep_their_relation():
    spec = next(s for s in g.all_specs() if s.relation == "above")
    a, objs = g.render_spec(spec, 32, 3)
    b, _ = g.render_spec(spec, 32, 3)
    assert np.array_equal(a, b)
    (ay, ax), (by, bx) = objs[0].centre, objs[1].centre
    assert by - ay > 0 and abs(by - ay) >= 2 * abs(bx - ax)
    assert math.isclose(g.shape_mask("circle", 40).mean(), math.pi / 4, abs_tol=0.01)


def test_reading_layout_fills_cells_in_order_and_is_judged_exactly():
    specs = g.draw_specs(list(g.all_specs()), 300, seed=98)
    for i, spec in enumerate(specs):
        img, placed = g.render_spec(spec, 32, FRESH_SEED + 10_000 + i, "reading")
        cells = [(round(p.centre[0]) // 16, round(p.centre[1]) // 16) for p in placed]
        if spec.relation in ("left of", "right of"):
            assert sorted(cells) == [(0, 0), (0, 1)], (spec.caption, cells)
        elif spec.relation:
            assert sorted(cells) == [(0, 0), (1, 0)], (spec.caption, cells)
        else:
            assert cells == [(k // 2, k % 2) for k in range(len(placed))], (spec.caption, cells)
        assert ShapesJudge().judge(img, spec.caption).strict == 1.0, spec.caption
    with pytest.raises(ValueError, match="layout"):
        g.render_spec(specs[0], 32, 0, "spiral")


def test_minimal_edits_change_one_requirement_and_the_judge_sees_each():
    pos = g.spec_for_caption("a red circle to the left of a blue square")
    by_kind = g.minimal_edits(pos)
    assert [e.caption for e in by_kind["relation"] + by_kind["order"] + by_kind["binding"]] == [
        "a red circle to the right of a blue square", "a red circle above a blue square", "a red circle below a blue square",
        "a blue square to the left of a red circle", "a blue circle to the left of a red square"]
    edits = {e.caption for specs in by_kind.values() for e in specs}
    assert {"a red circle to the right of a blue square", "a red circle above a blue square",
            "a blue square to the left of a red circle", "a blue circle to the left of a red square",
            "a green circle to the left of a blue square", "a red triangle to the left of a blue square"} <= edits
    # two colours, two shapes, three relations, the objects swapped, the colours swapped
    assert pos.caption not in edits and len(edits) == 3 + 3 + 2 + 2 + 3 + 1 + 1
    flat = lambda spec: [e for specs in g.minimal_edits(spec).values() for e in specs]  # noqa: E731
    assert [e.caption for e in g.minimal_edits(g.spec_for_caption("two green squares"))["count"]] == [
        "a green square", "three green squares"]  # an exact count of one is the colours prompt
    assert [e.caption for e in g.minimal_edits(g.spec_for_caption("four green squares"))["count"]] == [
        "three green squares"]
    assert all(s not in flat(s) and len(set(flat(s))) == len(flat(s))
               and all(g.spec_for_caption(e.caption) == e for e in flat(s)) for s in g.all_specs())
    # on a correct render the judge gives the prompt 1 and every edit that changes a requirement less
    judge = build_reward("shapes")
    for k, spec in enumerate([pos, g.spec_for_caption("a red square and a green circle"),
                              g.spec_for_caption("three blue triangles")]):
        img = torch.from_numpy(g.render_spec(spec, 32, seed=k)[0]).float()[None] / 255
        caps = [e.caption for e in flat(spec)]
        scores = judge(img.expand(len(caps), -1, -1, -1), caps)
        assert float(judge(img, [spec.caption])) == 1.0
        swapped = [c for c in caps if c.startswith("a green square and a red")
                   or c.endswith("to the right of a blue square")
                   or c == "a blue square to the left of a red circle"]
        assert (len(swapped) > 0) == (spec.category != "counting")
        assert all(float(scores[caps.index(c)]) < 1.0 for c in swapped), swapped
        assert float(scores.max()) <= 1.0 and float(scores.min()) < 1.0



def test_contrast_order_is_one_for_the_judge_itself_and_zero_for_a_caption_blind_score():
    from posttrain.tools.train_judge import contrast_order

    judge = build_reward("shapes")
    specs = [g.spec_for_caption(c) for c in ("a red circle to the left of a blue square",
                                             "a red square and a green circle", "three blue triangles")]
    images = torch.stack([torch.from_numpy(g.render_spec(s, 32, seed=k)[0]) for k, s in enumerate(specs)])
    vocab: list[str] = []

    def text(captions):  # caption -> its index, so the stand-ins below can look the caption up
        vocab.extend(c for c in captions if c not in vocab)
        return torch.tensor([[float(vocab.index(c))] for c in captions])

    class Oracle(torch.nn.Module):  # the judge's own partial score as a logit
        def logits(self, x, f):
            return torch.logit(judge(x, [vocab[int(i)] for i in f[:, 0]]).clamp(1e-4, 1 - 1e-4))

    class Blind(torch.nn.Module):  # the same score for every caption
        def logits(self, x, f):
            return x.mean((1, 2, 3))

    oracle = contrast_order(Oracle(), text, images, [s.caption for s in specs], judge)
    # every edit but "a square and a circle"-style swaps changes the judge's score: colour, shape, count,
    # relation, order (position) and binding all occur among these three prompts
    assert set(oracle) == {"all", "pairs", *g.EDIT_KINDS} and oracle["pairs"] > 20
    assert all(oracle[k] == 1.0 for k in ("all", *g.EDIT_KINDS))
    blind = contrast_order(Blind(), text, images, [s.caption for s in specs], judge)
    assert blind["pairs"] == oracle["pairs"] and all(blind[k] == 0.0 for k in ("all", *g.EDIT_KINDS))
