import math

import pytest
import torch

from posttrain.dpo.errors import eps_errors
from posttrain.objectives.dpo_loss import diffusion_dpo_loss, dpo_inside_term

pytestmark = pytest.mark.core


def test_inside_term_and_sigmoid_loss_by_hand():
    ew, el = torch.tensor([0.10, 0.30]), torch.tensor([0.20, 0.25])
    rw, rl = torch.tensor([0.12, 0.30]), torch.tensor([0.18, 0.20])
    beta = 50.0
    # pair 0: (0.10 - 0.12) - (0.20 - 0.18) = -0.04 -> inside = -0.5 * 50 * -0.04 = 1.0
    # pair 1: (0.30 - 0.30) - (0.25 - 0.20) = -0.05 -> inside = 1.25
    inside = dpo_inside_term(ew, el, rw, rl, beta)
    assert inside.tolist() == pytest.approx([1.0, 1.25], abs=1e-6)
    loss, stats = diffusion_dpo_loss(ew, el, rw, rl, beta)
    expected = (math.log(1 + math.exp(-1.0)) + math.log(1 + math.exp(-1.25))) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["implicit_acc"] == 1.0 and stats["reward_margin"] == pytest.approx(1.125, abs=1e-6)
    assert stats["err_diff_w"] == pytest.approx(-0.01, abs=1e-6)
    assert stats["err_diff_l"] == pytest.approx(0.035, abs=1e-6)


def test_policy_equal_to_reference_gives_log2_and_half_accuracy():
    e = torch.tensor([0.3, 0.1, 0.7])
    loss, stats = diffusion_dpo_loss(e, e.flip(0), e, e.flip(0), beta=5000.0)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert stats["implicit_acc"] == 0.5  # inside == 0: ties count 0.5


def test_alternative_losses_by_hand():
    ew, el, rw, rl = torch.tensor([0.1]), torch.tensor([0.2]), torch.tensor([0.2]), torch.tensor([0.2])
    # inside = -0.5 * 10 * (-0.1 - 0) = 0.5
    assert diffusion_dpo_loss(ew, el, rw, rl, 10.0, "hinge")[0].item() == pytest.approx(0.5)
    assert diffusion_dpo_loss(ew, el, rw, rl, 10.0, "ipo")[0].item() == pytest.approx(0.0, abs=1e-12)
    # inside = 2.0: hinge 0, ipo (2 - 0.5)^2 = 2.25; inside = -1: hinge 2, ipo 2.25
    ew2 = torch.tensor([0.1 - 0.3])
    assert diffusion_dpo_loss(ew2, el, rw, rl, 10.0, "hinge")[0].item() == pytest.approx(0.0)
    assert diffusion_dpo_loss(ew2, el, rw, rl, 10.0, "ipo")[0].item() == pytest.approx(2.25, abs=1e-5)
    ew3 = torch.tensor([0.4])
    assert diffusion_dpo_loss(ew3, el, rw, rl, 10.0, "hinge")[0].item() == pytest.approx(2.0, abs=1e-6)
    assert diffusion_dpo_loss(ew3, el, rw, rl, 10.0, "ipo")[0].item() == pytest.approx(2.25, abs=1e-5)
    with pytest.raises(ValueError, match="dpo.loss_type"):
        diffusion_dpo_loss(ew, el, rw, rl, 1.0, "kto")


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_a_tie_is_symmetric(loss_type):
    ew = torch.tensor([0.1], requires_grad=True)
    el, rw, rl = torch.tensor([0.3]), torch.tensor([0.2]), torch.tensor([0.2])
    tie = torch.tensor([0.5])
    a, stats = diffusion_dpo_loss(ew, el, rw, rl, 10.0, loss_type, pref=tie)
    b, _ = diffusion_dpo_loss(el, ew, rl, rw, 10.0, loss_type, pref=tie)  # images listed the other way
    assert a.item() == pytest.approx(b.item(), abs=1e-7)
    assert stats["implicit_acc"] == 0.5  # ties are not scored
    # at policy == reference a tie pulls neither way
    e = torch.tensor([0.2], requires_grad=True)
    loss, _ = diffusion_dpo_loss(e, torch.tensor([0.3]), torch.tensor([0.2]), torch.tensor([0.3]), 10.0,
                                 loss_type, pref=tie)
    loss.backward()
    assert abs(e.grad.item()) < 1e-6


def test_strict_and_tie_pairs_mixed():
    ew, el = torch.tensor([0.1, 0.1]), torch.tensor([0.2, 0.1])
    rw, rl = torch.tensor([0.2, 0.1]), torch.tensor([0.2, 0.1])
    loss, stats = diffusion_dpo_loss(ew, el, rw, rl, 10.0, pref=torch.tensor([1.0, 0.5]))
    # pair 0: -log sigmoid(0.5); pair 1 (tie, inside 0): 0.5 * (log 2 + log 2)
    expected = (math.log(1 + math.exp(-0.5)) + math.log(2)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["implicit_acc"] == 1.0  # only the strict pair is scored


def test_eps_prediction_errors_on_a_tiny_unet():
    from diffusers import DDPMScheduler, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                attention_head_dim=8, norm_num_groups=8).eval()
    sched = DDPMScheduler(num_train_timesteps=1000)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(4, 4, 8, 8, generator=g)
    noise = torch.randn(2, 4, 8, 8, generator=g).repeat(2, 1, 1, 1)  # winners and losers share noise
    t = torch.tensor([10, 900]).repeat(2)
    ehs = torch.randn(2, 5, 16, generator=g).repeat(2, 1, 1)
    with torch.no_grad():
        err = eps_errors(unet, sched, x0, ehs, noise, t)
        a = sched.alphas_cumprod[t].view(-1, 1, 1, 1)
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
        by_hand = (unet(x_t, t, encoder_hidden_states=ehs).sample - noise).square().mean(dim=(1, 2, 3))
    assert err.shape == (4,) and err.dtype == torch.float32
    torch.testing.assert_close(err, by_hand)
    # rows 0/2 and 1/3 share noise and timestep: identical images give identical errors
    same = eps_errors(unet, sched, x0[:2].repeat(2, 1, 1, 1), ehs, noise, t)
    assert torch.equal(same[:2], same[2:])
