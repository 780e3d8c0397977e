"""Lexical shortcuts (Emelin et al. 2019; SPEC §2): gated connections from the embeddings into keys/values.

For an attention sub-layer with key/value source ``H`` (= ``H_{l-1}``, layer-normed under pre-norm) and the
shortcut input ``E`` (the scaled embeddings plus positions: exactly what layer 1 receives; never normalised)::

    K_sc = W_ksc E     K = W_k H     r_k = sigmoid(K_sc + K + b_k)     K' = r_k * K_sc + (1 - r_k) * K   (Eq. 5-12)
    V_sc = W_vsc E     V = W_v H     r_v = sigmoid(V_sc + V + b_v)     V' = r_v * V_sc + (1 - r_v) * V

Feature-fusion (Eq. 13-14): ``[K_sc ; K] = W_k [E ; H]`` with ``W_k`` 2d×2d (no bias), split in halves along
features; same for V; the gates are unchanged. Queries are never touched. Parameters added per sub-layer:
``2d² + 2d`` (shortcuts) or ``6d² + 2d`` (feature-fusion: the d×d ``W_k``/``W_v`` are replaced).

Every variant is a config choice per attention slot of the Transformer::

    encoder_self_attention: {type: shortcut}                         # encoder self-attention
    decoder_self_attention: {type: shortcut, feature_fusion: true}   # decoder self-attention, fused
    cross_attention: {type: shortcut}                                # decoder-to-encoder: E = source embeddings
    encoder_self_attention: {type: shortcut, source: nonlexical}     # layer n takes H_{n-2}; layers 1-2 take E

Choices where the paper and SPEC are silent:

* ``b_k``, ``b_v`` start at zero; ``W_ksc``, ``W_vsc`` and the fusion maps are initialised like ``W_k``.
* Non-lexical shortcuts take ``H_{n-2}`` as the layer stack carries it (the input of layer n-1, the residual
  stream, not layer-normed): like E it is a raw stack input, and no LayerNorm is added, so the parameter
  count equals that of lexical shortcuts. They need the layer inputs, so they exist for self-attention only.
* Incremental decoding: the gate works position by position, so ``K'``/``V'`` of the prefix are cached
  like ordinary keys/values (``state[name + ".k"/".v"]``) and the new positions' ``E`` arrives in ``ctx``.
  Keeping the prefix embeddings themselves in the cache would only recompute the same ``K'``/``V'``.

Speed: keys and values go through one GEMM per input (one for ``[E ; H]`` under fusion) and one fused gate
(:class:`PairGate`, :class:`FusedGate`): a single autograd node with a hand-written backward that writes the
GEMM-output gradient in place, where autograd through slices, sums, a sigmoid and a blend would zero-fill and
add slice gradients. ``benchmarks/shortcuts.py`` measures the cost against the baseline.

Gate statistics (for analysis): with ``record_gates = True`` on the module, or ``ctx.need_weights``, the
last call leaves ``gates = {"k": r_k, "v": r_v}`` (B,S,D, detached) and ``gate_stats`` (their mean/std).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmtflow.config import ConfigError
from nmtflow.nn.attention import AttentionConfig, AttentionContext, MultiHeadAttention, split_heads
from nmtflow.registry import register_attention

SOURCES = ("lexical", "nonlexical")


@dataclass
class ShortcutOptions(AttentionConfig):
    """``{type: shortcut, feature_fusion: bool, source: lexical | nonlexical}``."""

    type: str = "shortcut"
    feature_fusion: bool = False  # [K_sc ; K] = W_k [E ; H] with a 2d×2d W_k (Eq. 13-14)
    source: str = "lexical"  # nonlexical: layer n takes H_{n-2} instead of E (layers 1-2 still take E)

    def validate(self, where: str) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"{where}.source: expected one of {', '.join(SOURCES)}, got {self.source!r}")


@register_attention("shortcut", ShortcutOptions)
class ShortcutAttention(MultiHeadAttention):
    """Multi-head attention whose keys and values are gated mixtures of ``H`` and the shortcut input (SPEC §2)."""

    options: ShortcutOptions

    def __init__(self, d_model: int, heads: int, *, dropout: float = 0.0, self_attention: bool = True,
                 name: str = "attn", options: ShortcutOptions | None = None) -> None:
        options = options or ShortcutOptions()
        super().__init__(d_model, heads, dropout=dropout, self_attention=self_attention, name=name, options=options)
        if options.source == "nonlexical" and not self_attention:
            raise ConfigError(f"{name}: non-lexical shortcuts need the layer inputs of a self-attention stack; "
                              "decoder-to-encoder shortcuts take the source embeddings (source: lexical)")
        d = d_model
        if options.feature_fusion:
            del self.k_proj, self.v_proj  # W_k, W_v become 2d×2d maps of [E ; H]
            self.k_fusion = nn.Linear(2 * d, 2 * d, bias=False)  # rows: [K_sc ; K]
            self.v_fusion = nn.Linear(2 * d, 2 * d, bias=False)  # rows: [V_sc ; V]
        else:
            self.k_shortcut = nn.Linear(d, d, bias=False)  # W_ksc
            self.v_shortcut = nn.Linear(d, d, bias=False)  # W_vsc
        self.k_gate_bias = nn.Parameter(torch.zeros(d))  # b_k
        self.v_gate_bias = nn.Parameter(torch.zeros(d))  # b_v
        self.record_gates = False
        self.gates: dict[str, Tensor] = {}
        self.gate_stats: dict[str, Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.out_proj.weight)
        for name in ("q_proj", "k_proj", "v_proj", "k_shortcut", "v_shortcut", "k_fusion", "v_fusion"):
            proj = getattr(self, name, None)  # absent while the base class initialises, or under fusion
            if proj is not None:
                nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2))
        for name in ("k_gate_bias", "v_gate_bias"):
            bias = getattr(self, name, None)
            if bias is not None:
                nn.init.zeros_(bias)

    # ---- the seam ------------------------------------------------------------------------------------
    def project_kv(self, source: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """source H (B,S,D), shortcut input from ``ctx`` (B,S,D) → K', V' (B,H,S,Dh) (Eq. 9-12)."""
        b, s, d = source.shape
        e = self.shortcut_input(source, ctx)
        bias = torch.stack([self.k_gate_bias, self.v_gate_bias])  # (2,D): [b_k ; b_v]
        if self.options.feature_fusion:  # one GEMM: rows [K_sc; K; V_sc; V] of W [E ; H] (Eq. 13-14)
            w = torch.cat([self.k_fusion.weight, self.v_fusion.weight])  # (4D,2D)
            y = F.linear(torch.cat([e, source], dim=-1), w).view(b * s, 2, 2, d)  # [k|v] × [shortcut|hidden]
            k, v, r = FusedGate.apply(y, bias.to(y.dtype))
        else:  # Eq. 5-8: [K_sc; V_sc] = W_sc E, [K; V] = W H
            w_sc = torch.cat([self.k_shortcut.weight, self.v_shortcut.weight])  # (2D,D)
            w = torch.cat([self.k_proj.weight, self.v_proj.weight])  # (2D,D)
            shortcut, hidden = F.linear(e, w_sc).view(b * s, 2, d), F.linear(source, w).view(b * s, 2, d)
            k, v, r = PairGate.apply(shortcut, hidden, bias.to(hidden.dtype))
        if self.record_gates or ctx.need_weights:
            self._record(r.view(2, b, s, d))
        return split_heads(k.view(b, s, d), self.heads), split_heads(v.view(b, s, d), self.heads)

    def shortcut_input(self, source: Tensor, ctx: AttentionContext) -> Tensor:
        """E, or for non-lexical shortcuts H_{n-2} from layer ``n = ctx.layer + 1`` ≥ 3 on (B,S,D)."""
        if self.options.source == "nonlexical" and ctx.layer >= 2:
            if len(ctx.layer_inputs) < ctx.layer:
                raise ValueError(f"{self.name}: non-lexical shortcuts need ctx.layer_inputs of the layers below")
            x = ctx.layer_inputs[ctx.layer - 1]  # the input of layer n-1 = H_{n-2}
        elif ctx.embeddings is None:
            raise ValueError(f"{self.name}: lexical shortcuts need ctx.embeddings (the input of layer 1)")
        else:
            x = ctx.embeddings
        if x.shape != source.shape:
            raise ValueError(f"{self.name}: shortcut input {tuple(x.shape)} does not match keys {tuple(source.shape)}")
        return x

    def _record(self, r: Tensor) -> None:
        self.gates = {"k": r[0], "v": r[1]}
        self.gate_stats = {f"{kv}_{stat}": fn(g) for kv, g in self.gates.items()
                           for stat, fn in (("mean", torch.mean), ("std", torch.std))}


# ---- the gate, fused (Eq. 9-12) ----------------------------------------------------------------------------
def _gate_forward(shortcut: Tensor, hidden: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """X_sc, X (N,2,D) for [K, V], bias (2,D) → K', V' (N,D) each, r and X_sc − X (2,N,D), kv-major.

    ``r = sigmoid(X_sc + X + b)``, ``X' = X + r (X_sc − X)`` (= r X_sc + (1 − r) X).
    """
    sc, h = shortcut.transpose(0, 1), hidden.transpose(0, 1)  # (2,N,D) views
    r = torch.add(sc, h, out=sc.new_empty(sc.shape)).add_(bias[:, None]).sigmoid_()
    diff = torch.sub(sc, h, out=sc.new_empty(sc.shape))
    k, v = (torch.addcmul(h[i], r[i], diff[i], out=sc.new_empty(sc.shape[1:])) for i in range(2))
    return k, v, r, diff


def _gate_backward(grads: tuple[Tensor, Tensor], r: Tensor, diff: Tensor, d_shortcut: Tensor,
                   d_hidden: Tensor) -> Tensor:
    """dK', dV' (N,D) → dX_sc, dX written into ``d_shortcut``/``d_hidden`` (N,2,D); returns db (2,D).

    With p = g (X_sc − X) r (1 − r), the gradient of the gate's pre-activation:
    dX_sc = g r + p, dX = g (1 − r) + p, db = Σ_N p.
    """
    db = r.new_empty(2, r.size(-1))
    for i, g in enumerate(grads):  # keys, then values
        p = torch.mul(g, diff[i]).mul_(torch.addcmul(r[i], r[i], r[i], value=-1))
        gr = torch.mul(g, r[i])
        torch.add(gr, p, out=d_shortcut[:, i])
        torch.sub(g, gr, out=d_hidden[:, i]).add_(p)
        torch.sum(p, 0, out=db[i])
    return db


class FusedGate(torch.autograd.Function):
    """The gates of keys and values from one feature-fusion GEMM output ``y`` (N,2,2,D): [k|v] × [shortcut|hidden].

    Returns K', V' (N,D) and r (2,N,D, no gradient). One autograd node instead of a chain of slices, sums, a
    sigmoid and a blend: the backward pass writes dy in place, with no zero-filled slice gradients.
    """

    @staticmethod
    def forward(ctx: Any, y: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        k, v, r, diff = _gate_forward(y[:, :, 0], y[:, :, 1], bias)
        ctx.save_for_backward(r, diff)
        ctx.mark_non_differentiable(r)
        return k, v, r

    @staticmethod
    def backward(ctx: Any, dk: Tensor, dv: Tensor, _: Tensor) -> tuple[Tensor, Tensor]:
        r, diff = ctx.saved_tensors
        dy = r.new_empty(r.size(1), 2, 2, r.size(2))
        return dy, _gate_backward((dk, dv), r, diff, dy[:, :, 0], dy[:, :, 1])


class PairGate(torch.autograd.Function):
    """:class:`FusedGate` for separate shortcut and hidden projections X_sc, X (N,2,D) (lexical shortcuts)."""

    @staticmethod
    def forward(ctx: Any, shortcut: Tensor, hidden: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        k, v, r, diff = _gate_forward(shortcut, hidden, bias)
        ctx.save_for_backward(r, diff)
        ctx.mark_non_differentiable(r)
        return k, v, r

    @staticmethod
    def backward(ctx: Any, dk: Tensor, dv: Tensor, _: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        r, diff = ctx.saved_tensors
        d_shortcut, d_hidden = (r.new_empty(r.size(1), 2, r.size(2)) for _ in range(2))
        return d_shortcut, d_hidden, _gate_backward((dk, dv), r, diff, d_shortcut, d_hidden)
