"""The EMA of trainable weights (:mod:`pretrain.runtime.ema`) is ``AveragedModel``'s EMA bit for bit,
copies only trainable parameters, swaps into the model and back (also after an error), and keeps
``AveragedModel``'s state keys (old checkpoints resume)."""

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from pretrain.runtime.ema import EMA, build_ema

pytestmark = pytest.mark.core


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    model[0].bias.requires_grad_(False)  # a frozen parameter (as a LoRA base)
    return model


def _steps(model, n):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for i in range(n):
        torch.manual_seed(100 + i)
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        yield


def test_ema_equals_averaged_model_bitwise():
    model = _model()
    ema = EMA(model, 0.9)
    ref = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=False)
    for _ in _steps(model, 5):
        ema.update()
        ref.update_parameters(model)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref_weights = dict(ref.module.named_parameters())
    assert set(ema.shadow) == {"0.weight", "2.weight", "2.bias"}  # the frozen bias has no copy
    for n, t in ema.shadow.items():
        assert torch.equal(t, ref_weights[n]), n
        assert not torch.equal(t, trained[n]), n  # the EMA lags the weights
    assert int(ema.n_averaged) == 5


def test_swapped_puts_the_ema_in_and_the_weights_back():
    model = _model()
    ema = EMA(model, 0.5)
    for _ in _steps(model, 3):
        ema.update()
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped():
        for n, p in model.named_parameters():
            assert torch.equal(p, ema.shadow.get(n, trained[n])), n
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    with pytest.raises(RuntimeError, match="inside"):
        with ema.swapped():
            raise RuntimeError("inside")
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())


def test_state_keys_are_averaged_models_and_round_trip():
    model = _model()
    ema = EMA(model, 0.9)
    for _ in _steps(model, 2):
        ema.update()
    ref = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=False)
    state = ema.state_dict()
    assert set(state) <= set(ref.state_dict()) and "n_averaged" in state
    other = EMA(_model(), 0.9)
    other.load_state_dict({k: v.clone() for k, v in state.items()})
    assert all(torch.equal(other.shadow[n], ema.shadow[n]) for n in ema.shadow) and int(other.n_averaged) == 2


def test_build_ema_checks_the_decay():
    assert build_ema(_model(), 0.0) is None
    with pytest.raises(ValueError, match="train.ema_decay must be in"):
        build_ema(_model(), 1.0)
