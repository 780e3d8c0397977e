"""The attention bridge: a shared inner-attention layer (Vázquez et al. 2020, §2.2; SPEC §5).

Language-specific encoders produce ``H`` (n × d_h); the bridge turns it into a fixed-size matrix of k rows::

    A = softmax_over_positions(W_2 ReLU(W_1 Hᵀ))    (k × n)    Eq. 8, padding positions get weight 0
    M = A H                                          (k × d_h)  Eq. 9

with ``W_1`` d_w × d_h and ``W_2`` k × d_w (with biases as in the paper's code, ``bias=True``; without by default,
as checkpoints from before that option were built). Each row of ``A`` is a distribution over the source positions.
The redundancy penalty of Eq. 10 is ``‖A Aᵀ − I‖²_F`` per sentence; the paper's code adds the unsquared norm
``‖A Aᵀ − I‖_F`` (:func:`bridge_penalty`, ``squared=False``). How it is weighed against the cross-entropy is the
model's choice (``BridgeConfig.penalty_scale``).

The bridge is not an :class:`~nmtflow.nn.attention.MultiHeadAttention` variant: it has no query (its k
"queries" are the rows of ``W_2``) and its output has k rows whatever the source length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmtflow.nn.layers import in_dtype_of, masked_softmax


class AttentionBridge(nn.Module):
    """Inner attention H (B,S,d_h) → M (B,k,d_h), A (B,k,S) (Eq. 8–9)."""

    def __init__(self, hidden_dim: int, heads: int = 10, attention_dim: int = 1024, bias: bool = False) -> None:
        super().__init__()
        if heads < 1 or attention_dim < 1:
            raise ValueError(f"the bridge needs heads >= 1 and attention_dim >= 1, got {heads}, {attention_dim}")
        self.heads = heads
        self.w1 = nn.Linear(hidden_dim, attention_dim, bias=bias)  # W_1: d_w × d_h
        self.w2 = nn.Linear(attention_dim, heads, bias=bias)  # W_2: k × d_w (its bias cannot change A: a constant
        # per head over the positions; kept so that checkpoints hold the paper's code's parameters)
        nn.init.xavier_uniform_(self.w1.weight)
        nn.init.xavier_uniform_(self.w2.weight)

    def forward(self, h: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """h (B,S,d_h), padding_mask (B,S) True = pad → M (B,k,d_h), A (B,k,S) with rows summing to 1
        (all zeros for a sentence that is all padding)."""
        scores = self.w2(F.relu(self.w1(h)))  # (B,S,k) = (W_2 ReLU(W_1 Hᵀ))ᵀ
        # an all-padding row gets A = 0 and M = 0, not NaN
        attention = scores.softmax(1) if padding_mask is None else masked_softmax(scores, padding_mask[:, :, None], 1)
        attention = attention.transpose(1, 2)  # (B,k,S): softmax over positions
        return attention @ in_dtype_of(h, attention), attention  # M = A H: (B,k,d_h)


def bridge_penalty(attention: Tensor, squared: bool = True) -> Tensor:
    """‖A Aᵀ − I‖²_F (Eq. 10), or ``‖A Aᵀ − I‖_F`` with ``squared=False``, per sentence of A (B,k,S) → (B,).

    Padding positions hold zero weight, so they do not contribute to ``A Aᵀ``. The unsquared norm is taken as
    ``sqrt(‖·‖²_F + 1e-10)`` as in the paper's code, which keeps its gradient finite at ``A Aᵀ = I``.
    """
    k = attention.size(1)
    gram = attention @ attention.transpose(1, 2)  # (B,k,k)
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    squares = (gram - eye).pow(2).sum(dim=(1, 2))
    return squares if squared else (squares + 1e-10).sqrt()


def pool_bridge(memory: Tensor, pooling: str = "mean") -> Tensor:
    """Sentence embeddings from M (B,k,d_h): ``mean`` over the k rows → (B,d_h); ``flat`` → (B,k·d_h)."""
    if pooling == "mean":
        return memory.mean(dim=1)
    if pooling == "flat":
        return memory.reshape(memory.size(0), -1)
    raise ValueError(f"unknown pooling {pooling!r} (known: mean, flat)")
