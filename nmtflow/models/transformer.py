"""The Transformer (Vaswani et al. 2017; SPEC §1), composed from registered attention variants.

Each attention slot (encoder self, decoder self, cross) is typed by its own ``{type: ...}`` config, so
lexical shortcuts and phrasal attention plug in here — alone or combined — without another copy of
this file. Pre-norm with a final LayerNorm by default (``pre_norm: false`` gives post-norm).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from torch import Tensor, nn

from nmtflow.config import ConfigError
from nmtflow.data.vocab import PAD
from nmtflow.models.base import EncoderDecoder, EncoderOut, ModelConfig, State, Vocabularies
from nmtflow.nn.attention import AttentionConfig, AttentionContext, build_attention, link_stack
from nmtflow.nn.compiled import CompiledRegion
from nmtflow.nn.dropout import dropout
from nmtflow.nn.layers import FeedForward, SinusoidalPositions, output_logits, token_embedding
from nmtflow.registry import register_model

ACTIVATIONS = ("relu", "gelu")


def check_transformer_sizes(where: str, *, d_model: int, heads: int, ffn_dim: int, layers: dict[str, int],
                            activation: str = "relu", dropouts: dict[str, float] | None = None,
                            max_positions: int = 1) -> None:
    """ConfigError for sizes a Transformer stack cannot be built or run with (checked when the config is read,
    so that a bad value is reported by name instead of failing deep inside a layer)."""
    for name, value in (("d_model", d_model), ("heads", heads), ("ffn_dim", ffn_dim),
                        ("max_positions", max_positions)):
        if value < 1:
            raise ConfigError(f"{where}.{name}: must be positive, got {value}")
    if d_model % heads:
        raise ConfigError(f"{where}.heads: {heads} does not divide d_model={d_model}")
    for name, value in layers.items():
        if value < 0:
            raise ConfigError(f"{where}.{name}: must be >= 0, got {value}")
    if activation not in ACTIVATIONS:
        raise ConfigError(f"{where}.activation: expected one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    for name, value in (dropouts or {}).items():
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{where}.{name}: must be in [0, 1), got {value}")


@dataclass
class TransformerConfig(ModelConfig):
    name: str = "transformer"
    d_model: int = 512
    ffn_dim: int = 2048
    heads: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    activation: str = "relu"
    pre_norm: bool = True
    tie_embeddings: bool = True  # joint vocab: source = target = output; else target = output
    max_positions: int = 1024
    encoder_self_attention: AttentionConfig = field(default_factory=AttentionConfig)
    decoder_self_attention: AttentionConfig = field(default_factory=AttentionConfig)
    cross_attention: AttentionConfig = field(default_factory=AttentionConfig)

    PRESETS: ClassVar[dict[str, dict]] = {
        "small": dict(d_model=256, ffn_dim=1024, heads=4),
        "base": dict(d_model=512, ffn_dim=2048, heads=8),
        "big": dict(d_model=1024, ffn_dim=4096, heads=16),
    }

    def validate(self, where: str) -> None:
        check_transformer_sizes(
            where, d_model=self.d_model, heads=self.heads, ffn_dim=self.ffn_dim,
            layers={"encoder_layers": self.encoder_layers, "decoder_layers": self.decoder_layers},
            activation=self.activation, max_positions=self.max_positions,
            dropouts={"dropout": self.dropout, "attention_dropout": self.attention_dropout,
                      "activation_dropout": self.activation_dropout})
        for slot, self_attention in (("encoder_self_attention", True), ("decoder_self_attention", True),
                                     ("cross_attention", False)):
            getattr(self, slot).check_slot(f"{where}.{slot}", self_attention)


class Residual(nn.Module):
    """x + dropout(f(LN(x))) (pre-norm) or LN(x + dropout(f(x))) (post-norm)."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = dropout
        self.pre_norm = pre_norm

    def inner(self, x: Tensor) -> Tensor:
        """What the sub-layer reads: LN(x) with pre-norm, x itself with post-norm."""
        return self.norm(x) if self.pre_norm else x

    def outer(self, x: Tensor, y: Tensor) -> Tensor:
        out = x + dropout(y, self.dropout, self.training)
        return out if self.pre_norm else self.norm(out)


