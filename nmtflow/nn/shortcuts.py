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

Parameters are stored stacked, keys' rows above values': ``kv_proj`` [W_k ; W_v], ``kv_shortcut``
[W_ksc ; W_vsc], ``kv_fusion`` [W_k ; W_v] (2d×2d each) and ``kv_gate_bias`` [b_k ; b_v]; each block is
initialised as its own map, and checkpoints with separate ``k_*``/``v_*`` parameters still load.

Speed: keys and values go through one GEMM per input (one for ``[E ; H]`` under fusion) and one fused gate
(:class:`PairGate`, :class:`FusedGate`) over both: a single autograd node with a hand-written backward that
writes the GEMM-output gradient whole, where autograd through slices, sums, a sigmoid and a blend would
zero-fill and add slice gradients. On CUDA the gate's forward and backward are one elementwise kernel each.
E is the same for all layers of a stack, so the lexical shortcuts of one slot compute ``W_sc E`` for all their
layers in one GEMM (:class:`StackedLinear`; the stack links its layers, :meth:`ShortcutAttention.link`). A
training step on a GPU is bound by how many kernels it launches at ~4k-token batches (``benchmarks/README.md``);
``benchmarks/shortcuts.py`` measures the cost against the baseline.

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
from nmtflow.nn.layers import in_dtype_of
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

    def check_slot(self, where: str, self_attention: bool) -> None:
        if self.source == "nonlexical" and not self_attention:
            raise ConfigError(f"{where}.source: non-lexical shortcuts need the layer inputs of a self-attention "
                              "stack; decoder-to-encoder shortcuts take the source embeddings (source: lexical)")


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
        # Keys and values are one map each of H and E (one of [E ; H] under fusion), stored stacked as one
        # parameter: no concatenation of weights per forward pass, fewer autograd nodes and parameters.
        del self.k_proj, self.v_proj
        if options.feature_fusion:  # W_k, W_v become 2d×2d maps of [E ; H]
            self.kv_fusion = nn.Linear(2 * d, 4 * d, bias=False)  # rows [W_k ; W_v] = [K_sc ; K ; V_sc ; V]
        else:
            self.kv_proj = nn.Linear(d, 2 * d, bias=False)  # rows [W_k ; W_v]
            self.kv_shortcut = nn.Linear(d, 2 * d, bias=False)  # rows [W_ksc ; W_vsc]
        self.kv_gate_bias = nn.Parameter(torch.zeros(2, d))  # rows [b_k ; b_v]
        self.record_gates = False
        self.gates: dict[str, Tensor] = {}
        self.gate_stats: dict[str, Tensor] = {}
        self.stack: tuple[ShortcutAttention, ...] = ()  # lexical shortcuts of one stack slot: W_sc E shared
        self.reset_parameters()

    def link(self, stack: list[MultiHeadAttention]) -> None:
        """Lexical shortcuts (not fused) of all layers of a slot project the one E together (:class:`StackedLinear`)."""
        if self.options.source == "lexical" and not self.options.feature_fusion:
            group = tuple(m for m in stack if isinstance(m, ShortcutAttention) and m.options.source == "lexical"
                          and not m.options.feature_fusion)
            self.stack = group  # a tuple of modules: plain references, no submodules or state-dict entries

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.out_proj.weight)
        for name in ("q_proj", "k_proj", "v_proj", "kv_proj", "kv_shortcut", "kv_fusion"):
            proj = getattr(self, name, None)  # absent while the base class initialises, or by variant
            if proj is not None:  # each stacked map (square blocks of rows) on its own, as W_k, W_ksc, ...
                for block in proj.weight.data.split(proj.weight.size(1)):
                    nn.init.xavier_uniform_(block, gain=1 / math.sqrt(2))
        bias = getattr(self, "kv_gate_bias", None)
        if bias is not None:
            nn.init.zeros_(bias)

    # checkpoints written before keys and values were stacked: (old names) → new name, joined along dim 0
    _UNSTACKED = {"kv_proj.weight": ("k_proj.weight", "v_proj.weight"),
                  "kv_shortcut.weight": ("k_shortcut.weight", "v_shortcut.weight"),
                  "kv_fusion.weight": ("k_fusion.weight", "v_fusion.weight"),
                  "kv_gate_bias": ("k_gate_bias", "v_gate_bias")}

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Accept checkpoints with the keys and values' maps as separate parameters (``k_shortcut``, ...)."""
        for new, old in self._UNSTACKED.items():
            if all(prefix + o in state_dict for o in old) and prefix + new not in state_dict:
                parts = [state_dict.pop(prefix + o) for o in old]
                state_dict[prefix + new] = torch.cat(parts) if parts[0].dim() == 2 else torch.stack(parts)
        super()._load_from_state_dict(state_dict, prefix, *args)

    # ---- the seam ------------------------------------------------------------------------------------
    def project_kv(self, source: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """source H (B,S,D), shortcut input from ``ctx`` (B,S,D) → K', V' (B,H,S,Dh) (Eq. 9-12)."""
        b, s, d = source.shape
        e = self.shortcut_input(source, ctx)
        bias = self.kv_gate_bias  # (2,D): [b_k ; b_v]
        if self.options.feature_fusion:  # one GEMM: rows [K_sc; K; V_sc; V] of W [E ; H] (Eq. 13-14)
            y = self.kv_fusion(torch.cat([e, source], dim=-1)).view(b * s, 2, 2, d)  # [k|v] × [shortcut|hidden]
            shortcut, hidden = y[:, :, 0], y[:, :, 1]
        else:  # Eq. 5-8: [K_sc; V_sc] = W_sc E, [K; V] = W H
            shortcut, hidden = self.project_shortcut(e, ctx), self.kv_proj(source).view(b * s, 2, d)
        if torch.compiler.is_compiling():  # in a compiled layer (train.compile): operations the compiler fuses
            kv = plain_gate(shortcut, hidden, bias)
        elif self.options.feature_fusion:
            kv = FusedGate.apply(y, bias.to(y.dtype))  # K', V' (N,D) each
        else:
            kv = PairGate.apply(shortcut, hidden, bias.to(hidden.dtype))
        if self.record_gates or ctx.need_weights:
            with torch.no_grad():
                self._record(torch.add(shortcut, hidden).add_(bias).sigmoid_().view(b, s, 2, d))
        k, v = (x.view(b, s, d) for x in kv)
        return split_heads(k, self.heads), split_heads(v, self.heads)

    def project_shortcut(self, e: Tensor, ctx: AttentionContext) -> Tensor:
        """[K_sc | V_sc] = [W_ksc ; W_vsc] E (N,2,D) (Eq. 5, 7).

        E is the same for every layer of a stack, so a linked module (:meth:`link`) computes the products of
        all its stack's layers in one GEMM, once per forward pass, and takes its own slice.
        """
        b, s, d = e.shape
        if not self.stack or torch.compiler.is_compiling():  # unlinked, or one compiled graph for every layer
            return self.kv_shortcut(e).view(b * s, 2, d)
        key = f"shortcut:{self.stack[0].name}"
        if key not in ctx.shared:
            w = torch.cat([m.kv_shortcut.weight for m in self.stack])  # (2LD,D)
            ctx.shared[key] = StackedLinear.apply(in_dtype_of(e.reshape(b * s, d), w), w, len(self.stack))
        return ctx.shared[key][self.stack.index(self)]

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
        """r (B,S,2,D): [r_k | r_v]."""
        self.gates = {"k": r[:, :, 0], "v": r[:, :, 1]}
        self.gate_stats = {f"{kv}_{stat}": fn(g) for kv, g in self.gates.items()
                           for stat, fn in (("mean", torch.mean), ("std", torch.std))}


# ---- the gate, fused (Eq. 9-12) ----------------------------------------------------------------------------
def _gate_forward(shortcut: Tensor, hidden: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """X_sc, X (N,2,D) for [K, V], bias (2,D) → K', V' (N,D) each, r and X_sc − X (2,N,D), kv-major.

    ``r = sigmoid(X_sc + X + b)``, ``X' = X + r (X_sc − X)`` (= r X_sc + (1 − r) X). K' and V' come out
    contiguous: on the CPU attention over strided keys and values is slower.
    """
    sc, h = shortcut.transpose(0, 1), hidden.transpose(0, 1)  # (2,N,D) views
    r = torch.add(sc, h, out=sc.new_empty(sc.shape)).add_(bias[:, None]).sigmoid_()
    diff = torch.sub(sc, h, out=sc.new_empty(sc.shape))
    k, v = (torch.addcmul(h[i], r[i], diff[i], out=sc.new_empty(sc.shape[1:])) for i in range(2))
    return k, v, r, diff


def _gate_backward(grads: tuple[Tensor, Tensor], r: Tensor, diff: Tensor) -> tuple[Tensor, Tensor]:
    """dK', dV' (N,D) → dy (N,2,2,D): [k|v] × [dX_sc | dX], and db (2,D).

    With p = g (X_sc − X) r (1 − r), the gradient of the gate's pre-activation:
    dX_sc = g r + p, dX = g (1 − r) + p = g − dX_sc + 2p, db = Σ_N p: five element-wise operators and a sum
    per half (``sigmoid_backward`` multiplies by r (1 − r) in one pass); the CPU gate is bound by memory
    traffic (``benchmarks/gate.py``).
    """
    dy = r.new_empty(r.size(1), 2, 2, r.size(2))
    db = r.new_empty(2, r.size(-1))
    for i, g in enumerate(grads):  # keys, then values
        p = torch.mul(g, diff[i])
        torch.ops.aten.sigmoid_backward.grad_input(p, r[i], grad_input=p)  # in place: p *= r (1 − r)
        d_shortcut = torch.addcmul(p, g, r[i], out=dy[:, i, 0])
        torch.sub(g, d_shortcut, out=dy[:, i, 1]).add_(p, alpha=2)
        torch.sum(p, 0, out=db[i])
    return dy, db


# On CUDA each direction is one elementwise kernel over keys and values together (compiled at first use by
# PyTorch's jiterator), computed in float32 whatever the storage type; the backward recomputes r from X_sc, X
# instead of saving r and X_sc − X, and takes dK', dV' as they come (a ``key`` flag along the [k|v] axis picks
# one), so no stacked copy of them is made. A step there is bound by kernel launches (benchmarks/README.md).
_CUDA_GATE = """
template <typename T> float shortcut_gate_r(T sc, T h, T b) {
  return 1.0f / (1.0f + expf(-(static_cast<float>(sc) + static_cast<float>(h) + static_cast<float>(b))));
}
template <typename T> float shortcut_gate_p(T gk, T gv, T key, T sc, T h, T b, float& g, float& r) {
  r = shortcut_gate_r(sc, h, b);
  g = static_cast<float>(key) > 0.5f ? static_cast<float>(gk) : static_cast<float>(gv);
  return g * (static_cast<float>(sc) - static_cast<float>(h)) * r * (1.0f - r);
}
"""
_CUDA_FORWARD = _CUDA_GATE + """
template <typename T> T shortcut_gate(T sc, T h, T b) {
  float r = shortcut_gate_r(sc, h, b), x = static_cast<float>(h);
  return static_cast<T>(x + r * (static_cast<float>(sc) - x));
}
"""
# PairGate, over (N,2,D): (dK', dV', key, X_sc, X, b) → (dX_sc, dX, p), each contiguous; Σ_N p is db.
_CUDA_PAIR_BACKWARD = _CUDA_GATE + """
template <typename T> void shortcut_pair_gate_backward(T gk, T gv, T key, T sc, T h, T b, T& dsc, T& dh, T& p) {
  float g, r, q = shortcut_gate_p(gk, gv, key, sc, h, b, g, r);
  dsc = static_cast<T>(g * r + q);
  dh = static_cast<T>(g * (1.0f - r) + q);
  p = static_cast<T>(q);
}
"""
# FusedGate, over dy's (N,2,2,D): (..., first) → (dX_sc where first else dX, p where first else 0): ``first``
# runs along the [shortcut | hidden] axis of dy, which comes out whole as the fusion GEMM needs it.
_CUDA_FUSED_BACKWARD = _CUDA_GATE + """
template <typename T> void shortcut_fused_gate_backward(T gk, T gv, T key, T sc, T h, T b, T first, T& d, T& p) {
  float g, r, q = shortcut_gate_p(gk, gv, key, sc, h, b, g, r);
  bool is_shortcut = static_cast<float>(first) > 0.5f;
  d = static_cast<T>(is_shortcut ? g * r + q : g * (1.0f - r) + q);
  p = static_cast<T>(is_shortcut ? q : 0.0f);
}
"""
_cuda_kernels: tuple[Any, Any, Any] | None = None
_flags: dict[tuple[torch.dtype, torch.device, tuple[int, ...]], Tensor] = {}  # [1, 0] in a broadcast shape
USE_CUDA_KERNELS = True  # False: the same elementwise operators as on the CPU


def _use_cuda_kernels(x: Tensor) -> bool:
    return x.is_cuda and USE_CUDA_KERNELS


def _cuda_gate_kernels() -> tuple[Any, Any, Any]:
    """The jiterator kernels (forward, PairGate backward, FusedGate backward), created once."""
    global _cuda_kernels
    if _cuda_kernels is None:
        from torch.cuda import jiterator
        _cuda_kernels = (jiterator._create_jit_fn(_CUDA_FORWARD),
                         jiterator._create_multi_output_jit_fn(_CUDA_PAIR_BACKWARD, num_outputs=3),
                         jiterator._create_multi_output_jit_fn(_CUDA_FUSED_BACKWARD, num_outputs=2))
    return _cuda_kernels


def _flag(like: Tensor, *shape: int) -> Tensor:
    """[1, 0] viewed as ``shape`` (one dimension of 2), made once per dtype, device and shape: no copy per step."""
    key = (like.dtype, like.device, shape)
    if key not in _flags:
        _flags[key] = torch.tensor([1.0, 0.0], dtype=like.dtype, device=like.device).view(shape)
    return _flags[key]


def _cuda_pair_backward(dk: Tensor, dv: Tensor, shortcut: Tensor, hidden: Tensor,
                        bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_gate_backward` for :class:`PairGate` on CUDA from the saved X_sc, X (N,2,D): one kernel, a sum."""
    d_shortcut, d_hidden, p = _cuda_gate_kernels()[1](dk[:, None], dv[:, None], _flag(dk, 1, 2, 1),
                                                      shortcut, hidden, bias)
    return d_shortcut, d_hidden, p.sum(0)


def _cuda_fused_backward(dk: Tensor, dv: Tensor, y: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_gate_backward` for :class:`FusedGate` on CUDA from the saved y (N,2,2,D): one kernel, a sum."""
    dy, p = _cuda_gate_kernels()[2](dk[:, None, None], dv[:, None, None], _flag(dk, 1, 2, 1, 1),
                                    y[:, :, :1], y[:, :, 1:], bias[:, None], _flag(dk, 1, 1, 2, 1))
    return dy, p.sum((0, 2))


def _forward(ctx: Any, shortcut: Tensor, hidden: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """The forward of :class:`FusedGate` and :class:`PairGate`: K', V' (N,D); the CPU path saves r, X_sc − X."""
    ctx.cuda = _use_cuda_kernels(shortcut)
    if ctx.cuda:
        kv = _cuda_gate_kernels()[0](shortcut, hidden, bias)  # (N,2,D)
        return kv[:, 0], kv[:, 1]
    k, v, r, diff = _gate_forward(shortcut, hidden, bias)
    ctx.save_for_backward(r, diff)
    return k, v


class FusedGate(torch.autograd.Function):
    """K', V' (N,D) from the feature-fusion GEMM output ``y`` (N,2,2,D): [k|v] × [shortcut|hidden].

    One autograd node instead of a chain of slices, sums, a sigmoid and a blend: the backward writes dy
    whole, with no zero-filled slice gradients; on CUDA forward and backward are one fused kernel each.
    """

    @staticmethod
    def forward(ctx: Any, y: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        k, v = _forward(ctx, y[:, :, 0], y[:, :, 1], bias)
        if ctx.cuda:
            ctx.save_for_backward(y, bias)
        return k, v

    @staticmethod
    def backward(ctx: Any, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor]:
        if ctx.cuda:
            return _cuda_fused_backward(dk, dv, *ctx.saved_tensors)
        return _gate_backward((dk, dv), *ctx.saved_tensors)


def plain_gate(shortcut: Tensor, hidden: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """K', V' (N,D) = X + r ⊙ (X_sc − X), r = σ(X_sc + X + b) (Eq. 5–12) from X_sc, X (N,2,D), in float32 and stored
    in X's dtype: what :class:`PairGate` and :class:`FusedGate` compute, as operations autograd differentiates."""
    sc, h = shortcut.float(), hidden.float()
    r = torch.sigmoid(sc + h + bias.float())
    return (h + r * (sc - h)).to(hidden.dtype).unbind(1)


class PairGate(torch.autograd.Function):
    """:class:`FusedGate` for separate shortcut and hidden projections X_sc, X (N,2,D) (lexical shortcuts)."""

    @staticmethod
    def forward(ctx: Any, shortcut: Tensor, hidden: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        k, v = _forward(ctx, shortcut, hidden, bias)
        if ctx.cuda:
            ctx.save_for_backward(shortcut, hidden, bias)
        return k, v

    @staticmethod
    def backward(ctx: Any, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if ctx.cuda:
            return _cuda_pair_backward(dk, dv, *ctx.saved_tensors)
        dy, db = _gate_backward((dk, dv), *ctx.saved_tensors)
        return dy[:, :, 0], dy[:, :, 1], db


class StackedLinear(torch.autograd.Function):
    """``E Wᵀ`` for the stacked weights of L layers (W: (L·2D, D)) as L outputs [K_sc | V_sc] (N,2,D).

    One GEMM forward and two backward instead of L and 2L; the backward stacks the L output gradients once
    (a layer's slice of one output tensor would instead get a zero-filled full-size gradient each).
    """

    @staticmethod
    def forward(ctx: Any, e: Tensor, weight: Tensor, layers: int) -> tuple[Tensor, ...]:
        y = F.linear(e, weight)  # (N, L·2D); under autocast in its dtype
        ctx.save_for_backward(e, weight)
        return y.view(e.size(0), layers, 2, -1).unbind(1)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, Tensor, None]:
        e, weight = ctx.saved_tensors
        dy = torch.stack(grads, dim=1).flatten(1)  # (N, L·2D)
        de = dy.mm(weight.to(dy.dtype)).to(e.dtype)
        dw = dy.t().mm(e.to(dy.dtype)).to(weight.dtype)
        return de, dw, None
