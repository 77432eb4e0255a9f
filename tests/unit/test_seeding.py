import torch

from pretrain.seeding import randn_per_sample, seed_for


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
