"""Shared layers: sinusoidal positions, position-wise feed-forward, embeddings, the masked softmax."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmtflow.data.vocab import PAD
from nmtflow.nn.dropout import dropout


def masked_softmax(scores: Tensor, pad: Tensor, dim: int = -1) -> Tensor:
    """softmax along ``dim`` with ``pad`` (True, broadcast to ``scores``) positions at weight 0. A row with nothing
    but padding (an all-padding source) gets all-zero weights, i.e. no context, as in SDPA, not NaN; other rows
    are exactly what filling with −inf gives."""
    return scores.masked_fill(pad, torch.finfo(scores.dtype).min).softmax(dim).masked_fill(pad, 0.0)


class SinusoidalPositions(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(·) (Vaswani et al. 2017, §3.5)."""

    def __init__(self, d_model: int, max_positions: int = 1024) -> None:
        super().__init__()
        self.max_positions = max_positions
        pos = torch.arange(max_positions, dtype=torch.float32)[:, None]
        inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_positions, d_model)
        table[:, 0::2] = torch.sin(pos * inv_freq)
        table[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
        self.register_buffer("table", table, persistent=False)

    def forward(self, length: int, offset: Tensor | int = 0) -> Tensor:
        """Positions offset … offset+length-1 → (L,D), or (B,L,D) for a per-row offset tensor."""
        if isinstance(offset, Tensor):
            idx = offset[:, None] + torch.arange(length, device=offset.device)
            if int(idx.max()) >= self.max_positions:
                raise ValueError(f"sequence longer than max_positions={self.max_positions}")
            return self.table[idx]
        if offset + length > self.max_positions:
            raise ValueError(f"sequence of length {offset + length} exceeds max_positions={self.max_positions}")
        return self.table[offset: offset + length]


class FeedForward(nn.Module):
    """FFN(x) = W_2 dropout(act(W_1 x + b_1)) + b_2 (Vaswani et al. 2017, Eq. 2)."""

    def __init__(self, d_model: int, ffn_dim: int, activation: str = "relu", dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.activation = {"relu": F.relu, "gelu": F.gelu}[activation]
        self.dropout = dropout
        nn.init.xavier_uniform_(self.fc1.weight)
        nn.init.xavier_uniform_(self.fc2.weight)
        nn.init.zeros_(self.fc1.bias)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(dropout(self.activation(self.fc1(x)), self.dropout, self.training))


def token_embedding(vocab_size: int, d_model: int) -> nn.Embedding:
    """Embedding ~ N(0, d^-1/2) with a zero PAD row (so scaled by √d it has unit variance)."""
    emb = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
    nn.init.normal_(emb.weight, mean=0.0, std=d_model ** -0.5)
    with torch.no_grad():
        emb.weight[PAD].zero_()
    return emb


def in_dtype_of(x: Tensor, other: Tensor) -> Tensor:
    """``x`` in ``other``'s dtype where the two differ outside autocast: in the bf16 decoding copy
    (:func:`nmtflow.decode.precision.cast_copy`) the matrix modules hold bf16 weights and give bf16 outputs while the
    activations between them stay float32; a product of the two kinds casts to the matrix side's dtype. Under
    autocast ``x`` is returned as it is (autocast casts both operands itself)."""
    if x.dtype == other.dtype or torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(other.dtype)


def output_logits(x: Tensor, weight: Tensor) -> Tensor:
    """The output layer's logits x·Wᵀ (…,V) for x (…,D) and W (V,D). A bf16 ``x`` meets a float32 ``W`` in the bf16
    decoding copy: x is cast up (:func:`in_dtype_of`), so that the logits keep float32's resolution for the
    log-softmax and the beam scores. Under autocast ``F.linear`` casts as usual."""
    return F.linear(in_dtype_of(x, weight), weight)
