"""GRPO's pre-training loss (``data_loss``, PPO-ptx): which images and draws it takes, and that it adds
``weight`` times its gradient to every mini-batch's gradient in both update engines."""

import pytest
import torch

from posttrain.grpo.update import GRPOAlgorithmConfig
from pretrain.runtime.config import OptimConfig, RuntimeConfig
from pretrain.runtime.runtime import Runtime
from tests.conftest import grpo_config
from tests.integration.test_grpo import STEPS, _rollout, _setup

pytestmark = pytest.mark.core


def test_grpo_data_loss_is_the_flow_matching_loss_of_drawn_train_images(tiny_export, tmp_path):
    """Mini-batch ``number`` of an iteration takes ``batch_size`` train images drawn by (seed,
    "data_loss_images", iteration, number) and their noise and sigma by (seed, "data_loss", iteration,
    number * batch + i), without prompt dropout; the value is weighted, and an iteration logs it."""
    from posttrain.grpo.stage import GRPORun
    from pretrain.flow import flow_matching_loss, interpolate
    from pretrain.schedule import sample_training_sigmas
    from pretrain.seeding import generator_for

    run = GRPORun(grpo_config(tmp_path, tiny_export, "data_loss.weight=0.5", "data_loss.batch_size=3",
                              "train.steps=1", "data.limit=16", "eval.every=0", "guard.every=0"))
    st = run.st
    idx = torch.randint(len(st.train_set), (3,), generator=generator_for(0, "data_loss_images", 2, 1)).tolist()
    images, embeds, _ = st.train_set.batch(idx)
    x0 = st.codec.encode(images)
    gens = [generator_for(0, "data_loss", 2, 3 + i) for i in range(3)]
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens])
    sigma = sample_training_sigmas(gens, 0.0, 1.0, 1.0)
    with torch.no_grad():
        want = flow_matching_loss(st.policy.model(interpolate(x0, noise, sigma), sigma, embeds), x0, noise).mean()
        got, stats = run.data_loss(2, 1)
    assert want.item() > 0
    assert abs(got.item() - 0.5 * want.item()) <= 1e-6 and abs(stats["data_loss"] - want.item()) <= 1e-6
    metrics = run.train_step()
    assert metrics["data_loss"] > 0


@pytest.mark.parametrize("loss", [{"name": "ppo_clip_kl", "clip_range": 0.2, "beta": 0.04}, {"name": "nft"}])
def test_the_extra_term_adds_its_gradient_to_each_mini_batch(tiny_export, loss):
    """Both update engines: the gradient of an optimizer step with the extra term equals the gradient
    without it plus the term's own gradient (the term: the pre-training loss's form, a weighted
    flow-matching loss of the policy on fixed images)."""
    from pretrain.flow import flow_matching_loss, interpolate

    model, codec, train, null, policy, meta = _setup(tiny_export)
    traj = _rollout(model, codec, train, null, meta, n_prompts=2, group=2, batch=4)  # 4 samples
    images, embeds, _ = train.batch([5, 6])
    x0 = codec.encode(images)
    g = torch.Generator().manual_seed(3)
    noise, sigma = torch.randn(x0.shape, generator=g), torch.tensor([0.3, 0.8])

    def term():
        return 2.0 * flow_matching_loss(policy.model(interpolate(x0, noise, sigma), sigma, embeds), x0, noise).mean()

    params = [p for p in model.parameters() if p.requires_grad]

    def step_grads(extra):
        rt = Runtime(model, RuntimeConfig(steps=1, grad_accum=1), OptimConfig(lr=0.0, weight_decay=0.0),
                     torch.device("cpu"), "/tmp/unused")
        seen = []
        step = rt.optimizer_step
        rt.optimizer_step = lambda *a: (seen.append([p.grad.clone() for p in params]), step(*a))[1]
        cfg = GRPOAlgorithmConfig(loss=loss)
        update = cfg.build().update(cfg, None, policy)
        update(policy, rt, traj, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4, dtype=torch.bool),
               transitions=list(range(STEPS)), mini_batch_size=4, seed=0, iteration=0, extra=extra)
        model.zero_grad(set_to_none=True)
        return seen[0]

    plain = step_grads(None)
    both = step_grads(lambda number: (term(), {"data_loss": 0.0}))
    model.train()
    term().backward()
    own = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    assert max(float(o.abs().max()) for o in own) > 1e-4
    for a, b, c in zip(plain, both, own):
        assert torch.allclose(b, a + c, atol=1e-6, rtol=1e-4)
