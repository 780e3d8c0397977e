"""The fused label-smoothed cross-entropy against PyTorch's own, values and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nmtflow.data.vocab import PAD
from nmtflow.train.loss import SmoothedCrossEntropy, label_smoothed_nll


def logits_and_target(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(PAD + 1, 11, (3, 5), generator=g)
    target[0, 3:] = PAD  # padded positions
    target[2, 4] = PAD
    return logits, target


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3])
def test_matches_torch_cross_entropy_values_and_gradients(epsilon: float) -> None:
    logits, target = logits_and_target()
    loss, nll = label_smoothed_nll(logits, target, epsilon)
    (grad,) = torch.autograd.grad(loss, logits)
    ref = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), ignore_index=PAD, reduction="sum",
                          label_smoothing=epsilon)
    ref_nll = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), ignore_index=PAD, reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(nll, ref_nll.detach())
    torch.testing.assert_close(grad, ref_grad)
    assert not nll.requires_grad
    assert grad[0, 3:].abs().max() == 0  # PAD positions get no gradient


def test_gradcheck() -> None:
    logits, target = logits_and_target()
    assert torch.autograd.gradcheck(lambda z: SmoothedCrossEntropy.apply(z, target.reshape(-1), 0.1)[0],
                                    (logits.reshape(-1, 11),))


def test_low_precision_logits_are_scored_in_float32() -> None:
    logits, target = logits_and_target(torch.bfloat16)
    loss, _ = label_smoothed_nll(logits, target, 0.1)
    (grad,) = torch.autograd.grad(loss, logits)
    ref = F.cross_entropy(logits.float().reshape(-1, 11), target.reshape(-1), ignore_index=PAD, reduction="sum",
                          label_smoothing=0.1)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref)


def test_a_target_far_below_the_rest_gets_its_exact_loss() -> None:
    """A target whose probability underflows float32 (its log no longer exact, or −inf) still gets the exact loss:
    those rows take log Σ exp z from the row's largest probability instead of the target's."""
    logits, target = logits_and_target(torch.float32)
    with torch.no_grad():
        logits[1, 2] = 0.0
        logits[1, 2, target[1, 2]] = -120.0  # p ≈ e^-120: 0 in float32
        logits[2, 0, target[2, 0]] = -80.0   # ≈ 1.8e-35: below 1e-30, not yet subnormal
        logits[0, 4] = 500.0                 # a PAD position with a huge logit row: ignored, no inf/nan
    loss, nll = label_smoothed_nll(logits, target, 0.1)
    (grad,) = torch.autograd.grad(loss, logits)
    kwargs = {"ignore_index": PAD, "reduction": "sum"}
    flat, ref_target = logits.double().reshape(-1, 11), target.reshape(-1)
    torch.testing.assert_close(loss.double(), F.cross_entropy(flat, ref_target, label_smoothing=0.1, **kwargs))
    torch.testing.assert_close(nll.double(), F.cross_entropy(flat, ref_target, **kwargs))
    assert torch.isfinite(grad).all()
