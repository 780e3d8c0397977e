"""Label-smoothed cross-entropy (Szegedy et al. 2016): (1-ε)·NLL + ε·mean_v(−log p_v), PAD ignored."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from nmtflow.data.vocab import PAD


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """logits (B,T,V), target (B,T) → (smoothed loss sum, NLL sum) over non-PAD positions.

    One log-softmax serves both terms: ``nll_t = −log p(y_t)``, ``smooth_t = −(1/V) Σ_v log p(v)``,
    ``loss = Σ_t (1−ε)·nll_t + ε·smooth_t`` (the same as ``cross_entropy(label_smoothing=ε)``).
    """
    lprobs = F.log_softmax(logits.reshape(-1, logits.size(-1)).float(), dim=-1)  # (N,V)
    flat = target.reshape(-1)
    keep = flat.ne(PAD)
    nll = -(lprobs.gather(1, flat[:, None]).squeeze(1) * keep).sum()
    if epsilon == 0.0:
        return nll, nll.detach()
    smooth = -(lprobs.mean(-1) * keep).sum()
    return (1.0 - epsilon) * nll + epsilon * smooth, nll.detach()