class EncoderLayer(CompiledRegion):
    """Self-attention and FFN, each in a :class:`Residual`; compiled in training under ``train.compile``."""

    def __init__(self, cfg: TransformerConfig, index: int) -> None:
        super().__init__()
        self.self_attn = build_attention(cfg.encoder_self_attention, cfg.d_model, cfg.heads,
                                         dropout=cfg.attention_dropout, self_attention=True,
                                         name=f"encoder.{index}.self_attn")
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.attn_res = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.ffn_res = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def run(self, x: Tensor, padding_mask: Tensor | None, ctx: AttentionContext) -> tuple[Tensor, Tensor | None]:
        h = self.attn_res.inner(x)
        y, weights = self.self_attn(h, h, key_padding_mask=padding_mask, ctx=ctx)
        x = self.attn_res.outer(x, y)
        x = self.ffn_res.outer(x, self.ffn(self.ffn_res.inner(x)))
        return x, weights


class DecoderLayer(CompiledRegion):
    """Causal self-attention, cross-attention, FFN; ``cross_attention=False`` drops the middle one (an LM layer).
    Compiled in training under ``train.compile`` (teacher forcing, no incremental ``state``)."""

    def __init__(self, cfg: TransformerConfig, index: int, *, cross_attention: bool = True) -> None:
        super().__init__()
        self.self_attn = build_attention(cfg.decoder_self_attention, cfg.d_model, cfg.heads,
                                         dropout=cfg.attention_dropout, self_attention=True,
                                         name=f"decoder.{index}.self_attn")
        self.cross_attn = build_attention(cfg.cross_attention, cfg.d_model, cfg.heads,
                                          dropout=cfg.attention_dropout, self_attention=False,
                                          name=f"decoder.{index}.cross_attn") if cross_attention else None
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.self_res = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.cross_res = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm) if cross_attention else None
        self.ffn_res = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def compilable(self, x: Tensor, enc: EncoderOut, state: State | None, *ctx: AttentionContext) -> bool:
        return state is None

    def run(self, x: Tensor, enc: EncoderOut, state: State | None, self_ctx: AttentionContext,
            cross_ctx: AttentionContext) -> tuple[Tensor, Tensor | None]:
        h = self.self_res.inner(x)
        y, _ = self.self_attn(h, h, causal=True, state=state, ctx=self_ctx)
        x = self.self_res.outer(x, y)
        weights = None
        if self.cross_attn is not None:
            y, weights = self.cross_attn(self.cross_res.inner(x), enc["out"], key_padding_mask=enc["padding_mask"],
                                         state=state, ctx=cross_ctx)
            x = self.cross_res.outer(x, y)
        x = self.ffn_res.outer(x, self.ffn(self.ffn_res.inner(x)))
        return x, weights


class Embedder(nn.Module):
    """E = dropout(√d · emb(tokens) + PE(positions)): exactly what layer 1 receives."""

    def __init__(self, embedding: nn.Embedding, positions: SinusoidalPositions, dropout: float) -> None:
        super().__init__()
        self.embedding = embedding
        self.positions = positions
        self.scale = math.sqrt(embedding.embedding_dim)
        self.dropout = dropout

    def forward(self, tokens: Tensor, offset: Tensor | int = 0) -> Tensor:
        x = self.embedding(tokens) * self.scale + self.positions(tokens.size(1), offset)
        return dropout(x, self.dropout, self.training)


