"""Transformer: masks, causality, incremental decoding, padding, gradients, parameters, save/load."""
from __future__ import annotations

import io

import pytest
import torch

from nmtflow.config import load_config
from nmtflow.data.vocab import PAD
from nmtflow.models.base import Vocabularies, build_model, count_parameters

from tests.conftest import padded_batch

V = 50


def make(pre_norm: bool = True, seed: int = 0, **model: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = load_config(data={"model": {"name": "transformer", "d_model": 32, "ffn_dim": 64, "heads": 4,
                                      "encoder_layers": 2, "decoder_layers": 2, "pre_norm": pre_norm, **model}})
    return build_model(cfg.model, Vocabularies(V, V)).eval()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return padded_batch(V, seed)


@pytest.mark.parametrize("pre_norm", [True, False])
def test_no_future_leakage(pre_norm: bool) -> None:
    model = make(pre_norm)
    src, tgt = batch()
    ref = model(src, tgt)
    for t in range(1, tgt.size(1)):
        perturbed = tgt.clone()
        perturbed[:, t:] = torch.randint(4, V, perturbed[:, t:].shape)
        out = model(src, perturbed)
        torch.testing.assert_close(out[:, :t], ref[:, :t], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(out[:, t:], ref[:, t:])


@pytest.mark.parametrize("pre_norm", [True, False])
def test_incremental_decoding_equals_full_forward(pre_norm: bool) -> None:
    model = make(pre_norm)
    src, tgt = batch()
    full = model(src, tgt)
    enc, state = model.encode(src), {}
    steps = [model.decode(tgt[:, t:t + 1], enc, state) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    # several new tokens at once after a cached prefix (causal mask with an offset)
    enc, state = model.encode(src), {}
    chunks = [model.decode(tgt[:, :3], enc, state), model.decode(tgt[:, 3:], enc, state)]
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=1e-5)


def test_source_padding_is_invisible() -> None:
    model = make()
    src, tgt = batch()
    alone = model(src[2:3, :4], tgt[2:3])
    padded = model(src[2:3], tgt[2:3])
    torch.testing.assert_close(alone, padded, atol=1e-5, rtol=1e-5)
    noisy = src.clone()
    noisy[2, 4:] = 7  # garbage under the padding mask must not matter... once masked again
    noisy[2, 4:] = PAD
    torch.testing.assert_close(model(noisy, tgt), model(src, tgt))


def test_every_parameter_gets_a_gradient() -> None:
    model = make().train()
    src, tgt = batch()
    model(src, tgt).logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_parameter_count_matches_the_formula() -> None:
    d, f, L = 32, 64, 2
    attn, ffn, ln = 4 * d * d, 2 * d * f + f + d, 2 * d
    enc_layer = attn + ffn + 2 * ln
    dec_layer = 2 * attn + ffn + 3 * ln
    expected = V * d + L * enc_layer + L * dec_layer + 2 * ln  # tied embeddings, two final LayerNorms
    assert count_parameters(make()) == expected
    untied = make(tie_embeddings=False)
    assert count_parameters(untied) == expected + 2 * V * d  # separate target embedding and output matrix


def test_save_load_gives_identical_outputs() -> None:
    model = make(seed=3)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    other = make(seed=4)
    other.load_state_dict(torch.load(buf, weights_only=True))
    src, tgt = batch()
    assert torch.equal(model(src, tgt), other(src, tgt))


def test_attention_weights_are_distributions_that_ignore_padding() -> None:
    model = make()
    src, _ = batch()
    out = model.encoder(src, need_weights=True)
    w = out["self_attn.0"]  # (B,H,S,S)
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
    assert w[1, :, :, 6:].abs().max() == 0
