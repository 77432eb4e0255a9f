"""The shapes editing task's data: every edit of the grammar once, its prompt looked up (not parsed), and
renders where the exact judge passes the target and fails the source on exactly the edited requirement,
with every pixel outside the edited object unchanged."""

import numpy as np
import pytest

from pretrain.data import shapes
from pretrain.data.shapes import all_edits, edit_for_prompt, is_novel_edit, render_edit
from rewards.shapes import ShapesJudge

pytestmark = pytest.mark.core


def test_every_edit_once_with_a_prompt_that_names_it():
    edits = all_edits()
    # colour edits: 3 other colours per object; shape edits: 2 other shapes where the grammar has the target
    assert len(edits) == 5292 and len({e.prompt for e in edits}) == len(edits)
    e = edit_for_prompt("a red square and a green circle; turn the green circle into a triangle")
    assert (e.op, e.index, e.target.caption) == ("shape", 1, "a red square and a green triangle")
    e = edit_for_prompt("a red circle to the left of a blue square; make the blue square yellow")
    assert (e.op, e.index, e.target.caption) == ("colour", 1, "a red circle to the left of a yellow square")
    assert all(edit_for_prompt(x.prompt) is x for x in edits[::97])
    with pytest.raises(KeyError, match="'make it pink' is not an edit prompt"):
        edit_for_prompt("make it pink")
    held = [x for x in edits if is_novel_edit(x, 0.25)]
    assert 0.2 < len(held) / len(edits) < 0.3


def test_the_judge_passes_the_target_and_fails_the_source_only_where_edited():
    judge, rng = ShapesJudge(), np.random.default_rng(0)
    edits = all_edits()
    for k in rng.choice(len(edits), size=300, replace=False):
        e = edits[int(k)]
        source, target, placed = render_edit(e, 32, seed=int(k))
        assert judge.judge(target, e.target.caption).strict == 1.0, e.prompt
        assert judge.judge(source, e.source.caption).strict == 1.0, e.prompt
        items = judge.judge(source, e.target.caption).items
        mine = [v for k, v in items.items() if k.startswith(f"{e.index}:")]
        assert min(mine) < 1.0, (e.prompt, items)  # the edited object's requirement fails on the source
        kept = [k for k in items if k.split(":")[0] not in (str(e.index), "relation")]
        assert all(items[k] == 1.0 for k in kept), (e.prompt, items)  # the others hold on both
        o = placed[e.index]
        outside = np.ones((32, 32), bool)
        outside[o.y:o.y + o.side, o.x:o.x + o.side] = False
        assert np.array_equal(source[:, outside], target[:, outside]), e.prompt
        assert not np.array_equal(source, target)


def test_the_sources_are_the_grammars_own_colour_scenes():
    cats = {e.source.category for e in all_edits()}
    assert cats == {"colors", "position", "color_attr"}
    assert all(all(o.colour is not None and o.count == 1 for o in e.source.objects) for e in all_edits())
    assert all(e.target in shapes.all_specs() for e in all_edits()[::50])


def test_the_edit_reward_judges_against_the_target():
    import torch

    from rewards.base import build_reward

    e = edit_for_prompt("a red square and a green circle; make the red square blue")
    source, target, _ = render_edit(e, 32, seed=3)
    images = torch.from_numpy(np.stack([target, source])).float() / 255
    strict = build_reward("shapes_edit", metric="strict")
    assert strict(images, [e.prompt] * 2).tolist() == [1.0, 0.0]
    partial = build_reward("shapes_edit")(images, [e.prompt] * 2).tolist()
    assert partial[0] == 1.0 and partial[1] == 0.75  # the source misses the blue square's colour: 3 of 4 items
    assert strict.categories([e.prompt]) == ["colour"]


