import math

import pytest
import torch

from mhmoe.moe.losses import entropy_loss, load_balancing_loss, router_z_loss


def test_balance_loss_is_one_when_uniform_and_e_when_collapsed():
    S, E = 8, 4
    mask = torch.ones(S, dtype=torch.bool)
    uniform = torch.full((S, E), 1 / E)
    experts = torch.arange(S)[:, None] % E
    valid = torch.ones(S, 1, dtype=torch.bool)
    assert float(load_balancing_loss(uniform, experts, valid, mask)) == pytest.approx(1.0)
    collapsed = torch.zeros(S, E)
    collapsed[:, 0] = 1
    assert float(load_balancing_loss(collapsed, torch.zeros(S, 1, dtype=torch.long), valid, mask)) == pytest.approx(E)


def test_balance_loss_matches_formula_and_ignores_padding():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4], [0.9, 0.05, 0.05]])
    experts = torch.tensor([[0, 1], [1, 0], [2, 0], [0, 1]])
    valid = torch.ones(4, 2, dtype=torch.bool)
    mask = torch.tensor([True, True, True, False])
    f = torch.tensor([3, 2, 1]) / 6  # counts over the 3 real tokens x 2 slots
    p = probs[:3].mean(0)
    assert float(load_balancing_loss(probs, experts, valid, mask)) == pytest.approx(float(3 * (f * p).sum()))


def test_z_loss_and_entropy():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    mask = torch.tensor([True, True])
    expect = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    assert float(router_z_loss(logits, mask)) == pytest.approx(expect)
    probs = logits.softmax(-1)
    h = -(probs * probs.log()).sum(-1).mean()
    assert float(entropy_loss(probs, mask, "token")) == pytest.approx(float(h))
    uniform = torch.full((3, 4), 0.25)
    assert float(entropy_loss(uniform, torch.ones(3, dtype=torch.bool), "batch")) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="entropy mode"):
        entropy_loss(probs, mask, "sum")


def test_losses_are_pure_and_differentiable():
    logits = torch.randn(6, 5, requires_grad=True)
    probs = logits.softmax(-1)
    mask = torch.ones(6, dtype=torch.bool)
    experts = probs.topk(2).indices
    valid = torch.ones(6, 2, dtype=torch.bool)
    a = load_balancing_loss(probs, experts, valid, mask)
    b = load_balancing_loss(probs, experts, valid, mask)
    assert float(a.detach()) == float(b.detach())
    (a + router_z_loss(logits, mask) + entropy_loss(probs, mask)).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
