"""Per-layer decoder attention of ConvS2S and DenseNMT (one module per decoder layer).

* :class:`MultiStepAttention` — Gehring et al. (2017), §3.3: keys = encoder output ``z``, values = ``z + e``
  (the source embedding).
* :class:`DenseAttention` — DenseAtt-1 / DenseAtt-2 of Shen et al. (2018), §3.2, over several encoder layers.

Both take the decoder layer's output ``z_l`` (B,T,w) as the query and return (B,T,w); what they read from the
encoder output is named in their docstrings. They are built by :mod:`nmtflow.models.convs2s` with widths that
the Transformer-style :func:`nmtflow.nn.attention.build_attention` does not know, so they are not registered
as attention variants.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmtflow.nn.conv import State, linear
from nmtflow.nn.layers import in_dtype_of, masked_softmax

SQRT_HALF = math.sqrt(0.5)


class MultiStepAttention(nn.Module):
    """Gehring et al. (2017), Eq. 1–2 and §3.4, one decoder layer's attention (all in the embedding space d0):

        d_i  = (W_d z_i + b_d + g_i) · √½      g_i: target embedding (B,T,d0)
        α_ij = softmax_j(d_i · k_j)              k_j: encoder output (``enc["out"]``, B,S,d0)
        c_i  = √m · Σ_j α_ij v_j                 v_j = (k_j + e_j) · √½ (``enc["values"]``), m: source length
        out  = W_o c_i + b_o                     back to the layer width w

    ``m`` is each sentence's own (unpadded) length, so padding changes nothing.
    """

    def __init__(self, width: int, embed_dim: int, *, weight_norm: bool = False) -> None:
        super().__init__()
        self.in_proj = linear(width, embed_dim, weight_norm=weight_norm)
        self.out_proj = linear(embed_dim, width, weight_norm=weight_norm)

    def forward(self, z: Tensor, g: Tensor, enc: dict[str, Tensor], state: State | None = None) -> Tensor:
        """z (B,T,w), g (B,T,d0) → (B,T,w)."""
        pad = enc["padding_mask"]  # (B,S)
        d = (self.in_proj(z) + g) * SQRT_HALF  # (B,T,d0)
        scores = in_dtype_of(d, enc["out"]) @ enc["out"].transpose(1, 2)  # (B,T,S)
        weights = masked_softmax(scores, pad.unsqueeze(1))
        lengths = (~pad).sum(1).clamp(min=1).to(z.dtype)  # (B,)
        c = (in_dtype_of(weights, enc["values"]) @ enc["values"]) * lengths.sqrt()[:, None, None]  # (B,T,d0)
        return self.out_proj(c)


class DenseAttention(nn.Module):
    """DenseAtt-1 (Shen et al. 2018, Eq. 9) or DenseAtt-2 (Eq. 10), with F(Q, K, V) = softmax(Q Kᵀ) V (Eq. 8).

    Reads ``enc["sources"]`` — the concatenation ``[h_n, …, h_1]`` (B,S,Σw_i) of the encoder layers it attends
    over, block widths ``source_widths`` — and ``enc["embeddings"]`` = h_0 (B,S,d0), the source embedding.
    The linear maps L are: ``W_q`` for the query, one map ``W_s`` over the concatenated sources (i.e. one block
    ``W_i`` per layer, ``W_s [h_i] = Σ_i W_i h_i``) and ``W_0`` for h_0:

        DenseAtt-1:  a_l = F(W_q z_l, K, K + W_0 h_0)                 K   = W_s [h_1, …, h_n]
        DenseAtt-2:  a_l = Σ_i F(W_q z_l, K_i, K_i + W_0 h_0)          K_i = W_i h_i;  K_i + W_0 h_0 = L([h_i, h_0])

    Both options therefore have exactly the same parameters (as the paper states for Eq. 10). As in the spec,
    F has no 1/√d scaling (nor has ConvS2S's attention). The encoder-side keys/values are computed once per
    sentence and cached in ``state[name + ".static_k"/".static_v"]`` (B,n,S,dim) while decoding.
    """

    def __init__(self, width: int, dim: int, source_widths: list[int], embed_dim: int, *, per_layer: bool,
                 weight_norm: bool = False, name: str = "attn") -> None:
        super().__init__()
        self.source_widths = list(source_widths)
        self.per_layer, self.name = per_layer, name
        self.q_proj = linear(width, dim, weight_norm=weight_norm)
        self.src_proj = linear(sum(source_widths), dim, weight_norm=weight_norm, bias=False)
        self.emb_proj = linear(embed_dim, dim, weight_norm=weight_norm)

    def keys_values(self, enc: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Encoder side → keys, values (B,n,S,dim); n = 1 for DenseAtt-1, one per source layer for DenseAtt-2."""
        sources, weight = enc["sources"], self.src_proj.weight  # (B,S,Σw), (dim,Σw)
        if self.per_layer:
            blocks = zip(sources.split(self.source_widths, -1), weight.split(self.source_widths, 1))
            k = torch.stack([F.linear(in_dtype_of(h_i, w_i), w_i) for h_i, w_i in blocks], dim=1)  # (B,n,S,dim)
        else:
            k = F.linear(in_dtype_of(sources, weight), weight).unsqueeze(1)  # (B,1,S,dim)
        v = k + self.emb_proj(enc["embeddings"]).unsqueeze(1)
        return k, v

    def forward(self, z: Tensor, g: Tensor, enc: dict[str, Tensor], state: State | None = None) -> Tensor:
        """z (B,T,w) → a_l (B,T,dim); ``g`` (the target embedding) is not used."""
        if state is None:
            k, v = self.keys_values(enc)
        else:
            if self.name + ".static_k" not in state:
                state[self.name + ".static_k"], state[self.name + ".static_v"] = self.keys_values(enc)
            k, v = state[self.name + ".static_k"], state[self.name + ".static_v"]
        q = self.q_proj(z).unsqueeze(1)  # (B,1,T,dim)
        scores = q @ k.transpose(-1, -2)  # (B,n,T,S)
        weights = masked_softmax(scores, enc["padding_mask"][:, None, None, :])
        return (weights @ v).sum(1)  # Σ_i F(·) over the n attention heads: (B,T,dim)
