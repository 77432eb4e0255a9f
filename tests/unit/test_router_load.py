"""The router-load metrics of a mixture-of-experts denoiser (``pretrain/router_load.py``) on hand-made routings."""

import pytest
import torch
import torch.utils.checkpoint

from pretrain.router_load import RouterLoad

pytestmark = pytest.mark.core


class Gate(torch.nn.Module):
    """Routes the tokens of ``x`` [N] to the fixed ``topk_idx`` [N, 2]."""

    def __init__(self, idx):
        super().__init__()
        self.idx = torch.tensor(idx)

    def forward(self, x):
        return self.idx, torch.full(self.idx.shape, 0.5), None


class Layer(torch.nn.Module):
    def __init__(self, idx, experts=4):
        super().__init__()
        self.gate, self.experts = Gate(idx), torch.nn.ModuleList(torch.nn.Identity() for _ in range(experts))


def test_load_shares_idle_experts_and_reset():
    # layer 0: experts 0..3 receive 3, 2, 1, 0 of 6 pairs (mean 1.5); layer 1: 2 each, balanced
    layers = [Layer([[0, 1], [0, 2], [0, 1]]), Layer([[0, 1], [2, 3]])]
    load = RouterLoad(layers)
    for layer in layers:
        layer.gate(torch.zeros(1))
    assert load.pop() == {"moe/load_max": 2.0, "moe/load_min": 0.0, "moe/idle_experts": 1.0}
    assert load.pop() == {}  # reset: nothing routed since
    layers[1].gate(torch.zeros(1))
    layers[1].gate(torch.zeros(1))
    assert load.pop() == {"moe/load_max": 1.0, "moe/load_min": 0.0, "moe/idle_experts": 4.0}  # layer 0 idle
    load.remove()
    layers[0].gate(torch.zeros(1))
    assert load.pop() == {}


def test_an_activation_checkpoint_recompute_is_not_counted_twice():
    layer = Layer([[0, 1]])
    load = RouterLoad([layer])
    x = torch.ones(1, requires_grad=True)

    def block(x):
        layer.gate(x)
        return x * 2

    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()  # forward, then recompute
    assert load.counts[0].tolist() == [1, 1, 0, 0]
