"""The tanh GELU written as x * sigmoid(2z) is the same function, and rewriting a model's GELUs keeps its
output, parameters and state dict."""

import pytest
import copy

import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU
from diffusers.models.attention import FeedForward

from pretrain.models import ModelConfig, build_backbone
from pretrain.models.activations import gelu_tanh_as_sigmoid, rewrite_tanh_gelu

pytestmark = pytest.mark.core


def test_sigmoid_form_equals_the_tanh_gelu_and_its_gradient():
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.randn(4000) * 3]).double().requires_grad_()
    want = F.gelu(x, approximate="tanh")
    got = gelu_tanh_as_sigmoid(x)
    assert (got - want).abs().max().item() <= 1e-14  # float64: the identity (1 + tanh z) / 2 = sigmoid(2z)
    g = torch.randn_like(x)
    (gw,) = torch.autograd.grad(want, x, g)
    (gg,) = torch.autograd.grad(got, x, g)
    assert (gg - gw).abs().max().item() <= 1e-13
    x32 = x.detach().float()  # float32: rounding only
    assert (gelu_tanh_as_sigmoid(x32) - F.gelu(x32, approximate="tanh")).abs().max().item() <= 2e-6
    assert gelu_tanh_as_sigmoid(x32).dtype == torch.float32


def _sd3():
    torch.manual_seed(0)
    return build_backbone(ModelConfig(arch="sd3", preset="tiny"), sample_size=8, channels=3, text_dim=32,
                          pooled_dim=32)


def test_rewrite_keeps_the_models_output_and_parameters():
    model = _sd3().eval()
    x, sigma = torch.randn(2, 3, 8, 8), torch.tensor([0.3, 0.8])
    from pretrain.text_encoder import PromptEmbeds

    embeds = PromptEmbeds(torch.randn(2, 5, 32), torch.randn(2, 32))
    with torch.no_grad():
        want = model(x, sigma, embeds)
    keys = list(model.state_dict())
    tanh_gelus = [m for m in model.modules() if isinstance(m, GELU) and m.approximate == "tanh"]
    assert len(tanh_gelus) >= 2  # image and context MLPs
    assert rewrite_tanh_gelu(model) == len(tanh_gelus)
    assert rewrite_tanh_gelu(model) == 0  # already rewritten: nothing more
    assert all(type(m).__name__ == "SigmoidGELU" and isinstance(m, GELU) for m in tanh_gelus)
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        got = model(x, sigma, embeds)
        copied = copy.deepcopy(model)(x, sigma, embeds)  # a deep copy (the LoRA-merged one) keeps the rewrite
    assert 0 < (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()  # a different rounding
    assert all(type(m).__name__ == "SigmoidGELU" for m in copy.deepcopy(model).modules() if isinstance(m, GELU))
    torch.testing.assert_close(copied, got, rtol=0, atol=0)


def test_rewrite_leaves_exact_gelus_and_calls_wrapped_projections():
    exact = FeedForward(8, 8, activation_fn="gelu")
    assert rewrite_tanh_gelu(exact) == 0 and type(exact.net[0]) is GELU
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(approximate="tanh"), torch.nn.GELU())
    assert rewrite_tanh_gelu(mlp) == 1 and type(mlp[2]) is torch.nn.GELU  # FLUX's single-block act_mlp form
    x = torch.randn(4, 8)
    torch.testing.assert_close(mlp(x), F.gelu(F.gelu(mlp[0](x), approximate="tanh")), rtol=1e-6, atol=1e-6)

    ff = FeedForward(8, 8, activation_fn="gelu-approximate")
    calls = []
    ff.net[0].proj.register_forward_hook(lambda *a: calls.append(1))  # e.g. a tensor-parallel input/output hook
    want = ff(x)
    rewrite_tanh_gelu(ff)
    torch.testing.assert_close(ff(x), want, rtol=1e-6, atol=1e-6)
    assert len(calls) == 2  # the hooked projection was called, not bypassed by the bias fusion
