"""Attention under bf16 autocast on a CPU runs in fp32 (nmtflow.nn.attention.sdpa): PyTorch's bf16 CPU kernel is
many times slower in backward. The result must be fp32 attention of the bf16 inputs, cast back, with gradients.
A bf16 decoding step's single query takes two products around a float32 softmax (single_query_attention)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nmtflow.nn.attention as attention
from nmtflow.nn.attention import MultiHeadAttention, sdpa, single_query_attention


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


def _single_query_inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 4, 1, 8).bfloat16(), torch.randn(6, 4, 9, 8).bfloat16(), torch.randn(6, 4, 9, 8).bfloat16()
    mask = torch.rand(6, 1, 1, 9) > 0.3
    mask[..., 0] = True
    return q, k, v, mask


def test_sdpa_without_gradients_is_pytorchs_bf16_kernel_where_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding (a bf16 copy of the weights, :mod:`nmtflow.decode.precision`) and validation record no gradients:
    with single-query products off (the default on AMX CPUs) the bf16 kernel reads the caches as they are."""
    monkeypatch.setattr(attention, "SINGLE_QUERY_PRODUCTS", False)
    q, k, v, mask = _single_query_inputs()
    with torch.inference_mode():
        out = sdpa(q, k, v, mask, 0.0, False)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    torch.testing.assert_close(out.float(), reference, atol=0.02, rtol=0.02)


def test_a_bf16_decoding_steps_attention_takes_single_query_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """One bf16 query per row without gradients: float32 scores and softmax, the weights times V in bf16, within
    bf16's rounding of fp32 attention of the same inputs; an all-padding row gets zero context, as in SDPA."""
    monkeypatch.setattr(attention, "SINGLE_QUERY_PRODUCTS", True)
    q, k, v, mask = _single_query_inputs()
    mask[2] = False  # a row that may attend to nothing
    calls = []
    monkeypatch.setattr(attention, "single_query_attention", lambda *a: calls.append(1) or single_query_attention(*a))
    with torch.inference_mode():
        out = sdpa(q, k, v, mask, 0.0, False)
        fused = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert calls and out.dtype == torch.bfloat16 and out.shape == q.shape
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    torch.testing.assert_close(out.float(), reference, atol=0.02, rtol=0.02)
    torch.testing.assert_close(out, fused, atol=0.02, rtol=0.02)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.allclose(single_query_attention(q, k, v, None).float(),
                          F.scaled_dot_product_attention(q.float(), k.float(), v.float()), atol=0.02)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):  # decoding under autocast
        autocast_out = sdpa(q, k, v, mask, 0.0, False)
    assert torch.equal(autocast_out, out)  # the scores stay float32: autocast does not cast them down
    # not taken: with gradients, several queries, fp32, a causal call, dropout
    calls.clear()
    sdpa(q, k, v, mask, 0.0, False)  # gradients on (outside inference mode): fp32 attention as in training
    with torch.inference_mode():
        sdpa(torch.randn(6, 4, 3, 8).bfloat16(), k, v, mask, 0.0, False)
        sdpa(q.float(), k.float(), v.float(), mask, 0.0, False)
        sdpa(q.double(), k.double(), v.double(), mask, 0.0, False)
        sdpa(q, k[:, :, :1], v[:, :, :1], None, 0.0, True)
        sdpa(q, k, v, mask, 0.1, False)
    assert not calls


def test_single_query_products_by_default_where_the_cpu_has_no_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "SINGLE_QUERY_PRODUCTS", None)
    for flags, expected in ((["avx512f", "avx512_bf16"], True), (["avx512_bf16", "amx_tile", "amx_bf16"], False),
                            (["avx2"], False), (["asimd", "bf16"], False), ([], False)):
        monkeypatch.setattr(attention, "cpu_info", lambda: {"cpu_model": "x", "cpu_flags": flags, "native_bf16": True})
        assert attention.single_query_products() is expected


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
