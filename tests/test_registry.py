"""Users register their own attention variants and models from their own code."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nmtflow.config import load_config
from nmtflow.models.base import Vocabularies, build_model
from nmtflow.nn.attention import AttentionConfig, MultiHeadAttention
from nmtflow.registry import ATTENTIONS, register_attention


@dataclass
class TemperatureOptions(AttentionConfig):
    temperature: float = 2.0


@register_attention("test_temperature", TemperatureOptions)
class TemperatureAttention(MultiHeadAttention):
    """Standard attention with its keys scaled by 1/temperature (a one-method variant)."""

    def project_kv(self, source, ctx):
        k, v = super().project_kv(source, ctx)
        return k / self.options.temperature, v


def test_a_user_attention_variant_plugs_into_the_transformer() -> None:
    assert "test_temperature" in ATTENTIONS.names()
    cfg = load_config(data={"model": {"d_model": 16, "ffn_dim": 32, "heads": 2, "encoder_layers": 1,
                                      "decoder_layers": 1,
                                      "encoder_self_attention": {"type": "test_temperature", "temperature": 4.0}}})
    assert cfg.model.encoder_self_attention.temperature == 4.0
    model = build_model(cfg.model, Vocabularies(20, 20))
    layer_attn = model.encoder.layers[0].self_attn
    assert isinstance(layer_attn, TemperatureAttention) and layer_attn.options.temperature == 4.0
    assert not isinstance(model.decoder.layers[0].self_attn, TemperatureAttention)
    src = torch.tensor([[5, 6, 7, 3]])
    assert model(src, torch.tensor([[2, 5]])).shape == (1, 2, 20)