def test_the_editing_source_gives_prompts_their_source_images(tmp_path):
    """``data.source: shapes_edit``: targets as images, sources as conditioning images, which the batch
    encodes with the attached codec into the prompts' images (and refuses without one); held-out edits
    are never trained on, and a held-out prompt's embeddings carry its own source."""
    import torch

    from pretrain.codec import PatchifyCodec
    from pretrain.data.dataset import DataConfig, attach_codec, build_datasets
    from pretrain.text_encoder import NoTextEmbeds

    cfg = DataConfig(source="shapes_edit", scenes=48, heldout_per_category=4, heldout_fraction=0.25, size=32,
                     layout="reading", cache_dir=str(tmp_path))
    train, held = build_datasets(cfg, NoTextEmbeds())
    assert len(train) == 48 and len(held) == 8 and not set(train.captions) & set(held.captions)
    with pytest.raises(ValueError, match="no codec is attached"):
        train.batch([0])
    codec = PatchifyCodec(1)
    attach_codec(codec, train, held)
    images, embeds, captions = train.batch([0, 5])
    e = edit_for_prompt(captions[1])
    assert torch.equal(embeds.images, codec.encode(train.conditions[torch.tensor([0, 5])].float() / 255))
    judge = ShapesJudge()
    assert judge.judge(train.conditions[5].numpy(), e.source.caption).strict == 1.0  # the source scene
    assert judge.judge((images[1] * 255).round().byte().numpy(), e.target.caption).strict == 1.0  # the target
    got = held.prompt_embeds([held.captions[3]], NoTextEmbeds())
    assert torch.equal(got.images, codec.encode(held.conditions[3:4].float() / 255))
    assert {edit_for_prompt(c).op for c in held.captions} == {"colour", "shape"}


def test_the_preservation_score_reads_the_source_image():
    """``shapes_edit_preserved``: 1.0 for the exact target of every edit kind (nothing outside the edited
    object moved), lower for an edit drawn on another object, the share of the source's background
    outside the box for a blank image; ``shapes_edit`` with ``preserve`` mixes it in; no source, a clear error."""
    import torch

    from rewards.base import build_reward
    from rewards.shapes import edit_box

    judge, rng, edits = ShapesJudge(), np.random.default_rng(1), all_edits()
    for k in rng.choice(len(edits), size=200, replace=False):  # every edit kind: the target keeps the rest
        e = edits[int(k)]
        source, target, _ = render_edit(e, 32, seed=int(k))
        both = torch.from_numpy(np.stack([target, source])).float() / 255
        kept = build_reward("shapes_edit_preserved")(both[:1], [e.prompt], {"source_images": both[1:]})
        assert kept.tolist() == [1.0], e.prompt
    e = edit_for_prompt("a red square and a green circle; make the red square blue")
    source, target, _ = render_edit(e, 32, seed=3)
    wrong = edit_for_prompt("a red square and a green circle; make the green circle blue")
    _, wrong_target, _ = render_edit(wrong, 32, seed=3)  # the other object edited instead
    blank = np.full_like(source, 255)
    images = torch.from_numpy(np.stack([target, wrong_target, blank])).float() / 255
    meta = {"source_images": torch.from_numpy(np.stack([source] * 3)).float() / 255}
    kept = build_reward("shapes_edit_preserved")(images, [e.prompt] * 3, meta)
    src_label = judge.pixel_labels(source.transpose(1, 2, 0).astype(np.float32))
    outside = ~edit_box(judge, src_label, "red", "square", 2)
    background = float((src_label[outside] == len(shapes.COLOURS)).mean())
    assert kept[0] == 1.0 and 0.8 < kept[1] < 1.0 and kept[2] == pytest.approx(background, abs=1e-6)
    judged = build_reward("shapes_edit")(images, [e.prompt] * 3)
    mixed = build_reward("shapes_edit", preserve=0.25)(images, [e.prompt] * 3, meta)
    assert torch.allclose(mixed, 0.75 * judged + 0.25 * kept)
    with pytest.raises(ValueError, match=r"rewards.shapes_edit: needs metadata\['source_images'\]"):
        build_reward("shapes_edit", preserve=0.25)(images, [e.prompt] * 3)
    with pytest.raises(ValueError, match="preserve: must be in"):
        build_reward("shapes_edit", preserve=1.5)


