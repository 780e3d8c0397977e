"""ConvS2S (Gehring et al. 2017; SPEC §1) and DenseNMT (Shen et al. 2018; SPEC §4) as one configurable model.

Three independent switches turn the residual ConvS2S into DenseNMT, part by part (the paper's ablations):

* ``dense_encoder`` — h_{l+1} = H([h_l, …, h_0]) (Eq. 6), each layer adding ``growth`` features;
* ``dense_decoder`` — z_{l+1} = H([z_l, a_l, …, z_1, a_1, z_0]) (Eq. 7) with causal convolutions;
* ``attention`` — ``multistep`` (Gehring et al. 2017, §3.3), ``dense1`` (Eq. 9) or ``dense2`` (Eq. 10).

H is a GLU convolution (:class:`~nmtflow.nn.conv.GLUConv`, Eq. 5). ``sumlen`` adds a summary layer after
every ``sumlen − 1`` dense layers (§3.3): a linear map of the concatenation back to ``embed_dim`` (d0) that
becomes the new h_0 / z_0 of the layers above. No summary follows the last layer (the output map does that
job). Choices where the paper is silent, all written down here:

* The decoder output is a linear map of the final concatenation (the layers above the last summary, that
  summary included, the last layer's attention output too), then dropout and the vocabulary projection.
  A dense encoder feeding multi-step attention uses the same kind of map as its output ``z``.
* Dense attention attends over the encoder layers above the last summary, plus that summary (the "last
  contextual embedding layer", §3.3); its h_0 term is always the source embedding e, as in multi-step attention.
  On a residual encoder (the DenseAtt-4L ablation) it attends over every encoder layer's output.
* In a residual decoder, dense attention joins like multi-step attention: y ← (y + a_l)·√½.
* ``hidden`` is the width of residual stacks, ``growth`` the d of dense stacks; ``layer_groups`` sets
  (count, width, kernel) groups for both stacks instead (width = hidden or growth, per stack type).
* Embeddings: token embedding (optionally ``embed_small`` wide, projected up to d0 — Shen et al. §4.2; the
  softmax matrix is then ``embed_small`` wide too) plus learned positions; ``N(0, 0.1)`` as in fairseq.
* Multi-step attention scales the encoder output's gradient by 1/(2·decoder layers) (Gehring et al. §3.4).

Incremental decoding: each causal convolution caches its last k−1 inputs (``decoder.{l}.conv.cache``),
dense attention caches its encoder-side keys/values (``decoder.{l}.attn.static_k/v``); the prefix is never
recomputed. The dense concatenations are built with one ``torch.cat`` per layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from torch import Tensor, nn

from nmtflow.config import ConfigError
from nmtflow.data.vocab import PAD
from nmtflow.models.base import EncoderDecoder, EncoderOut, ModelConfig, State, Vocabularies
from nmtflow.nn.conv import GLUConv, linear
from nmtflow.nn.conv_attention import SQRT_HALF, DenseAttention, MultiStepAttention
from nmtflow.nn.dropout import dropout
from nmtflow.registry import register_model

ATTENTIONS = ("multistep", "dense1", "dense2")
Attend = Callable[[int, Tensor], Tensor]  # (layer index, layer output (B,T,w)) → attention output (B,T,w)


@dataclass
class ConvS2SConfig(ModelConfig):
    """ConvS2S by default; the ``dense_*`` / ``attention`` / ``sumlen`` options give DenseNMT and its ablations."""

    name: str = "convs2s"
    embed_dim: int = 256  # d0: embeddings, positions, summaries, multi-step attention space
    embed_small: int | None = None  # small token embeddings and softmax matrix, projected up to embed_dim
    hidden: int = 256  # width of residual stacks
    growth: int = 128  # d: features each dense layer adds
    kernel_size: int = 3  # 2r + 1 (causal in the decoder)
    encoder_layers: int = 4
    decoder_layers: int = 4
    layer_groups: list[tuple[int, int, int]] | None = None  # [(count, width, kernel)] for both stacks: overrides
    #   encoder_layers, decoder_layers, hidden / growth and kernel_size
    dense_encoder: bool = False
    dense_decoder: bool = False
    attention: str = "multistep"  # multistep | dense1 | dense2
    sumlen: int = 0  # a summary layer after every sumlen − 1 dense layers; 0 = none
    dropout: float = 0.2
    weight_norm: bool = True  # w = g·v/‖v‖ in every conv and linear layer (Gehring et al. 2017); false: plain
    tie_embeddings: bool = False  # target embedding = softmax matrix
    max_positions: int = 1024

    PRESETS: ClassVar[dict[str, dict]] = {
        # BASE-4L / BASE-8L (Shen et al. 2018, §4.2): residual ConvS2S, embeddings 256, hidden size 256 (4L) or 192
        # (8L: "such that both 4-layer models and 8-layer models have similar number of parameters")
        "base-4l": dict(encoder_layers=4, decoder_layers=4, embed_dim=256, hidden=256, kernel_size=3),
        "base-8l": dict(encoder_layers=8, decoder_layers=8, embed_dim=256, hidden=192, kernel_size=3),
        # Gehring et al. (2017) WMT'14 En-De: 9×512, 4×1024, 2×2048 (kernel 1) per stack, embeddings 768
        "wmt-15l": dict(embed_dim=768, layer_groups=[(9, 512, 3), (4, 1024, 3), (2, 2048, 1)]),
    }

    def validate(self, where: str) -> None:
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"{where}.attention: unknown {self.attention!r} (known: {', '.join(ATTENTIONS)})")
        if self.sumlen == 1 or self.sumlen < 0:
            raise ConfigError(f"{where}.sumlen: must be 0 (no summary layers) or at least 2, got {self.sumlen}")
        for field_name in ("embed_dim", "hidden", "growth", "kernel_size", "encoder_layers", "decoder_layers"):
            if getattr(self, field_name) < 1:
                raise ConfigError(f"{where}.{field_name}: must be positive")
        if not 0.0 <= self.dropout < 1.0:  # (1 − dropout) scales the initial weights: 1 would zero them
            raise ConfigError(f"{where}.dropout: must be in [0, 1), got {self.dropout}")
        if self.max_positions < 1:
            raise ConfigError(f"{where}.max_positions: must be positive, got {self.max_positions}")
        if self.layer_groups is not None and not self.layer_groups:
            raise ConfigError(f"{where}.layer_groups: empty; give at least one [count, width, kernel] group, or null "
                              "to build encoder_layers and decoder_layers layers")
        for i, (count, width, kernel) in enumerate(self.layer_groups or []):
            if min(count, width, kernel) < 1:
                raise ConfigError(f"{where}.layer_groups[{i}]: count, width and kernel must be positive, "
                                  f"got {[count, width, kernel]}")
        if self.embed_small is not None and self.embed_small < 1:
            raise ConfigError(f"{where}.embed_small: must be positive (or null)")
        # the encoder's convolutions are centred (kernel 2r + 1); the same kernels serve both stacks
        for i, (_, _, kernel) in enumerate(self.layer_groups or []):
            if kernel % 2 == 0:
                raise ConfigError(f"{where}.layer_groups[{i}]: the encoder needs odd kernel sizes (2r + 1), "
                                  f"got {kernel}")
        if not self.layer_groups and self.kernel_size % 2 == 0:
            raise ConfigError(f"{where}.kernel_size: the encoder needs an odd kernel size (2r + 1), "
                              f"got {self.kernel_size}")

    def specs(self, layers: int, dense: bool) -> list[tuple[int, int]]:
        """(width, kernel) of each layer of a stack."""
        if self.layer_groups:
            return [(w, k) for count, w, k in self.layer_groups for _ in range(count)]
        return [(self.growth if dense else self.hidden, self.kernel_size)] * layers


@dataclass
class DenseNMTConfig(ConvS2SConfig):
    """DenseNMT: dense encoder, dense decoder and DenseAtt-2 by default (Shen et al. 2018)."""

    name: str = "densenmt"
    dense_encoder: bool = True
    dense_decoder: bool = True
    attention: str = "dense2"

    PRESETS: ClassVar[dict[str, dict]] = {
        # §4.2: the BASE-4L / BASE-8L layouts with smaller dense layers (4L: 128, 8L: 96). 4L has no summary layer;
        # 8L, the "deeper model" of §3.3, summarises after layer 4 (sumlen 5), which keeps it within ±10% of BASE-8L
        # as Table 1 keeps model sizes "consistent within each column" (without it: +34% at a 16k vocabulary)
        "4l-1": dict(encoder_layers=4, decoder_layers=4, embed_dim=256, growth=128, attention="dense1"),
        "4l-2": dict(encoder_layers=4, decoder_layers=4, embed_dim=256, growth=128, attention="dense2"),
        "8l-1": dict(encoder_layers=8, decoder_layers=8, embed_dim=256, growth=96, sumlen=5, attention="dense1"),
        "8l-2": dict(encoder_layers=8, decoder_layers=8, embed_dim=256, growth=96, sumlen=5, attention="dense2"),
        # DenseNMT-En-De-15: ConvS2S WMT'14 layout, same kernels, sumlen 6
        # growth 5/16 of ConvS2S's hidden units: 20% fewer parameters than convs2s wmt-15l at a 40k vocabulary
        # (176.3M vs 220.3M), as the paper reports for its En-De model (Table 5)
        "wmt-15l": dict(embed_dim=768, layer_groups=[(9, 160, 3), (4, 320, 3), (2, 640, 1)], sumlen=6,
                        attention="dense2"),
    }


# ---- embeddings ------------------------------------------------------------------------------------
class ConvEmbedder(nn.Module):
    """e = dropout(emb(x) [W_up] + p(position)) (B,T,d0): token embeddings plus learned positions."""

    def __init__(self, vocab_size: int, cfg: ConvS2SConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, cfg.embed_small or cfg.embed_dim, padding_idx=PAD)
        self.up = linear(cfg.embed_small, cfg.embed_dim, weight_norm=cfg.weight_norm) if cfg.embed_small else None
        self.positions = nn.Embedding(cfg.max_positions, cfg.embed_dim)
        for emb in (self.tokens, self.positions):
            nn.init.normal_(emb.weight, mean=0.0, std=0.1)
        with torch.no_grad():
            self.tokens.weight[PAD].zero_()
        self.dropout = cfg.dropout

    def forward(self, tokens: Tensor, offset: Tensor | int = 0) -> Tensor:
        """tokens (B,T), offset: first position (int, or (B,) per row) → (B,T,d0)."""
        idx = torch.arange(tokens.size(1), device=tokens.device) + (
            offset[:, None] if isinstance(offset, Tensor) else offset)  # (T,) or (B,T)
        if int(idx.max()) >= self.positions.num_embeddings:
            raise ValueError(f"sequence longer than max_positions={self.positions.num_embeddings}")
        x = self.tokens(tokens)
        if self.up is not None:
            x = self.up(x)
        return dropout(x + self.positions(idx), self.dropout, self.training)


# ---- stacks ----------------------------------------------------------------------------------------
class ResidualConvStack(nn.Module):
    """Gehring et al. (2017): x_0 = W_in e, x_l = (y_l + R(x_{l−1}))·√½ with y_l = GLU(conv(x_{l−1})).

    In the decoder the layer's attention joins first: y_l ← (y_l + a_l)·√½. R is the identity, or a linear
    map where the width changes. Returns x_L (B,T,w_L).
    """

    def __init__(self, embed_dim: int, specs: list[tuple[int, int]], *, causal: bool, dropout: float,
                 weight_norm: bool, name: str) -> None:
        super().__init__()
        width = specs[0][0]
        self.in_proj = linear(embed_dim, width, dropout=dropout, weight_norm=weight_norm)
        self.convs, self.residuals = nn.ModuleList(), nn.ModuleList()
        for i, (w, k) in enumerate(specs):
            self.residuals.append(nn.Identity() if w == width else linear(width, w, weight_norm=weight_norm))
            self.convs.append(GLUConv(width, w, k, causal=causal, dropout=dropout, weight_norm=weight_norm,
                                      name=f"{name}.{i}.conv"))
            width = w
        self.out_dim = width
        self.source_widths = [w for w, _ in reversed(specs)]  # every layer's output, newest first

    def forward(self, e: Tensor, *, padding_mask: Tensor | None = None, state: State | None = None,
                attend: Attend | None = None, layer_outputs: list[Tensor] | None = None) -> Tensor:
        x = self.in_proj(e)
        for i, conv in enumerate(self.convs):
            y = conv(x, padding_mask=padding_mask, state=state)  # (B,T,w)
            if attend is not None:
                y = (y + attend(i, y)) * SQRT_HALF
            x = (y + self.residuals[i](x)) * SQRT_HALF
            if layer_outputs is not None:
                layer_outputs.append(x)
        return x

    def attention_sources(self, final: Tensor, layer_outputs: list[Tensor]) -> Tensor:
        """[h_L, …, h_1] (B,S,Σw): what dense attention reads from a residual encoder."""
        return torch.cat(layer_outputs[::-1], dim=-1)


class DenseConvStack(nn.Module):
    """Shen et al. (2018): h_{l+1} = H([h_l, …, h_0]) (Eq. 6), or with attention z_{l+1} = H([z_l, a_l, …, z_0])
    (Eq. 7); a summary layer after every ``sumlen − 1`` layers maps the concatenation back to d0 (§3.3).

    Returns the final concatenation (B,T,out_dim), newest first: [h_L, (a_L,) …, h_{s+1}, (a_{s+1},) h_s*],
    h_s* the last summary (or h_0 = e without one). ``input_widths`` lists the input width of every conv and
    summary layer: at most (sumlen−1)·d + d0 in an encoder, 2·(sumlen−1)·d + d0 with attention outputs.
    """

    def __init__(self, embed_dim: int, specs: list[tuple[int, int]], *, causal: bool, with_attention: bool,
                 sumlen: int, dropout: float, weight_norm: bool, name: str) -> None:
        super().__init__()
        self.convs, self.summaries = nn.ModuleList(), nn.ModuleDict()
        self.input_widths: list[int] = []
        width, last_summary = embed_dim, -1
        for i, (w, k) in enumerate(specs):
            self.input_widths.append(width)
            self.convs.append(GLUConv(width, w, k, causal=causal, dropout=dropout, weight_norm=weight_norm,
                                      name=f"{name}.{i}.conv"))
            width += 2 * w if with_attention else w
            if sumlen and (i + 1) % (sumlen - 1) == 0 and i + 1 < len(specs):
                self.input_widths.append(width)
                self.summaries[str(i)] = linear(width, embed_dim, weight_norm=weight_norm)
                width, last_summary = embed_dim, i
        self.out_dim = width
        # attention sources: the layers above the last summary, newest first, plus that summary (not e)
        self.source_widths = [w for w, _ in reversed(specs[last_summary + 1:])] + (
            [embed_dim] if last_summary >= 0 else [])

    def forward(self, e: Tensor, *, padding_mask: Tensor | None = None, state: State | None = None,
                attend: Attend | None = None, layer_outputs: list[Tensor] | None = None) -> Tensor:
        x = e  # (B,T,d0): [h_0]
        for i, conv in enumerate(self.convs):
            z = conv(x, padding_mask=padding_mask, state=state)  # (B,T,w)
            new = [z] if attend is None else [z, attend(i, z)]
            x = torch.cat([*new, x], dim=-1)  # [z_l, a_l, …, z_0]
            if layer_outputs is not None:
                layer_outputs.append(z)
            if str(i) in self.summaries:
                x = self.summaries[str(i)](x)  # the new h_0 / z_0 (B,T,d0)
        return x

    def attention_sources(self, final: Tensor, layer_outputs: list[Tensor]) -> Tensor:
        """The final concatenation without e (the summary stays in): (B,S,Σ source_widths)."""
        return final[..., :sum(self.source_widths)]


def build_stack(cfg: ConvS2SConfig, specs: list[tuple[int, int]], *, dense: bool, causal: bool,
                name: str) -> ResidualConvStack | DenseConvStack:
    common = dict(causal=causal, dropout=cfg.dropout, weight_norm=cfg.weight_norm, name=name)
    if dense:
        return DenseConvStack(cfg.embed_dim, specs, with_attention=causal, sumlen=cfg.sumlen, **common)
    return ResidualConvStack(cfg.embed_dim, specs, **common)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient × ``scale`` backward (Gehring et al. 2017, §3.4)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None  # type: ignore[attr-defined]


# ---- encoder and decoder ---------------------------------------------------------------------------
class ConvEncoder(nn.Module):
    """src (B,S) → ``{"padding_mask", "embeddings" (e), and "out"+"values" (multi-step) or "sources" (dense)}``."""

    def __init__(self, cfg: ConvS2SConfig, vocab_size: int) -> None:
        super().__init__()
        self.embedder = ConvEmbedder(vocab_size, cfg)
        self.stack = build_stack(cfg, cfg.specs(cfg.encoder_layers, cfg.dense_encoder), dense=cfg.dense_encoder,
                                 causal=False, name="encoder")
        multistep = cfg.attention == "multistep"
        self.out_proj = linear(self.stack.out_dim, cfg.embed_dim, weight_norm=cfg.weight_norm) if multistep else None
        self.grad_scale = 1.0 / (2 * len(cfg.specs(cfg.decoder_layers, cfg.dense_decoder)))
        self.source_widths = self.stack.source_widths

    def forward(self, src: Tensor, layer_outputs: list[Tensor] | None = None) -> EncoderOut:
        """Each layer's output (B,S,w) is appended to ``layer_outputs`` if given."""
        pad = src.eq(PAD)  # (B,S)
        e = self.embedder(src).masked_fill(pad.unsqueeze(-1), 0.0)  # (B,S,d0)
        outputs = [] if layer_outputs is None else layer_outputs
        first = len(outputs)
        x = self.stack(e, padding_mask=pad, layer_outputs=outputs)
        enc: EncoderOut = {"padding_mask": pad, "embeddings": e}
        if self.out_proj is not None:
            out = _ScaleGrad.apply(self.out_proj(x), self.grad_scale)  # z (B,S,d0)
            enc["out"], enc["values"] = out, (out + e) * SQRT_HALF
        else:
            enc["sources"] = self.stack.attention_sources(x, outputs[first:])
        return enc


