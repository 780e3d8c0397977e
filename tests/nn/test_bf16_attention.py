"""Attention under bf16 autocast on a CPU runs in fp32 (nmtflow.nn.attention.sdpa): PyTorch's bf16 CPU kernel is
many times slower in backward. The result must be fp32 attention of the bf16 inputs, cast back, with gradients."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nmtflow.nn.attention import MultiHeadAttention, sdpa


def test_sdpa_under_cpu_bf16_is_fp32_attention_of_the_bf16_inputs() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8).bfloat16() for _ in range(3))
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True  # every query may attend somewhere
    for causal, m in ((False, mask), (True, None)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = sdpa(q, k, v, m, 0.0, causal)
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, is_causal=causal)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, expected.bfloat16())
    x = torch.randn(2, 4, 5, 8)  # fp32 without autocast: PyTorch's kernel as it is
    assert torch.equal(sdpa(x, x, x, None, 0.0, True), F.scaled_dot_product_attention(x, x, x, is_causal=True))


def test_sdpa_without_gradients_is_pytorchs_bf16_kernel() -> None:
    """Decoding (a bf16 copy of the weights, :mod:`nmtflow.decode.precision`) and validation record no gradients:
    the bf16 kernel then reads the caches as they are, without casting them up at every step."""
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 4, 1, 8).bfloat16(), torch.randn(6, 4, 9, 8).bfloat16(), torch.randn(6, 4, 9, 8).bfloat16()
    mask = torch.rand(6, 1, 1, 9) > 0.3
    mask[..., 0] = True
    with torch.inference_mode():
        out = sdpa(q, k, v, mask, 0.0, False)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    torch.testing.assert_close(out.float(), reference, atol=0.02, rtol=0.02)


def test_attention_trains_under_cpu_bf16_autocast() -> None:
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4)
    x = torch.randn(3, 6, 16)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[0, 4:] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = layer(x, x, key_padding_mask=pad, causal=True)
    out.float().sum().backward()
    reference, _ = layer(x, x, key_padding_mask=pad, causal=True)
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), reference, atol=0.05)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
               for p in layer.parameters())
