"""Multilingual models (SPEC §5 and §1): the attention bridge and the language-label baseline.

The multilingual contract, on top of :class:`~nmtflow.models.base.EncoderDecoder`:

* ``encode(src, lang=SRC)`` and ``decode(tgt_in, enc, state, lang=TGT)`` name the languages explicitly;
  ``model.pair(SRC, TGT)`` returns a :class:`LanguagePair`: that one direction behind the plain contract
  (``encode(src)``, ``decode(tgt_in, enc, state)``, ``auxiliary_loss(enc)``), so training steps, beam search,
  scoring and translation run on it unchanged. Zero-shot directions are pairs that were never trained.
* ``uses_language_tags``: whether every source must start with the ``<2TGT>`` tag (the data pipeline and
  the translator add it; the model itself never sees a language name).
* Training batches carry their direction as :class:`~nmtflow.data.multilingual.PairBatch` ``src_lang`` /
  ``tgt_lang``; :class:`~nmtflow.train.multilingual.MultilingualTrainer` runs each on ``model.pair(...)``.
* Which languages have modules, and their vocabulary sizes, is part of the vocabularies
  (:class:`LanguageVocabularies`), stored in every checkpoint, so a model rebuilds itself exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn

from nmtflow.config import ConfigError
from nmtflow.models.base import EncoderDecoder, EncoderOut, ModelConfig, State, Vocabularies, build_model
from nmtflow.models.rnn import DECODER_INITS, BiLSTMEncoder, LuongDecoder, RNNConfig, output_projection
from nmtflow.models.transformer import (Embedder, TransformerConfig, TransformerDecoder, TransformerEncoder,
                                        check_transformer_sizes)
from nmtflow.nn.attention import AttentionConfig
from nmtflow.nn.bridge import AttentionBridge, bridge_penalty
from nmtflow.nn.layers import SinusoidalPositions, token_embedding
from nmtflow.registry import register_model


@dataclass(frozen=True)
class LanguageVocabularies(Vocabularies):
    """Per-language vocabulary sizes: one encoder per ``encoders`` key, one decoder per ``decoders`` key.

    ``src_size``/``tgt_size`` hold the largest sizes (what a shared, language-agnostic model needs).
    """

    encoders: dict[str, int] = field(default_factory=dict)
    decoders: dict[str, int] = field(default_factory=dict)


def language_sizes(vocabs: Vocabularies) -> tuple[dict[str, int], dict[str, int]]:
    """(source language → size, target language → size); plain vocabularies give one ``src → tgt`` direction."""
    if isinstance(vocabs, LanguageVocabularies) and vocabs.encoders and vocabs.decoders:
        return dict(vocabs.encoders), dict(vocabs.decoders)
    return {"src": vocabs.src_size}, {"tgt": vocabs.tgt_size}


class MultilingualModel(EncoderDecoder):
    """Base of models that translate between several languages; see the module docstring."""

    uses_language_tags: ClassVar[bool] = False

    def encode(self, src: Tensor, lang: str | None = None) -> EncoderOut:  # type: ignore[override]
        raise NotImplementedError

    def decode(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None,  # type: ignore[override]
               lang: str | None = None) -> Tensor:
        raise NotImplementedError

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.decode(tgt_in, self.encode(src))

    def check_pair(self, src_lang: str, tgt_lang: str) -> None:
        """Raise ValueError if the model cannot translate ``src_lang`` → ``tgt_lang``."""

    def pair(self, src_lang: str, tgt_lang: str) -> "LanguagePair":
        """The ``src_lang → tgt_lang`` direction with the plain EncoderDecoder contract."""
        self.check_pair(src_lang, tgt_lang)
        return LanguagePair(self, src_lang, tgt_lang)


class LanguagePair(EncoderDecoder):
    """One direction of a :class:`MultilingualModel` (a view: it owns no parameters of its own)."""

    def __init__(self, model: MultilingualModel, src_lang: str, tgt_lang: str) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.src_lang, self.tgt_lang = src_lang, tgt_lang

    def encode(self, src: Tensor) -> EncoderOut:
        return self.model.encode(src, lang=self.src_lang)

    def decode(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None) -> Tensor:
        return self.model.decode(tgt_in, enc, state, lang=self.tgt_lang)

    def auxiliary_loss(self, enc: EncoderOut, num_tgt_tokens: int) -> Tensor | None:
        return self.model.auxiliary_loss(enc, num_tgt_tokens)

    def extra_repr(self) -> str:
        return f"{self.src_lang} → {self.tgt_lang}"


# ---------------------------------------------------------------------------------------------------
# the attention bridge (Vázquez et al. 2020)


# How the penalty of Eq. 10 enters the loss. Every scale but the legacy ones adds a sum over the batch's sentences to
# the summed token cross-entropy and divides both by the update's target tokens (SPEC §5), so the ratio between a
# sentence's penalty and its cross-entropy does not depend on the rest of the batch, update_freq or DDP:
PENALTY_SCALES = {
    # the paper's code (Helsinki-NLP's OpenNMT-py fork, att-brg: utils/loss.py): the batch mean of the unsquared
    # norm ‖AAᵀ − I‖_F, added once per batch of 64 sentences to the summed cross-entropy: per sentence
    # λ‖AAᵀ − I‖_F / penalty_batch
    "paper": "λ·‖AAᵀ − I‖_F / penalty_batch per sentence, against its summed token cross-entropy",
    # SPEC §5 as written: each sentence's squared norm once against its summed token cross-entropy
    "squared_sum": "λ·‖AAᵀ − I‖²_F per sentence, against its summed token cross-entropy",
    # the earlier SPEC §5: the batch mean squared norm added to the per-token mean cross-entropy (about one sentence
    # length stronger than squared_sum; on Multi30k it collapses every head onto one token)
    "legacy_mean": "λ·mean over sentences of ‖AAᵀ − I‖²_F, against the per-token mean cross-entropy",
    # the squared norms summed over the batch and divided by its source tokens, against the per-token mean
    "legacy_per_source_token": "λ·Σ ‖AAᵀ − I‖²_F / source tokens, against the per-token mean cross-entropy",
}
LEGACY_PENALTY_NAMES = {"sentence": "legacy_mean", "token": "legacy_per_source_token"}  # names of earlier versions


@dataclass
class BridgeConfig(ModelConfig):
    """Language-specific encoders and decoders joined by one shared attention bridge (SPEC §5).

    Defaults are the paper's (§3.1): 2-layer BiLSTM encoders and 2-layer LSTM decoders of d_h = 512,
    k = 10 bridge heads, d_w = 1024, penalty λ = 1; dropout 0.3 is OpenNMT-py's default (the paper does not
    say). ``encoder``/``decoder: transformer`` put the bridge on Transformer stacks instead (SPEC §6):
    d_model = ``hidden_dim``, the decoder's cross-attention reads M.
    """

    name: str = "bridge"
    encoder: str = "rnn"  # rnn | transformer
    decoder: str = "rnn"  # rnn | transformer
    hidden_dim: int = 512  # d_h: embeddings, encoder states, rows of M, decoder states
    encoder_layers: int = 2
    decoder_layers: int = 2
    dropout: float = 0.3
    input_feeding: bool = True  # rnn decoder (Luong §3.3)
    heads: int = 8  # transformer stacks only
    ffn_dim: int = 2048  # transformer stacks only
    tie_embeddings: bool = True  # per language: encoder input = decoder input = output projection
    max_positions: int = 1024
    bridge_heads: int = 10  # k: rows of M
    bridge_dim: int = 1024  # d_w
    bridge_bias: bool = False  # W_1 and W_2 with biases, as in the paper's code (the presets set it)
    penalty: float = 1.0  # λ of Eq. 10; 0 switches the penalty off
    # how λ·penalty is weighed against the cross-entropy (see PENALTY_SCALES); the default is the paper's code's
    penalty_scale: str = "paper"
    penalty_batch: int = 64  # paper: the sentences over which the paper's code averages the penalty (its batch)
    # rnn decoder's initial state: projected = tanh(W_init mean(M)), c_0 = 0; mean = h_0 = c_0 = mean(M), as the
    # paper's code (the presets set it)
    decoder_init: str = "projected"
    # rnn encoder: dropout on H, the bridge's input (the paper's code has none; the presets switch it off)
    encoder_output_dropout: bool = True
    # the self-attention of Transformer stacks, e.g. lexical shortcuts or phrasal attention under the bridge
    # (SPEC §6); a Transformer decoder's cross-attention reads the k rows of M, so it stays standard
    encoder_self_attention: AttentionConfig = field(default_factory=AttentionConfig)
    decoder_self_attention: AttentionConfig = field(default_factory=AttentionConfig)

    def validate(self, where: str) -> None:
        for side in ("encoder", "decoder"):
            if getattr(self, side) not in ("rnn", "transformer"):
                raise ConfigError(f"{where}.{side}: expected rnn or transformer, got {getattr(self, side)!r}")
            slot = getattr(self, f"{side}_self_attention")
            if getattr(self, side) == "rnn" and slot.type != AttentionConfig.type:
                raise ConfigError(f"{where}.{side}_self_attention: {slot.type!r} needs a Transformer {side} "
                                  f"({side}: transformer); an LSTM {side} has no self-attention")
        if self.hidden_dim < 1:
            raise ConfigError(f"{where}.hidden_dim: must be positive, got {self.hidden_dim}")
        if self.encoder == "rnn" and self.hidden_dim % 2:
            raise ConfigError(f"{where}.hidden_dim: a BiLSTM encoder needs an even size, got {self.hidden_dim}")
        for side in ("encoder", "decoder"):
            if getattr(self, side) == "rnn" and getattr(self, f"{side}_layers") < 1:
                raise ConfigError(f"{where}.{side}_layers: an LSTM {side} needs at least one layer")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{where}.dropout: must be in [0, 1), got {self.dropout}")
        if "transformer" in (self.encoder, self.decoder):
            if self.heads >= 1 and self.hidden_dim % self.heads:
                raise ConfigError(f"{where}.heads: {self.heads} does not divide hidden_dim={self.hidden_dim}")
            check_transformer_sizes(where, d_model=self.hidden_dim, heads=self.heads, ffn_dim=self.ffn_dim,
                                    layers={"encoder_layers": self.encoder_layers,
                                            "decoder_layers": self.decoder_layers},
                                    max_positions=self.max_positions)
        if self.decoder_init not in DECODER_INITS:
            raise ConfigError(f"{where}.decoder_init: expected one of {', '.join(DECODER_INITS)}, "
                              f"got {self.decoder_init!r}")
        if self.decoder_init != "projected" and self.decoder != "rnn":
            raise ConfigError(f"{where}.decoder_init: {self.decoder_init!r} sets an LSTM decoder's initial state; "
                              "a Transformer decoder has none (decoder: rnn)")
        if not self.encoder_output_dropout and self.encoder != "rnn":
            raise ConfigError(f"{where}.encoder_output_dropout: only an LSTM encoder (encoder: rnn) can leave it out")
        if self.bridge_heads < 1 or self.bridge_dim < 1:
            raise ConfigError(f"{where}: bridge_heads and bridge_dim must be >= 1")
        if not 0 <= self.penalty < float("inf"):  # NaN fails too
            raise ConfigError(f"{where}.penalty: must be a finite number >= 0, got {self.penalty}")
        self.penalty_scale = LEGACY_PENALTY_NAMES.get(self.penalty_scale, self.penalty_scale)
        if self.penalty_scale not in PENALTY_SCALES:
            raise ConfigError(f"{where}.penalty_scale: expected one of {', '.join(PENALTY_SCALES)}, "
                              f"got {self.penalty_scale!r}")
        if self.penalty_batch < 1:
            raise ConfigError(f"{where}.penalty_batch: must be >= 1, got {self.penalty_batch}")

    def transformer_config(self) -> TransformerConfig:
        """The Transformer sizes (and self-attention variants) used by transformer encoders/decoders."""
        return TransformerConfig(d_model=self.hidden_dim, ffn_dim=self.ffn_dim, heads=self.heads,
                                 encoder_layers=self.encoder_layers, decoder_layers=self.decoder_layers,
                                 dropout=self.dropout, max_positions=self.max_positions,
                                 encoder_self_attention=self.encoder_self_attention,
                                 decoder_self_attention=self.decoder_self_attention)


@register_model("bridge", BridgeConfig)
class AttentionBridgeModel(MultilingualModel):
    """``encoders[SRC]`` → H → shared bridge → M (k × d_h) → ``decoders[TGT]`` (SPEC §5).

    ``encode`` returns ``out`` = H (B,S,d_h), ``padding_mask`` (B,S), ``bridge`` = M (B,k,d_h) and
    ``bridge_attention`` = A (B,k,S). Decoders attend over all k rows of M (no mask); an RNN decoder starts
    from the mean of M (``decoder_init``). ``auxiliary_loss`` = the penalty of Eq. 10 weighed as ``penalty_scale``
    says, which the trainer adds to the summed token cross-entropy before dividing by the update's target tokens.
    """

    def __init__(self, cfg: BridgeConfig, vocabs: Vocabularies) -> None:
        super().__init__()
        self.config = cfg
        enc_sizes, dec_sizes = language_sizes(vocabs)
        for lang in {*enc_sizes, *dec_sizes}:
            if not lang or "." in lang:
                raise ConfigError(f"language {lang!r}: names with '.' cannot key model modules")
        self.positions = SinusoidalPositions(cfg.hidden_dim, cfg.max_positions)
        tables: dict[str, nn.Embedding] = {}

        def embedding(lang: str, size: int) -> nn.Embedding:
            if not cfg.tie_embeddings:
                return token_embedding(size, cfg.hidden_dim)
            if lang not in tables:  # one table per language, shared by its encoder and decoder
                tables[lang] = token_embedding(size, cfg.hidden_dim)
            return tables[lang]

        self.encoders = nn.ModuleDict({lang: self._encoder(embedding(lang, enc_sizes[lang]))
                                       for lang in sorted(enc_sizes)})
        self.bridge = AttentionBridge(cfg.hidden_dim, cfg.bridge_heads, cfg.bridge_dim, bias=cfg.bridge_bias)
        self.decoders = nn.ModuleDict({lang: self._decoder(embedding(lang, dec_sizes[lang]))
                                       for lang in sorted(dec_sizes)})

    def _encoder(self, emb: nn.Embedding) -> nn.Module:
        cfg = self.config
        if cfg.encoder == "rnn":
            return BiLSTMEncoder(emb, cfg.hidden_dim, cfg.encoder_layers, cfg.dropout,
                                 output_dropout=cfg.encoder_output_dropout)
        return TransformerEncoder(cfg.transformer_config(), Embedder(emb, self.positions, cfg.dropout))

    def _decoder(self, emb: nn.Embedding) -> nn.Module:
        cfg = self.config
        out = output_projection(emb, cfg.tie_embeddings)
        if cfg.decoder == "rnn":
            return LuongDecoder(emb, cfg.hidden_dim, cfg.hidden_dim, cfg.decoder_layers, cfg.dropout, out,
                                input_feeding=cfg.input_feeding, init=cfg.decoder_init)
        return TransformerDecoder(cfg.transformer_config(), Embedder(emb, self.positions, cfg.dropout), out)

    # ---- languages ---------------------------------------------------------------------------------
    @staticmethod
    def _pick(lang: str | None, modules: nn.ModuleDict, side: str) -> str:
        if lang is None:
            if len(modules) != 1:
                raise ValueError(f"this model has {side}s for {', '.join(modules)}: name the language")
            return next(iter(modules))
        if lang not in modules:
            raise ValueError(f"no {side} for language {lang!r} (the model has {', '.join(modules) or 'none'})")
        return lang

    def check_pair(self, src_lang: str, tgt_lang: str) -> None:
        self._pick(src_lang, self.encoders, "encoder")
        self._pick(tgt_lang, self.decoders, "decoder")

    def language_modules(self, langs: list[str]) -> list[nn.Module]:
        """The encoders and decoders of ``langs`` (what training a newly added language updates)."""
        return [m[lang] for m in (self.encoders, self.decoders) for lang in langs if lang in m]

    # ---- the contract ------------------------------------------------------------------------------
    def encode(self, src: Tensor, lang: str | None = None) -> EncoderOut:
        """src (B,S) → H, its padding mask, M = A H (B,k,d_h) and A (B,k,S) (Eq. 8–9)."""
        enc = self.encoders[self._pick(lang, self.encoders, "encoder")](src)
        memory, attention = self.bridge(enc["out"], enc["padding_mask"])
        return {"out": enc["out"], "padding_mask": enc["padding_mask"], "bridge": memory,
                "bridge_attention": attention}

    def decode(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None,
               lang: str | None = None) -> Tensor:
        """tgt_in (B,T) → logits (B,T,V); the decoder reads only M, every row of it."""
        decoder = self.decoders[self._pick(lang, self.decoders, "decoder")]
        memory = enc["bridge"]  # (B,k,d_h)
        if isinstance(decoder, LuongDecoder):
            return decoder(tgt_in, memory, None, state)
        no_padding = torch.zeros(memory.shape[:2], dtype=torch.bool, device=memory.device)  # (B,k)
        return decoder(tgt_in, {"out": memory, "padding_mask": no_padding}, state)

    def auxiliary_loss(self, enc: EncoderOut, num_tgt_tokens: int) -> Tensor | None:
        """λ·(penalty of Eq. 10) on the scale of the summed token cross-entropy (``penalty_scale``, PENALTY_SCALES):
        ``paper`` Σ_b ‖A_bA_bᵀ − I‖_F / penalty_batch; ``squared_sum`` Σ_b ‖A_bA_bᵀ − I‖²_F; the legacy scales
        their per-token value times ``num_tgt_tokens``."""
        cfg = self.config
        if cfg.penalty == 0:
            return None
        attention = enc["bridge_attention"]
        if cfg.penalty_scale == "paper":
            return cfg.penalty * bridge_penalty(attention, squared=False).sum() / cfg.penalty_batch
        penalties = bridge_penalty(attention)  # (B,) squared norms
        if cfg.penalty_scale == "squared_sum":
            return cfg.penalty * penalties.sum()
        if cfg.penalty_scale == "legacy_mean":
            return cfg.penalty * penalties.mean() * num_tgt_tokens
        source_tokens = (~enc["padding_mask"]).sum().clamp(min=1)  # legacy_per_source_token
        return cfg.penalty * penalties.sum() / source_tokens * num_tgt_tokens


# ---------------------------------------------------------------------------------------------------
# the language-label baseline (Johnson et al. 2017)


@dataclass
class LanguageLabelConfig(ModelConfig):
    """One shared single-direction model (``backbone``: any registered one) over a joint vocabulary; each
    source starts with its target language's ``<2xx>`` tag (prepare the data with ``--lang-tags``)."""

    name: str = "language_label"
    backbone: ModelConfig = field(default_factory=RNNConfig)

    def validate(self, where: str) -> None:
        if self.backbone.name in ("bridge", "language_label"):
            raise ConfigError(f"{where}.backbone.name: {self.backbone.name!r} is itself multilingual")
        if self.backbone.name == "lm":  # the <2xx> tag is in the source, which a language model never reads
            raise ConfigError(f"{where}.backbone.name: 'lm' ignores the source, so it never sees the target-language "
                              "tag; use an encoder-decoder backbone (rnn, transformer, convs2s, densenmt)")

    @property
    def max_positions(self) -> int:
        """The backbone's decoding length limit (read by beam search)."""
        return int(getattr(self.backbone, "max_positions", 1024))


@register_model("language_label", LanguageLabelConfig)
class LanguageLabelModel(MultilingualModel):
    """The backbone model, unchanged: the ``<2xx>`` tag in the source selects the target language."""

    uses_language_tags = True

    def __init__(self, cfg: LanguageLabelConfig, vocabs: Vocabularies) -> None:
        super().__init__()
        self.config = cfg
        self.model = build_model(cfg.backbone, Vocabularies(vocabs.src_size, vocabs.tgt_size, vocabs.joint))

    def encode(self, src: Tensor, lang: str | None = None) -> EncoderOut:
        return self.model.encode(src)

    def decode(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None,
               lang: str | None = None) -> Tensor:
        return self.model.decode(tgt_in, enc, state)

    def auxiliary_loss(self, enc: EncoderOut, num_tgt_tokens: int) -> Tensor | None:
        return self.model.auxiliary_loss(enc, num_tgt_tokens)
