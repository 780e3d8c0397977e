"""A decoder-only Transformer language model (SPEC §3: phrasal self-attention evaluated by perplexity).

The layers are the Transformer's decoder layers without cross-attention (:class:`TransformerDecoder` with
``cross_attention=False``); the ``self_attention`` slot is typed like the Transformer's slots, e.g.
``self_attention: {type: phrasal, ngrams: [1, 2]}`` for the paper's Table 3 model.

Training on monolingual text through the ordinary :class:`~nmtflow.train.trainer.Trainer`: the model
keeps the :class:`EncoderDecoder` contract but ignores the source and models the target,
``P(y) = Π_t P(y_t | BOS, y_<t)`` (EOS included). Prepare one language (``nmtflow prepare --train PREFIX
--langs de --out DIR``) and point both sides at it (``data: {src_lang: de, tgt_lang: de}``); the
source ids are then read but unused. Use ``train.valid_bleu: false`` (BLEU means nothing for an LM),
as the ``lm-*.yaml`` presets do, and ``nmtflow evaluate --perplexity CKPT --data DIR`` for test perplexity.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import Tensor, nn

from nmtflow.data.vocab import PAD
from nmtflow.models.base import EncoderDecoder, EncoderOut, ModelConfig, State, Vocabularies
from nmtflow.models.transformer import (Embedder, TransformerConfig, TransformerDecoder,
                                        check_transformer_sizes)
from nmtflow.nn.attention import AttentionConfig
from nmtflow.nn.layers import SinusoidalPositions, token_embedding
from nmtflow.registry import register_model


@dataclass
class LanguageModelConfig(ModelConfig):
    """The Transformer decoder's sizes and one ``self_attention`` slot (``{type: NAME, ...options}``)."""

    name: str = "lm"
    d_model: int = 512
    ffn_dim: int = 2048
    heads: int = 8
    layers: int = 6
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    activation: str = "relu"
    pre_norm: bool = True
    tie_embeddings: bool = True  # input embedding = output projection
    max_positions: int = 1024
    self_attention: AttentionConfig = field(default_factory=AttentionConfig)

    PRESETS: ClassVar[dict[str, dict]] = TransformerConfig.PRESETS

    def validate(self, where: str) -> None:
        check_transformer_sizes(
            where, d_model=self.d_model, heads=self.heads, ffn_dim=self.ffn_dim, layers={"layers": self.layers},
            activation=self.activation, max_positions=self.max_positions,
            dropouts={"dropout": self.dropout, "attention_dropout": self.attention_dropout,
                      "activation_dropout": self.activation_dropout})

    def decoder_config(self) -> TransformerConfig:
        """The equivalent Transformer config, whose decoder half this model builds."""
        return TransformerConfig(
            d_model=self.d_model, ffn_dim=self.ffn_dim, heads=self.heads, encoder_layers=0,
            decoder_layers=self.layers, dropout=self.dropout, attention_dropout=self.attention_dropout,
            activation_dropout=self.activation_dropout, activation=self.activation, pre_norm=self.pre_norm,
            tie_embeddings=self.tie_embeddings, max_positions=self.max_positions,
            decoder_self_attention=self.self_attention)


@register_model("lm", LanguageModelConfig)
class LanguageModel(EncoderDecoder):
    """Decoder-only Transformer LM over the target vocabulary; ``src`` is accepted and ignored."""

    def __init__(self, cfg: LanguageModelConfig, vocabs: Vocabularies) -> None:
        super().__init__()
        self.config = cfg
        emb = token_embedding(vocabs.tgt_size, cfg.d_model)
        output_weight = emb.weight if cfg.tie_embeddings else nn.Parameter(
            nn.init.normal_(emb.weight.new_empty(vocabs.tgt_size, cfg.d_model), std=cfg.d_model ** -0.5))
        embedder = Embedder(emb, SinusoidalPositions(cfg.d_model, cfg.max_positions), cfg.dropout)
        self.decoder = TransformerDecoder(cfg.decoder_config(), embedder, output_weight, cross_attention=False)

    def encode(self, src: Tensor) -> EncoderOut:
        """Nothing to encode: only the (batch-first) padding mask the contract asks for."""
        return {"padding_mask": src.eq(PAD)}

    def decode(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None) -> Tensor:
        """tgt_in (B,T) → next-token logits (B,T,V); with ``state`` only the new tokens."""
        return self.decoder(tgt_in, enc, state)