def test_the_stand_in_scores_an_edit_against_its_target_caption(tmp_path):
    """``learned_judge_edit`` = ``learned_judge`` on the edit's target caption, with the gradient kept."""
    import torch

    from rewards.base import build_reward
    from rewards.learned_clip import LearnedClipConfig
    from rewards.learned_judge import JudgeNet, save_learned_judge

    torch.manual_seed(0)
    save_learned_judge(JudgeNet(LearnedClipConfig(image_size=32, width=8, embed_dim=16, text_path=None)), tmp_path)
    e = edit_for_prompt("a red square and a green circle; make the red square blue")
    source, target, _ = render_edit(e, 32, seed=3)
    images = (torch.from_numpy(np.stack([target, source])).float() / 255).requires_grad_(True)
    edit = build_reward("learned_judge_edit", path=str(tmp_path))
    plain = build_reward("learned_judge", path=str(tmp_path))
    got = edit.score(images, [e.prompt] * 2)
    assert torch.allclose(got, plain.score(images, [e.target.caption] * 2))
    assert not torch.allclose(got, plain.score(images, [e.prompt] * 2))
    got.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0


def test_eval_draws_more_held_out_edits_without_changing_training(tmp_path):
    """``posttrain eval --data heldout_per_category=N`` (:func:`posttrain.eval.evaluate.eval_data`): the
    export's recorded data with the item applied; the longer held-out list keeps the shorter one's edits of
    each kind first, every edit in it is held out, and the training rows are the same edits and images."""
    import json

    import torch

    from posttrain.eval.evaluate import eval_data
    from pretrain.data.builtin import load_shapes_edit
    from pretrain.data.dataset import DataConfig

    recorded = dict(source="shapes_edit", scenes=48, heldout_per_category=4, heldout_fraction=0.25, size=32,
                    layout="reading", cache_dir=str(tmp_path))
    (tmp_path / "posttrain.json").write_text(json.dumps({"data": recorded}))
    assert eval_data(tmp_path, []) is None
    assert eval_data(tmp_path / "pipeline", ["scenes=16"]) == DataConfig(scenes=16)  # records none: the defaults
    small, big = eval_data(tmp_path, ["scenes=48"]), eval_data(tmp_path, ["heldout_per_category=12"])
    assert (small.heldout_per_category, big.heldout_per_category, big.scenes) == (4, 12, 48)
    a, b = load_shapes_edit(small), load_shapes_edit(big)
    held = lambda d, op: [c for c, h in zip(d["captions"], d["heldout"]) if h and edit_for_prompt(c).op == op]
    for op in shapes.EDIT_OPS:
        assert held(b, op)[:4] == held(a, op) and len(held(b, op)) == 12
        assert all(is_novel_edit(edit_for_prompt(c), 0.25) for c in held(b, op))
    assert a["captions"][:48] == b["captions"][:48] and torch.equal(a["images"][:48], b["images"][:48])
    with pytest.raises(ValueError, match="--data.heldout_per_categry"):
        eval_data(tmp_path, ["heldout_per_categry=8"])
    with pytest.raises(ValueError, match="must look like key=value"):
        eval_data(tmp_path, ["heldout_per_category"])
    with pytest.raises(ValueError, match="'layout=\\[': the value is not YAML"):
        eval_data(tmp_path, ["layout=["])
    with pytest.raises(ValueError, match="size cannot be set"):  # each model samples at its own size
        eval_data(tmp_path, ["size=64"])
    # a pipeline's eval.data: the same items over its first stage's data, checked when the config loads
    from posttrain.eval.evaluate import EvalConfig, with_data_overrides

    assert with_data_overrides(small, ["heldout_per_category=12"], "eval.data") == big
    assert with_data_overrides(small, [], "eval.data") is small
    with pytest.raises(ValueError, match="eval.data.heldout_per_categry: not a field of the data config"):
        EvalConfig(rewards=["shapes_edit_strict"], data=["heldout_per_categry=8"]).validate("eval.")


def test_the_evaluation_runs_without_autograd(tmp_path, monkeypatch):
    """``evaluate`` loads, samples and scores with gradients off (an export's parameters require grad)."""
    import torch

    from posttrain.eval import evaluate as ev

    seen = []

    def load(*args, **kwargs):
        seen.append(torch.is_grad_enabled())
        raise RuntimeError("stop here")

    monkeypatch.setattr(ev, "load_exported", load)
    with pytest.raises(RuntimeError, match="stop here"):
        ev.evaluate([str(tmp_path)], ev.EvalConfig(rewards=["shapes_edit_strict"]), tmp_path / "eval")
    assert seen == [False] and torch.is_grad_enabled()