class ConvDecoder(nn.Module):
    """Causal conv stack with one attention per layer, output map and vocabulary projection."""

    def __init__(self, cfg: ConvS2SConfig, vocab_size: int, source_widths: list[int]) -> None:
        super().__init__()
        self.embedder = ConvEmbedder(vocab_size, cfg)
        specs = cfg.specs(cfg.decoder_layers, cfg.dense_decoder)
        self.stack = build_stack(cfg, specs, dense=cfg.dense_decoder, causal=True, name="decoder")
        self.attentions = nn.ModuleList(
            MultiStepAttention(w, cfg.embed_dim, weight_norm=cfg.weight_norm) if cfg.attention == "multistep"
            else DenseAttention(w, w, source_widths, cfg.embed_dim, per_layer=cfg.attention == "dense2",
                                weight_norm=cfg.weight_norm, name=f"decoder.{i}.attn")
            for i, (w, _) in enumerate(specs))
        out_dim = cfg.embed_small or cfg.embed_dim
        self.out_proj = linear(self.stack.out_dim, out_dim, weight_norm=cfg.weight_norm)
        self.output = linear(out_dim, vocab_size, dropout=cfg.dropout,
                             weight_norm=cfg.weight_norm and not cfg.tie_embeddings)
        if cfg.tie_embeddings:
            self.output.weight = self.embedder.tokens.weight
        self.dropout = cfg.dropout

    def forward(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None,
                layer_outputs: list[Tensor] | None = None) -> Tensor:
        """tgt_in (B,T) → logits (B,T,V); with ``state`` only the new positions."""
        offset: Tensor | int = 0
        if state is not None:
            offset = state.get("decoder.steps", tgt_in.new_zeros(tgt_in.size(0)))
            state["decoder.steps"] = offset + tgt_in.size(1)
        g = self.embedder(tgt_in, offset)  # (B,T,d0)

        def attend(i: int, z: Tensor) -> Tensor:
            return self.attentions[i](z, g, enc, state)

        x = self.stack(g, state=state, attend=attend, layer_outputs=layer_outputs)
        x = dropout(self.out_proj(x), self.dropout, self.training)  # (B,T,out_dim)
        return self.output(x)


@register_model("convs2s", ConvS2SConfig)
class ConvS2S(EncoderDecoder):
    """ConvS2S / DenseNMT encoder–decoder (see the module docstring for the options)."""

    def __init__(self, cfg: ConvS2SConfig, vocabs: Vocabularies) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = ConvEncoder(cfg, vocabs.src_size)
        self.decoder = ConvDecoder(cfg, vocabs.tgt_size, self.encoder.source_widths)

    def encode(self, src: Tensor) -> EncoderOut:
        return self.encoder(src)

    def decode(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None) -> Tensor:
        return self.decoder(tgt_in, enc, state)


@register_model("densenmt", DenseNMTConfig)
class DenseNMT(ConvS2S):
    """DenseNMT (Shen et al. 2018): :class:`ConvS2S` with :class:`DenseNMTConfig`'s dense defaults."""

