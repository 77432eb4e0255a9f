import pytest
import torch

from pretrain.seeding import randn_per_sample, seed_for

pytestmark = pytest.mark.core


def test_noise_depends_on_global_index_not_on_batch_layout():
    full = randn_per_sample((3, 4, 4), seed=7, step=2, indices=range(6))
    # two "ranks" each drawing their half
    a = randn_per_sample((3, 4, 4), seed=7, step=2, indices=range(0, 3))
    b = randn_per_sample((3, 4, 4), seed=7, step=2, indices=range(3, 6))
    assert torch.equal(torch.cat([a, b]), full)


def test_seed_keys_separate_streams_and_steps():
    assert seed_for(0, "train", 1, 5) != seed_for(0, "eval", 1, 5)
    assert seed_for(0, "train", 1, 5) != seed_for(0, "train", 2, 5)
    assert seed_for(0, "train", 1, 5) == seed_for(0, "train", 1, 5)


def test_shared_initial_noise_is_one_draw_per_group_and_rank_free():
    from rollout.noise import rollout_noise

    shape = (3, 2, 4, 4)
    own_init, own_steps = rollout_noise(shape, 5, seed=1, step=3, sample_ids=list(range(8)))
    init, steps = rollout_noise(shape, 5, seed=1, step=3, sample_ids=list(range(8)), shared_group_size=4)
    assert torch.equal(steps, own_steps)  # the per-transition noise stays each sample's own
    assert all(torch.equal(init[i], init[0]) for i in range(4)) and all(torch.equal(init[i], init[4]) for i in range(4, 8))
    assert not torch.equal(init[0], init[4]) and not torch.equal(init[0], own_init[0])
    # a rank holding the second group draws the same noise for it
    share, _ = rollout_noise(shape, 5, seed=1, step=3, sample_ids=list(range(4, 8)), shared_group_size=4)
    assert torch.equal(share, init[4:])
