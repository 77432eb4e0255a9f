"""Diffusion-SDPO (``dpo.sdpo_mu``): the winner-preserving scale in closed form, the first-order guarantee
it is built on, and on the tiny preset a loss whose value is Diffusion-DPO's and whose gradient is the
winners' part plus lambda times the losers'."""

import pytest
import torch

from posttrain.objectives.dpo_loss import scale_gradient, winner_preserving_scale

pytestmark = pytest.mark.core


def test_winner_preserving_scale_by_hand():
    rw = torch.tensor([[1.0, 0.0]])
    assert winner_preserving_scale(rw, torch.tensor([[4.0, 0.0]]), 0.0).item() == pytest.approx(0.25)  # 1 / 4
    assert winner_preserving_scale(rw, torch.tensor([[4.0, 0.0]]), 0.5).item() == pytest.approx(0.125)
    assert winner_preserving_scale(rw, torch.tensor([[0.5, 3.0]]), 0.0).item() == 1.0  # bound 2, clamped to 1
    assert winner_preserving_scale(rw, torch.tensor([[-1.0, 2.0]]), 0.0).item() == 1.0  # opposed: unconstrained
    assert winner_preserving_scale(rw, torch.tensor([[4.0, 0.0]]), 1.0).item() == 0.0  # mu 1: losers frozen
    with pytest.raises(ValueError, match="sdpo_mu"):
        winner_preserving_scale(rw, rw, 1.5)


def test_the_scaled_step_keeps_the_winners_error_falling():
    """(-g_w + lambda g_l) . g_w <= -mu ||g_w||^2 for aligned residuals, with equality where the bound binds."""
    g = torch.Generator().manual_seed(0)
    for mu in (0.0, 0.3):
        for _ in range(20):
            rw = torch.randn(3, 8, generator=g)
            rl = rw * 2 + 0.5 * torch.randn(3, 8, generator=g)  # mostly aligned with the winners'
            lam = winner_preserving_scale(rw, rl, mu).double()
            gw, gl = rw.double().flatten(), rl.double().flatten()
            step, norm = ((-gw + lam * gl) @ gw).item(), gw.square().sum().item()
            assert step <= -mu * norm + 1e-6 * norm  # lambda is float32: up to its rounding
            if lam < 1:
                assert step == pytest.approx(-mu * norm, abs=1e-6 * norm)


def test_scale_gradient_keeps_the_value_and_scales_the_gradient():
    x = torch.tensor([2.0, -1.0], requires_grad=True)
    y = scale_gradient(x * 3, torch.tensor(0.25))
    assert y.tolist() == [6.0, -3.0]
    y.sum().backward()
    assert x.grad.tolist() == [0.75, 0.75]


def test_sdpo_pair_loss_is_dpo_in_value_and_winner_plus_lambda_loser_in_gradient(tiny_export, monkeypatch):
    from dataclasses import replace

    import posttrain.dpo.step as step
    from posttrain.base.policy import Policy, PolicyConfig
    from posttrain.dpo.data import PairSet
    from posttrain.dpo.stage import DPOLossConfig
    from pretrain.export import load_exported

    model, encoder, codec, _ = load_exported(tiny_export)
    policy = Policy(model, PolicyConfig(lora_rank=4, lora_alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    caps = ["a", "b", "c", "d"]
    pairs = PairSet(torch.rand(4, 3, 16, 16, generator=g), torch.rand(4, 3, 16, 16, generator=g), caps,
                    encoder.encode(caps), torch.ones(4))
    null, params = encoder.encode([""]), [p for p in model.parameters() if p.requires_grad]

    def grads(cfg):
        for p in params:
            p.grad = None
        loss, stats = step.pair_loss(policy, codec, pairs, cfg, null, seed=0, step=2, offset=0, device="cpu")
        loss.backward()
        return loss.detach(), stats, torch.cat([p.grad.flatten() for p in params])

    plain_loss, _, plain = grads(DPOLossConfig())
    sdpo_loss, stats, sdpo = grads(replace(DPOLossConfig(), sdpo_mu=0.9))  # mu 0.9: the bound binds
    lam = stats["sdpo_scale"]
    monkeypatch.setattr(step, "winner_preserving_scale", lambda *a: torch.tensor(0.0))
    _, _, winners = grads(replace(DPOLossConfig(), sdpo_mu=0.9))  # lambda 0: the winners' part alone
    assert sdpo_loss == plain_loss  # the value is Diffusion-DPO's
    assert 0.0 <= lam < 1.0 and not torch.allclose(winners, plain)  # the bound binds: the losers' part is scaled
    scale = plain.abs().max().item()  # float32 sums of terms up to this size: compare on its scale
    assert torch.allclose(sdpo, winners + lam * (plain - winners), rtol=1e-5, atol=1e-6 * scale)
    # the same value as the closed form on the residuals the step computed
    ew, el, rw, rl = step.pair_errors(model, codec, pairs, DPOLossConfig(), null, seed=0, step=2, offset=0,
                                      device="cpu", residuals=True)[0]
    assert lam == pytest.approx(winner_preserving_scale(rw, rl, 0.9).item(), rel=1e-6)
