"""Adam's eps swallowing small gradients is measured and warned about: ``adam_eps_dominated_frac`` is the
share of trainable elements with sqrt(v_hat) < eps (:mod:`pretrain.runtime.adam_eps`)."""

import pytest
import logging

import torch

from pretrain.runtime.config import OptimConfig, RuntimeConfig
from pretrain.runtime.runtime import Runtime

pytestmark = pytest.mark.core


def _run(tmp_path, eps: float, grad: float, steps: int = 3, every: int = 1) -> tuple[list[dict], torch.Tensor]:
    """A linear layer of 100 weights trained on a loss whose gradient is ``grad`` on 70 weights and 1 on
    the other 30, with Adam's ``eps``; returns the metrics and the weight change of each step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 1, bias=False)
    rt = Runtime(model, RuntimeConfig(steps=steps), OptimConfig(lr=1e-3, eps=eps, eps_check_every=every,
                                                                grad_clip=0.0), torch.device("cpu"), tmp_path / "ck")
    scale = torch.cat([torch.full((70,), grad), torch.ones(30)])
    out, moves = [], []
    for _ in range(steps):
        before = model.weight.detach().clone()
        loss = (model.weight[0] * scale).sum()  # d loss / d w = scale
        rt.backward(loss)
        out.append(rt.optimizer_step(float(loss)))
        moves.append((model.weight.detach() - before).abs()[0])
    return out, torch.stack(moves)


def test_the_share_of_eps_dominated_elements_is_logged(tmp_path):
    m, moves = _run(tmp_path, eps=1e-8, grad=1e-10)
    assert [x["adam_eps_dominated_frac"] for x in m] == [0.7, 0.7, 0.7]
    # the 70 tiny-gradient weights move ~lr * 1e-10 / 1e-8 = 1e-5 instead of lr = 1e-3
    torch.testing.assert_close(moves[0, :70], torch.full((70,), 1e-3 * 1e-10 / (1e-10 + 1e-8)), rtol=1e-3, atol=0)
    torch.testing.assert_close(moves[0, 70:], torch.full((30,), 1e-3), rtol=1e-3, atol=0)
    m, moves = _run(tmp_path / "b", eps=1e-15, grad=1e-10)
    assert [x["adam_eps_dominated_frac"] for x in m] == [0.0, 0.0, 0.0]
    torch.testing.assert_close(moves[0], torch.full((100,), 1e-3), rtol=1e-3, atol=0)
    m, _ = _run(tmp_path / "c", eps=1e-8, grad=0.0)  # 70 weights never get a gradient: eps decides nothing
    assert [x["adam_eps_dominated_frac"] for x in m] == [0.0, 0.0, 0.0]


def test_logged_every_n_steps_and_step_one_and_warned_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pretrain.runtime.adam_eps"):
        m, _ = _run(tmp_path, eps=1e-8, grad=1e-12, steps=5, every=2)
    assert ["adam_eps_dominated_frac" in x for x in m] == [True, True, False, True, False]
    warnings = [r.getMessage() for r in caplog.records if "eps" in r.getMessage()]
    assert len(warnings) == 1 and "70%" in warnings[0] and "1e-08" in warnings[0] and "1e-15" in warnings[0]
    m, _ = _run(tmp_path / "off", eps=1e-8, grad=1e-12, steps=2, every=0)
    assert not any("adam_eps_dominated_frac" in x for x in m)
