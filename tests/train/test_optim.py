"""Adam/AdamW in PyTorch's fused implementation: chosen where it applies, the same updates, older states load."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from nmtflow.config import ConfigError, TrainConfig, load_config
from nmtflow.train.optim import build_optimizer


def params(seed: int = 0) -> list[nn.Parameter]:
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(7, 5)), nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3, 2, 4))]


def run(optimizer: torch.optim.Optimizer, ps: list[nn.Parameter], steps: int, seed: int = 1) -> None:
    torch.manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn_like(p)
        optimizer.step()


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_is_fused_by_default_and_not_when_turned_off(name: str) -> None:
    fused = build_optimizer(params(), TrainConfig(optimizer=name))
    assert fused.defaults["fused"] is True
    plain = build_optimizer(params(), TrainConfig(optimizer=name, fused_optimizer=False))
    assert not plain.defaults["fused"] and not plain.defaults["foreach"]  # PyTorch's own default on the CPU
    assert not build_optimizer([nn.Parameter(torch.zeros(2, device="meta"))], TrainConfig()).defaults["fused"]
    assert not build_optimizer(params(), TrainConfig(optimizer="nesterov")).defaults["fused"]  # SGD as before


@pytest.mark.parametrize("name, weight_decay", [("adam", 0.0), ("adam", 0.01), ("adamw", 0.01)])
def test_fused_and_default_updates_agree(name: str, weight_decay: float) -> None:
    cfg = dict(optimizer=name, lr=1e-2, weight_decay=weight_decay)
    fused_params, plain_params = params(), params()
    run(build_optimizer(fused_params, TrainConfig(**cfg)), fused_params, 20)
    run(build_optimizer(plain_params, TrainConfig(**cfg, fused_optimizer=False)), plain_params, 20)
    assert any((p.detach() - q).abs().max() > 0.1 for p, q in zip(fused_params, params()))  # they did move
    for p, q in zip(fused_params, plain_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_default_optimizer_state_resumes_in_a_fused_one() -> None:
    """Checkpoints written before the fused optimizer (and by ``fused_optimizer: false``) go on identically."""
    cfg = TrainConfig(lr=1e-2)
    first, reference = params(), params()
    old = build_optimizer(first, TrainConfig(lr=1e-2, fused_optimizer=False))
    run(old, first, 5)
    ref = build_optimizer(reference, TrainConfig(lr=1e-2, fused_optimizer=False))
    run(ref, reference, 5)
    resumed = build_optimizer(first, cfg)
    resumed.load_state_dict(old.state_dict())
    run(resumed, first, 5, seed=2)
    run(ref, reference, 5, seed=2)
    for p, q in zip(first, reference, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fused_optimizer_is_a_typed_config_key() -> None:
    assert load_config(data={"train": {"fused_optimizer": False}}).train.fused_optimizer is False
    with pytest.raises(ConfigError):
        load_config(data={"train": {"fused_optimizer": "sometimes"}})


def test_fused_adam_under_loss_scaling_skips_overflows_like_the_default() -> None:
    """The trainer's fp16 sequence (scale, backward, unscale_, clip, scaler.step, update) with an overflow at
    the third update: the fused optimizer skips it as the default one does and ends on the same parameters."""
    def train(fused: bool) -> tuple[list[torch.Tensor], float]:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        optimizer = build_optimizer(list(model.parameters()), TrainConfig(lr=1e-2, fused_optimizer=fused))
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # the CUDA scaler's logic, on the CPU
        for i in range(5):
            scaler.scale(model(torch.randn(16, 8)).pow(2).mean()).backward()
            if i == 2:
                model.weight.grad[0, 0] = float("inf")
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        return [p.detach() for p in model.parameters()], scaler.get_scale()

    (fused, fused_scale), (plain, plain_scale) = train(True), train(False)
    assert fused_scale == plain_scale == 512.0  # one overflow halved the scale
    assert all(torch.isfinite(p).all() for p in fused)
    for p, q in zip(fused, plain, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
