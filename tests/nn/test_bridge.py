"""The attention bridge (SPEC §5, Eq. 8–10): attention rows, padding, penalty, pooling."""
from __future__ import annotations

import torch

from nmtflow.nn.bridge import AttentionBridge, bridge_penalty, pool_bridge


def make(k: int = 4, d: int = 16, dw: int = 24) -> AttentionBridge:
    torch.manual_seed(0)
    return AttentionBridge(d, heads=k, attention_dim=dw)


def test_shapes_follow_the_paper() -> None:
    bridge = make(k=4, d=16, dw=24)
    assert bridge.w1.weight.shape == (24, 16) and bridge.w1.bias is None  # W_1: d_w × d_h
    assert bridge.w2.weight.shape == (4, 24) and bridge.w2.bias is None  # W_2: k × d_w
    memory, attention = bridge(torch.randn(3, 7, 16))
    assert memory.shape == (3, 4, 16) and attention.shape == (3, 4, 7)


def test_rows_sum_to_one_and_padding_gets_no_weight() -> None:
    bridge = make()
    h = torch.randn(2, 9, 16)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 5:] = True
    memory, attention = bridge(h, mask)
    torch.testing.assert_close(attention.sum(-1), torch.ones(2, 4))
    assert attention[1, :, 5:].abs().max() == 0
    # the padded sentence's M is that of the sentence alone, whatever the padding positions hold
    h_garbage = h.clone()
    h_garbage[1, 5:] = 1e3 * torch.randn(4, 16)
    memory2, _ = bridge(h_garbage, mask)
    alone, alone_attention = bridge(h[1:, :5])
    torch.testing.assert_close(memory2[1], alone[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(memory[1], alone[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(attention[1, :, :5], alone_attention[0], atol=1e-6, rtol=1e-6)


def test_penalty_is_zero_for_orthogonal_one_hot_rows_and_positive_otherwise() -> None:
    a = torch.zeros(2, 3, 5)
    a[0, 0, 1] = a[0, 1, 3] = a[0, 2, 0] = 1.0  # one-hot rows on distinct positions: A Aᵀ = I
    a[1, 0, 4] = a[1, 1, 2] = a[1, 2, 3] = 1.0
    assert bridge_penalty(a).tolist() == [0.0, 0.0]
    same = a.clone()
    same[1] = 0
    same[1, :, 2] = 1.0  # all heads on the same position: A Aᵀ = all ones, ‖·−I‖² = 6 off-diagonal ones
    torch.testing.assert_close(bridge_penalty(same), torch.tensor([0.0, 6.0]))  # one value per sentence
    # the paper's code's unsquared norm: sqrt(‖·‖² + 1e-10)
    torch.testing.assert_close(bridge_penalty(same, squared=False), torch.tensor([1e-5, 6.0 ** 0.5]))
    uniform = torch.full((1, 3, 5), 1 / 5)
    assert bridge_penalty(uniform).item() > 0
    _, attention = make()(torch.randn(2, 6, 16))
    assert (bridge_penalty(attention) > 0).all()


def test_the_bias_option_adds_the_paper_codes_biases_and_the_w2_bias_cannot_change_a() -> None:
    torch.manual_seed(0)
    bridge = AttentionBridge(16, heads=4, attention_dim=8, bias=True)
    assert bridge.w1.bias.shape == (8,) and bridge.w2.bias.shape == (4,)
    assert make().w1.bias is None and make().w2.bias is None
    h = torch.randn(2, 5, 16)
    _, attention = bridge(h)
    with torch.no_grad():
        bridge.w2.bias.add_(torch.randn(4))  # a constant per head over the positions
    torch.testing.assert_close(bridge(h)[1], attention)


def test_penalty_gradient_spreads_the_heads() -> None:
    bridge = make()
    h = torch.randn(4, 8, 16)
    before = bridge_penalty(bridge(h)[1]).mean().item()
    opt = torch.optim.SGD(bridge.parameters(), lr=0.5)
    for _ in range(20):
        opt.zero_grad()
        bridge_penalty(bridge(h)[1]).mean().backward()
        opt.step()
    assert bridge_penalty(bridge(h)[1]).mean().item() < before


def test_pooling_shapes() -> None:
    memory = torch.randn(3, 4, 16)
    assert pool_bridge(memory, "mean").shape == (3, 16)
    assert pool_bridge(memory, "flat").shape == (3, 64)
    torch.testing.assert_close(pool_bridge(memory, "flat")[:, 16:32], memory[:, 1])
