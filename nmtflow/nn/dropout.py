"""Inverted dropout (Srivastava et al. 2014): ``y = x · m / (1 − p)`` with ``m ~ Bernoulli(1 − p)`` per element.

Every model calls :func:`dropout` instead of ``F.dropout``. On a GPU, or inside a ``torch.compile`` graph, it is
``F.dropout``. On the CPU, PyTorch draws one Bernoulli number per element from its generator, a serial loop that
more threads do not speed up (a tenth of a bf16 training step of the small Transformer, ``benchmarks/README.md``).
Here the keep mask is cut from 64-bit draws instead, four 15-bit uniform integers per draw (one serial draw for
four elements; the rest is parallel element-wise work), and only a one-byte mask is kept for the backward pass
(``F.dropout`` on the CPU keeps a scaled noise tensor of ``x``'s dtype).

The drop probability is thereby rounded to a multiple of 2⁻¹⁵ (0.1 → 3277/32768 = 0.100006), and the kept values
are scaled by the inverse of that exact keep probability, so ``E[y] = x`` (up to rounding in ``x``'s dtype). The
draws come from PyTorch's default CPU generator, so seeding and exact resumption (its state is in every
checkpoint) cover them as they cover ``F.dropout``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

LEVELS = 1 << 15  # a 15-bit integer per element: drop where it is below round(p · 2¹⁵)
_own_cpu_masks = True  # False inside torch_dropout()


@contextmanager
def torch_dropout() -> Iterator[None]:
    """Within the block :func:`dropout` is ``F.dropout`` on the CPU too (PyTorch's per-element Bernoulli draws),
    e.g. to time the two against each other (``benchmarks/bf16_cpu.py --torch-dropout``)."""
    global _own_cpu_masks
    saved, _own_cpu_masks = _own_cpu_masks, False
    try:
        yield
    finally:
        _own_cpu_masks = saved


def drop_level(p: float) -> int:
    """round(p · 2¹⁵): the number of the 2¹⁵ integer values that drop an element."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    return round(p * LEVELS)


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> Tensor:
    """A bool tensor of ``shape``, each element True with probability 1 − round(p·2¹⁵)/2¹⁵, independently.

    ``random_()`` fills int64 with uniform integers in [0, 2⁶³); seen as four int16 each, masked to their low 15
    bits, that is four independent uniform integers in [0, 2¹⁵) per draw."""
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_()
    return (words.view(torch.int16)[:n].view(shape) & (LEVELS - 1)) >= drop_level(p)


class _MaskedScale(torch.autograd.Function):
    """y = x · mask · scale, and ∂L/∂x = ∂L/∂y · mask · scale, keeping only the bool mask."""

    @staticmethod
    def forward(ctx, x: Tensor, mask: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x.mul(mask.to(x.dtype)).mul_(scale)  # a bool operand would take PyTorch's slow mixed-dtype path

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return grad.mul(mask.to(grad.dtype)).mul_(ctx.scale), None, None


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Inverted dropout of ``x`` with drop probability ``p`` when ``training`` (``F.dropout``'s signature)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or not _own_cpu_masks or torch.compiler.is_compiling():
        return F.dropout(x, p, True)
    level = drop_level(p)
    if level == LEVELS:
        return x * 0.0
    mask = keep_mask(x.shape, p, x.device)
    return _MaskedScale.apply(x, mask, LEVELS / (LEVELS - level))
