"""GLU convolutions: causality, the incremental cache, padding, weight normalisation."""
from __future__ import annotations

import pytest
import torch

from nmtflow.nn.conv import GLUConv


pytestmark = pytest.mark.usefixtures("one_thread")


def make(causal: bool, kernel: int = 3, weight_norm: bool = False, seed: int = 0) -> GLUConv:
    torch.manual_seed(seed)
    return GLUConv(6, 5, kernel, causal=causal, weight_norm=weight_norm, name="layer.0.conv").eval()


@pytest.mark.parametrize("kernel", [1, 2, 3, 5])
def test_causal_convolution_sees_no_future(kernel: int) -> None:
    conv = make(causal=True, kernel=kernel)
    x = torch.randn(2, 8, 6)
    ref = conv(x)
    assert ref.shape == (2, 8, 5)
    for t in range(1, 8):
        perturbed = x.clone()
        perturbed[:, t:] = torch.randn_like(perturbed[:, t:])
        out = conv(perturbed)
        torch.testing.assert_close(out[:, :t], ref[:, :t])
        assert not torch.allclose(out[:, t:], ref[:, t:])


@pytest.mark.parametrize("kernel", [1, 3, 4])
def test_incremental_cache_equals_full_convolution_without_recomputing_the_prefix(kernel: int) -> None:
    conv = make(causal=True, kernel=kernel, weight_norm=True)
    x = torch.randn(2, 7, 6)
    full = conv(x)
    lengths: list[int] = []
    conv.conv.register_forward_pre_hook(lambda _m, inp: lengths.append(inp[0].size(-1)))
    state: dict[str, torch.Tensor] = {}
    steps = torch.cat([conv(x[:, t:t + 1], state=state) for t in range(7)], dim=1)
    torch.testing.assert_close(steps, full)
    assert lengths == [kernel] * 7  # k−1 cached inputs + 1 new position: the prefix is never recomputed
    if kernel > 1:
        assert state["layer.0.conv.cache"].shape == (2, kernel - 1, 6)
        torch.testing.assert_close(state["layer.0.conv.cache"], x[:, -(kernel - 1):])
    else:
        assert state == {}
    state = {}
    chunks = torch.cat([conv(x[:, :3], state=state), conv(x[:, 3:], state=state)], dim=1)
    torch.testing.assert_close(chunks, full)


def test_non_causal_convolution_ignores_padding() -> None:
    conv = make(causal=False, kernel=5)
    x = torch.randn(1, 4, 6)
    alone = conv(x)
    padded = torch.cat([x, torch.randn(1, 3, 6)], dim=1)  # garbage in the padding positions
    mask = torch.tensor([[False] * 4 + [True] * 3])
    torch.testing.assert_close(conv(padded, padding_mask=mask)[:, :4], alone)


def test_weight_norm_keeps_the_initial_function_and_adds_one_gain_per_output_channel() -> None:
    plain, normed = make(causal=True), make(causal=True, weight_norm=True)
    x = torch.randn(2, 5, 6)
    torch.testing.assert_close(normed(x), plain(x))
    n_plain = sum(p.numel() for p in plain.parameters())
    n_normed = sum(p.numel() for p in normed.parameters())
    assert n_normed - n_plain == 2 * 5  # g: one per conv output channel (2·out_dim before the GLU)


def test_even_kernel_needs_a_causal_convolution() -> None:
    with pytest.raises(ValueError, match="odd"):
        GLUConv(4, 4, 2, causal=False)


@pytest.mark.parametrize("per_layer", [False, True])
def test_dense_attention_follows_equations_9_and_10(per_layer: bool) -> None:
    """DenseAtt-1: F(W_q z, W_s[h], W_s[h] + W_0 h_0); DenseAtt-2: Σ_i F(W_q z, W_i h_i, W_i h_i + W_0 h_0)."""
    from nmtflow.nn.conv_attention import DenseAttention

    torch.manual_seed(0)
    widths, d0, dim = [3, 5], 4, 6
    attn = DenseAttention(7, dim, widths, d0, per_layer=per_layer, name="decoder.0.attn")
    z, h0 = torch.randn(2, 3, 7), torch.randn(2, 4, d0)
    h = [torch.randn(2, 4, w) for w in widths]
    pad = torch.tensor([[False] * 4, [False, False, True, True]])
    enc = {"sources": torch.cat(h, -1), "embeddings": h0, "padding_mask": pad}
    q = z @ attn.q_proj.weight.T + attn.q_proj.bias
    e = h0 @ attn.emb_proj.weight.T + attn.emb_proj.bias
    w_blocks = attn.src_proj.weight.split(widths, 1)

    def f(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # softmax(Q Kᵀ) V (Eq. 8), padding masked
        return (q @ k.transpose(1, 2)).masked_fill(pad[:, None], float("-inf")).softmax(-1) @ v

    if per_layer:
        expected = sum(f(h_i @ w_i.T, h_i @ w_i.T + e) for h_i, w_i in zip(h, w_blocks))
    else:
        k = sum(h_i @ w_i.T for h_i, w_i in zip(h, w_blocks))
        expected = f(k, k + e)
    torch.testing.assert_close(attn(z, torch.empty(0), enc), expected)
    state: dict[str, torch.Tensor] = {}
    torch.testing.assert_close(attn(z, torch.empty(0), enc, state), expected)
    assert state["decoder.0.attn.static_k"].shape == (2, 2 if per_layer else 1, 4, dim)
