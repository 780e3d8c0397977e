"""Convolution building blocks of ConvS2S (Gehring et al. 2017) and DenseNMT (Shen et al. 2018).

* :class:`GLUConv` — ``Y = GLU(conv(X)) = A ⊗ σ(B)`` with ``[A; B] = W * X + b`` (Dauphin et al. 2017;
  Gehring et al. 2017, §3.2; Shen et al. 2018, Eq. 5: ``h^l_j = GLU([h^{l-1}_{j-r}, …, h^{l-1}_{j+r}] W^l + b^l)``).
  Non-causal (encoder: ``r`` positions either side, zero-padded) or causal (decoder: the ``k − 1`` previous
  positions and the current one). A causal block decodes incrementally: it keeps the last ``k − 1`` inputs in
  ``state[name + ".cache"]`` (B,k−1,C_in) and computes only the new positions, never the prefix again.
* :func:`linear` — a linear map with ConvS2S's initialisation.

Weight normalisation (Salimans & Kingma 2016) is optional: ``weight_norm=True`` reparametrises every weight
as ``w = g · v / ‖v‖`` per output unit (``g`` initialised to ‖v‖, so the initial function is unchanged), as in
Gehring et al. (2017) and the fairseq ConvS2S that DenseNMT builds on; it adds one parameter per output unit.
``weight_norm=False`` gives plain layers. Initialisation follows Gehring et al. (2017), §3.5: weights
``N(0, sqrt(c·(1 − p) / n_in))`` with ``c = 4`` before a GLU and ``c = 1`` otherwise (``p`` the dropout
applied to the layer's input, ``n_in`` its fan-in), biases zero.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm as _weight_norm

from nmtflow.nn.dropout import dropout
State = dict[str, Tensor]


def linear(in_dim: int, out_dim: int, *, dropout: float = 0.0, weight_norm: bool = False,
           bias: bool = True) -> nn.Linear:
    """Linear map, weights ``N(0, sqrt((1 − dropout) / in_dim))`` (Gehring et al. 2017, §3.5)."""
    layer = nn.Linear(in_dim, out_dim, bias=bias)
    nn.init.normal_(layer.weight, mean=0.0, std=math.sqrt((1.0 - dropout) / in_dim))
    if bias:
        nn.init.zeros_(layer.bias)
    return _weight_norm(layer, dim=0) if weight_norm else layer


class GLUConv(nn.Module):
    """dropout → 1-d convolution (kernel ``k``, ``2·out_dim`` channels) → GLU: (B,T,C_in) → (B,T,out_dim).

    ``causal=False`` needs an odd ``k = 2r + 1`` and pads ``r`` zeros on both sides; padding positions of
    the input (``padding_mask`` True) are zeroed first, so a sentence's output does not depend on how much
    padding follows it. ``causal=True`` pads ``k − 1`` zeros on the left — or, with ``state``, the cached
    last ``k − 1`` inputs of the previous call.
    """

    def __init__(self, in_dim: int, out_dim: int, kernel_size: int, *, causal: bool, dropout: float = 0.0,
                 weight_norm: bool = False, name: str = "conv") -> None:
        super().__init__()
        if kernel_size < 1 or (not causal and kernel_size % 2 == 0):
            raise ValueError(f"{name}: a {'causal' if causal else 'non-causal'} convolution needs "
                             f"{'a positive' if causal else 'an odd'} kernel size, got {kernel_size}")
        self.in_dim, self.out_dim, self.kernel_size = in_dim, out_dim, kernel_size
        self.causal, self.dropout, self.name = causal, dropout, name
        conv = nn.Conv1d(in_dim, 2 * out_dim, kernel_size)
        nn.init.normal_(conv.weight, mean=0.0, std=math.sqrt(4.0 * (1.0 - dropout) / (kernel_size * in_dim)))
        nn.init.zeros_(conv.bias)
        self.conv = _weight_norm(conv, dim=0) if weight_norm else conv

    @property
    def cache_key(self) -> str:
        return self.name + ".cache"

    def forward(self, x: Tensor, *, padding_mask: Tensor | None = None, state: State | None = None) -> Tensor:
        """x (B,T,C_in), padding_mask (B,T) True = pad → (B,T,out_dim)."""
        x = dropout(x, self.dropout, self.training)
        if self.causal:
            x = self._with_history(x, state)  # (B, k−1+T, C_in)
        else:
            if padding_mask is not None:
                x = x.masked_fill(padding_mask.unsqueeze(-1), 0.0)
            r = (self.kernel_size - 1) // 2
            x = F.pad(x, (0, 0, r, r))  # (B, T+2r, C_in)
        y = self.conv(x.transpose(1, 2)).transpose(1, 2)  # (B,T,2·out_dim)
        return F.glu(y, dim=-1)

    def _with_history(self, x: Tensor, state: State | None) -> Tensor:
        """Prepend the k−1 previous inputs: zeros at the start, else the cache (which is then updated)."""
        history = self.kernel_size - 1
        if history == 0:
            return x
        if state is None:
            return F.pad(x, (0, 0, history, 0))
        past = state.get(self.cache_key)
        if past is None:
            past = x.new_zeros(x.size(0), history, x.size(2))
        window = torch.cat([past, x], dim=1)  # (B, k−1+T, C_in)
        state[self.cache_key] = window[:, -history:]
        return window