class TransformerEncoder(nn.Module):
    """A stack of encoder layers; returns ``{"out", "padding_mask", "embeddings"}``."""

    def __init__(self, cfg: TransformerConfig, embedder: Embedder) -> None:
        super().__init__()
        self.embedder = embedder
        self.layers = nn.ModuleList(EncoderLayer(cfg, i) for i in range(cfg.encoder_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        link_stack([layer.self_attn for layer in self.layers])

    def forward(self, src: Tensor, need_weights: bool = False,
                layer_outputs: list[Tensor] | None = None) -> EncoderOut:
        """src (B,S) → encoder output; each layer's output (B,S,D) is appended to ``layer_outputs`` if given."""
        padding_mask = src.eq(PAD)  # (B,S)
        x = self.embedder(src)
        ctx = AttentionContext(embeddings=x, need_weights=need_weights)
        out: EncoderOut = {"padding_mask": padding_mask, "embeddings": x}
        for i, layer in enumerate(self.layers):
            ctx.layer = i
            ctx.layer_inputs.append(x)
            x, weights = layer(x, padding_mask, ctx)
            if layer_outputs is not None:
                layer_outputs.append(x)
            if need_weights and weights is not None:
                out[f"self_attn.{i}"] = weights
        out["out"] = self.final_norm(x)
        return out


class TransformerDecoder(nn.Module):
    """A stack of decoder layers with the output projection; supports incremental ``state``."""

    def __init__(self, cfg: TransformerConfig, embedder: Embedder, output_weight: nn.Parameter, *,
                 cross_attention: bool = True) -> None:
        super().__init__()
        self.embedder = embedder
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, cross_attention=cross_attention)
                                    for i in range(cfg.decoder_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        link_stack([layer.self_attn for layer in self.layers])
        if cross_attention:
            link_stack([layer.cross_attn for layer in self.layers])
        self.output_weight = output_weight  # (V,D), usually tied to the target embedding

    def features(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None,
                 need_weights: bool = False, layer_outputs: list[Tensor] | None = None) -> tuple[Tensor, list[Tensor]]:
        """tgt_in (B,T) → final hidden states (B,T,D) and the cross-attention weights per layer.

        Each layer's output (B,T,D) is appended to ``layer_outputs`` if given (for analysis).
        """
        offset: Tensor | int = 0
        if state is not None:
            offset = state.get("decoder.steps", tgt_in.new_zeros(tgt_in.size(0)))
            state["decoder.steps"] = offset + tgt_in.size(1)
        x = self.embedder(tgt_in, offset)
        self_ctx = AttentionContext(embeddings=x, need_weights=need_weights)
        cross_ctx = AttentionContext(embeddings=enc.get("embeddings"), need_weights=need_weights)
        cross_weights = []
        for i, layer in enumerate(self.layers):
            self_ctx.layer = cross_ctx.layer = i
            self_ctx.layer_inputs.append(x)
            x, weights = layer(x, enc, state, self_ctx, cross_ctx)
            if layer_outputs is not None:
                layer_outputs.append(x)
            if weights is not None:
                cross_weights.append(weights)
        return self.final_norm(x), cross_weights

    def forward(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None) -> Tensor:
        x, _ = self.features(tgt_in, enc, state)
        return output_logits(x, self.output_weight)  # (B,T,V)


@register_model("transformer", TransformerConfig)
class Transformer(EncoderDecoder):
    """Encoder–decoder Transformer; embeddings tied as SPEC §1 prescribes."""

    def __init__(self, cfg: TransformerConfig, vocabs: Vocabularies) -> None:
        super().__init__()
        self.config = cfg
        positions = SinusoidalPositions(cfg.d_model, cfg.max_positions)
        src_emb = token_embedding(vocabs.src_size, cfg.d_model)
        share_all = cfg.tie_embeddings and vocabs.joint and vocabs.src_size == vocabs.tgt_size
        tgt_emb = src_emb if share_all else token_embedding(vocabs.tgt_size, cfg.d_model)
        self.encoder = TransformerEncoder(cfg, Embedder(src_emb, positions, cfg.dropout))
        output_weight = tgt_emb.weight if cfg.tie_embeddings else nn.Parameter(
            nn.init.normal_(tgt_emb.weight.new_empty(vocabs.tgt_size, cfg.d_model), std=cfg.d_model ** -0.5))
        self.decoder = TransformerDecoder(cfg, Embedder(tgt_emb, positions, cfg.dropout), output_weight)

    def encode(self, src: Tensor) -> EncoderOut:
        return self.encoder(src)

    def decode(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None) -> Tensor:
        return self.decoder(tgt_in, enc, state)
