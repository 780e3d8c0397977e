"""nmtflow.nn.dropout: the CPU keep mask's statistics, the scaling, the gradient, seeding and what is kept."""
from __future__ import annotations

import math

import pytest
import torch

from nmtflow.nn.dropout import LEVELS, drop_level, dropout, keep_mask


def test_drop_rate_and_scaling_follow_the_rounded_probability() -> None:
    torch.manual_seed(0)
    x = torch.rand(512, 1000) + 0.5
    y = dropout(x, 0.3)
    q = drop_level(0.3) / LEVELS  # 9830/32768
    dropped = y == 0
    n = x.numel()
    assert abs(dropped.float().mean().item() - q) < 5 * math.sqrt(q * (1 - q) / n)
    torch.testing.assert_close(y[~dropped], x[~dropped] / (1 - q), rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", [(7,), (3, 5, 11), (2, 4, 6, 8)])
def test_mask_lanes_are_independent(shape: tuple[int, ...]) -> None:
    """Four elements share one 64-bit draw: neighbours in each lane position must drop independently."""
    torch.manual_seed(1)
    p = 0.5
    masks = torch.stack([keep_mask(torch.Size(shape), p, torch.device("cpu")).flatten() for _ in range(4000)])
    assert masks.shape == (4000, math.prod(shape))
    rate = masks.float().mean(0)
    assert ((rate - 0.5).abs() < 5 * math.sqrt(0.25 / 4000)).all()  # every position, the top lane included
    both = (masks[:, :-1] & masks[:, 1:]).float().mean(0)  # P(keep i and i+1) = 1/4 for every lane pair
    assert ((both - 0.25).abs() < 5 * math.sqrt(0.25 * 0.75 / 4000)).all()


def test_gradient_is_the_same_mask_and_scale() -> None:
    torch.manual_seed(2)
    x = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    state = torch.get_rng_state()
    y = dropout(x, 0.25)
    weights = torch.randn_like(y)
    (y * weights).sum().backward()
    torch.set_rng_state(state)
    mask = keep_mask(x.shape, 0.25, x.device)
    scale = LEVELS / (LEVELS - drop_level(0.25))
    torch.testing.assert_close(y.detach(), x.detach() * mask * scale)
    torch.testing.assert_close(x.grad, weights * mask * scale)


def test_seeded_and_resumable_from_the_default_generator() -> None:
    x = torch.randn(33, 17)
    torch.manual_seed(5)
    a = dropout(x, 0.1)
    torch.manual_seed(5)
    b = dropout(x, 0.1)
    state = torch.get_rng_state()
    c = dropout(x, 0.1)
    torch.set_rng_state(state)
    d = dropout(x, 0.1)
    assert torch.equal(a, b) and torch.equal(c, d) and not torch.equal(a, c)


def test_identity_when_not_training_or_p_zero_and_errors() -> None:
    x = torch.randn(4, 5)
    assert dropout(x, 0.3, training=False) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    with pytest.raises(ValueError, match="dropout probability"):
        dropout(x, 1.5)


def test_keeps_dtype_and_saves_only_a_bool_mask() -> None:
    torch.manual_seed(6)
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = dropout(x, 0.2)
    assert y.dtype == torch.bfloat16
    assert [t.dtype for t in saved] == [torch.bool] and saved[0].shape == x.shape
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    kept = y.detach() != 0
    assert torch.equal(x.grad != 0, kept)
